"""Smoke checks: each a small unit with a name and parameters, runnable against any base URL.

A check returns a Result with one of three outcomes: passed, failed, or not run (with why: a check
that could not measure never passes), and the figures it measured. A fourth status, not required,
is given by the matrix to a check a profile does not need on a target by design (with why), never by
a check. A run passes only when every check passed or was not required (`all_passed`). The registry
maps the names used in images.yaml to the functions.
"""

from __future__ import annotations

# Importing the check modules registers their checks (they import .core, never this package: no cycle).
from . import agreement, api, cache, load, logs, spec, spill, tools  # noqa: F401
from .core import (
    AFTER_TRAFFIC,
    CHECK_DEADLINE_S,
    CHECKS,
    GATE_PASSES,
    MAX_BODY_BYTES,
    RUN_DEADLINE_S,
    STATUSES,
    CheckFailure,
    Context,
    NotRun,
    Result,
    Status,
    all_passed,
    check,
    ensure,
    metric_samples,
    param_problems,
    reasoning_of,
    run_check,
    stream_events,
    text_of,
    totals,
)

__all__ = [
    "AFTER_TRAFFIC", "CHECK_DEADLINE_S", "CHECKS", "GATE_PASSES", "MAX_BODY_BYTES", "RUN_DEADLINE_S", "STATUSES",
    "CheckFailure", "Context", "NotRun", "Result", "Status", "all_passed", "check", "ensure", "metric_samples",
    "param_problems", "reasoning_of", "run_check", "stream_events", "text_of", "totals"
]
