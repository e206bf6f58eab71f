"""Registry names as Docker resolves them, and push progress from the engine's own push events (the Engine API's
stream: status, id, progressDetail {current, total}, then aux {Tag, Digest, Size})."""

from __future__ import annotations

from servekit.release.registry import PushProgress, host_of


def test_names_resolve_as_docker_resolves_them():
    assert host_of("user/vllm-serve") == "docker.io"
    assert host_of("docker.io/user/vllm-serve") == "docker.io"
    assert host_of("ghcr.io/org/vllm-serve") == "ghcr.io"
    assert host_of("127.0.0.1:5000/serve/vllm-serve") == "127.0.0.1:5000"


EVENTS: list[dict] = [
    {"status": "The push refers to repository [127.0.0.1:5000/serve/vllm-serve]"},
    {"status": "Preparing", "progressDetail": {}, "id": "a1"},
    {"status": "Preparing", "progressDetail": {}, "id": "b2"},
    {"status": "Pushing", "progressDetail": {"current": 50_000_000, "total": 200_000_000}, "id": "a1"},
    {"status": "Layer already exists", "progressDetail": {}, "id": "b2"},
    {"status": "Pushing", "progressDetail": {"current": 200_000_000, "total": 200_000_000}, "id": "a1"},
    {"status": "Pushed", "progressDetail": {}, "id": "a1"},
    {"status": "v1: digest: sha256:0123 size: 528"},
    {"progressDetail": {}, "aux": {"Tag": "v1", "Digest": "sha256:0123", "Size": 528}},
]


def test_push_progress_is_plain_lines_in_a_log_and_one_live_line_on_a_terminal():
    lines: list[tuple[str, bool]] = []
    log = PushProgress("v1", lambda text, live: lines.append((text, live)), terminal=False, every_s=3600)
    for event in EVENTS:
        log(event)
    assert lines == []  # in a log: a line every every_s, never one per event
    assert log.line().startswith("push v1: 200 of 200 MB, ") and log.line().endswith(", 2 layers done")
    live: list[tuple[str, bool]] = []
    term = PushProgress("v1", lambda text, on: live.append((text, on)), terminal=True)
    for event in EVENTS:
        term(event)
    assert len(live) == len(EVENTS) and all(on for _, on in live)
    assert live[3][0].startswith("push v1: 50 of 200 MB") and live[-1][0].endswith("2 layers done")
