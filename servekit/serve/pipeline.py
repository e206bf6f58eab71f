"""A run on one engine: for each profile, boot, check, report and take it down (`run`, sweeps and fleets)."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from servekit import engines
from servekit.config.matrix import Matrix
from servekit.engines import transfer
from servekit.engines.deployment import Deployment
from servekit.errors import BootFailed
from servekit.image.boundary import read_secret
from servekit.output import Say
from servekit.records.budget import compile_cache, read_budget
from servekit.records.models import BootFigures, ImageUsed, Memory, ReleaseRecord, RunReport
from servekit.serve import deploy
from servekit.serve.boot import Boot, BootInterrupted, Stopped, boot
from servekit.serve.checks import checks_to_run, console_line, not_required_results, smoke
from servekit.smoke import Context, Result, all_passed


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a run, carrying the report of what it got to (written before the run stops)."""

    def __init__(self, report: RunReport, series: dict) -> None:
        super().__init__(report.run_id)
        self.report, self.series = report, series
        self.written: list[Path] = []  # the run's report folders, this one's last (set by run_profiles)


def _new_report(matrix: Matrix, dep: Deployment, profile: str) -> RunReport:
    """The report of a run about to start: what runs where, the image's ID and what the reader must know of it."""
    created = dt.datetime.now(dt.UTC)
    report = RunReport(run_id=f"{created:%Y%m%d-%H%M%S}-{profile}-{dep.target}",
                       created=created.isoformat(timespec="seconds"), profile=profile, target=dep.target,
                       host=dep.host, engine=dep.engine.given, url=dep.url,
                       image=ImageUsed(tag=dep.image, left_out=list(dep.left_out)),
                       served_from="image" if dep.engine.serves_images else "environment",
                       stand_in=dep.stand_in, pins=matrix.target_pins(dep.target))
    report.image.id = dep.engine.image_id(dep.image)  # what a release is matched by, known before the boot
    source = matrix.profiles[profile].source_budget.get(dep.host)
    report.source_budget = source.model_dump(exclude_none=True) if source else None
    if dep.stand_in:
        report.notes.append(f"served {dep.stand_in} ({matrix.models[dep.stand_in].dir}, through MODEL_DIR) in place "
                            f"of {matrix.targets[dep.target].model}, with its check parameters (images.yaml models."
                            f"{dep.stand_in}.checks)")
    if dep.card:
        report.card = dep.card.to_json()
        report.notes.append(dep.card.said() + "; the GPU's peak and margin are the card's: what the GPU held above "
                            "its use before the boot, against the card's memory")
    if matrix.profiles[profile].auth == "none":
        report.notes.append("served WITHOUT an API key: the profile says auth: none in images.yaml")
    return report


def _record_memory(report: RunReport, b: Boot | None) -> dict:
    """The boot's figures and memory into the report; the series for its plot."""
    memory = b.memory() if b else {"gpus": [], "shared_usage": None, "phases": [], "notes": [], "container": None}
    if b:
        lines = list(b.record.lines)  # once: the watch's thread may still append to the deque
        report.boot = BootFigures(time_to_healthy_s=b.record.time_to_healthy_s, kv_pool_tokens=b.record.kv_pool_tokens,
                                  detection_lag_s=b.record.detection_lag_s, phases=memory["phases"],
                                  budget=read_budget(lines), compile_cache=compile_cache(lines), prepare=b.prepare)
    shared = dict(memory["shared_usage"]) if memory["shared_usage"] else None
    series = {"gpus": memory.get("gpu_series") or [], "container": memory.get("container_series"),
              "shared": shared.pop("series") if shared else None}
    report.memory = Memory(gpus=memory["gpus"], shared_usage=shared, container=memory.get("container"))
    report.notes += memory["notes"]
    return series


def run_profile(matrix: Matrix, dep: Deployment, profile: str, key_file: Path, say: Say = print, knobs: dict | None = None,
                only: list[str] | None = None, stop: threading.Event | None = None,
                boot_timeout_s: float | None = None) -> tuple[RunReport, dict]:
    """Boot, smoke, down: (the report, the series for its plot). Never raises for a failed boot or check; raises
    RunInterrupted, with the report of what was measured, on Ctrl-C or SIGTERM.

    `knobs` apply to this boot only; `only` limits the checks to those named; `boot_timeout_s` bounds the boot
    (default: serve.boot_timeout_s)."""
    checks = checks_to_run(matrix, profile, dep.target, only, dep.host, dep.stand_in)
    report = _new_report(matrix, dep, profile)
    b = failed_boot = down_failed = None
    interrupted = None
    done: list[Result] = []

    def heard(result: Result) -> None:
        done.append(result)
        say(f"  {console_line(result)}")
    try:
        if deploy.is_running(profile, dep.engine):  # somebody's server (an `up`): never restarted or stopped by a run
            raise BootFailed(f"{profile} is already running on engine {dep.engine.given}, started by someone else "
                             f"(`up`?); left alone: stop it with `python3 build.py down {profile}` first", "", [])
        b = boot(dep, profile, boot_timeout_s or matrix.serve.boot_timeout_s, knobs=knobs, stop=stop, say=say)
        say(f"  healthy in {b.record.time_to_healthy_s} s (KV pool {b.record.kv_pool_tokens} tokens)")
        b.mark("traffic")
        lines = lambda: list(b.record.lines)  # noqa: E731
        served_name = matrix.models[matrix.targets[dep.target].model].served_name
        server = b.server
        assert server is not None, "a boot returns with its server"
        ctx = Context(dep.url, read_secret(key_file), served_name,
                      gpu=matrix.targets[dep.target].gpu, logs=lines, healthy_line=len(b.record.lines),
                      environ=server.environ,
                      shared_usage=b.end_traffic if dep.host == "wsl2" else None)
        results = smoke(ctx, checks, on_result=heard)
        b.mark("end")
    except BootFailed as exc:
        failed_boot = exc.boot  # its samples up to the failure (taken down already)
        say(f"  boot failed: {exc}")
        results = [Result("boot", "failed", _with_notes(exc), {"last_lines": exc.last_lines[-12:]})]
        results += [Result(name, "not_run", "the server did not boot") for name in checks]
    except Stopped:  # a fleet run told to stop: no report of this profile
        raise
    except Exception as exc:  # an engine's or a sampler's error: the run still ends with its report, failed
        failed_boot = getattr(exc, "boot", None)  # a boot's samples up to the error, where it got that far
        reason = f"the run ended on an error ({type(exc).__name__}): {_with_notes(exc)}"
        say(f"  {reason}")
        results = done if b else [Result("boot", "failed", reason, {"last_lines": []})]
        if b:
            results.append(Result("run", "failed", reason))
        results += [Result(name, "not_run", f"not run: {reason}") for name in checks
                    if name not in {r.name for r in results}]
    except KeyboardInterrupt as exc:  # a `timeout` or Ctrl-C: the report keeps what was measured before it
        failed_boot = getattr(exc, "boot", None)  # a boot's log and samples up to the signal
        interrupted = _with_notes(exc) if isinstance(exc, BootInterrupted) else "interrupted " + (
            "during the checks" if b else "before the boot")
        say(f"  {interrupted}")
        results = done if b else [Result("boot", "not_run", interrupted, {
            "last_lines": exc.last_lines if isinstance(exc, BootInterrupted) else []})]
        results += [Result(name, "not_run", f"not run: {interrupted}") for name in checks
                    if name not in {r.name for r in results}]
    finally:
        if b:
            b.stop_samplers()
            report.image.id = (b.server.image_id if b.server else None) or report.image.id
            try:
                deploy.down(dep, profile)  # what this run started, and nothing else
            except Exception as exc:  # the report is still written, and says the server may be left
                down_failed = Result("down", "failed", f"taking {profile} down failed ({type(exc).__name__}): {exc}; "
                                     f"`python3 build.py down {profile}` tries again")
    series = _record_memory(report, b or failed_boot)
    # what the server ran with (the shell's knobs included), else what this run asked for
    report.knobs = deploy.knobs_of(b.server.state()) if b and b.server else (knobs or {})
    for result in not_required_results(matrix, profile, dep.target, only, dep.stand_in):
        say(f"  {console_line(result)}")
        results.append(result)
    report.checks = results + ([down_failed] if down_failed else [])
    report.passed = all_passed(r.status for r in report.checks)
    if interrupted:
        raise RunInterrupted(report, series)
    return report, series


def _with_notes(exc: BaseException) -> str:
    return "; ".join([str(exc), *getattr(exc, "__notes__", [])])


def run_profiles(matrix: Matrix, dep: Deployment, profiles: list[str], key_file: Path,
                 write: Callable[[RunReport, dict], Path], say: Say = print,
                 release: ReleaseRecord | None = None, stop: threading.Event | None = None,
                 knobs: dict | None = None, only: list[str] | None = None,
                 boot_timeout_s: float | None = None) -> list[tuple[RunReport, Path]]:
    """On dep's engine: the image put there if need be, then each profile booted, checked and written.

    `write(report, series)` stores one report and returns where; the list pairs each report with that.
    `stop`, when set, ends the work at the next boot or profile with Stopped; `knobs`, `only` and `boot_timeout_s`
    as run_profile."""
    arrived = transfer.ensure_image(dep.engine, dep.image, release, say=say)
    if arrived != "already there":
        say(f"image {arrived}")
    written: list[tuple[RunReport, Path]] = []
    with engines.reach(dep.engine, dep.bind, dep.port) as url:
        dep = replace(dep, reached_at=url)
        for profile in profiles:
            if stop and stop.is_set():
                raise Stopped("stopped")
            say(f"run: {profile}")
            try:
                report, series = run_profile(matrix, dep, profile, key_file, say=say, stop=stop, knobs=knobs,
                                             only=only, boot_timeout_s=boot_timeout_s)
            except RunInterrupted as exc:
                exc.report.image.arrived = arrived
                exc.written = [folder for _, folder in written] + [write(exc.report, exc.series)]
                say(f"run: {profile}: interrupted; report in {exc.written[-1]}")
                raise
            report.image.arrived = arrived
            written.append((report, write(report, series)))
    return written
