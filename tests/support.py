"""What the tests share besides fixtures: the repository's root, the tests' own Compose project and port, the
throwaway copy of the repository every command runs in (made on first use, not at import), and the helpers that
run the command line, Docker and `logs -f`.

Every command the tests run works in work_dir(), a copy of the repository made for this session, under the
Compose project TEST_PROJECT and on TEST_PORT: a developer's reports, releases, compose/.env, key and running
servers are left as they were. The image tags are the same as the checkout's (content-addressed), so the engine's
images and build cache serve both.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

from servekit.image import module_command
from servekit.layout import PROJECT_LABEL

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = module_command(sys.executable, "launcher")  # the image's launcher, run as the image runs it
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
SLOTS = 10  # runs of the suite at once on one machine
SLOT_ENV = "SERVEKIT_TEST_SLOT"
SLOT_LOCKS = Path(tempfile.gettempdir()) / "servekit-test-slots"
_held_slot: list[int] = []  # the slot lock's descriptor, held until the run's process ends


def _take_slot() -> int:
    """This run's slot: the first of SLOTS whose lock no other run of the suite holds, kept until this process ends
    (a worker of pytest-xdist has its controller's, from the environment). What a run owns on the machine, its
    Compose projects, ports, second engine and names, derives from it: two runs never share one."""
    if WORKER:
        return int(os.environ[SLOT_ENV])
    SLOT_LOCKS.mkdir(exist_ok=True)
    for slot in range(SLOTS):
        fd = os.open(SLOT_LOCKS / f"slot-{slot}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _held_slot.append(fd)
        os.environ[SLOT_ENV] = str(slot)  # for the workers, started after this
        return slot
    raise RuntimeError(f"{SLOTS} runs of the suite hold every slot in {SLOT_LOCKS}: wait for one to end")


SLOT = _take_slot()
# Under pytest-xdist each worker (gw0, gw1, ...) has a project and a port of its own: workers share the engine.
TEST_PROJECT = "servekit-test" + (f"-s{SLOT}" if SLOT else "") + (f"-{WORKER}" if WORKER else "")
_WORKER_INDEX = int(WORKER[2:]) if WORKER[2:].isdigit() else 0
# 18000, 18100, ... in the first slot, 19000, ... in the next: never a developer's serve.port (18020)
TEST_PORT = 18000 + 1000 * SLOT + 100 * _WORKER_INDEX
MPS_DIR = Path(tempfile.gettempdir()) / f"servekit-test-mps-s{SLOT}"  # the run's MPS folder (conftest sets it)
HYPOTHESIS_DIR = Path(tempfile.gettempdir()) / f"servekit-test-hypothesis-s{SLOT}"  # the fuzz suite's caches
STATE_AT_START: dict = {}  # checkout_state() when the session began (conftest's pytest_configure)


@functools.cache
def work_dir() -> Path:
    """The session's copy of the repository (tests' port in its matrix), made the first time a test needs it."""
    return tracked_copy(Path(tempfile.mkdtemp(prefix="servekit-tests-")))


@functools.cache
def compose_dir() -> Path:
    """The Compose files as committed, in a folder no command writes to (no compose/.env appears there): copied from
    the checkout's tracked files, never from work_dir(), where `image` and `up` write compose/.env and secrets."""
    dest = Path(tempfile.mkdtemp(prefix="servekit-compose-")) / "compose"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "compose"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for rel in files:
        target = dest / Path(rel).relative_to("compose")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    return dest


def cleanup() -> None:
    """Remove what work_dir() and compose_dir() made, if they were made."""
    if work_dir.cache_info().currsize:
        shutil.rmtree(work_dir(), ignore_errors=True)
    if compose_dir.cache_info().currsize:
        shutil.rmtree(compose_dir().parent, ignore_errors=True)


# What a whole run writes where the engine keeps images, at its peak (the cuda image built from a cache pruned to
# nothing, the cpu image rebuilt from nothing, registries' storage): 22.6 GB on `.ci/run` from a fresh clone of
# c53045c, an engine that had built before. Free disk is the machine's; the run checks it once, before any build can
# run out of it.
SUITE_DISK_GB = 23


def disk_shortfall(need_gb: float = SUITE_DISK_GB) -> str | None:
    """One line when the filesystem holding the engine's images has less than `need_gb` free; None when it has
    enough, or when no engine answers (the tests that need one say so themselves)."""
    try:
        root = docker("info", "--format", "{{.DockerRootDir}}", timeout=30).stdout.strip()
        free = shutil.disk_usage(root).free / 1e9
    except (OSError, subprocess.SubprocessError):
        return None
    if free >= need_gb:
        return None
    return (f"the suite writes up to about {need_gb:.0f} GB where the engine keeps images, and {root} has "
            f"{free:.0f} GB free: free some (`docker builder prune -f`, `docker image prune`) and run it again")


def docker(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def cpu_tag(root: Path = ROOT) -> str:
    """The cpu image's tag as `plan` names it for the checkout at `root`."""
    plan = json.loads(run_build_py("plan", "--json", "--target", "cpu", cwd=root).stdout)
    return plan["targets"][0]["tag"]


def run_build_py(*argv: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    cwd = cwd or work_dir()
    return subprocess.run([sys.executable, str(ROOT / "build.py"), *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def tracked_copy(dst: Path) -> Path:
    """A copy of the repository as git tracks it (new files included), plus the caches `verify` keeps, serving
    on the tests' own port (not part of any image, so the tags stay the checkout's)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_symlink():  # servekit/smoke -> ../smoke: a link stays a link
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(ROOT / rel), dst / rel)
        elif (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    for cache in ("metadata", "pristine"):
        if (ROOT / ".cache" / cache).is_dir():
            (dst / ".cache").mkdir(exist_ok=True)
            os.symlink(ROOT / ".cache" / cache, dst / ".cache" / cache)
    on_test_port(dst / "images.yaml")
    return dst


def on_test_port(matrix: Path) -> None:
    """The matrix at `matrix` serving on TEST_PORT, not the developer's serve.port."""
    text = matrix.read_text()
    assert "\n  port: 18020\n" in text
    matrix.write_text(text.replace("\n  port: 18020\n", f"\n  port: {TEST_PORT}\n"))


def with_prebuilt_cubins(root: Path) -> Path:
    """The matrix of `root` with FlashInfer's prebuilt kernels in the cuda target, as docs/build.md says to add
    them where FlashInfer's index answers (the lock is not made again: it leaves them out, as one made here
    would); its images.yaml."""
    path = root / "images.yaml"
    default = "packages: [vllm, flashinfer-python, torch,"
    assert default in path.read_text()
    path.write_text(path.read_text().replace(default, "packages: [vllm, flashinfer-python, flashinfer-cubin, torch,"))
    return path


def checkout_state() -> dict:
    """What the tests must leave as they found it: the checkout's files and the developer's servers."""
    def listing(rel: str) -> list[str]:
        folder = ROOT / rel
        return sorted(p.relative_to(ROOT).as_posix() for p in folder.rglob("*")) if folder.is_dir() else []
    env = ROOT / "compose" / ".env"
    return {
        "git status": subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                                     text=True).stdout,
        "files": listing("reports") + listing("releases") + listing("compose/secrets") + listing("logs"),
        "compose/.env": env.read_text() if env.is_file() else None,
        "servers": subprocess.run(["docker", "ps", "-aq", "--filter", f"label={PROJECT_LABEL}=servekit"],
                                  capture_output=True, text=True).stdout.split() if shutil.which("docker") else [],
    }


def left_as_found() -> dict:
    """What differs from STATE_AT_START in the checkout and the developer's servers (nothing, when left alone)."""
    now = checkout_state()
    return {k: v for k, v in now.items() if v != STATE_AT_START[k]}


def project_containers() -> list[str]:
    """The tests' Compose project's containers, running or not."""
    return subprocess.run(["docker", "ps", "-aq", "--filter", f"label={PROJECT_LABEL}={TEST_PROJECT}"],
                          capture_output=True, text=True).stdout.split()


def ctrl_c_reaches_it() -> None:
    """preexec_fn for a command a test stops with SIGINT: Ctrl-C's default, even where the tests were started in
    the background of a shell, which starts them with SIGINT ignored (and a child inherits that)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def follow_logs(*argv: str, wanted: str, within_s: float = 60) -> tuple[bool, int]:
    """`build.py logs ... -f` until a line holding `wanted` arrives, then Ctrl-C, as a person stops it: (seen while
    it was still following, its exit code). Bounded in time, whatever the command does."""
    import queue
    import signal
    import threading
    import time
    proc = subprocess.Popen([sys.executable, str(ROOT / "build.py"), "logs", *argv, "-f"], cwd=work_dir(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=ctrl_c_reaches_it)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout or []:
            lines.put(line)
    threading.Thread(target=read, daemon=True).start()
    deadline, seen = time.monotonic() + within_s, False
    while not seen and time.monotonic() < deadline:
        try:
            seen = wanted in lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            break
    following = seen and proc.poll() is None
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    return following, code


@contextlib.contextmanager
def serving(handler, host: str = "127.0.0.1"):
    """A stand-in HTTP server of `handler` on `host` (a free port), each request in a daemon thread; shut down
    when the block ends."""
    server = ThreadingHTTPServer((host, 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
