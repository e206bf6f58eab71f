"""The rerun rule's report: with `--reruns 1` (pytest-rerunfailures; `make test` passes it) a test that failed once
and passed on its rerun ends the run with a `FLAKY:` line and the last lines of its first failure; one that failed
twice fails the run, as any failure does. A FLAKY line is a bug to fix next, not a pass to forget.

conftest.py registers it; a suite of its own registers it the same way (tests/test_rerun_rule.py does)."""

from __future__ import annotations

import pytest

TAIL_LINES = 12  # of the first failure: enough for the assertion and where it was raised


class FlakyLines:
    """Collects, in the process that prints the summary (the controller under pytest-xdist), each test's first
    failure that was rerun, and the tests whose rerun then passed."""

    def __init__(self) -> None:
        self.first_failure: dict[str, str] = {}
        self.flaky: list[str] = []

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.outcome == "rerun":
            self.first_failure.setdefault(report.nodeid, report.longreprtext)
        elif report.when == "call" and report.passed and report.nodeid in self.first_failure:
            self.flaky.append(report.nodeid)  # one that failed again fails the run, as any failure does

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for nodeid in self.flaky:
            tail = self.first_failure[nodeid].rstrip().splitlines()[-TAIL_LINES:]
            terminalreporter.write_line(f"FLAKY: {nodeid} passed only on its rerun; its first failure ended:",
                                        yellow=True)
            for line in tail:
                terminalreporter.write_line(f"FLAKY:   {line}")


def register(config: pytest.Config) -> None:
    """Into `config`, unless this process is a pytest-xdist worker (whose reports reach the controller)."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(FlakyLines(), "flaky-lines")
