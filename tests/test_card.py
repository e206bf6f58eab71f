"""`--card`: a card of images.yaml emulated on a bigger GPU (servekit/engines/card.py). No GPU here: the card's
sizes, the kernels it forces, the refusals, the Compose file that carries it into the container, the MPS daemon's
lifecycle against a stand-in control program (the real one's protocol: `-d` to start, commands on standard input),
and the card's margin in the memory summary."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from servekit.config.load import load_matrix
from servekit.engines import card as cards
from servekit.engines import gpuaccess
from servekit.errors import EnvironmentProblem, UserError
from servekit.gpu import GpuInfo, GpuSeries

ROOT = Path(__file__).resolve().parent.parent
MATRIX = load_matrix(ROOT / "images.yaml")
H200 = GpuInfo(0, "NVIDIA H200", 143_771 * 2**20, "9.0")
GiB = 2**30

# nvidia-cuda-mps-control as its manual describes it: `-d` starts the daemon (which makes the control pipe in
# CUDA_MPS_PIPE_DIRECTORY and logs to CUDA_MPS_LOG_DIRECTORY); without -d it reads commands from standard input
# and fails when no daemon answers; `quit` stops the daemon.
MPS_STAND_IN = r"""#!/bin/sh
pipe=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
log=${CUDA_MPS_LOG_DIRECTORY:-/var/log/nvidia-mps}
if [ "$1" = "-d" ]; then
    [ -e "$pipe/control" ] && { echo "An instance of this daemon is already running" >&2; exit 1; }
    mkfifo "$pipe/control" && echo "started" >> "$log/control.log"
    exit 0
fi
[ -e "$pipe/control" ] || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
read -r command
case "$command" in
    quit) rm -f "$pipe/control"; echo "quit" >> "$log/control.log" ;;
    get_server_list) ;;
    *) echo "unknown command $command" >&2; exit 1 ;;
esac
"""


@pytest.fixture
def mps_host(tmp_path, monkeypatch):
    """A host whose driver folder holds the MPS control program (a stand-in), and a private MPS folder."""
    program = tmp_path / "nvidia" / "bin" / cards.MPS_CONTROL
    program.parent.mkdir(parents=True)
    program.write_text(MPS_STAND_IN)
    program.chmod(0o755)
    monkeypatch.setenv(gpuaccess.DRIVER_DIR_ENV, str(tmp_path / "nvidia"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv(cards.MPS_DIR_ENV, str(tmp_path / "mps"))
    return tmp_path


def test_the_cards_are_24_gb_cards_as_cuda_shows_them_and_each_host_names_its_own():
    assert set(MATRIX.cards) == {"rtx3090", "rtx4090", "rtx4090-wsl2"}
    for name in ("rtx3090", "rtx4090"):
        card = MATRIX.cards[name]
        assert 23.4 <= card.memory_gib <= 23.7 and card.memory_source and card.free_gib is None
    wsl2 = MATRIX.cards["rtx4090-wsl2"]  # 24.0 GiB total to CUDA, at least 22.8 GiB of it free under WSL2
    assert (wsl2.memory_gib, wsl2.free_gib) == (24.0, 22.81) and wsl2.memory_source
    # the source's alternative.sh boots on it at GPU_UTIL 0.95: vLLM's startup gate (math.ceil of total x util)
    assert wsl2.free_bytes is not None and wsl2.free_bytes >= math.ceil(wsl2.total_bytes * 0.95)
    assert {h: MATRIX.hosts[h].card for h in MATRIX.hosts} == {"native": "rtx3090", "wsl2": "rtx4090-wsl2"}
    assert {MATRIX.cards[h.card].cuda_arch for h in MATRIX.hosts.values() if h.card} == {"8.6", "8.9"}


def test_a_hopper_gpu_forces_the_kernels_an_ampere_or_ada_card_runs_and_nothing_else_does():
    forced = {f.variable: f.value for f in cards.forced_kernels("8.6", "9.0")}
    assert forced == {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel", "VLLM_FLASH_ATTN_VERSION": "2",
                      "VLLM_GDN_PREFILL_BACKEND": "triton", "VLLM_FLASHINFER_Q_QUANTIZATION": "0",
                      "VLLM_FLASHINFER_AUTOTUNE": "0"}
    assert set(forced) == set(cards.FORCED_VARIABLES)
    assert {f.variable for f in cards.forced_kernels("8.9", "10.0")} == set(forced)
    assert cards.forced_kernels("8.6", "8.6") == () and cards.forced_kernels("9.0", "9.0") == ()


def test_the_emulation_sizes_the_mps_limit_and_vllms_total_from_the_card(mps_host):
    emulation = cards.plan(MATRIX, "rtx3090", H200)
    env = emulation.compose_env()
    assert int(env["SERVEKIT_CARD_BYTES"]) == round(23.56 * GiB) == emulation.total_bytes
    assert env["SERVEKIT_CARD_MIB"] == str(round(23.56 * GiB) // 2**20) == "24125"
    assert env["SERVEKIT_CARD_DISABLED_KERNELS"] == "MacheteLinearKernel"
    assert env["SERVEKIT_CARD_FLASH_ATTN_VERSION"] == "2" and env["SERVEKIT_CARD_FLASHINFER_AUTOTUNE"] == "0"
    assert env["SERVEKIT_CARD_GDN_PREFILL_BACKEND"] == "triton" and env["SERVEKIT_CARD_FLASHINFER_Q_QUANTIZATION"] == "0"
    assert env["SERVEKIT_MPS_PIPE_DIR"] == str(mps_host / "mps" / "pipe")
    # vLLM reads 24.0 GiB and finds 22.81 free: the cap holds that and the server's own context
    wsl2 = cards.plan(MATRIX, "rtx4090-wsl2", H200).compose_env()
    assert (wsl2["SERVEKIT_CARD_BYTES"], wsl2["SERVEKIT_CARD_MIB"]) == (str(24 * GiB), str(round(22.81 * 1024) + 512))
    said = emulation.said()
    assert "rtx3090 (23.56 GiB, sm_86) emulated on NVIDIA H200" in said and "Machete" in said
    assert emulation.to_json()["emulated_on"]["name"] == "NVIDIA H200"


def test_a_card_that_cannot_be_emulated_is_refused_in_one_line(mps_host, monkeypatch):
    with pytest.raises(UserError, match=r"--card rtx5090: expected one of rtx3090, rtx4090, rtx4090-wsl2 \(images"):
        cards.plan(MATRIX, "rtx5090", H200)
    small = GpuInfo(0, "NVIDIA GeForce RTX 3060", 12 * GiB, "8.6")
    with pytest.raises(UserError, match="--card rtx3090: its 23.56 GiB is more than this GPU's .*RTX 3060, 12.00 GiB"):
        cards.plan(MATRIX, "rtx3090", small)
    monkeypatch.setenv(gpuaccess.DRIVER_DIR_ENV, str(mps_host / "elsewhere"))
    with pytest.raises(EnvironmentProblem, match="this host has no nvidia-cuda-mps-control .*SERVEKIT_DRIVER_DIR"):
        cards.plan(MATRIX, "rtx3090", H200)


def test_run_up_and_sweep_refuse_a_card_before_they_build_or_ask_for_a_gpu(monkeypatch):
    from servekit.config.session import Session
    from servekit.serve import commands, ready, sweep
    session = Session.open(ROOT / "images.yaml")
    built: list[str] = []
    monkeypatch.setattr(ready, "ensure_built", lambda *a, **k: built.append("built"))
    refusals = ((lambda: commands.run(session, "cpu", card="rtx3090"), "target cpu has no GPU to emulate a card on"),
                (lambda: commands.run(session, "cuda", card="rtx5090"), "expected one of rtx3090, rtx4090"),
                (lambda: sweep.sweep(session, "default", ["GPU_UTIL=0.2"], target="cpu", card="rtx3090"),
                 "no GPU to emulate"),
                (lambda: commands.up_profile(session, "default", "cpu", card="rtx4090"), "no GPU to emulate"))
    for call, said in refusals:
        with pytest.raises(UserError, match=said):
            call()
    assert built == []


def test_the_mps_daemon_is_started_once_and_asked_to_quit(mps_host):
    daemon = cards.MpsDaemon(cards.mps_dir())
    said: list[str] = []
    assert daemon.start(say=said.append) is True and daemon.answers()
    assert daemon.start(say=said.append) is False  # one answers there already: not a second
    pipe = mps_host / "mps" / "pipe"
    assert oct(pipe.stat().st_mode & 0o7777) == "0o1777"  # the server runs as the container's user
    daemon.stop(say=said.append)
    assert not daemon.answers() and said == [f"card: starting the MPS control daemon ({pipe}, up to 20 s)",
                                             "card: MPS control daemon started",
                                             "card: asking the MPS control daemon to quit (up to 30 s)",
                                             "card: MPS control daemon stopped"]
    assert (mps_host / "mps" / "log" / "control.log").read_text().split() == ["started", "quit"]


def test_the_mps_folder_must_be_the_users_own(mps_host):
    (mps_host / "target").mkdir()
    (mps_host / "mps").symlink_to(mps_host / "target")
    with pytest.raises(EnvironmentProblem, match="is a link, not a folder or not yours"):
        cards.MpsDaemon(cards.mps_dir()).start()


@pytest.mark.parametrize("case", ["folder-is-a-file", "parent-missing", "program-is-a-folder", "program-never-returns"])
def test_an_mps_daemon_that_cannot_start_says_why_in_one_line_within_its_deadline(mps_host, monkeypatch, case):
    """Each way the MPS setup can be wrong ends in one EnvironmentProblem saying what and what to do, never a
    traceback or a wait without a word or an end."""
    program = mps_host / "nvidia" / "bin" / cards.MPS_CONTROL
    says = {"folder-is-a-file": "File exists", "parent-missing": "No such file or directory",
            "program-is-a-folder": "cannot run", "program-never-returns": "did not return in 1 s"}[case]
    if case == "folder-is-a-file":
        (mps_host / "mps").write_text("")
    elif case == "parent-missing":
        monkeypatch.setenv(cards.MPS_DIR_ENV, str(mps_host / "gone" / "mps"))
    elif case == "program-is-a-folder":
        program.unlink()
        program.mkdir()
    else:
        program.write_text("#!/bin/sh\nexec sleep 60\n")
        monkeypatch.setattr(cards, "START_S", 1)
    said: list[str] = []
    with pytest.raises(EnvironmentProblem, match=says) as refused:
        cards.MpsDaemon(cards.mps_dir(), program).start(say=said.append)
    assert "\n" not in str(refused.value)
    assert all(line.startswith("card: starting") for line in said)  # a wait is announced before it begins


@pytest.mark.parametrize("line, says", [
    ("memory_gib: .inf", "finite number"), ("memory_gib: 1.0e+300", "less than or equal to 1024"),
    ("memory_gib: 1.0e-12", "greater than or equal to 1"), ("free_gib: 99.0", "more than the card's memory_gib"),
])
def test_a_cards_numbers_are_held_to_what_a_card_can_be(tmp_path, line, says):
    """A card's memory is a finite size a GPU can have, and what a process finds free is at most all of it."""
    text = (ROOT / "images.yaml").read_text()
    key = line.split(":")[0]
    start = text.index("  rtx4090-wsl2:")
    at = text.index(f"    {key}:", start)
    end = text.index("\n", at)
    (tmp_path / "images.yaml").write_text(text[:at] + f"    {line}" + text[end:])
    with pytest.raises(UserError, match=says) as refused:
        load_matrix(tmp_path / "images.yaml")
    assert "cards.rtx4090-wsl2" in str(refused.value) and "\n" not in str(refused.value)


def _service(env: dict[str, str], profile: str = "default") -> dict:
    done = subprocess.run(["docker", "compose", "-f", "compose.yaml", "-f", cards.COMPOSE_FILE, "config", "--format",
                           "json", profile], cwd=ROOT / "compose", capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SERVEKIT_IMAGE": "vllm-serve:test", "COMPOSE_FILE": "", **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["services"][profile]


def test_the_card_reaches_the_container_through_compose(mps_host, tmp_path):
    from servekit.config.userenv import users_settings
    from servekit.engines.compose import compose_files, write_env
    from servekit.engines.deployment import Deployment
    from servekit.engines.docker import DockerEngine
    (tmp_path / "compose").mkdir()
    engine = DockerEngine("unix:///var/run/docker.sock", "unix:///var/run/docker.sock")
    emulation = cards.plan(MATRIX, "rtx3090", H200)
    dep = Deployment(tmp_path, "cuda", "native", "vllm-serve:test", "127.0.0.1", 18020, engine=engine,
                     card=emulation)
    assert [p.name for p in compose_files(dep)] == ["compose.yaml", cards.COMPOSE_FILE]
    written_to = write_env(dep)
    written = written_to.read_text()
    env = {k: v for k, v in (line.split("=", 1) for line in written.splitlines() if "=" in line and
                             not line.startswith("#"))}
    assert env["SERVEKIT_CARD"] == "rtx3090" and env["COMPOSE_FILE"].endswith(cards.COMPOSE_FILE)
    assert users_settings(written_to) == {}  # the card's lines are servekit's block: a later `up` rewrites them
    service = _service(env)
    environment = service["environment"]
    assert environment["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=24125M"
    assert environment["VLLM_DEVICE_TOTAL_MEMORY"] == str(emulation.total_bytes)
    assert environment["VLLM_DISABLED_KERNELS"] == "MacheteLinearKernel"
    assert environment["VLLM_FLASH_ATTN_VERSION"] == "2" and environment["VLLM_FLASHINFER_AUTOTUNE"] == "0"
    # every variable the card may force reaches the server as forced (compose.card.yaml passes each)
    assert {v: environment.get(v) for v in cards.FORCED_VARIABLES} == {f.variable: f.value for f in emulation.forced}
    assert environment["CUDA_MPS_PIPE_DIRECTORY"] == cards.CONTAINER_PIPE_DIR
    assert service["ipc"] == "host"
    mounts = {v["target"]: v["source"] for v in service["volumes"]}
    assert mounts[cards.CONTAINER_PIPE_DIR] == str(emulation.pipe_dir)
    # the prepare service gets no card: it serves nothing
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in _service(env, "prepare").get("environment", {})


def test_the_memory_summary_on_a_card_is_the_cards():
    series = GpuSeries(0, "NVIDIA H200", 143_771 * 2**20, times=[0.0, 1.0, 2.0],
                       used=[600 * 2**20, 20 * GiB, 22 * GiB], card=("rtx3090 (emulated)", round(23.56 * GiB)))
    summary = series.summary([("before load", 0.0)], 2.0)
    assert summary["name"] == "rtx3090 (emulated)" and summary["total_bytes"] == round(23.56 * GiB)
    assert summary["peak_used_bytes"] == 22 * GiB - 600 * 2**20  # above the GPU's use before the boot
    assert summary["min_margin_bytes"] == round(23.56 * GiB) - (22 * GiB - 600 * 2**20)
    assert summary["emulated_on"] == {"name": "NVIDIA H200", "total_bytes": 143_771 * 2**20,
                                      "idle_used_bytes": 600 * 2**20}
    plain = GpuSeries(0, "NVIDIA H200", 143_771 * 2**20, times=[0.0], used=[GiB]).summary([("x", 0.0)], 1.0)
    assert plain["min_margin_bytes"] == 143_771 * 2**20 - GiB and "emulated_on" not in plain


def test_stand_in_refuses_a_target_whose_model_has_no_published_layout(tmp_path):
    from servekit.build.standin import write_stand_in
    from servekit.config.session import Session
    with pytest.raises(UserError, match="target cpu's model has no source_folder"):
        write_stand_in(Session.open(ROOT / "images.yaml"), tmp_path / "m", True, 0, "small", target="cpu")
    assert not (tmp_path / "m").exists()


def test_smoke_with_a_card_refuses_a_server_that_runs_on_another_or_none(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from servekit.config.session import Session
    from servekit.serve import commands, deploy
    session = Session.open(ROOT / "images.yaml")
    key = tmp_path / "api_key"
    key.write_text("sk-" + "x" * 40 + "\n")
    engine = SimpleNamespace(check=lambda: None, is_local=True, given="local", serves_images=True, same_machine=True,
                             serving=lambda tag, pins: (tag, {}), gpu_by_devices=lambda: False, host_kind=lambda: "native")
    for env, said in (({}, "default runs on the GPU as it is; start it with `python3 build.py up default --card "
                           "rtx3090`"), ({"SERVEKIT_CARD": "rtx4090"}, "default runs on card rtx4090")):
        server = SimpleNamespace(log=lambda: "", environ={}, state=lambda env=env: SimpleNamespace(env=env, port=None))
        monkeypatch.setattr(deploy, "find_server", lambda profile, engine, server=server: server)
        with pytest.raises(UserError, match=said.replace("(", r"\(").replace(")", r"\)")):
            commands.smoke_running(session, "default", "cpu", engine=engine, card="rtx3090", api_key_file=key)
    with pytest.raises(UserError, match="--card and --url"):
        commands.smoke_running(session, "default", "cpu", url="http://127.0.0.1:1", card="rtx3090")
