"""monitor: NVML absent here, WSL2's Shared Usage through a powershell.exe stand-in, interop off."""

from __future__ import annotations

import json
import os
import subprocess
import sys


from conftest import ROOT
from wsl2.shared_usage import AdapterSeries, parse_sample, pick_adapter, summarize

STANDINS = ROOT / "tests" / "standins"
NVIDIA = "luid_0x00000000_0x0000c3a1"
INTEL = "luid_0x00000000_0x0000a18d"


def _monitor(env_extra: dict, seconds: str = "3") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "WSL_DISTRO_NAME"}
    env.update(env_extra)
    return subprocess.run([sys.executable, str(ROOT / "build.py"), "monitor", "--seconds", seconds, "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_without_gpu_or_wsl2_both_are_null_with_a_clear_line():
    result = _monitor({})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["gpu"] is None and json.loads(result.stdout)["shared_usage"] is None
    assert "GPU memory not sampled: no NVIDIA driver library" in result.stderr
    assert "Traceback" not in result.stderr


def test_wsl2_stand_in_gives_the_right_adapter_baseline_peak_and_spill():
    result = _monitor({"WSL_DISTRO_NAME": "Ubuntu-24.04", "PATH": f"{STANDINS}:{os.environ['PATH']}",
                       "STANDIN_INTERVAL_S": "0.15"})
    assert result.returncode == 0, result.stderr
    shared = json.loads(result.stdout)["shared_usage"]
    assert shared["adapter"] == NVIDIA  # the largest dedicated usage, with no NVML to match against
    assert shared["baseline_bytes"] == 382_000_000
    assert shared["peak_bytes"] == 632_000_000
    assert shared["spill_bytes"] == 250_000_000
    assert shared["end_bytes"] == 400_000_000
    assert shared["samples"] >= 8  # the ramp, the lone-object sample, then the steady state


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


def test_adapter_choice_follows_nvml_then_the_name():
    series = {NVIDIA: AdapterSeries([0.0], [3e8], [21.5e9]), INTEL: AdapterSeries([0.0], [1e8], [22.9e9])}
    assert pick_adapter(series) == INTEL  # largest dedicated usage
    assert pick_adapter(series, nvml_used=21_400_000_000) == NVIDIA  # the one NVML agrees with
    assert pick_adapter(series, nvml_used=21_400_000_000, named="0x0000a18d") == INTEL  # named in images.yaml
    summary = summarize(series, NVIDIA)
    assert summary["baseline_bytes"] == 300_000_000 and summary["spill_bytes"] == 0


def test_monitor_starts_without_the_heavy_packages():
    code = ("import sys; sys.argv=['build.py','monitor','--seconds','0.1','--json']; "
            "from servekit.cli import main; main(sys.argv[1:]); "
            "heavy=[m for m in ('pydantic','docker','python_on_whales','rich','requests','tenacity') if m in sys.modules]; "
            "print('HEAVY', heavy)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout
