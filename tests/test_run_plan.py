"""run-plan: a plan of runs back to back, each boot bounded, resumable after a stop, one table at the end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import ROOT, run_build_py, work_dir

from servekit.errors import UserError

pytestmark = pytest.mark.engine


def _plan(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, says", [
    ("runs: [", "not YAML"),
    ("runs: []", "runs: List should have at least 1 item"),
    ("runs:\n  - {name: a, profile: default, colour: red}", "runs.0.colour: Extra inputs are not permitted"),
    ("runs:\n  - {name: a, profile: default}\n  - {name: a, profile: default}", "each run's name once: a"),
    ("runs:\n  - {name: ../a, profile: default}", "runs.0.name: String should match pattern"),
    ("runs:\n  - {name: a, profile: default, timeout_s: 5}", "runs.0.timeout_s: Input should be greater than"),
    ("runs:\n  - {name: a, profile: default}\n  - {name: b, profile: nope}",
     "runs.1 (b): profile nope: not a profile of the cpu target"),
    ("runs:\n  - {name: a, profile: default, checks: [helth]}", "runs.0 (a): "),
    ("runs:\n  - {name: a, profile: default, knobs: {MAX_SEQS: lots}}", "runs.0 (a): "),
    ("runs:\n  - {name: a, profile: default, host: windows}", "runs.0 (a): host 'windows': expected auto or one of"),
    ("runs:\n  - {name: a, profile: default}\n  - {name: b, profile: default, without: [signed-scales]}",
     "runs.1 (b): without: signed-scales (SERVEKIT_WITHOUT): neither a pin listed under may_omit"),
], ids=["not-yaml", "no-runs", "unknown-key", "name-twice", "name-a-path", "timeout-too-short", "unknown-profile",
        "unknown-check", "bad-knob", "unknown-host", "unknown-patch-left-out"])
def test_a_bad_plan_is_refused_in_one_line(repo, cli, text, says):
    code, _, err = cli("--matrix", str(repo / "images.yaml"), "run-plan", str(_plan(repo, "bad.yaml", text)),
                       "--target", "cpu")
    assert code in (1, 2) and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and says in last, last


def test_until_shorter_than_a_runs_bound_stops_before_it_and_says_how_to_resume(repo, cli):
    plan = _plan(repo, "short.yaml", "runs:\n  - {name: first, profile: default, timeout_s: 600}\n")
    code, out, err = cli("--matrix", str(repo / "images.yaml"), "run-plan", str(plan), "--target", "cpu", "--until",
                         "5", "--json")
    assert code == 3, err[-2000:]
    said = json.loads(out)
    assert said["left"] == ["first"] and said["passed"] is False
    assert said["runs"][0]["healthy in"] == "not run yet"
    assert "stopped before first" in err and "the same command again resumes there" in err


@pytest.mark.slow
def test_a_plan_stopped_by_until_resumes_where_it_stopped_and_ends_with_its_table(tmp_path):
    """Buys the resume on real boots: the first call runs what fits its time and stops before a run whose bound does
    not; the second skips what the record names and runs the rest; the table has both runs' figures."""
    # The bounds make the stop certain whatever the machine's load: the first fits the call's 2,500 s, the second's
    # 3,000 never does. (A first run bounded at 300 s once failed its boot under stress-ng, at 178 s a boot.)
    plan = _plan(tmp_path, "resume.yaml", "runs:\n"
                 "  - {name: quick, profile: default, checks: [health], timeout_s: 1200}\n"
                 "  - {name: long, profile: default, checks: [health], timeout_s: 3000, knobs: {MAX_SEQS: '2'}}\n")
    first = run_build_py("run-plan", str(plan), "--target", "cpu", "--until", "2500", "--json", timeout=3000)
    assert first.returncode == 3, first.stderr[-3000:]
    said = json.loads(first.stdout)
    assert said["left"] == ["long"] and said["runs"][0]["checks"] == "passed", said
    record = work_dir() / "reports" / "plans" / "resume.json"
    assert list(json.loads(record.read_text())) == ["quick"]
    second = run_build_py("run-plan", str(plan), "--target", "cpu", "--json", timeout=3500)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "run-plan: quick: done" in second.stderr
    runs = json.loads(second.stdout)["runs"]
    assert [(r["run"], r["checks"]) for r in runs] == [("quick", "passed"), ("long", "passed")]
    assert runs[1]["knobs"] == "MAX_SEQS=2" and runs[1]["healthy in"].endswith(" s") and runs[1]["KV pool"]
    folders = json.loads(record.read_text())
    assert list(folders) == ["quick", "long"] and folders["quick"] != folders["long"]
    assert json.loads((Path(folders["long"]) / "report.json").read_text())["knobs"]["MAX_SEQS"] == "2"


def test_a_run_that_leaves_a_patch_out_serves_that_build_and_its_report_says_so():
    """The image a row serves is the plan's own built --without the patch too: another tag, which a host gets as a
    few MiB on top of the plan's image (pack.py --on-top-of); its report says what was left out."""
    from servekit.build.plan import plan_for
    from servekit.config.session import Session
    from servekit.records.models import RunReport
    from servekit.records.report import render_markdown
    from servekit.serve.runplan import PlannedRun, run_session
    session = Session.open(ROOT / "images.yaml")
    plain = PlannedRun(name="a", profile="batch")
    unsigned = PlannedRun(name="b", profile="batch", without=["marlin-int8-signed-scales", "marlin-int8-emulated"])
    assert run_session(session, plain) is session
    measured = run_session(session, unsigned)
    assert measured.settings.without == ("marlin-int8-emulated", "marlin-int8-signed-scales")
    assert plan_for(measured, "cuda").tag != plan_for(session, "cuda").tag
    assert measured.settings.leaves_out_patch("marlin-int8-signed-scales.patch")
    report = RunReport.model_validate({
        "run_id": "r", "created": "2026-12-07T00:00:00+00:00", "profile": "batch", "target": "cuda", "host": "native",
        "url": "http://127.0.0.1:18000", "pins": {},
        "image": {"tag": plan_for(measured, "cuda").tag, "left_out": list(measured.settings.without)}})
    assert "Built **without `marlin-int8-emulated`, `marlin-int8-signed-scales`** of the series (`--without`)" in render_markdown(
        report)
    with pytest.raises(UserError, match="marlin-int8-emulated.patch requires it"):  # what the emulation calls kept
        run_session(session, PlannedRun(name="c", profile="batch", without=["marlin-int8-signed-scales"]))


@pytest.mark.parametrize("plan", sorted((ROOT / "bench" / "gpu" / "plans").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_plan_the_gpu_kit_carries_is_a_plan_the_cuda_target_can_run(plan):
    """A visit's plan found wrong on the host costs device time: each shipped plan's runs are judged here as
    run-plan judges them there (profile, checks, knobs, host, card), the card's GPU left out."""
    from servekit.config.load import load_matrix
    from servekit.config.session import Session
    from servekit.image.knobs import KNOBS
    from servekit.serve.checks import checks_to_run
    from servekit.serve.runplan import load_plan, run_session
    matrix = load_matrix(ROOT / "images.yaml")
    session = Session.open(ROOT / "images.yaml")
    for run in load_plan(plan).runs:
        run_session(session, run)  # what it leaves out is patches of the series (or pins), and whole
        assert "cuda" in matrix.profiles[run.profile].targets, run.name
        checks_to_run(matrix, run.profile, "cuda", run.checks)
        assert run.card in matrix.cards and run.host in {"auto", *matrix.hosts}, run.name
        assert set(run.knobs) <= set(KNOBS), run.name
