"""The checks of a run: which a profile runs on a target and host (those it does not require said apart), running
them in order within the run's deadline, and a verdict's line for the console."""

from __future__ import annotations

import time
from collections.abc import Callable

from servekit.config.matrix import Matrix
from servekit.errors import UserError
from servekit.smoke import AFTER_TRAFFIC, RUN_DEADLINE_S, Context, Result, run_check


def checks_to_run(matrix: Matrix, profile: str, target: str, only: list[str] | None = None,
                  host: str | None = None, stand_in: str | None = None) -> dict[str, dict]:
    """The profile's checks on `host` with their parameters (a `stand_in` model's where one is served), or only those
    named (each with the profile's parameters where it has the check, else the check's own); those that judge the
    others' traffic (spill) come last. A check the target does not require is left out, unless named."""
    for name in only or []:
        if name not in matrix.checks:
            raise UserError(f"--check {name}: expected one of {', '.join(matrix.checks)}")
    checks = matrix.profile_checks(profile, target, host, stand_in)
    if only:
        everywhere = {**matrix.profile_checks(profile, target, model_name=stand_in),
                      **{name: {} for name in matrix.not_required(profile, target, stand_in)}}
        checks = {name: {**matrix.checks[name].params, **everywhere.get(name, {})} for name in only}
    return dict(sorted(checks.items(), key=lambda item: AFTER_TRAFFIC.index(item[0]) + 1
                       if item[0] in AFTER_TRAFFIC else 0))


def not_required_results(matrix: Matrix, profile: str, target: str, only: list[str] | None = None,
                         stand_in: str | None = None) -> list:
    """A result for each check of the profile the target (or the stand-in served) does not require (images.yaml says
    why), unless named."""
    return [Result(name, "not_required", why) for name, why in matrix.not_required(profile, target, stand_in).items()
            if not only or name not in only]


def console_line(result: Result) -> str:
    """A check's verdict in one line, its whole first line of reason (report.md holds all of it)."""
    reason = result.reason.splitlines()[0] if result.reason else ""
    return f"{result.status.replace('_', ' '):12} {result.name} ({result.seconds} s) {reason}".rstrip()


def smoke(ctx: Context, checks: dict[str, dict], on_result: Callable[[Result], None] | None = None,
          deadline_s: float | None = None) -> list[Result]:
    """Run each check in order within the run's deadline, `on_result` hearing each verdict as it comes; a check that
    raises something unexpected fails, and the rest still run."""
    results = []
    ends = time.monotonic() + (deadline_s or RUN_DEADLINE_S)
    for name, params in checks.items():
        left = ends - time.monotonic()
        if left <= 0:
            results.append(Result(name, "not_run", "the run's deadline for its checks had passed"))
            continue
        try:
            result = run_check(name, ctx, params, deadline_s=left)
        except Exception as exc:  # a bug in a check must not hide the others' results
            result = Result(name, "failed", f"the check itself broke: {type(exc).__name__}: {exc}")
        results.append(result)
        if on_result:
            on_result(result)
    return results
