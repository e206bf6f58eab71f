"""The same profiles on several engines at once: a thread per engine, a report per engine, one summary.

Each engine gets the image (sent or pulled if need be), its own env file and port, and the same
boot-check-report path as a single run. Whatever goes wrong on one engine becomes its row in the
summary; the others go on.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servekit.config.matrix import Matrix
from servekit.config.session import Session
from servekit.engines import Engine
from servekit.engines.deployment import Deployment
from servekit.image.boundary import write_text_atomic
from servekit.output import Say, as_output
from servekit.records.models import FleetEngine, FleetSummary, ReleaseRecord, RunReport, Table, save
from servekit.records.releases import released
from servekit.records.report import markdown_table, write_report
from servekit.serve import deploy
from servekit.serve.pipeline import run_profiles
from servekit.serve.ready import ready_to_serve

STOP_WAIT_S = 60  # after Ctrl-C, how long the engines' threads get to take their boots down


@dataclass
class EngineRun:
    dep: Deployment
    reports: list[tuple[RunReport, Path]] = field(default_factory=list)
    error: str | None = None

    @property
    def engine(self) -> Engine:
        return self.dep.engine

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.reports) and all(r.passed for r, _ in self.reports)


def _run_one(run: EngineRun, matrix: Matrix, profiles: list[str], key_file: Path, out: Path, release: ReleaseRecord | None,
             say: Say, stop: threading.Event,
             only: list[str] | None = None) -> None:
    label = run.engine.label
    tell = as_output(say).child(f"[{label}] ")
    try:
        run.engine.check()
        run.reports = run_profiles(matrix, run.dep, profiles, key_file, release=release, say=tell, stop=stop,
                                   only=only, write=lambda report, series: write_report(out / f"{label}-{report.profile}",
                                                                             report, series, latest=False))
    except Exception as exc:  # one engine's failure is its row in the summary, never the others' end
        run.error = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        tell(f"failed: {run.error}")


def run_fleet(matrix: Matrix, deps: list[Deployment], profiles: list[str], key_file: Path, out: Path,
              release: ReleaseRecord | None = None,
              say: Say = print, only: list[str] | None = None) -> list[EngineRun]:
    """Run `profiles` on every deployment's engine in parallel (`only` those checks, where given); Ctrl-C takes
    every engine's profile down."""
    runs = [EngineRun(dep) for dep in deps]
    stop = threading.Event()
    threads = [threading.Thread(target=_run_one, args=(run, matrix, profiles, key_file, out, release, say, stop, only),
                                name=f"engine-{run.engine.label}", daemon=True) for run in runs]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    except KeyboardInterrupt:
        stop.set()
        _down_everywhere(runs, profiles)  # a compose up waiting on prepare fails at once; a boot then stops at its next poll
        deadline = time.monotonic() + STOP_WAIT_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        _down_everywhere(runs, profiles)  # whatever a compose up in flight created after the first round
        raise
    return runs


def _down_everywhere(runs: list[EngineRun], profiles: list[str]) -> None:
    for run in runs:
        for profile in profiles:
            with contextlib.suppress(Exception):  # an engine that went away has nothing left to take down
                deploy.down(run.dep, profile)


def summary(runs: list[EngineRun]) -> tuple[FleetSummary, str]:
    """(summary.json's document, summary.md): one row per engine and profile."""
    header = ["engine", "host", "profile", "result", "image", "healthy in (s)", "KV pool (tokens)", "tokens/s",
              "checks", "report"]
    rows: list[list[Any]] = []
    for run in runs:
        if run.error:
            rows.append([run.engine.label, run.dep.host, "", f"error: {run.error}", "", "", "", "", "", ""])
        for report, folder in run.reports:
            burst = next((c for c in report.checks if c.name == "burst"), None)
            passed = sum(1 for c in report.checks if c.status == "passed")
            rows.append([run.engine.label, run.dep.host, report.profile, "passed" if report.passed else "FAILED",
                         report.image.arrived or "", report.boot.time_to_healthy_s, report.boot.kv_pool_tokens,
                         burst.figures.get("tokens_per_s") if burst and burst.status == "passed" else None,
                         f"{passed}/{len(report.checks)}", f"{folder.name}/report.md"])
    doc = FleetSummary(passed=all(r.passed for r in runs), table=Table(header=header, rows=rows),
                       engines=[FleetEngine(engine=r.engine.given, label=r.engine.label, url=r.engine.url,
                                            port=r.dep.port, passed=r.passed, error=r.error,
                                            reports=[str(folder) for _, folder in r.reports]) for r in runs])
    cell = lambda v: "" if v is None else (f"{v:,}" if isinstance(v, int) else str(v))  # noqa: E731
    lines = [f"# Fleet run: {sum(r.passed for r in runs)} of {len(runs)} engines passed", "",
             *markdown_table(header, [[cell(v) for v in row] for row in rows])]
    lines += ["", "Engines: " + "; ".join(f"{r.engine.label} = {r.engine.url} (port {r.dep.port})" for r in runs)]
    return doc, "\n".join(lines) + "\n"


def write_summary(out: Path, runs: list[EngineRun]) -> tuple[FleetSummary, Path]:
    doc, markdown = summary(runs)
    save(out / "summary.json", doc)
    write_text_atomic(out / "summary.md", markdown)
    return doc, out / "summary.md"


def run(session: Session, engines: list[Engine], target: str | None = None, profiles: list[str] | None = None,
        host: str | None = "auto", port: int | None = None, say: Say = print,
        only: list[str] | None = None) -> tuple[FleetSummary, Path, list[EngineRun]]:
    """`run --engines`: build here once, then the profiles on every engine at once (`only` those checks, where
    given); (summary, its file, runs)."""

    ready = ready_to_serve(session, engines, "run", profiles, target=target, host=host, port=port, checks=only,
                           engines_checked=False, say=as_output(say).child("run: "))
    target, profiles, plan, deps = ready.target, ready.profiles, ready.plan, ready.deployments
    assert plan is not None, "run --engines builds"
    out = session.root / "reports" / f"{dt.datetime.now(dt.UTC):%Y%m%d-%H%M%S}-fleet-{target}"
    say(f"run: {', '.join(profiles)} on {len(engines)} engines in parallel: "
        f"{', '.join(f'{d.engine.given} ({d.host}, port {d.port})' for d in deps)}")
    runs = run_fleet(session.matrix, deps, profiles, ready.key_file, out, say=say,
                     release=released(session.root, session.matrix, target, plan.digest), only=only)
    doc, summary_md = write_summary(out, runs)
    return doc, summary_md, runs
