"""Registry names as Docker resolves them, and push progress from the engine's own push events (the Engine API's
stream: status, id, progressDetail {current, total}, then aux {Tag, Digest, Size})."""

from __future__ import annotations

import pytest

from servekit.engines.registry import PushProgress, RegistryDoor, TransientRegistryError, _follow, host_of


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
    {"status": f"v1: digest: sha256:{'01' * 32} size: 528"},
    {"progressDetail": {}, "aux": {"Tag": "v1", "Digest": f"sha256:{'01' * 32}", "Size": 528}},
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


def test_on_a_terminal_a_pull_draws_a_bar_for_each_layer():
    """`pull` on a terminal: each layer's bar (its bytes of its size and what the engine says of it), by rich, as
    `docker pull` draws them; the summing line stays for the log."""
    import io

    from rich.console import Console

    from servekit.engines.registry import LayerBars
    screen = io.StringIO()
    pulled = [{**e, "status": e.get("status", "").replace("Pushing", "Downloading").replace("Pushed", "Pull complete")}
              for e in EVENTS]
    with LayerBars("v1", console=Console(file=screen, force_terminal=True, width=120)) as bars:
        for event in pulled:
            bars(event)
    drawn = screen.getvalue()
    assert "pull a1 Downloading" in drawn and "pull a1 Pull complete" in drawn and "200.0/200.0 MB" in drawn, drawn
    assert "b2" not in drawn  # a layer the registry had already: no bytes, no bar
    assert bars.line().startswith("pull v1: 200 of 200 MB, ") and bars.line().endswith(", 2 layers done")


# --- what the registry names is checked before it becomes a reference or a record (issue #47) ----------------------

GOOD_DIGEST = "sha256:" + "ab" * 32


class _Api:
    def __init__(self, answer):
        self.answer = answer

    def inspect_distribution(self, reference):
        return self.answer


class _Client:
    def __init__(self, answer=None, events=()):
        self.api, self.events = _Api(answer), list(events)


@pytest.mark.parametrize("answer", [{"Descriptor": {"digest": "sha256:../../etc"}}, {"Descriptor": {"digest": 7}},
                                    {"Descriptor": {"digest": "md5:" + "0" * 32}}, ["Descriptor"], "nonsense"])
def test_a_digest_the_registry_names_that_is_no_digest_is_not_believed(answer):
    with pytest.raises(TransientRegistryError) as refused:
        RegistryDoor(_Client(answer)).digest("127.0.0.1:5000/x/vllm-serve", "v1")
    assert "reading 127.0.0.1:5000/x/vllm-serve:v1" in str(refused.value) and "\n" not in str(refused.value)


def test_a_digest_of_the_right_form_is_taken_and_no_descriptor_is_no_tag():
    assert RegistryDoor(_Client({"Descriptor": {"digest": GOOD_DIGEST}})).digest("r/x", "v1") == GOOD_DIGEST
    assert RegistryDoor(_Client({"Descriptor": {}})).digest("r/x", "v1") is None


@pytest.mark.parametrize("pushed, says", [("sha256:0123", "which is no sha256 digest"),
                                          (["sha256:" + "0" * 64], "which is no sha256 digest")])
def test_a_push_whose_stream_names_no_digest_is_not_believed(pushed, says):
    events = [{"status": "Pushing", "progressDetail": {"current": "lots", "total": None}, "id": "a1"},
              {"progressDetail": {}, "aux": {"Tag": "v1", "Digest": pushed}}]
    with pytest.raises(TransientRegistryError, match=says):
        _follow(lambda: iter(events), "r/x", "v1", "push", PushProgress("v1", lambda *a: None, terminal=True))
    good = [*events[:1], {"aux": {"Tag": "v1", "Digest": GOOD_DIGEST}}]
    assert _follow(lambda: iter(good), "r/x", "v1", "push", PushProgress("v1", lambda *a: None, terminal=True)) \
        == GOOD_DIGEST
