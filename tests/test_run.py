"""run: boot, smoke, down and a report; a failing check is named; compare reads two reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import ROOT, TEST_PORT, project_containers, run_build_py, tracked_copy, work_dir

from servekit.engines.deployment import Deployment

pytestmark = pytest.mark.engine


@pytest.mark.slow
def test_a_profile_expecting_another_model_name_fails_naming_the_check(tmp_path):
    """Buys a failed check on a real boot: the run exits 1 and report.md names the check and why."""
    root = tracked_copy(tmp_path)
    matrix = root / "images.yaml"
    text = matrix.read_text()
    matrix.write_text(text.replace("          tool_auto: {thinking: \"on\"}",
                                   "          tool_auto: {thinking: \"on\"}\n          models: {expect: not-served}"))
    result = subprocess.run([sys.executable, str(ROOT / "build.py"), "--matrix", str(matrix), "run", "--target", "cpu",
                             "--profile", "default", "--check", "health", "--check", "models"], cwd=root,
                            capture_output=True, text=True, timeout=3000)  # the profile's parameters still apply
    assert result.returncode == 1, result.stderr[-2000:]
    report_md = (root / "reports" / "latest" / "report.md").read_text()
    assert "| models | **FAILED** |" in report_md and "not-served" in report_md
    report = json.loads((root / "reports" / "latest" / "report.json").read_text())
    assert report["passed"] is False and {"name", "status", "reason", "figures"} <= set(report["checks"][0])


@pytest.mark.slow
def test_run_writes_the_three_files_and_compare_reads_two(tmp_path):
    """Buys `run` end to end twice on real boots: the three files and nothing else, reports/latest, the budget from the
    cpu image's real log, and compare over two real reports."""
    runs = []
    for _ in range(2):
        result = run_build_py("run", "--target", "cpu", "--profile", "default", "--json", timeout=3000)
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(Path(json.loads(result.stdout)["reports"][0]))
    for run in runs:
        # the three files and nothing else (matplotlib's cache once landed there, and into docs/gpu with the reports)
        assert {p.name for p in run.iterdir()} == {"report.json", "report.md", "memory.png"}
        assert (run / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (work_dir() / "reports" / "latest").resolve() == runs[-1].resolve()
    # vLLM's memory budget from the cpu image's real log: the node's memory, the KV cache it set aside, the pool
    budget = json.loads((runs[0] / "report.json").read_text())["boot"]["budget"]
    assert {"total_gib", "kv_available_gib", "kv_pool_tokens"} <= budget.keys(), budget
    assert 0 < budget["kv_available_gib"] < budget["total_gib"]
    assert "| left for the KV cache |" in (runs[0] / "report.md").read_text()
    # prepare ran before the boot, out of its time: the demo model is copied from the image, nothing downloaded
    prepared = json.loads((runs[0] / "report.json").read_text())["boot"]["prepare"]
    assert prepared["download_gb"] == 0 and prepared["conversion_s"] == 0 and prepared["total_s"] > 0, prepared
    assert "| prepare, before it | " in (runs[0] / "report.md").read_text()
    table = run_build_py("compare", str(runs[0]), str(runs[1]))
    assert table.returncode == 0
    assert "time to healthy" in table.stdout and "burst: tokens_per_s" in table.stdout


@pytest.mark.slow
def test_a_boot_past_the_runs_timeout_fails_with_its_report_written():
    """What a caller with a hard limit (a command sent to a remote host) needs: the boot ends at --timeout and the report says so."""
    result = run_build_py("run", "--target", "cpu", "--profile", "default", "--timeout", "3", "--json", timeout=1200)
    assert result.returncode == 1, result.stderr[-2000:]
    report = json.loads((Path(json.loads(result.stdout)["reports"][0]) / "report.json").read_text())
    assert report["checks"][0]["name"] == "boot" and report["checks"][0]["status"] == "failed", report["checks"][0]
    assert all(c["status"] in ("not_run", "not_required") for c in report["checks"][1:])
    # what the failed boot measured up to its end is kept (an out-of-memory boot's peak is what its report is for)
    assert [phase[0] for phase in report["boot"]["phases"]][:1] == ["load"], report["boot"]


@pytest.mark.slow
def test_two_runs_at_once_both_finish_with_their_own_reports():
    """The second waits for the first (one boot at a time in a checkout), says for whom, then runs (two checks each:
    the lock is what it proves)."""
    command = [sys.executable, str(ROOT / "build.py"), "run", "--target", "cpu", "--profile", "default", "--check",
               "health", "--check", "greedy", "--json"]
    procs = [subprocess.Popen(command, cwd=work_dir(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=3000) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    reports = [Path(json.loads(out)["reports"][0]) for out, _ in outs]
    assert reports[0] != reports[1] and all((r / "report.json").is_file() for r in reports)
    assert sum("waiting for" in err and "one build, boot or release at a time" in err for _, err in outs) == 1
    assert project_containers() == []


@pytest.mark.slow
def test_run_leaves_a_server_started_by_up_alone(cpu_image):  # `up` serves what is built: the session's image
    """Buys the rule that a run never restarts or stops somebody's server: a real `up`, then a run of the same profile
    refused, the server untouched."""
    up = run_build_py("up", "default", "--target", "cpu", "--json", timeout=3000)
    assert up.returncode == 0, up.stderr[-3000:]
    try:
        container = json.loads(up.stdout)["container"]
        result = run_build_py("run", "--target", "cpu", "--profile", "default", timeout=3000)
        assert result.returncode == 1 and "already running" in result.stderr, result.stderr[-2000:]
        state = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}} {{.RestartCount}}", container],
                               capture_output=True, text=True).stdout.split()
        assert state == ["true", "0"]
    finally:
        run_build_py("down")
    assert project_containers() == []


BOOT_LINES = ["(EngineCore pid=96) INFO 12-06 06:20:00 [gpu_model_runner.py:4519] Model loading took 14.26 GiB memory "
              "and 37.2 seconds",
              "(EngineCore pid=96) INFO 12-06 06:23:00 [kv_cache_utils.py:1638] GPU KV cache size: 212,628 tokens, "
              "Maximum concurrency for 150,000 tokens per request: 1.42x"]


@pytest.mark.parametrize("when", ["during the boot", "while taking down a boot that had failed"])
def test_a_signal_that_ends_a_boot_keeps_the_budget_its_log_gave(repo, monkeypatch, when):
    """A `timeout` (SIGTERM) 300 s into a full-size boot, or just after the boot's own timeout while the server is
    taken down: the report still carries the memory budget the log had given (the KV pool sized, the weights), and
    the run ends interrupted. Once such a report said "interrupted before the boot" and held no budget at all."""
    from servekit.config.load import load_matrix
    from servekit.engines import resolve
    from servekit.errors import BootFailed
    from servekit.serve import boot, deploy, pipeline
    matrix = load_matrix(repo / "images.yaml")
    dep = Deployment(repo, "cpu", "native", "unused", "127.0.0.1", TEST_PORT,
                            engine=resolve(f"venv:{repo / 'venv'}"), matrix=matrix)
    server = SimpleNamespace(memory=lambda: iter(()), image_id=None, state=lambda: {})

    def watch(server, url, timeout_s, record, progress=None):
        record.lines.extend(BOOT_LINES)
        if when == "during the boot":
            raise KeyboardInterrupt
        raise BootFailed(f"not healthy within {timeout_s} s", "", BOOT_LINES)

    def down(*args, **kwargs):
        if when != "during the boot":
            raise KeyboardInterrupt
    monkeypatch.setattr(deploy, "prepare", lambda *args, **kwargs: [])
    monkeypatch.setattr(deploy, "up", lambda *args, **kwargs: server)
    monkeypatch.setattr(deploy, "down", down)
    monkeypatch.setattr(boot, "watch_boot", watch)
    with pytest.raises(pipeline.RunInterrupted) as ended:
        pipeline.run_profile(matrix, dep, "default", repo / "no-key", say=lambda line: None)
    report = ended.value.report
    assert report.boot is not None and report.boot.budget == {"weights_gib": 14.26, "kv_pool_tokens": 212628,
                                                              "max_concurrency": 1.42}, report.boot
    check = report.checks[0]
    assert check.name == "boot" and check.status == "not_run" and "s into the boot" in check.reason, check
    if when != "during the boot":
        assert "after the boot had failed: not healthy within" in check.reason, check


def test_a_boot_that_ends_on_an_unexpected_error_still_gets_its_report(repo, monkeypatch):
    """An engine that fails in a way no boot expects (its socket gone, an SDK error) still ends the run with its
    report, failed and saying why: what `run --json` then names, where the error once ended the command with none."""
    from servekit.config.load import load_matrix
    from servekit.engines import resolve
    from servekit.serve import deploy, pipeline
    matrix = load_matrix(repo / "images.yaml")
    dep = Deployment(repo, "cpu", "native", "unused", "127.0.0.1", TEST_PORT,
                            engine=resolve(f"venv:{repo / 'venv'}"), matrix=matrix)

    def up(*args, **kwargs):
        raise RuntimeError("the engine's socket went away")
    monkeypatch.setattr(deploy, "prepare", lambda *args, **kwargs: [])
    monkeypatch.setattr(deploy, "up", up)
    report, _ = pipeline.run_profile(matrix, dep, "default", repo / "no-key", say=lambda line: None)
    boot = report.checks[0]
    assert boot.name == "boot" and boot.status == "failed", boot
    assert "(RuntimeError): the engine's socket went away" in boot.reason
    assert report.passed is False and {c.status for c in report.checks[1:]} <= {"not_run", "not_required"}
