"""The lines a run ends with, each a bug to fix next, not a pass to forget:

- `FLAKY:` the rerun rule's report. With `--reruns 1` (pytest-rerunfailures; `make test` passes it) a test that
  failed once and passed on its rerun is named, with the last lines of its first failure; one that failed twice
  fails the run, as any failure does.
- `SLOW:` a test whose call took over SLOW_S without a docstring saying what it proves that a cheaper test cannot.

conftest.py registers it; a suite of its own registers it the same way (tests/test_rerun_rule.py does)."""

from __future__ import annotations

import pytest

TAIL_LINES = 12  # of the first failure: enough for the assertion and where it was raised
SLOW_S = 60.0


class Explained:
    """In the process that runs the test (a worker under pytest-xdist): whether it has a docstring, carried to the
    summary's process with its report."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.when == "call":
            doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
            outcome.get_result().user_properties.append(("explained", bool(doc.strip())))


class SummaryLines:
    """Collects, in the process that prints the summary (the controller under pytest-xdist), each test's first
    failure that was rerun, the tests whose rerun then passed, and the slow tests that do not say why."""

    def __init__(self) -> None:
        self.first_failure: dict[str, tuple[str, str]] = {}  # test id -> (the crash's line, the failure's text)
        self.flaky: list[str] = []
        self.unexplained: dict[str, float] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.outcome == "rerun":  # the crash's line first: the text's tail may be a long message's end
            crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "") or ""
            self.first_failure.setdefault(report.nodeid, (crash.split("\n")[0][:300], report.longreprtext))
        elif report.when == "call" and report.passed and report.nodeid in self.first_failure:
            self.flaky.append(report.nodeid)  # one that failed again fails the run, as any failure does
        if report.when == "call" and report.duration > SLOW_S and not dict(report.user_properties).get("explained"):
            self.unexplained[report.nodeid] = report.duration

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for nodeid in self.flaky:
            crash, text = self.first_failure[nodeid]
            tail = [crash, "...", *text.rstrip().splitlines()[-TAIL_LINES:]]
            terminalreporter.write_line(f"FLAKY: {_shown(nodeid)} passed only on its rerun; its first failure ended:",
                                        yellow=True)
            for line in tail:
                terminalreporter.write_line(f"FLAKY:   {line}")
        for nodeid, seconds in self.unexplained.items():
            terminalreporter.write_line(f"SLOW: {_shown(nodeid)} took {seconds:.0f} s, and its docstring does not say what "
                                        "it proves that a cheaper test cannot", yellow=True)


def register(config: pytest.Config) -> None:
    """Into `config`: the docstring's mark where tests run, the lines where the summary is printed (not in a
    pytest-xdist worker, whose reports reach the controller)."""
    config.pluginmanager.register(Explained(), "summary-lines-explained")
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(SummaryLines(), "summary-lines")


def _shown(nodeid: str) -> str:
    """The test's own id, without the `@group` pytest-xdist's loadgroup appends to it (tests/grouping.py)."""
    return nodeid.rsplit("@", 1)[0] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid
