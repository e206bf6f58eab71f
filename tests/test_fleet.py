"""Remote engines and fleets: --engine names, tunnels, image transfer, and runs on a second real engine.

The second engine is a real dockerd on its own socket and data folder (tests/second_engine.py);
to the orchestrator it is another machine's engine: nothing is bind-mounted from this disk there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import second_engine
from support import ROOT, SLOT, TEST_PROJECT, compose_dir, follow_logs, run_build_py, work_dir

from servekit.engines import local, resolve
from servekit.engines.docker import address, reach, tunnel_command
from servekit.engines.docker import resolve as docker_engine
from servekit.errors import UserError
from servekit.layout import PROFILE_LABEL, PROJECT_LABEL

pytestmark = pytest.mark.xdist_group("second-engine")  # one second engine on this machine: test_release's too



# --- engine names, addresses and tunnels (no engine) -------------------------------------------

def test_engine_names_give_labels_and_where_they_are():
    socket = resolve("unix:///run/gpu-box/docker.sock")
    assert socket.label == "unix-gpu-box" and socket.same_machine and not socket.is_local
    ssh = docker_engine("ssh://me@gpu1:2222")
    assert ssh.label == "ssh-gpu1-2222" and not ssh.same_machine and ssh.cli_options() == {"host": "ssh://me@gpu1:2222"}
    assert resolve("tcp://127.0.0.1:2375").same_machine and not resolve("tcp://10.0.0.5:2376").same_machine
    assert resolve(None).is_local and docker_engine("local").cli_options() == {}


@pytest.mark.parametrize("argv,says", [
    (["run", "--engine", "ftp://gpu1"], "expected a unix://, tcp:// or ssh:// URL"),
    (["up", "default", "--engine", "unix://"], "names a socket path"),
    (["down", "--engine", "ssh://"], "no host in the URL"),
    (["smoke", "default", "--engine", "not a name"], "a Docker context name or venv:PATH"),
    (["run", "--engines", "local,local"], "named twice"),
    (["run", "--engines", " , "], "name at least one engine"),
    (["run", "--engine", "local", "--engines", "local"], "not allowed with argument"),
])
def test_bad_engines_are_refused_in_one_line(cli, argv, says):
    code, _, err = cli(*argv)
    assert code == 2 and says in err and "Traceback" not in err


def test_an_engine_on_docker_desktop_under_wsl2_gets_the_wsl2_defaults():
    from servekit.engines.docker import host_kind_of
    # GET /info as Docker Desktop's WSL2 engine and a native Linux engine answer it (the fields used)
    desktop = {"OperatingSystem": "Docker Desktop", "KernelVersion": "5.15.153.1-microsoft-standard-WSL2"}
    native = {"OperatingSystem": "Ubuntu 24.04.1 LTS", "KernelVersion": "6.8.0-45-generic"}
    assert host_kind_of(desktop) == "wsl2" and host_kind_of(native) == "native"


def test_an_ssh_engine_is_reached_through_a_tunnel_to_its_loopback():
    engine = resolve("ssh://me@gpu1:2222")
    assert tunnel_command(engine, 40001, 8001)[-4:] == ["2222", "-L", "127.0.0.1:40001:127.0.0.1:8001", "me@gpu1"]
    assert "ssh -N" in address(engine, "127.0.0.1", 8001) and "me@gpu1" in address(engine, "127.0.0.1", 8001)


def test_a_tcp_engine_elsewhere_needs_ssh_or_a_bind_it_can_reach():
    engine = resolve("tcp://10.0.0.5:2376")
    with pytest.raises(UserError, match="use ssh://user@10.0.0.5"), reach(engine, "127.0.0.1", 8000):
        pass
    with reach(engine, "0.0.0.0", 8000) as url:
        assert url == "http://10.0.0.5:8000"
    with reach(resolve("unix:///run/x/docker.sock"), "127.0.0.1", 8001) as url:
        assert url == "http://127.0.0.1:8001"


def test_another_engine_gets_its_own_env_file_and_no_bind_mounted_secrets(tmp_path):
    from servekit.engines.compose import compose_files, write_env
    from servekit.engines.deployment import Deployment
    (tmp_path / "compose").mkdir()
    dep = Deployment(tmp_path, "cpu", "native", "vllm-serve:x", "127.0.0.1", 8001,
                     engine=resolve("ssh://me@gpu1"), overrides=("compose.cpu.yaml",))
    path = write_env(dep)
    assert path is not None and path == tmp_path / ".cache/engines/ssh-gpu1.env" and not (tmp_path / "compose/.env").exists()
    assert "SERVEKIT_PORT=8001" in path.read_text() and "SERVEKIT_UID" not in path.read_text()
    assert [p.name for p in compose_files(dep)] == ["compose.yaml", "compose.cpu.yaml", "compose.remote.yaml"]


def test_the_summary_has_a_row_per_engine_and_fails_with_any(tmp_path):
    from servekit.engines.deployment import Deployment
    from servekit.records.models import RunReport
    from servekit.serve.fleet import EngineRun, summary
    report = RunReport.model_validate({
        "run_id": "r", "created": "2026-12-01T00:00:00+00:00", "profile": "default", "target": "cpu", "host": "native",
        "url": "http://127.0.0.1:8001", "pins": {}, "passed": True,
        "image": {"tag": "x", "arrived": "sent (save+load) in 57 s"},
        "boot": {"time_to_healthy_s": 26.7, "kv_pool_tokens": 4151936},
        "checks": [{"name": "burst", "status": "passed", "figures": {"tokens_per_s": 888.1}}]})
    good = EngineRun(Deployment(tmp_path, "cpu", "native", "x", "127.0.0.1", 8001, engine=resolve("ssh://gpu1")),
                     reports=[(report, tmp_path / "ssh-gpu1-default")])
    bad = EngineRun(Deployment(tmp_path, "cpu", "native", "x", "127.0.0.1", 8002, engine=resolve("ssh://gpu2")),
                    error="engine ssh://gpu2 does not answer")
    doc, markdown = summary([good, bad])
    assert doc.passed is False and [e.passed for e in doc.engines] == [True, False]
    assert ("| ssh-gpu1 | native | default | passed | sent (save+load) in 57 s | 26.7 | 4,151,936 | 888.1 | 1/1 |"
            in markdown)
    assert "| ssh-gpu2 | native |  | error: engine ssh://gpu2 does not answer |" in markdown
    assert markdown.startswith("# Fleet run: 1 of 2 engines passed")


# --- with the engines -------------------------------------------------------------------------

@pytest.mark.engine
def test_the_remote_override_copies_secrets_in_from_the_environment(tmp_path):
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "SERVEKIT_IMAGE": "vllm-serve:test",
           "SERVEKIT_API_KEY": "sk-never-printed", "SERVEKIT_HF_TOKEN": ""}
    cmd = ["docker", "compose", "--project-directory", str(compose_dir()), "-f", str(compose_dir() / "compose.yaml"),
           "-f", str(compose_dir() / "compose.cpu.yaml"), "-f", str(compose_dir() / "compose.remote.yaml"),
           "--profile", "*", "config", "--format", "json"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    config = json.loads(done.stdout)
    assert config["secrets"]["api_key"] == {"name": "servekit_api_key", "environment": "SERVEKIT_API_KEY"}
    assert "file" not in config["secrets"]["hf_token"] and "sk-never-printed" not in done.stdout


@pytest.mark.engine
def test_a_context_name_resolves_to_its_endpoint(second):
    name = f"{TEST_PROJECT}-context"
    subprocess.run(["docker", "context", "rm", "-f", name], capture_output=True)
    made = subprocess.run(["docker", "context", "create", name, "--docker", f"host={second}"],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    try:
        engine = docker_engine(name)
        assert engine.url == second and engine.cli_options() == {"context": name}
        assert engine.label == name
        assert engine.sdk().info()["DockerRootDir"] == str(second_engine.for_slot(SLOT).data / "data")
    finally:
        subprocess.run(["docker", "context", "rm", "-f", name], capture_output=True)


@pytest.mark.slow
@pytest.mark.engine
def test_restarting_a_second_engine_leaves_the_first_engines_bridge_alone(tmp_path, cpu_base):
    """On an engine of its own: the run's second engine is in use by the other tests of its group."""
    engine = second_engine.throwaway(tmp_path / "engine", SLOT)
    try:
        for _ in range(3):  # dockerd deletes docker0 on a restart over a stale default bridge, unless prevented
            assert engine.start() is True
            engine.stop()
    finally:
        engine.stop()
        engine.remove_bridge()
    assert subprocess.run(["ip", "link", "show", "docker0"], capture_output=True).returncode == 0
    ran = subprocess.run(["docker", "run", "--rm", cpu_base, "true"], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr


@pytest.mark.slow
@pytest.mark.engine
def test_a_throwaway_engine_left_running_by_a_killed_run_is_stopped_before_the_next_starts(tmp_path):
    """A run killed before its teardown leaves its throwaway dockerd running on the slot's socket; the next run of
    the slot found its pid file and could not start one ('pid file found'). The next start stops that orphan first."""
    orphan = second_engine.throwaway(tmp_path / "orphan", SLOT)
    assert orphan.start() is True
    left = orphan.proc
    orphan.proc = None  # as a killed run leaves it: nobody to stop it
    engine = second_engine.throwaway(tmp_path / "engine", SLOT)
    try:
        assert engine.start() is True
        assert left is not None and left.poll() is not None  # the orphan is gone, and this one is ours
    finally:
        engine.stop()
        if left is not None and left.poll() is None:
            left.kill()
        engine.remove_bridge()


@pytest.mark.slow
@pytest.mark.engine
def test_an_engine_killed_mid_run_leaves_nothing_behind_once_stopped(tmp_path):
    """A dockerd binds its data root onto itself and lets go of it only on a clean shutdown; one killed left the
    mount behind, and every later pytest on the machine warned that it could not remove the folder (which failed
    the rerun rule's tests, which count their own summary's words). It also left its containerd running, which the
    next dockerd on that exec root took for its own and waited on until it gave up: the next start must work."""
    engine = second_engine.throwaway(tmp_path / "engine", SLOT)
    root = str(tmp_path / "engine" / "data")
    try:
        assert engine.start() is True
        assert engine.proc is not None
        assert root in _mount_points()  # what dockerd does: else this test proves nothing
        engine.proc.kill()
        engine.proc.wait(30)
        engine.stop()
        assert not [p for p in _mount_points() if p == root or p.startswith(root + "/")]
        assert engine.start() is True  # on the same exec root, within its deadline
    finally:
        engine.stop()
        engine.remove_bridge()


def _mount_points() -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.engine
def test_a_restarted_second_engine_reclaims_the_bridges_its_forgotten_networks_left(tmp_path):
    """A network left on an engine outlives its dockerd as a bridge holding a subnet of the engine's pool; the next
    start drops the network store, so unless those bridges go too, the pool fills up run after run until Compose
    can create no network (CI failed so: "could not find an available, non-overlapping IPv4 address pool")."""
    import ipaddress
    engine = second_engine.throwaway(tmp_path / "engine", SLOT)
    pool = ipaddress.IPv4Network(engine.pool)

    def routes_in_pool() -> list[str]:
        routes = subprocess.run(["ip", "-j", "route"], capture_output=True, text=True, check=True).stdout
        return [r["dst"] for r in json.loads(routes) if "/" in r["dst"] and ipaddress.IPv4Network(r["dst"]).subnet_of(pool)]
    try:
        engine.start()
        assert _on_second(engine.url, "network", "create", "left-behind").returncode == 0
        engine.stop()
        assert routes_in_pool(), "the network's bridge did not outlive its engine: nothing left to reclaim"
        engine.start()
        assert routes_in_pool() == []
        assert _on_second(engine.url, "network", "create", "after-restart").returncode == 0
    finally:
        if engine.answers():
            _on_second(engine.url, "network", "prune", "-f")
        engine.stop()
        engine.remove_bridge()


def _on_second(url: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "--host", url, *argv], capture_output=True, text=True, timeout=600)


def _running(url: str | None, service: str | None = None) -> list[str]:
    """The project's containers (or one service's, running only) on the second engine, or this machine's."""
    argv = ["ps", "-q" if service else "-aq", "--filter", f"label={PROJECT_LABEL}={TEST_PROJECT}"]
    if service:
        argv += ["--filter", f"label={PROFILE_LABEL}={service}"]
    done = _on_second(url, *argv) if url else subprocess.run(["docker", *argv], capture_output=True, text=True)
    return done.stdout.split()


@pytest.mark.engine
@pytest.mark.slow
def test_an_image_reaches_another_engine_by_stream_then_by_registry(second, tmp_path, cpu_base):
    from servekit.engines.docker import free_port
    from servekit.engines.transfer import ensure_image
    from servekit.release.localregistry import start_registry
    from servekit.release.publish import push
    engine = resolve(second)
    local_id = subprocess.run(["docker", "image", "inspect", cpu_base, "--format", "{{.Id}}"], capture_output=True,
                              text=True).stdout.strip()
    _on_second(second, "image", "rm", "-f", cpu_base)
    said: list[str] = []
    assert ensure_image(engine, cpu_base, say=said.append).startswith("sent (save+load)")
    assert _on_second(second, "image", "inspect", cpu_base, "--format", "{{.Id}}").stdout.strip() == local_id
    assert ensure_image(engine, cpu_base) == "already there"

    port = free_port()
    repository = f"127.0.0.1:{port}/test/bookworm-python"
    registry = start_registry(tmp_path / "storage", port, tmp_path / "registry.log")
    digest = ""
    try:
        digest = push(local().registries(), local_id, repository, "3.11", say=said.append)
        _on_second(second, "image", "rm", "-f", cpu_base)
        from servekit.records.models import ReleaseRecord
        release = ReleaseRecord(target="cpu", repository=repository, tags=["3.11"], registry_digest=digest,
                                image_id=local_id, content_digest="0123456789ab", pins={}, smoke={})
        assert ensure_image(engine, cpu_base, release=release).startswith("pulled from the registry")
        assert _on_second(second, "image", "inspect", cpu_base, "--format", "{{.Id}}").stdout.strip() == local_id
    finally:
        registry.kill()
        if digest:
            _on_second(second, "image", "rm", f"{repository}@{digest}")
        subprocess.run(["docker", "image", "rm", f"{repository}:3.11"], capture_output=True)


@pytest.mark.engine
@pytest.mark.slow
def test_reading_a_file_of_an_image_leaves_none_of_its_volumes_behind(second, tmp_path):
    """An image that declares VOLUMEs (the serving image declares /cache and /app/models) gets an anonymous volume for
    each in every container made of it: the throwaway container that reads one file of it (the SBOM check, `release
    --verify`) takes them with it. On the second engine, which only this group's worker uses, so that nothing else
    makes or removes volumes meanwhile."""
    (tmp_path / "f").write_text("x")
    (tmp_path / "Dockerfile").write_text("FROM scratch\nCOPY f /f\nVOLUME /data /more\n")
    image = f"servekit-test-volumes:{SLOT}"
    built = subprocess.run(["docker", "--host", second, "build", "-q", "-t", image, str(tmp_path)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr

    def volumes() -> set[str]:
        return set(subprocess.run(["docker", "--host", second, "volume", "ls", "-q"], capture_output=True, text=True,
                                  check=True, timeout=60).stdout.split())
    try:
        before = volumes()
        assert docker_engine(second).registries().read_file(image, "/f") == b"x"
        assert volumes() == before
    finally:
        subprocess.run(["docker", "--host", second, "image", "rm", image], capture_output=True, timeout=60)


def test_up_smoke_and_down_on_another_engine(second, cpu_image):  # `up` serves what is built: the session's image
    """Buys a server on another engine end to end: the image sent there, `up`, `smoke`, `ps`, `logs -f` and `down`
    through --engine, nothing left behind."""
    from servekit.engines.docker import free_port
    port = str(free_port())
    try:
        up = run_build_py("up", "default", "--target", "cpu", "--engine", second, "--port", port, "--json",
                          timeout=1200)
        assert up.returncode == 0, up.stderr[-3000:]
        assert json.loads(up.stdout)["url"] == f"http://127.0.0.1:{port}"
        assert _running(second), "nothing runs on the second engine"
        assert not _running(None), f"containers on this machine's engine: {_running(None)}"
        # smoke finds the container on that engine, and its port, by itself
        smoke = run_build_py("smoke", "default", "--target", "cpu", "--engine", second, "--check", "health", "--check",
                             "models", "--check", "logs", "--json", timeout=600)  # those it asserts: the rest are run's
        assert smoke.returncode == 0, smoke.stdout[-3000:] + smoke.stderr[-2000:]
        checks = {c["name"]: c["status"] for c in json.loads(smoke.stdout)["checks"]}
        assert checks["health"] == checks["models"] == checks["logs"] == "passed"
        # ps and logs -f reach that engine too
        ps = run_build_py("ps", "--engine", second, "--json")
        assert ps.returncode == 0, ps.stderr
        row = next(r for r in json.loads(ps.stdout) if r["profile"] == "default")
        assert row["state"] == "running" and row["url"] == f"http://127.0.0.1:{port}", row
        assert not any(r["profile"] == "default" for r in json.loads(run_build_py("ps", "--json").stdout))
        assert follow_logs("default", "--engine", second, "--tail", "1000",
                           wanted="launcher: profile default: vllm serve") == (True, 0)
    finally:
        down = run_build_py("down", "--engine", second)
    assert down.returncode == 0 and "nothing left running" in down.stdout and not _running(second)


@pytest.mark.engine
@pytest.mark.slow
def test_run_on_two_engines_and_one_that_is_not_there(second):
    """Buys a run across engines: two servers at once on two engines, a report each and one summary, and an engine
    that is not there as its own failed row. Three checks, not the profile's fifteen: two servers of the whole set
    on two cores beside another worker's took 991 s and once failed a check of a starved server (a full run,
    2026-12-06); the checks themselves are the single-engine tests'."""
    result = run_build_py("run", "--target", "cpu", "--profile", "default", "--engines",
                          f"local,{second},unix:///nonexistent/docker.sock", "--check", "health", "--check", "models",
                          "--check", "greedy", "--json", timeout=3000)
    assert result.returncode == 1, result.stderr[-3000:]  # the missing engine fails; the other two still run
    out = json.loads(result.stdout)
    engines = {e["engine"]: e for e in out["engines"]}
    failed = {name: [f"{c['name']}: {c['reason']}" for report in engines[name]["reports"]
                     for c in json.loads((Path(report) / "report.json").read_text())["checks"]
                     if c["status"] in ("failed", "not_run")] for name in ("local", second)}
    assert engines["local"]["passed"] and engines[second]["passed"], failed
    assert "no socket at /nonexistent/docker.sock" in engines["unix:///nonexistent/docker.sock"]["error"]
    assert engines["local"]["port"] != engines[second]["port"]
    for name in ("local", second):
        [folder] = map(Path, engines[name]["reports"])
        assert {"report.json", "report.md", "memory.png"} <= {p.name for p in folder.iterdir()}
        report = json.loads((folder / "report.json").read_text())
        assert report["engine"] == name and report["passed"]
    summary = Path(out["summary"]).read_text()
    assert summary.startswith("# Fleet run: 2 of 3 engines passed") and summary.count("| default | passed |") == 2
    assert not _running(None) and not _running(second)


@pytest.fixture(scope="module")
def ssh_engine(second, tmp_path_factory):
    """ssh://root@127.0.0.1:PORT, a real sshd whose sessions' docker is the second engine; and the environment
    (PATH) whose `ssh` uses this fixture's own keys and config, as ~/.ssh/config would."""
    import os
    import shutil
    import time

    from servekit.engines.docker import free_port
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    assert Path(sshd).exists(), "no sshd: `make engine` installs openssh-server"
    d = tmp_path_factory.mktemp("ssh")
    for key in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    (d / "authorized_keys").write_text((d / "id.pub").read_text())
    port = free_port()
    (d / "sshd_config").write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {d}/host_key
AuthorizedKeysFile {d}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
StrictModes no
PidFile {d}/sshd.pid
AllowTcpForwarding yes
SetEnv DOCKER_HOST={second}
""")
    (d / "ssh_config").write_text(f"""Host 127.0.0.1
  IdentityFile {d}/id
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
""")
    (d / "bin").mkdir()
    (d / "bin" / "ssh").write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {d}/ssh_config "$@"\n')
    (d / "bin" / "ssh").chmod(0o755)
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
    with open(d / "sshd.log", "wb") as log:  # the child's own descriptor once it started
        daemon = subprocess.Popen([sshd, "-D", "-e", "-f", str(d / "sshd_config")], stderr=log)
    env = dict(os.environ, PATH=f"{d / 'bin'}:{os.environ['PATH']}")
    url = f"ssh://root@127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while subprocess.run(["docker", "--host", url, "version"], env=env, capture_output=True).returncode != 0:
        assert daemon.poll() is None and time.monotonic() < deadline, (d / "sshd.log").read_text()
        time.sleep(0.3)
    yield url, env
    daemon.terminate()
    daemon.wait(timeout=10)


@pytest.mark.engine
@pytest.mark.slow
def test_run_on_an_ssh_engine_goes_through_a_tunnel(ssh_engine, second):
    """Buys ssh:// engines on a real sshd: the run's checks reach the server on the far engine's loopback through a
    tunnel, and the report says it ran on another machine. Three checks, not the profile's fifteen: the tunnel is
    what it proves (the whole set took 180 s of a CI run); the checks themselves are the single-engine tests'."""
    from servekit.engines.docker import free_port
    url, env = ssh_engine
    port = str(free_port())  # the engine's loopback is this machine's: a port no other run holds
    done = subprocess.run([sys.executable, str(ROOT / "build.py"), "run", "--target", "cpu", "--profile", "default",
                           "--engine", url, "--port", port, "--check", "health", "--check", "models", "--check",
                           "greedy", "--json"], cwd=work_dir(), env=env, capture_output=True,
                          text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    [folder] = map(Path, json.loads(done.stdout)["reports"])
    report = json.loads((folder / "report.json").read_text())
    assert report["engine"] == url and report["served_from"] == "image" and report["passed"]
    # the checks reached the port on the engine's loopback through a tunnel from another port of this machine's
    assert report["url"].startswith("http://127.0.0.1:") and not report["url"].endswith(f":{port}")
    assert any("on another machine" in note for note in report["notes"])
    assert not _running(second)


@pytest.mark.engine
@pytest.mark.slow
def test_sigterm_during_a_fleet_run_leaves_nothing_running_on_any_engine(second):
    import signal
    import time
    proc = subprocess.Popen([sys.executable, str(ROOT / "build.py"), "run", "--target", "cpu", "--profile", "default",
                             "--engines", f"local,{second}"], cwd=work_dir(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # both servers created (and booting) before the signal
    while time.monotonic() < deadline and not (_running(None, "default") and _running(second, "default")):
        time.sleep(0.5)
    assert _running(None, "default") and _running(second, "default"), "both servers were not started within 300 s"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err[-2000:]
    assert not _running(None) and not _running(second)


@pytest.mark.engine
@pytest.mark.slow
def test_an_update_packed_on_top_of_an_image_carries_only_its_new_layers_and_loads_as_the_same_id(second, cpu_base,
                                                                                                 tmp_path):
    """Buys the GPU kit's update path on real engines: an image of two new layers on the base another engine has
    packs to those layers alone (pack.py --on-top-of), and `airgap.sh update` loads them there as the very image ID
    built here; an update whose base that engine lacks is refused before anything is loaded."""
    from servekit.engines.transfer import ensure_image
    ensure_image(resolve(second), cpu_base, say=lambda line: None)
    tag = f"{TEST_PROJECT}-update:1"
    (tmp_path / "Dockerfile").write_text(f"FROM {cpu_base}\nRUN echo one > /one\nRUN echo two > /two\n")
    built = subprocess.run(["docker", "build", "-q", "-t", tag, str(tmp_path)], capture_output=True, text=True,
                           timeout=600)
    assert built.returncode == 0, built.stderr
    parts = tmp_path / "parts"
    env = {**__import__("os").environ, "DOCKER_HOST": second, "SERVEKIT_KIT": str(tmp_path / "kit")}
    try:
        packed = subprocess.run([sys.executable, str(ROOT / "bench/gpu/pack.py"), str(parts), "--tag", tag,
                                 "--on-top-of", cpu_base], capture_output=True, text=True, timeout=600)
        assert packed.returncode == 0, packed.stderr[-2000:]
        assert "2 of " in packed.stdout and not list(parts.glob("kit-*")), packed.stdout
        assert sum(p.stat().st_size for p in parts.glob("image-*")) < 1 << 20  # the base's MBs stay home
        local_id = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", tag], capture_output=True,
                                  text=True).stdout.strip()
        bad = tmp_path / "bad"
        subprocess.run(["cp", "-r", str(parts), str(bad)], check=True)
        (bad / "ON-TOP-OF").write_text("sha256:" + "0" * 64 + "\n")
        refused = subprocess.run(["bash", str(ROOT / "bench/gpu/airgap.sh"), "update", str(bad)], env=env,
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1 and "this host lacks image sha256:000" in refused.stderr, refused.stderr
        updated = subprocess.run(["bash", str(ROOT / "bench/gpu/airgap.sh"), "update", str(parts)], env=env,
                                 capture_output=True, text=True, timeout=600)
        assert updated.returncode == 0, updated.stderr[-2000:]
        assert _on_second(second, "image", "inspect", "-f", "{{.Id}}", tag).stdout.strip() == local_id
    finally:
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True)
        _on_second(second, "image", "rm", "-f", tag)


def test_the_socket_watch_names_what_ran_when_the_engines_socket_went_under_it(tmp_path):
    """The second engine's socket watch (conftest's `second`): a socket file gone while the pid file says the engine
    runs is written down with what ran then, once."""
    import time
    engine = second_engine.Dockerd(tmp_path / "data", tmp_path / "run", "sk-none", "10.0.0.1/24", "10.0.1.0/24")
    engine.data.mkdir()
    engine.run.mkdir()
    (engine.run / "docker.sock").write_text("")
    (engine.run / "dockerd.pid").write_text("12345")
    watch = second_engine.SocketWatch(engine, period_s=0.05)
    watch.start()
    try:
        time.sleep(0.2)
        assert not list(engine.data.glob("socket-gone-*"))  # there: nothing to say
        (engine.run / "docker.sock").unlink()
        deadline = time.monotonic() + 5
        while not list(engine.data.glob("socket-gone-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watch.stop()
    [report] = engine.data.glob("socket-gone-*")
    assert "with dockerd 12345 running" in report.read_text() and "PID" in report.read_text()
