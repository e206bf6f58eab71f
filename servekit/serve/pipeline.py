"""Compose the stages of one boot: samplers, compose up, watch; so `up` and `run` share one path.

The samplers start before the container (their first sample is the baseline) and the phases
are marked from what the watcher sees: `load` from the container start, `warm-up` once the
weights are in memory, `traffic` when the caller starts sending requests.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any
from pathlib import Path

from wsl2.shared_usage import SharedUsageSampler, SharedUsageUnavailable

from servekit.serve import deploy

from servekit import engines

from servekit.engines import transfer
from servekit.engines.docker import EngineError
from servekit.errors import UserError
from servekit.records.models import BootFigures, ImageUsed, Memory, ReleaseRecord, RunReport
from servekit.serve.gpu import NvmlSampler, NvmlUnavailable
from servekit.serve.watch import BootFailed, BootRecord, milestone, watch_boot

class ContainerMemory(threading.Thread):
    """The container's memory use about once a second (docker stats): the curve when there is no GPU."""

    def __init__(self, container, started: float):
        super().__init__(daemon=True, name="container-memory")
        self.container, self.started = container, started
        self.t: list[float] = []
        self.used: list[int] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            for stats in self.container.stats(stream=True, decode=True):
                usage = (stats.get("memory_stats") or {}).get("usage")
                if usage:
                    self.t.append(round(time.time() - self.started, 3))
                    self.used.append(usage)
                if self.stopped.is_set():
                    return
        except Exception:  # the container is gone: the series ends there
            return


class Stopped(Exception):
    """The run was told to stop (Ctrl-C on a fleet run): the boot in this thread takes its profile down."""


WEIGHTS_LOADED = re.compile(r"Model loading took|Loading weights took|Loading model weights took")


@dataclass
class Boot:
    dep: deploy.Deployment
    profile: str
    record: BootRecord = field(default_factory=lambda: BootRecord(started=time.time()))
    gpu: NvmlSampler | None = None
    shared: SharedUsageSampler | None = None
    container: Any = None  # the SDK container, once compose has started it
    container_memory: ContainerMemory | None = None
    notes: list[str] = field(default_factory=list)
    phases: list[tuple[str, float]] = field(default_factory=list)  # (name, seconds since the boot started)

    def mark(self, phase: str) -> None:
        """Phase `phase` starts now. Traffic and its end first wait (bounded) for two fresh Shared Usage samples,
        so the level the first request met, and the level the traffic left, are read, not a sample from before."""
        if phase in dict(self.phases):
            return
        if self.shared and phase in ("traffic", "end"):
            limit = self.shared.fresh_level_timeout()
            if not self.shared.wait_for_samples(2, limit):
                self.notes.append(f"Shared Usage: no fresh sample at the start of {phase} within {limit:.0f} s")
        self.phases.append((phase, round(time.time() - self.record.started, 3)))
        if self.gpu:
            self.gpu.mark(phase)

    def end_traffic(self) -> dict | None:
        """Close the traffic phase (`end`) and give the Shared Usage figures so far: what the spill check judges."""
        self.mark("end")
        return self.shared_summary()

    def shared_summary(self) -> dict | None:
        if not self.shared:
            return None
        host = self.dep.matrix.hosts.get(self.dep.host) if self.dep.matrix else None
        return self.shared.summary(host.adapter if host else None, phases=self.phases, origin=self.record.started)

    def start_samplers(self) -> None:
        if not self.dep.engine.same_machine:  # NVML and Get-Counter read this machine, not the engine's
            self.notes.append(f"GPU memory and Shared Usage not sampled: engine {self.dep.engine.given} is on "
                              "another machine (the container's memory from docker stats is plotted)")
            return
        try:
            self.gpu = NvmlSampler()
            self.gpu.start()
        except NvmlUnavailable as exc:
            self.notes.append(f"GPU memory not sampled: {exc}")
        if self.dep.host == "wsl2":
            try:
                self.shared = SharedUsageSampler().start()
                if not self.shared.wait_for_samples(1, 20):
                    self.notes.append("Shared Usage: Get-Counter gave no sample within 20 s")
            except SharedUsageUnavailable as exc:
                self.notes.append(f"Shared Usage not sampled: {exc}")

    def stop_samplers(self) -> None:
        if self.container_memory:
            self.container_memory.stopped.set()
        if self.gpu:
            self.gpu.stop()
        if self.shared:
            self.shared.stop()

    def memory(self) -> dict:
        """The figures for the report: GPU summaries with phases, Shared Usage with its series."""
        gpus = self.gpu.summary() if self.gpu else []
        series = [{"t": s.times, "used": s.used} for s in self.gpu.series] if self.gpu else []
        shared = self.shared_summary()
        cm = self.container_memory
        container = {"peak_bytes": max(cm.used), "samples": len(cm.used)} if cm and cm.used else None
        said = [f"Shared Usage: {error}" for error in (self.shared.errors if self.shared else [])]
        return {"gpus": gpus, "gpu_series": series, "shared_usage": shared, "phases": self.phases,
                "container": container, "container_series": {"t": cm.t, "used": cm.used} if cm else None,
                "notes": self.notes + said}


def boot(dep: deploy.Deployment, profile: str, timeout_s: float, say=None, knobs: dict | None = None,
         note=None, stop: threading.Event | None = None) -> Boot:
    """Start the samplers, then the profile, and watch it to healthy; on any failure take it down.

    `knobs` are set in the environment of this boot's compose only (it passes them to the launcher);
    `stop`, when set, ends the wait with Stopped (a Ctrl-C reaches only the main thread)."""
    b = Boot(dep, profile)
    b.start_samplers()
    for line in b.notes:
        (note or (lambda text: print(text, file=sys.stderr)))(f"note: {line}")
    try:
        b.record.started = time.time()
        b.mark("load")
        try:
            started = deploy.up(dep, profile, knobs)
        except EngineError as exc:  # a port in use, a missing image, an engine that went away
            last = exc.reason
            if "could not select device driver" in last:  # the engine has no way to give it a GPU
                last = f"no GPU: the engine has no NVIDIA runtime ({last.strip()})"
            raise BootFailed(f"compose up failed: {last}", "", exc.output) from None
        b.container = started or deploy.find_container(profile, dep.engine)
        if b.container is None:
            raise BootFailed(f"compose started no container for {profile}", "", [])
        b.container_memory = ContainerMemory(b.container, b.record.started)
        b.container_memory.start()

        def progress(elapsed, rec):
            if stop and stop.is_set():
                raise Stopped(f"stopped while {profile} was booting")
            if any(WEIGHTS_LOADED.search(line) for line in list(rec.lines)[-50:]):
                b.mark("warm-up")
            if say:
                say(f"{profile} booting, {elapsed:.0f} s: {milestone(rec.lines) or f'{len(rec.lines)} log lines'}")
        watch_boot(b.container, dep.url, timeout_s, b.record, progress=progress)
        b.mark("healthy")
        return b
    except BaseException:
        b.stop_samplers()
        deploy.down(dep, profile)  # a failed boot, Ctrl-C included, leaves nothing of its own running
        raise


def checks_to_run(matrix, profile: str, target: str, only: list[str] | None = None,
                  host: str | None = None) -> dict[str, dict]:
    """The profile's checks on `host` with their parameters, or only those named (each with the profile's parameters
    where it has the check, else the check's own); those that judge the others' traffic (spill) come last. A check
    the target does not require is left out, unless named."""
    from smoke import AFTER_TRAFFIC
    for name in only or []:
        if name not in matrix.checks:
            raise UserError(f"--check {name}: expected one of {', '.join(matrix.checks)}")
    checks = matrix.profile_checks(profile, target, host)
    if only:
        everywhere = {**matrix.profile_checks(profile, target),
                      **{name: {} for name in matrix.not_required(profile, target)}}
        checks = {name: {**matrix.checks[name].params, **everywhere.get(name, {})} for name in only}
    return dict(sorted(checks.items(), key=lambda item: AFTER_TRAFFIC.index(item[0]) + 1
                       if item[0] in AFTER_TRAFFIC else 0))


def not_required_results(matrix, profile: str, target: str, only: list[str] | None = None) -> list:
    """A result for each check of the profile the target does not require (images.yaml says why), unless named."""
    from smoke import Result
    return [Result(name, "not_required", why) for name, why in matrix.not_required(profile, target).items()
            if not only or name not in only]


def console_line(result) -> str:
    """A check's verdict in one line, its whole first line of reason (report.md holds all of it)."""
    reason = result.reason.splitlines()[0] if result.reason else ""
    return f"{result.status.replace('_', ' '):12} {result.name} ({result.seconds} s) {reason}".rstrip()


def smoke(ctx, checks: dict[str, dict], say=None, deadline_s: float | None = None) -> list:
    """Run each check in order within the run's deadline; a check that raises something unexpected fails, and the
    rest still run."""
    from smoke import RUN_DEADLINE_S, Result, run_check
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
        if say:
            say(result)
    return results


def _changes(say, every_s: float = 20.0):
    """A progress printer for a log or a pipe: a line when the boot's stage changes, else one every `every_s`."""
    shown: list[tuple[str, float]] = [("", 0.0)]  # (stage, when)

    def show(text: str) -> None:
        stage = text.split(": ", 1)[-1]
        if stage != shown[-1][0] or time.monotonic() - shown[-1][1] >= every_s:
            say(f"  {text}")
            shown[-1] = (stage, time.monotonic())
    return show


def run_profile(matrix, dep: deploy.Deployment, profile: str, key_file, say=print, knobs: dict | None = None,
                only: list[str] | None = None, stop: threading.Event | None = None) -> tuple[RunReport, dict]:
    """Boot, smoke, down: (the report, the series for its plot). Never raises for a failed boot or check.

    `knobs` apply to this boot only; `only` limits the checks to those named."""
    import datetime as dt
    from smoke import Context, Result, all_passed
    checks = checks_to_run(matrix, profile, dep.target, only, dep.host)
    created = dt.datetime.now(dt.timezone.utc)
    report = RunReport(run_id=f"{created:%Y%m%d-%H%M%S}-{profile}-{dep.target}",
                       created=created.isoformat(timespec="seconds"), profile=profile, target=dep.target,
                       host=dep.host, engine=dep.engine.given, url=dep.url, image=ImageUsed(tag=dep.image),
                       pins=matrix.target_pins(dep.target))
    if matrix.profiles[profile].auth == "none":
        report.notes.append("served WITHOUT an API key: the profile says auth: none in images.yaml")
    b = None
    try:
        if deploy.is_running(profile, dep.engine):  # somebody's server (an `up`): never restarted or stopped by a run
            raise BootFailed(f"{profile} is already running on engine {dep.engine.given}, started by someone else "
                             f"(`up`?); left alone: stop it with `python build.py down {profile}` first", "", [])
        b = boot(dep, profile, matrix.serve.boot_timeout_s, knobs=knobs, note=say, stop=stop, say=_changes(say))
        say(f"  healthy in {b.record.time_to_healthy_s} s (KV pool {b.record.kv_pool_tokens} tokens)")
        b.mark("traffic")
        lines = lambda: list(b.record.lines)  # noqa: E731
        served_name = matrix.models[matrix.targets[dep.target].model].served_name
        container = b.container
        ctx = Context(dep.url, key_file.read_text().strip(), served_name,
                      gpu=matrix.targets[dep.target].gpu, logs=lines, healthy_line=len(b.record.lines),
                      environ=lambda: dep.engine.server_environ(container),
                      shared_usage=b.end_traffic if dep.host == "wsl2" else None)
        results = smoke(ctx, checks, say=lambda r: say(f"  {console_line(r)}"))
        b.mark("end")
    except BootFailed as exc:
        say(f"  boot failed: {exc}")
        results = [Result("boot", "failed", str(exc), {"last_lines": exc.last_lines[-12:]})]
        results += [Result(name, "not_run", "the server did not boot") for name in checks]
    finally:
        if b:
            b.stop_samplers()
            report.image.id = b.container.image.id if b.container else None
            deploy.down(dep, profile)  # what this run started, and nothing else
    memory = b.memory() if b else {"gpus": [], "shared_usage": None, "phases": [], "notes": [], "container": None}
    if b:
        report.boot = BootFigures(time_to_healthy_s=b.record.time_to_healthy_s, kv_pool_tokens=b.record.kv_pool_tokens,
                                  detection_lag_s=b.record.detection_lag_s, phases=memory["phases"])
    shared = dict(memory["shared_usage"]) if memory["shared_usage"] else None
    series = {"gpus": memory.get("gpu_series") or [], "container": memory.get("container_series"),
              "shared": shared.pop("series") if shared else None}
    report.memory = Memory(gpus=memory["gpus"], shared_usage=shared, container=memory.get("container"))
    report.notes += memory["notes"]
    # what the server ran with (the shell's knobs included), else what this run asked for
    report.knobs = deploy.knobs_of(b.container) if b and b.container else (knobs or {})
    for result in not_required_results(matrix, profile, dep.target, only):
        say(f"  {console_line(result)}")
        results.append(result)
    report.checks = results
    report.passed = all_passed(r.status for r in results)
    return report, series


def run_profiles(matrix, dep: deploy.Deployment, profiles: list[str], key_file, write, say=print,
                 release: ReleaseRecord | None = None, stop: threading.Event | None = None,
                 knobs: dict | None = None, only: list[str] | None = None) -> list[tuple[RunReport, Path]]:
    """On dep's engine: the image put there if need be, then each profile booted, checked and written.

    `write(report, series)` stores one report and returns where; the list pairs each report with that.
    `stop`, when set, ends the work at the next boot or profile with Stopped; `knobs` and `only` as run_profile."""
    arrived = transfer.ensure_image(dep.engine, dep.image, release, say=say)
    if arrived != "already there":
        say(f"image {arrived}")
    written = []
    with engines.reach(dep.engine, dep.bind, dep.port) as url:
        dep = replace(dep, reached_at=url)
        for profile in profiles:
            if stop and stop.is_set():
                raise Stopped("stopped")
            say(f"run: {profile}")
            report, series = run_profile(matrix, dep, profile, key_file, say=say, stop=stop, knobs=knobs, only=only)
            report.image.arrived = arrived
            written.append((report, write(report, series)))
    return written


# --- the commands that compose these: up, run, smoke ---------------------------------------------

def up_profile(session, profile: str, target: str | None = None, host: str | None = "auto", engine=None,
               port: int | None = None, timeout_s: float | None = None, say=print, status=None,
               knobs: dict[str, str] | None = None) -> dict:
    """Start `profile` (with `knobs` over its own) and watch it to healthy; what it became (URL, key file, served
    name, the knobs it runs with, timings, memory). Raises BootFailed when it did not come up (it is taken down)."""
    engine = engine or engines.resolve(None)
    engine.check()
    target = session.profile_target(profile, target, engine)
    session.require_gpu(target, engine, f"up: {profile}")
    dep = session.deployment(target, engine, host, port)
    arrived = transfer.ensure_image(engine, dep.image, say=lambda line: say(f"up: {line}"))
    deploy.check_bind(dep.bind, warn=lambda w: say(f"warning: {w}"))
    key_file = deploy.ensure_secrets(dep)
    deploy.write_env(dep)
    where = "" if engine.is_local else f" on engine {engine.given} (image {arrived})"
    say(f"up: {profile} on {target} ({dep.host}){where}, {dep.image}")
    with engines.reach(engine, dep.bind, dep.port) as url:
        booted = boot(replace(dep, reached_at=url), profile, timeout_s or session.matrix.serve.boot_timeout_s,
                      say=status, knobs=knobs)
    booted.stop_samplers()  # `up` ends at healthy; `run` keeps them going through the traffic
    record, memory = booted.record, booted.memory()
    shared = memory["shared_usage"]
    return {"profile": profile, "target": target, "host": dep.host, "engine": engine.given, "image": dep.image,
            "url": engines.address(engine, dep.bind, dep.port), "api_key_file": str(key_file),
            "served_name": session.matrix.models[session.matrix.targets[target].model].served_name,
            "knobs": deploy.knobs_of(booted.container),
            "container": booted.container.name, "time_to_healthy_s": record.time_to_healthy_s,
            "kv_pool_tokens": record.kv_pool_tokens, "detection_lag_s": record.detection_lag_s,
            "phases": memory["phases"], "gpu": memory["gpus"][0] if memory["gpus"] else None,
            "shared_usage": {k: v for k, v in shared.items() if k != "series"} if shared else None}


def profiles_of(session, target: str, wanted: list[str] | None) -> list[str]:
    """The profiles asked for (each must run on `target`), else the target's first."""
    matrix = session.matrix
    mine = [p for p, spec in matrix.profiles.items() if target in spec.targets]
    for name in wanted or []:
        if name not in mine:
            raise UserError(f"--profile {name}: not a profile of the {target} target (those are: {', '.join(mine)})")
    return wanted or mine[:1]


def run(session, target: str | None = None, profiles: list[str] | None = None, host: str | None = "auto",
        engine=None, port: int | None = None, say=print, show=None, knobs: dict[str, str] | None = None,
        only: list[str] | None = None) -> list[tuple[RunReport, Path]]:
    """image, up, smoke, down and a report for each profile on one engine: (report, its folder) per profile.
    `knobs` are set for every boot (and recorded); `only` runs those checks instead of each profile's own."""
    from servekit.build.builder import ensure_built
    from servekit.release.publish import released
    from servekit.records.report import write_report
    engine = engine or engines.resolve(None)
    target = session.target(target, engine)
    profiles = profiles_of(session, target, profiles)
    checks_to_run(session.matrix, profiles[0], target, only)  # a misspelt --check ends here, before any boot
    engine.check()
    session.require_gpu(target, engine, f"run: {', '.join(profiles)}")
    plan = ensure_built(session, target, show, say=lambda line: say(f"run: {line}"), engine=engine)
    dep = session.deployment(target, engine, host, port, tag=plan.tag)
    key_file = deploy.ensure_secrets(dep)
    deploy.write_env(dep)
    return run_profiles(session.matrix, dep, profiles, key_file, say=say, knobs=knobs, only=only,
                        release=released(session.root, session.matrix, target, plan.digest),
                        write=lambda report, series: write_report(session.root / "reports" / report.run_id,
                                                                  report, series))


def smoke_running(session, profile: str, target: str | None = None, engine=None, url: str | None = None,
                  api_key_file: Path | None = None, say=None, only: list[str] | None = None) -> tuple[str, list]:
    """The profile's checks (or `only` those) against a server already running: its container on `engine`, or
    `url`."""
    from contextlib import nullcontext

    from smoke import Context

    from servekit.serve.watch import READY
    if url and engine:
        raise UserError("--url and --engine: name the server one way (--engine finds it on that engine)")
    engine = engine or engines.resolve(None)
    matrix = session.matrix
    target = session.target(target, engine)
    if profile not in matrix.profiles:
        raise UserError(f"profile {profile!r}: expected one of {', '.join(matrix.profiles)}")
    checks = checks_to_run(matrix, profile, target, only)
    dep = session.deployment(target, engine, "native")
    key_path = api_key_file or dep.api_key_file
    if not key_path.is_file():
        raise UserError(f"no API key file at {key_path}: pass --api-key-file")
    logs, environ, port, healthy_line = None, None, dep.port, 0
    if not url:  # a profile on an engine: its log and environment are readable, so the log checks can run
        engine.check()
        container = deploy.find_container(profile, engine)
        if container is None:
            raise UserError(f"{profile} is not running on engine {engine.given}: start it with `python build.py up "
                            f"{profile}" + ("" if engine.is_local else f" --engine {engine.given}") + "`")
        logs = lambda: container.logs().decode("utf-8", "replace").splitlines()  # noqa: E731
        environ = lambda: engine.server_environ(container)  # noqa: E731
        port = deploy.published_port(container) or port
        # compiles while booting are expected; the log checks judge what came after the server was ready
        healthy_line = next((i + 1 for i, line in enumerate(logs()) if READY.search(line)), 0)
    with (nullcontext(url) if url else engines.reach(engine, dep.bind, port)) as base_url:
        ctx = Context(base_url.rstrip("/"), key_path.read_text().strip(),
                      matrix.models[matrix.targets[target].model].served_name, gpu=matrix.targets[target].gpu,
                      logs=logs, environ=environ, healthy_line=healthy_line)
        results = smoke(ctx, checks, say=say)
        for result in not_required_results(matrix, profile, target, only):
            results.append(result)
            if say:
                say(result)
        return ctx.url, results
