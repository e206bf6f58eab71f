"""monitor: NVML absent here, WSL2's Shared Usage through a powershell.exe stand-in, interop off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import ROOT

from servekit.wsl2.shared_usage import AdapterSeries, choose_adapter, parse_sample, summarize

STANDINS = ROOT / "tests" / "standins"
NVIDIA = "luid_0x00000000_0x0000c3a1"
INTEL = "luid_0x00000000_0x0000a18d"


def _monitor(env_extra: dict, seconds: str = "3", extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "WSL_DISTRO_NAME"}
    env.update(env_extra)
    return subprocess.run([sys.executable, str(ROOT / "build.py"), "monitor", "--seconds", seconds, "--json", *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_without_gpu_or_wsl2_both_are_null_with_a_clear_line():
    result = _monitor({})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["gpu"] is None and json.loads(result.stdout)["shared_usage"] is None
    assert "GPU memory not sampled: no NVIDIA driver library" in result.stderr
    assert "Traceback" not in result.stderr


def test_wsl2_stand_in_gives_the_right_adapter_baseline_peak_and_end():
    result = _monitor({"WSL_DISTRO_NAME": "Ubuntu-24.04", "PATH": f"{STANDINS}:{os.environ['PATH']}",
                       "STANDIN_INTERVAL_S": "0.15"})
    assert result.returncode == 0, result.stderr
    shared = json.loads(result.stdout)["shared_usage"]
    assert shared["adapter"] == NVIDIA  # the most dedicated memory; the iGPU has none of its own
    assert "most dedicated memory" in shared["chosen_because"] and INTEL in shared["chosen_because"]
    assert shared["baseline_bytes"] == 382_000_000
    assert shared["peak_bytes"] == 632_000_000
    assert shared["end_bytes"] == 400_000_000
    assert shared["samples"] >= 8  # the ramp, the lone-object sample, then the steady state


@pytest.mark.slow
def test_an_adapter_named_in_the_matrix_is_the_one_monitor_reads(tmp_path):
    matrix = tmp_path / "images.yaml"
    matrix.write_text("hosts:\n  wsl2:\n    adapter: '0x0000a18d'\n")
    env = {"WSL_DISTRO_NAME": "Ubuntu-24.04", "PATH": f"{STANDINS}:{os.environ['PATH']}", "STANDIN_INTERVAL_S": "0.1"}
    result = _monitor(env, seconds="1", extra=("--matrix", str(matrix)))
    shared = json.loads(result.stdout)["shared_usage"]
    assert shared["adapter"] == INTEL and "hosts.wsl2.adapter" in shared["chosen_because"]
    result = _monitor(env, seconds="1", extra=("--matrix", str(matrix), "--adapter", "0x0000ffff"))
    assert json.loads(result.stdout)["shared_usage"]["adapter"] is None
    assert "--adapter names '0x0000ffff', which matches none" in result.stdout
    result = _monitor(env, seconds="1", extra=("--adapter", "rtx 4090"))  # by the name Windows' driver gives it
    shared = json.loads(result.stdout)["shared_usage"]
    assert shared["adapter"] == NVIDIA and shared["adapter_name"] == "NVIDIA GeForce RTX 4090"
    assert shared["adapters"][INTEL]["name"] == "Intel(R) UHD Graphics 770"
    # where Windows gives no names, a name reads no adapter, and the reason says why
    result = _monitor({**env, "STANDIN_ADAPTER_NAMES": "error"}, seconds="1", extra=("--adapter", "RTX 4090"))
    shared = json.loads(result.stdout)["shared_usage"]
    assert shared["adapter"] is None and "adapter names not read: Exception calling" in shared["chosen_because"]


def test_interop_off_is_one_clear_line():
    result = _monitor({"WSL_DISTRO_NAME": "Ubuntu-24.04", "PATH": "/usr/bin:/bin"}, seconds="0.5")
    assert result.returncode == 0
    assert json.loads(result.stdout)["shared_usage"] is None
    assert "Windows interop looks off" in result.stderr and "wsl.conf" in result.stderr


def test_parse_accepts_an_array_a_lone_object_crlf_and_a_bom():
    line = ('\ufeff[{"Path":"\\\\\\\\pc\\\\gpu adapter memory(luid_0x00000000_0x0000c3a1_phys_0)\\\\shared usage",'
            '"InstanceName":"luid_0x00000000_0x0000c3a1_phys_0","CookedValue":382000000.0}]\r\n')
    assert parse_sample(line) == {NVIDIA: {"shared": 382_000_000.0}}
    lone = line.strip().lstrip("\ufeff")[1:-1]
    assert parse_sample(lone) == {NVIDIA: {"shared": 382_000_000.0}}
    assert parse_sample("\r\n") == {}


def test_the_card_is_chosen_by_dedicated_memory_never_by_shared():
    # the iGPU holds more shared memory (a desktop on it) and a little dedicated; the card's dedicated dwarfs both
    series = {NVIDIA: AdapterSeries([0.0, 1.0], [3e8, 3e8], [1.2e9, 21.5e9]),
              INTEL: AdapterSeries([0.0, 1.0], [2.1e9, 2.2e9], [0.1e9, 0.1e9])}
    adapter, why = choose_adapter(series)
    assert adapter == NVIDIA and "21.5 GB" in why and f"{INTEL} 0.1 GB" in why
    assert choose_adapter(series, "0x0000a18d")[0] == INTEL  # named: the name wins
    assert choose_adapter(series, INTEL + "_phys_0")[0] == INTEL  # the counter's instance name works too
    adapter, why = choose_adapter(series, "0x00000000")  # part of both: refused, not guessed
    assert adapter is None and "matches several" in why


def test_figures_per_phase_and_the_levels_around_the_traffic():
    # before load 382, load rises to 1300, back to 100 when healthy, traffic rises to 632, end
    t = [-1.0, 1.0, 5.0, 9.0, 10.5, 11.0, 12.0, 14.0, 15.0]
    shared = [382, 900, 1300, 400, 120, 100, 632, 600, 590]
    dedicated = [1.2, 9, 21, 21.5, 21.5, 21.5, 23.1, 23.1, 23.1]
    series = {NVIDIA: AdapterSeries([x + 1000 for x in t], [v * 1e6 for v in shared], [d * 1e9 for d in dedicated])}
    phases = [("load", 0.0), ("warm-up", 8.0), ("healthy", 10.0), ("traffic", 11.5), ("end", 14.5)]
    s = summarize(series, NVIDIA, "why", phases, origin=1000)
    assert list(s["phases"]) == ["before load", "load", "warm-up", "healthy", "traffic", "end"]
    assert s["baseline_bytes"] == 382_000_000
    assert s["phases"]["load"]["peak_bytes"] == 1_300_000_000 and s["phases"]["load"]["samples"] == 2
    assert s["phases"]["healthy"]["last_bytes"] == 100_000_000
    assert s["traffic_start_bytes"] == 100_000_000 and s["traffic_peak_bytes"] == 632_000_000
    assert s["traffic_end_bytes"] == 600_000_000 and s["traffic_rise_bytes"] == 532_000_000
    assert s["phases"]["traffic"]["peak_dedicated_bytes"] == 23_100_000_000
    assert s["series"]["t"][0] == -1.0  # seconds since the container started, as the plot's axis


def test_monitor_starts_without_the_heavy_packages():
    code = ("import sys; sys.argv=['build.py','monitor','--seconds','0.1','--json']; "
            "from servekit.cli import main; main(sys.argv[1:]); "
            "heavy=[m for m in ('pydantic','docker','python_on_whales','rich','requests','tenacity') if m in sys.modules]; "
            "print('HEAVY', heavy)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout
