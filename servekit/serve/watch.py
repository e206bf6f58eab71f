"""Watch a booting vLLM container until it is healthy or has failed, and say why at once.

Three things are watched together: the keyless health route (polled every 250 ms), the
container's state, and its log stream. A Traceback, an out-of-memory line, an engine that
failed to start, a WSL2 failure or the container exiting ends the wait immediately with the
reason and the last log lines, rather than at the timeout.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import requests

from servekit.engines import Server
from servekit.engines.failures import VLLM_PREFIX, classify
from servekit.errors import BootFailed
from servekit.waiting import until

TRACEBACK_GRACE_S = 2.0  # a traceback's own exception line follows within this; it is the better reason
READY = re.compile(r"Application startup complete")
KV_POOL = re.compile(r"KV cache size: ([\d,]+) tokens")
LOG_PREFIX = re.compile(r"^(\S+) (.*)$")  # docker's RFC 3339 timestamp, then the line


# Lines that say where a boot is (weights, profiling, the KV pool, graphs, compiles, the server): shown as progress.
MILESTONE = re.compile(r"prepare: |Loading (weights|model)|Model loading took|profil|KV cache|Capturing|[Cc]ompil|"
                       r"Starting vLLM|Application startup|Uvicorn running|launcher: ")


def milestone(lines: Iterable[str]) -> str | None:
    """The latest line of `lines` that says where the boot is, without its logger prefix."""
    for line in reversed(list(lines)[-200:]):
        if MILESTONE.search(line):
            return re.sub(r"^(\(\w+ pid=\d+\) )?(INFO|DEBUG) \S+ \S+ \[[^\]]*\] ", "", line).strip()[:120]
    return None


@dataclass
class BootRecord:
    started: float  # time.time() when watching began (the container was just started)
    healthy_at: float | None = None
    ready_logged_at: float | None = None
    kv_pool_tokens: int | None = None
    lines: deque = field(default_factory=lambda: deque(maxlen=4000))

    @property
    def time_to_healthy_s(self) -> float | None:
        return None if self.healthy_at is None else round(self.healthy_at - self.started, 2)

    @property
    def detection_lag_s(self) -> float | None:
        if self.healthy_at is None or self.ready_logged_at is None:
            return None
        return round(max(0.0, self.healthy_at - self.ready_logged_at), 3)


def _timestamp(text: str) -> float | None:
    try:  # docker writes nanoseconds; Python takes microseconds
        return datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", text.replace("Z", "+00:00"))).timestamp()
    except ValueError:
        return None


class LogFollower(threading.Thread):
    """Follows the container's log stream; records readiness, the KV pool and the first failure."""

    def __init__(self, server: Server | None, record: BootRecord) -> None:
        super().__init__(daemon=True)
        self.server, self.record = server, record
        self._failure: tuple[str, str] | None = None
        self._detail: list[str] = []  # lines after the failure line: pydantic puts the message there
        self._traceback: tuple[float, tuple[str, str]] | None = None
        self.ended = threading.Event()

    @property
    def failure(self) -> tuple[str, str] | None:
        """The failure seen, if any; a bare traceback counts once its grace period has passed."""
        if self._failure is None and self._traceback and time.monotonic() - self._traceback[0] > TRACEBACK_GRACE_S:
            self._failure = self._traceback[1]
        if self._failure and self._detail:
            return self._failure[0], " | ".join([self._failure[1], *self._detail])
        return self._failure

    def failure_at_exit(self) -> tuple[str, str] | None:
        """Once the container has exited there is nothing more to wait for: a bare traceback counts."""
        return self.failure or (self._traceback[1] if self._traceback else None)

    def run(self) -> None:
        buffer = b""
        try:
            assert self.server is not None, "a follower that runs follows a server"
            for chunk in self.server.follow_log(follow=True, timestamps=True):
                buffer += chunk
                while b"\n" in buffer:
                    raw, buffer = buffer.split(b"\n", 1)
                    self.feed(raw.decode("utf-8", "replace"))
        except Exception:  # the container went away: the state check reports it
            pass
        finally:
            self.ended.set()

    def feed(self, raw: str) -> None:
        mo = LOG_PREFIX.match(raw)
        stamp, line = (_timestamp(mo[1]), mo[2]) if mo and _timestamp(mo[1]) else (None, raw)
        self.record.lines.append(line)
        if READY.search(line) and self.record.ready_logged_at is None:
            self.record.ready_logged_at = stamp or time.time()
        pool = KV_POOL.search(line)
        if pool:
            self.record.kv_pool_tokens = int(pool[1].replace(",", ""))
        if self._failure is not None:
            if len(self._detail) < 2 and line.strip() and without_frames(list(self.record.lines)[-2:])[-1:] == [line]:
                self._detail.append(line.strip()[:240])
            return
        found = classify(line)
        if found and found[0] == "traceback":
            self._traceback = self._traceback or (time.monotonic(), found)
        elif found:
            self._failure = found


def without_frames(lines: Iterable[str]) -> list[str]:
    """The lines without traceback frames (`  File "..."`, the source line after it, carets)."""
    out, after_file = [], False
    for line in lines:
        body = re.sub(VLLM_PREFIX, "", line)
        frame = body.startswith(('  File "', "Traceback")) or (after_file and body.startswith("    ")) or \
            (body.strip() != "" and set(body.strip()) <= set("^~ "))
        after_file = body.startswith('  File "')
        if not frame:
            out.append(line)
    return out


# --- the waits: each polled in turn until all hold or one says the boot cannot succeed ------------------------

class Wait(Protocol):
    def poll(self) -> bool:
        """True when this wait holds; raise BootFailed when it never will."""


@dataclass
class NoFailureLogged:
    """The log has shown no failure (a traceback counts once its own exception line had the time to follow)."""
    follower: LogFollower
    tail: Callable[[], list[str]]

    def poll(self) -> bool:
        if self.follower.failure:
            time.sleep(0.3)  # the failure's detail lines are usually a few milliseconds behind it
            raise BootFailed(*self.follower.failure, self.tail())
        return True


@dataclass
class StillRunning:
    """The container (or process) has not exited; if it has, the log's failure, else its exit code, says why."""
    state: Callable[[], Any]  # the server's ServerState, read afresh
    follower: LogFollower
    tail: Callable[[], list[str]]

    def poll(self) -> bool:
        state = self.state()
        # restart: unless-stopped brings a failed server back; an exit during a boot is still a failed boot
        if state.status in ("exited", "dead", "restarting") or state.restarts:
            self.follower.ended.wait(2)  # let the last lines arrive before quoting them
            failure = self.follower.failure_at_exit()
            if failure:
                raise BootFailed(*failure, self.tail())
            raise BootFailed(f"the container exited with code {state.exit_code}", "", self.tail())
        return True


@dataclass
class HealthAnswers:
    """The keyless health route answers 200."""
    url: str

    def poll(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False


def wait_until(waits: list[Wait], deadline_s: float, poll_s: float, tail: Callable[[], list[str]],
               each_round: Callable[[], None] | None = None) -> None:
    """Poll every wait in order, every `poll_s`, until all hold, within one deadline for all of them; the first that
    raises ends it at once. `each_round` runs after each round (progress, a stop request)."""
    def round_holds() -> bool:
        held = all([w.poll() for w in waits])  # every wait polled each round: a failure is never left unread
        if each_round:
            each_round()
        return held
    if not until(round_holds, deadline_s, poll_s):
        raise BootFailed(f"not healthy within {deadline_s:.0f} s", "", tail())


def watch_boot(server: Server, url: str, timeout_s: float, record: BootRecord | None = None,
               poll_s: float = 0.25,
               progress: Callable[[float, BootRecord], None] | None = None) -> BootRecord:
    """Block until /health answers 200; raise BootFailed on a failure line, an exit or the timeout."""
    record = record or BootRecord(started=time.time())
    follower = LogFollower(server, record)
    state = lambda: server.state(fresh=True)  # noqa: E731
    follower.start()

    def tail() -> list[str]:
        return without_frames(record.lines)[-20:]

    wait_until([NoFailureLogged(follower, tail), StillRunning(state, follower, tail), HealthAnswers(url)],
               timeout_s, poll_s, tail, each_round=(lambda: progress(time.time() - record.started, record))
               if progress else None)
    record.healthy_at = time.time()
    # The startup line is logged just before /health answers; give the stream a moment to deliver it.
    until(lambda: record.ready_logged_at is not None, 2, 0.05)
    return record
