"""Shared fixtures: throwaway copies of the repository, and the tests' own Compose project and port.

Every command the tests run works in WORK, a copy of the repository made for this session, under
the Compose project TEST_PROJECT and on TEST_PORT: a developer's reports, releases, compose/.env,
key and running servers are left as they were. The image tags are the same as the checkout's
(content-addressed), so the engine's images and build cache serve both.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from servekit.config.derived import PARTS  # noqa: E402

TEST_PROJECT = "servekit-test"
TEST_PORT = 18000  # the tests' servers publish here, never on a developer's 8000

# The matrix, the files that repeat its pins, and every file `derive` writes into.
COPIED = ("images.yaml", "images.schema.json", "docker/locks", "requirements.in", "requirements.lock",
          "docker/patches", "docs/install.md", "compose",
          *PARTS)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of the matrix and its mirror files; the caches come along so tests stay fast."""
    for rel in COPIED:
        src, dst = ROOT / rel, tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
    cache = ROOT / ".cache" / "metadata"
    if cache.is_dir():
        shutil.copytree(cache, tmp_path / ".cache" / "metadata")  # a copy: tests delete from it
    pristine = ROOT / ".cache" / "pristine"
    if pristine.is_dir():
        (tmp_path / ".cache" / "pristine").symlink_to(pristine)  # read only, and large
    return tmp_path


@pytest.fixture
def cli(capsys):
    """Run the command line in-process: returns (exit code, stdout, stderr)."""
    from servekit.cli import main

    def run(*argv: str):
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


def run_build_py(*argv: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    cwd = cwd or WORK
    return subprocess.run([sys.executable, str(ROOT / "build.py"), *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def tracked_copy(dst: Path) -> Path:
    """A copy of the repository as git tracks it (new files included), plus the caches `verify` keeps, serving
    on the tests' own port (not part of any image, so the tags stay the checkout's)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    for cache in ("metadata", "pristine"):
        if (ROOT / ".cache" / cache).is_dir():
            (dst / ".cache").mkdir(exist_ok=True)
            os.symlink(ROOT / ".cache" / cache, dst / ".cache" / cache)
    matrix = dst / "images.yaml"
    text = matrix.read_text()
    assert "\n  port: 8000\n" in text
    matrix.write_text(text.replace("\n  port: 8000\n", f"\n  port: {TEST_PORT}\n"))
    return dst


@pytest.fixture(scope="session")
def cpu_base() -> str:
    """The cpu target's base image, made here as a build would make it (a no-op once it is there)."""
    from servekit.build.bases import ensure_made_base
    from servekit.config.matrix import load_matrix
    matrix = load_matrix(ROOT / "images.yaml")
    name = next(t.bases[0] for t in matrix.targets.values() if not t.gpu)
    ensure_made_base(name, matrix.bases[name], ROOT / ".cache" / "bases", say=lambda line: None)
    return matrix.bases[name].image


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
        "servers": subprocess.run(["docker", "ps", "-aq", "--filter", "label=com.docker.compose.project=servekit"],
                                  capture_output=True, text=True).stdout.split() if shutil.which("docker") else [],
    }


STATE_AT_START = checkout_state()
os.environ["SERVEKIT_PROJECT"] = TEST_PROJECT  # for the commands run in-process and in subprocesses alike


WORK = tracked_copy(Path(tempfile.mkdtemp(prefix="servekit-tests-")))
# The Compose files as committed, in a folder no command writes to (no compose/.env appears there).
COMPOSE = Path(shutil.copytree(WORK / "compose", Path(tempfile.mkdtemp(prefix="servekit-compose-")) / "compose"))


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(WORK, ignore_errors=True)
    shutil.rmtree(COMPOSE.parent, ignore_errors=True)


def project_containers() -> list[str]:
    """The tests' Compose project's containers, running or not."""
    return subprocess.run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={TEST_PROJECT}"],
                          capture_output=True, text=True).stdout.split()


def follow_logs(*argv: str, wanted: str, within_s: float = 60) -> tuple[bool, int]:
    """`build.py logs ... -f` until a line holding `wanted` arrives, then Ctrl-C, as a person stops it: (seen while
    it was still following, its exit code). Bounded in time, whatever the command does."""
    import queue
    import signal
    import threading
    import time
    proc = subprocess.Popen([sys.executable, str(ROOT / "build.py"), "logs", *argv, "-f"], cwd=WORK,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
