"""A plan of runs (`run-plan FILE`): profiles, cards, knobs, checks and model folders run back to back, each boot
bounded by its own timeout, resumable, and summed up in one table. Made for a GPU host that may only be had in
short calls: `--until S` starts no run that its own bound would carry past S seconds, and the next call skips every
run whose report the plan's record names, so a visit of many short commands runs the plan once.

A plan (YAML):

    runs:
      - name: batch-64k            # a plain name, once a plan; the plan's record keys its report by it
        profile: batch
        card: rtx3090              # optional: --card
        host: native               # optional: --host (a host of images.yaml; default auto, the engine's)
        knobs: {INT8_ACT: "off", MAX_LEN: "65536"}
        checks: [health, forced_prefill, burst, logs]   # optional: the profile's own otherwise
        timeout_s: 600             # the boot's bound (default 900)
        model_dir: .cache/stand-in/Qwen3.8-27B-W4A16-AutoRound   # optional: MODEL_DIR, DRAFTER_DIR
        drafter_dir: .cache/stand-in/Qwen3.8-27B-DFlash2-W4A16
        without: [marlin-int8-emulated]   # optional: serve the image built --without these patches (to measure
                                          # what a patch does; never released), beside the plan's own

The record, `reports/plans/<plan file's stem>.json`, maps each run done to its report folder; it is written after
each run, atomically.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, field_validator

from servekit import engines
from servekit.config.matrix import Strict
from servekit.config.session import Session
from servekit.engines import Engine, choice
from servekit.errors import UserError
from servekit.image import boundary
from servekit.image.boundary import write_text_atomic
from servekit.output import Say
from servekit.records.models import RunReport
from servekit.records.report import in_gib, load_report
from servekit.serve import commands
from servekit.serve.checks import checks_to_run

DEFAULT_TIMEOUT_S = 900
MAX_BYTES = 1 << 20  # a plan, or its record: a page of runs, never megabytes


class PlannedRun(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    profile: str
    card: str | None = None
    host: str = "auto"
    knobs: dict[str, str] = {}
    checks: list[str] | None = None
    timeout_s: int = Field(DEFAULT_TIMEOUT_S, ge=10, le=86_400)
    model_dir: str | None = None
    drafter_dir: str | None = None
    without: list[str] = []


class Plan(Strict):
    runs: list[PlannedRun] = Field(min_length=1)

    @field_validator("runs")
    @classmethod
    def _names_once(cls, runs: list[PlannedRun]) -> list[PlannedRun]:
        names = [run.name for run in runs]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"each run's name once: {', '.join(twice)} more than once")
        return runs


def load_plan(path: Path) -> Plan:
    """The plan at `path`, or one line saying what is wrong with it and where."""
    try:
        doc = yaml.safe_load(boundary.read_text(path, MAX_BYTES))
    except boundary.Refused as exc:
        raise UserError(str(exc)) from None
    except (yaml.YAMLError, RecursionError) as exc:
        raise UserError(f"{path}: not YAML: {str(exc).splitlines()[0]}") from None
    try:
        return Plan.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise UserError(f"{path}: {where}: {first['msg']} ({exc.error_count()} problem"
                        f"{'s' if exc.error_count() > 1 else ''})") from None


def record_path(root: Path, plan_path: Path) -> Path:
    return root / "reports" / "plans" / f"{plan_path.stem}.json"


def _done(record: Path) -> dict[str, str]:
    """The record's runs whose report is still there: name to report folder."""
    if not record.is_file():
        return {}
    try:
        doc = json.loads(boundary.read_text(record, MAX_BYTES))
        if not isinstance(doc, dict):
            raise ValueError("not a mapping")
    except (boundary.Refused, ValueError, RecursionError):
        raise UserError(f"{record}: not a plan's record; remove it to run the plan from its start") from None
    return {name: folder for name, folder in doc.items()
            if isinstance(folder, str) and (Path(folder) / "report.json").is_file()}


@contextmanager
def _model_folders(run: PlannedRun, root: Path) -> Iterator[None]:
    """MODEL_DIR and DRAFTER_DIR as the run names them (relative to the checkout), for this run only; a run that
    names no model serves what the environment names (airgap.sh sets them), as `run` would; one that names a model
    serves its drafter only if it names one too."""
    before = {name: os.environ.get(name) for name in ("MODEL_DIR", "DRAFTER_DIR")}
    for name, folder in (("MODEL_DIR", run.model_dir), ("DRAFTER_DIR", run.drafter_dir)):
        if folder:
            os.environ[name] = str((root / folder).resolve())
        elif run.model_dir:
            os.environ.pop(name, None)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_session(session: Session, run: PlannedRun) -> Session:
    """The session a run serves in: the plan's, or, where the run leaves patches or pins out, one whose image is
    the build --without them as well (its own tag)."""
    if not run.without:
        return session
    settings = replace(session.settings, without=tuple(sorted({*session.settings.without, *run.without})))
    try:
        settings.check(session.matrix, session.root / session.matrix.series.dir)
    except UserError as exc:
        raise UserError(str(exc).replace("--without ", "without: ", 1)) from None
    return replace(session, settings=settings)


def check_runs(session: Session, plan: Plan, plan_path: Path, target: str, engine: Engine) -> None:
    """Every run's profile, checks, knobs and card judged before the first boot, as `run` judges its flags: a typo
    in the last run must not cost the boots before it. One line naming the run."""
    for i, run in enumerate(plan.runs):
        try:
            run_session(session, run)
            session.profiles_of(target, [run.profile])
            checks_to_run(session.matrix, run.profile, target, run.checks)
            session.check_knobs([run.profile], target, run.knobs)
            choice.check_card(session, run.card, target, engine)
            if run.host != "auto" and run.host not in session.matrix.hosts:
                raise UserError(f"host {run.host!r}: expected auto or one of {', '.join(session.matrix.hosts)}")
        except UserError as exc:
            said = str(exc)
            for flag in ("--profile ", "--check ", "--card ", "--knob "):  # the plan names them without dashes
                said = said.replace(flag, flag[2:])
            raise UserError(f"{plan_path}: runs.{i} ({run.name}): {said}") from None


def run_plan(session: Session, plan_path: Path, target: str | None, engine: Engine | None = None, until_s: float | None = None,
             say: Say = print) -> tuple[list[tuple[PlannedRun, RunReport | None]], list[str]]:
    """Run what the plan has not done yet: (each run with its report, or None where not run), (the names left, where
    `until_s` stopped it before them)."""
    plan = load_plan(plan_path)
    engine = engine or engines.resolve(None)
    target = choice.target(session, target, engine)
    check_runs(session, plan, plan_path, target, engine)
    record = record_path(session.root, plan_path)
    done = _done(record)
    deadline = time.monotonic() + until_s if until_s else None
    left: list[str] = []
    for run in plan.runs:
        if run.name in done:
            say(f"run-plan: {run.name}: done ({Path(done[run.name]).name})")
            continue
        if left or (deadline is not None and deadline - time.monotonic() < run.timeout_s):
            left.append(run.name)  # this call's time cannot hold its bound: the next call starts here
            continue
        say(f"run-plan: {run.name}: {run.profile}" + (f" on {run.card}" if run.card else ""))
        with _model_folders(run, session.root):
            [(_, folder)] = commands.run(run_session(session, run), target, [run.profile], run.host, engine=engine,
                                         say=say, knobs=run.knobs, only=run.checks, boot_timeout_s=run.timeout_s,
                                         card=run.card)
        done[run.name] = str(folder)
        record.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(record, json.dumps(done, indent=2) + "\n")
    return [(run, load_report(Path(done[run.name])) if run.name in done else None) for run in plan.runs], left


TABLE_HEADER = ["run", "profile", "card", "knobs", "healthy in", "KV pool", "peak", "margin", "checks"]


def table_rows(results: list[tuple[PlannedRun, RunReport | None]]) -> list[list[str]]:
    """One row a run: what it asked for and what its report says (a run not yet done says so)."""
    rows = []
    for run, report in results:
        knobs = " ".join([*(f"{k}={v}" for k, v in run.knobs.items()), *(f"without {w}" for w in run.without)])
        if report is None:
            rows.append([run.name, run.profile, run.card or "", knobs, "not run yet", "", "", "", ""])
            continue
        boot, gpus = report.boot, report.memory.gpus
        healthy = f"{boot.time_to_healthy_s:.0f} s" if boot.time_to_healthy_s is not None else "never"
        if boot.compile_cache:
            healthy += f" ({boot.compile_cache.split(':')[0]})"
        failed = [c.name for c in report.checks if c.status in ("failed", "not_run")]
        rows.append([run.name, run.profile, run.card or "", knobs, healthy,
                     f"{boot.kv_pool_tokens:,}" if boot.kv_pool_tokens else "",
                     *(in_gib(gpus[0][key] if gpus else None) for key in ("peak_used_bytes", "min_margin_bytes")),
                     "passed" if report.passed else "FAILED: " + ", ".join(failed)])
    return rows
