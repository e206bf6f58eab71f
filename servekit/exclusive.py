"""One build, boot or release at a time in a checkout: they share the engine's port, the Compose project,
compose/.env and the key. A second command waits (saying for whom) until the first ends, up to a deadline."""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path

from servekit.errors import EnvironmentProblem

WAIT_S = 3600.0


@contextmanager
def exclusive(cache: Path, what: str, say=print, wait_s: float = WAIT_S):
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / "servekit.exclusive"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another servekit command"
                    say(f"waiting for {holder} to finish: one build, boot or release at a time in this checkout")
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
