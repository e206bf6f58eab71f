"""The GPU without the NVIDIA toolkit (the devices route) and the engine from carried Debian packages: what an air-gapped
GPU machine, a VM without a toolkit or a package index, needs of the project's own commands."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from servekit.engines import bootstrap, gpuaccess
from servekit.errors import EnvironmentProblem, UserError
from servekit.waiting import until

ROOT = Path(__file__).resolve().parent.parent
NO_TOOLKIT = (False, "it has no NVIDIA runtime (runtimes: runc) and no NVIDIA CDI device")


@pytest.fixture
def fake_driver_host(tmp_path, monkeypatch):
    """A machine whose nodes and driver folder exist where the devices route looks (stand-in files: no GPU here)."""
    nodes = [tmp_path / "dev" / n for n in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")]
    for node in nodes:
        node.parent.mkdir(exist_ok=True)
        node.touch()
    (tmp_path / "nvidia" / "lib64").mkdir(parents=True)
    (tmp_path / "nvidia" / "lib64" / "libcuda.so.1").touch()
    monkeypatch.setenv(gpuaccess.GPU_DEVICE_ENV, str(nodes[0]))
    monkeypatch.setenv(gpuaccess.DRIVER_DIR_ENV, str(tmp_path / "nvidia"))
    monkeypatch.setattr(gpuaccess, "CONTROL_DEVICES", tuple(str(n) for n in nodes[1:]))
    return tmp_path


def test_auto_takes_the_toolkit_where_the_engine_has_it_and_else_the_devices(fake_driver_host, monkeypatch):
    assert gpuaccess.decide((True, "the engine lists the nvidia runtime"), same_machine=True).route == "toolkit"
    access = gpuaccess.decide(NO_TOOLKIT, same_machine=True)
    assert access.devices and "nvidia0" in access.how and gpuaccess.COMPOSE_FILE in access.how
    # Another machine's engine: this machine's nodes say nothing of it.
    assert gpuaccess.decide(NO_TOOLKIT, same_machine=False).route is None
    monkeypatch.setenv(gpuaccess.ACCESS_ENV, "toolkit")
    assert gpuaccess.decide(NO_TOOLKIT, same_machine=True).route is None
    monkeypatch.setenv(gpuaccess.ACCESS_ENV, "cdi")
    with pytest.raises(UserError, match="SERVEKIT_GPU_ACCESS='cdi': expected one of auto, toolkit, devices"):
        gpuaccess.decide(NO_TOOLKIT, same_machine=True)


def test_the_devices_route_says_what_is_missing(fake_driver_host, monkeypatch):
    (fake_driver_host / "nvidia" / "lib64" / "libcuda.so.1").unlink()
    access = gpuaccess.decide(NO_TOOLKIT, same_machine=True)
    assert access.route is None and "libcuda.so.1 is missing" in access.how and "SERVEKIT_DRIVER_DIR" in access.how
    monkeypatch.setenv(gpuaccess.GPU_DEVICE_ENV, str(fake_driver_host / "dev" / "nvidia7"))
    assert "nvidia7" in gpuaccess.decide(NO_TOOLKIT, same_machine=True).how


def _compose_json(files: list[str], *args: str) -> dict:
    """The services Compose renders from `files` for `args` (profiles, a service's name)."""
    done = subprocess.run(["docker", "compose", *(a for f in files for a in ("-f", f)), *args], cwd=ROOT / "compose",
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SERVEKIT_IMAGE": "vllm-serve:test", "COMPOSE_FILE": ""})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["services"]


def _compose_config(files: list[str], service: str) -> dict:
    return _compose_json(files, "config", "--format", "json", service)[service]


def _compose_services(files: list[str], profiles: list[str]) -> dict:
    """The services of all `profiles` in one call (one call a profile took most of this module's time)."""
    return _compose_json(files, *(a for p in profiles for a in ("--profile", p)), "config", "--format", "json")


def test_the_devices_compose_file_gives_every_gpu_profile_the_nodes_and_driver_folder_and_no_reservation():
    from servekit.config.load import load_matrix
    matrix = load_matrix(ROOT / "images.yaml")
    gpu_profiles = [name for name, p in matrix.profiles.items() if any(matrix.targets[t].gpu for t in p.targets)]
    assert "default" in gpu_profiles and "alternative" in gpu_profiles
    plain_services = _compose_services(["compose.yaml"], gpu_profiles)
    device_services = _compose_services(["compose.yaml", gpuaccess.COMPOSE_FILE], gpu_profiles)
    for profile in gpu_profiles:
        plain = plain_services[profile]
        assert plain["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
        service = device_services[profile]
        assert not service.get("deploy"), f"{profile}: the toolkit's reservation fails without the toolkit"
        # The same nodes, folder and library path that `doctor` passes to `docker run` (gpuaccess).
        assert [d["source"] for d in service["devices"]] == [gpuaccess.GPU_DEVICE, *gpuaccess.CONTROL_DEVICES]
        mounts = {v["target"]: v for v in service["volumes"]}
        driver = mounts[gpuaccess.CONTAINER_DRIVER_DIR]
        assert driver["source"] == gpuaccess.DRIVER_DIR and driver["read_only"] is True
        assert service["environment"]["LD_LIBRARY_PATH"] == f"{gpuaccess.CONTAINER_DRIVER_DIR}/lib64"
        assert {"/cache", "/app/models"} <= set(mounts)  # the volumes of compose.yaml stay


def test_a_deployment_by_devices_names_the_file_in_compose_env(tmp_path):
    from servekit.engines.compose import compose_files, write_env
    from servekit.engines.deployment import Deployment
    from servekit.engines.docker import DockerEngine
    (tmp_path / "compose").mkdir()
    engine = DockerEngine("unix:///var/run/docker.sock", "unix:///var/run/docker.sock")
    dep = Deployment(tmp_path, "cuda", "native", "vllm-serve:test", "127.0.0.1", 18020, engine=engine,
                     gpu_devices=True)
    assert [p.name for p in compose_files(dep)] == ["compose.yaml", gpuaccess.COMPOSE_FILE]
    written = write_env(dep)
    assert written and f"COMPOSE_FILE=compose.yaml:{gpuaccess.COMPOSE_FILE}\n" in written.read_text()


def test_carried_packages_are_refused_in_one_line_when_one_is_missing(tmp_path):
    (tmp_path / "docker.io_20.10.24_amd64.deb").touch()
    with pytest.raises(EnvironmentProblem, match="no .deb of containerd, runc, tini, libdevmapper1.02.1; fetch"):
        bootstrap.packages_folder(str(tmp_path))
    with pytest.raises(EnvironmentProblem, match="not a folder"):
        bootstrap.packages_folder(str(tmp_path / "absent"))


def test_carried_packages_with_two_versions_of_one_are_refused_never_guessed(tmp_path):
    """`9.0` sorts after `20.10.24` as text: which is newer is Debian's order, so the folder must hold one of each."""
    for name in bootstrap.ENGINE_DEBS:
        (tmp_path / f"{name}_1.0_amd64.deb").touch()
    (tmp_path / "docker.io_9.0_amd64.deb").touch()
    with pytest.raises(EnvironmentProblem) as refused:
        bootstrap.packages_folder(str(tmp_path))
    assert str(refused.value) == (f"{tmp_path}: 2 versions of docker.io (docker.io_1.0_amd64.deb, docker.io_9.0_amd64.deb)"
                                  "; keep the one to install")


@pytest.mark.slow
def test_the_engine_unpacks_from_carried_debian_packages_and_its_programs_run(tmp_path):
    """What `make engine` does where no package index answers (SERVEKIT_ENGINE_PACKAGES): Debian 12's packages, as
    `apt-get download` fetches them, unpacked without dpkg's database; dockerd, containerd, runc and the client
    then run from the links, dockerd with the carried libdevmapper."""
    debs = tmp_path / "debs"
    debs.mkdir()
    got = subprocess.run(["apt-get", "download", *bootstrap.ENGINE_DEBS], cwd=debs, capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0, got.stderr
    folder = bootstrap.packages_folder(str(debs))
    assert folder is not None and folder == debs
    said: list[str] = []
    linked = bootstrap.install_from_packages(folder, said.append, root=tmp_path / "engine", bin_dir=tmp_path / "bin")
    assert "no package index used" in said[0]
    names = {link.name for link in linked}
    assert {"docker", "dockerd", "containerd", "containerd-shim-runc-v2", "runc", "docker-proxy"} <= names, names
    libraries = sorted({str(p.parent) for p in (tmp_path / "engine").glob("**/libdevmapper.so.1.02.1")})
    assert libraries, "the carried libdevmapper was not unpacked"
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "LD_LIBRARY_PATH": ":".join(libraries)}
    for program, said_word in (("dockerd", "Docker version 20.10"), ("docker", "Docker version 20.10"),
                               ("containerd", "containerd"), ("runc", "runc version")):
        done = subprocess.run([str(tmp_path / "bin" / program), "--version"], capture_output=True, text=True,
                              timeout=30, env=env)
        assert done.returncode == 0 and said_word in done.stdout, (program, done.stdout, done.stderr)


def test_dockerd_leaves_iptables_alone_where_there_is_no_iptables(monkeypatch):
    monkeypatch.setattr(bootstrap.shutil, "which", lambda name: None)
    assert bootstrap.dockerd_args() == ["--iptables=false", "--ip-masq=false"]
    monkeypatch.setattr(bootstrap.shutil, "which", lambda name: f"/usr/sbin/{name}")
    assert bootstrap.dockerd_args() == []


def _runs_as(pid: int, program: str) -> bool:
    return Path(f"/proc/{pid}/comm").read_text().strip() == program


def test_a_pid_file_left_by_a_stopped_machine_is_removed_and_a_running_engines_kept(tmp_path):
    """The CI machine restored from a snapshot held /var/run/docker.pid naming a pid that was some other
    process's by then: dockerd refused to start ("pid file found"). Real processes here: a stranger under the
    named pid, none at all, and a program called dockerd."""
    shutil.copy("/bin/sleep", tmp_path / "dockerd")
    pid_file = tmp_path / "docker.pid"
    with subprocess.Popen(["sleep", "60"]) as stranger, subprocess.Popen([str(tmp_path / "dockerd"), "60"]) as engine:
        try:
            # a child is its parent's program until it has exec'd its own (CI found python's name under load)
            for pid, name in ((stranger.pid, "sleep"), (engine.pid, "dockerd")):
                assert until(partial(_runs_as, pid, name), 30, 0.01), name
            pid_file.write_text(f"{stranger.pid}\n")
            assert bootstrap.live_program(pid_file) == (stranger.pid, "sleep")
            assert bootstrap.remove_stale_pid_file(pid_file, "dockerd") and not pid_file.exists()
            pid_file.write_text(f"{engine.pid}\n")
            assert not bootstrap.remove_stale_pid_file(pid_file, "dockerd") and pid_file.exists()
        finally:
            stranger.kill()
            engine.kill()
    pid_file.write_text(f"{stranger.pid}\n")  # reaped: no process has it now (or another stranger)
    assert bootstrap.remove_stale_pid_file(pid_file, "dockerd") and not pid_file.exists()
    pid_file.write_text("garbled")
    assert bootstrap.remove_stale_pid_file(pid_file, "dockerd")
    assert not bootstrap.remove_stale_pid_file(pid_file, "dockerd")  # no file: nothing to do


def test_engine_help_names_the_carried_packages():
    done = subprocess.run([sys.executable, str(ROOT / "build.py"), "engine", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "--packages DIR" in done.stdout and "SERVEKIT_ENGINE_PACKAGES" in done.stdout


def test_a_model_folder_of_this_machine_is_mounted_read_only_for_prepare_and_every_profile(tmp_path, monkeypatch):
    from servekit.engines.compose import MODEL_DIR_COMPOSE
    monkeypatch.setenv("MODEL_DIR", str(tmp_path))
    for service in ("prepare", "default", "alternative"):
        config = _compose_config(["compose.yaml", MODEL_DIR_COMPOSE], service)
        mount = next(v for v in config["volumes"] if v["source"] == str(tmp_path))
        assert mount["read_only"] is True and config["environment"]["MODEL_DIR"] == mount["target"]
        # Inside the models volume: prepare locks the model's parent folder, which the image's user can write.
        assert mount["target"].startswith("/app/models/")
    # prepare fetches what the profile being started serves (`up` sets SERVEKIT_PROFILE), not every drafter: a
    # folder of your own usually comes without a hub to fetch the others from.
    assert _compose_config(["compose.yaml", MODEL_DIR_COMPOSE], "prepare")["command"] == ["prepare", "default"]
    monkeypatch.setenv("SERVEKIT_PROFILE", "batch")
    assert _compose_config(["compose.yaml", MODEL_DIR_COMPOSE], "prepare")["command"] == ["prepare", "batch"]


def test_a_drafter_folder_of_this_machine_is_mounted_beside_the_model_folder(tmp_path, monkeypatch):
    from servekit.engines.compose import DRAFTER_DIR_COMPOSE, MODEL_DIR_COMPOSE
    model, drafter = tmp_path / "model", tmp_path / "drafter"
    monkeypatch.setenv("MODEL_DIR", str(model))
    monkeypatch.setenv("DRAFTER_DIR", str(drafter))
    for service in ("prepare", "alternative"):
        config = _compose_config(["compose.yaml", MODEL_DIR_COMPOSE, DRAFTER_DIR_COMPOSE], service)
        mounts = {v["source"]: v for v in config["volumes"]}
        assert mounts[str(model)]["read_only"] and mounts[str(drafter)]["read_only"]
        assert config["environment"]["DRAFTER_DIR"] == mounts[str(drafter)]["target"]
        assert config["environment"]["MODEL_DIR"] == mounts[str(model)]["target"]  # both files' environment kept
    assert _compose_config(["compose.yaml", MODEL_DIR_COMPOSE, DRAFTER_DIR_COMPOSE], "prepare")["command"][0] == "prepare"
