"""A server that never answers, trickles, or sends without end: each check fails within its deadline, naming
why, and no answer is held in memory past the cap."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest
from support import serving

from servekit.serve.checks import smoke
from servekit.smoke import Context, run_check

DEADLINE_S = 3.0


class Hostile(BaseHTTPRequestHandler):
    mode = "hang"
    stop = threading.Event()

    def do_GET(self):
        if self.mode == "hang":
            self.stop.wait(60)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if self.mode == "huge":
            self.send_header("Content-Length", str(300 << 20))
            self.end_headers()
            try:
                for _ in range(300 << 4):  # 300 MiB in 64 KiB pieces, as fast as it is read
                    self.wfile.write(b" " * (64 << 10))
            except OSError:  # the client left, as it should
                pass
            return
        self.end_headers()  # trickle: a byte a second, forever (each read is in time; the whole never is)
        while not self.stop.wait(1.0):
            try:
                self.wfile.write(b" ")
                self.wfile.flush()
            except OSError:
                return

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def hostile():
    with serving(Hostile) as server:
        yield server
        Hostile.stop.set()
    Hostile.stop = threading.Event()


@pytest.mark.parametrize("mode, says", [("hang", "no verdict within 3 s"), ("trickle", "no verdict within 3 s"),
                                        ("huge", "passed 1 MiB")])
def test_a_hostile_server_fails_the_check_within_its_deadline(hostile, mode, says):
    Hostile.mode = mode
    ctx = Context(f"http://127.0.0.1:{hostile.server_port}", "k" * 20, "m", timeout_s=30,
                  check_deadline_s=DEADLINE_S, max_body_bytes=1 << 20)
    started = time.monotonic()
    result = run_check("models", ctx, {})
    assert time.monotonic() - started < DEADLINE_S + 2
    assert result.status == "failed" and says in result.reason, result


@pytest.mark.slow
def test_the_runs_deadline_bounds_all_its_checks(hostile):
    Hostile.mode = "hang"
    ctx = Context(f"http://127.0.0.1:{hostile.server_port}", "k" * 20, "m", check_deadline_s=DEADLINE_S)
    started = time.monotonic()
    results = smoke(ctx, {"models": {}, "greedy": {}, "streaming": {}}, deadline_s=4.0)
    assert time.monotonic() - started < 6
    assert [r.status for r in results] == ["failed", "failed", "not_run"]
    assert "the run's deadline" in results[-1].reason
