"""Waits for one holder at a time, each with a deadline, saying for whom: one build, boot or release at a time in a
checkout (they share the engine's port, the Compose project, compose/.env and the key), one build of an image
tag (or a base) at a time on a machine, whatever the checkout: the builder's own tag and the canonical pass belong
to the engine, which every checkout of this machine shares; and one BuildKit solve at a time on the machine's
engine, whatever the tag."""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from servekit.errors import EnvironmentProblem
from servekit.output import Say

WAIT_S = 3600.0
MACHINE_LOCKS = Path(tempfile.gettempdir()) / "servekit-locks"


@contextmanager
def exclusive(cache: Path, what: str, say: Say = print, wait_s: float = WAIT_S, name: str = "servekit.exclusive",
              scope: str = "one build, boot or release at a time in this checkout") -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise EnvironmentProblem(f"{path}: cannot be opened as a lock ({exc.strerror})") from None
    try:
        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another servekit command"
                    say(f"waiting for {holder} to finish: {scope}")
                    told = True
                if time.monotonic() > deadline:
                    raise EnvironmentProblem(f"{path} was held for {wait_s:.0f} s; if no servekit command is "
                                             "running, something else holds it") from None
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} ({what})".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def machine_wide(kind: str, key: str, say: Say = print, wait_s: float = WAIT_S) -> AbstractContextManager[None]:
    """One `kind` (a build, a base) of `key` (an image tag, a base image) at a time on this machine, whichever
    checkout asks."""
    name = hashlib.sha256(f"{kind} {key}".encode()).hexdigest()[:24] + ".lock"
    return exclusive(MACHINE_LOCKS, f"{kind} of {key}", say, wait_s, name=name,
                     scope=f"one {kind} of {key} at a time on this machine")


def one_buildkit_solve(say: Say = print, wait_s: float = WAIT_S) -> AbstractContextManager[None]:
    """One BuildKit solve at a time on this machine's engine, whichever tag and checkout: Docker 20.10's BuildKit
    (Debian 12's docker.io) panics with "failed to get edge" on two solves at once that share steps, and the panic
    takes the whole daemon down (moby/moby#42414; two workers of the tests building two cpu images at once did)."""
    return exclusive(MACHINE_LOCKS, "a BuildKit build", say, wait_s, name="buildkit-solve.lock",
                     scope="one BuildKit build at a time on this machine's engine (Docker 20.10's BuildKit crashes "
                     "on two at once)")
