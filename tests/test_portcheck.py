"""`port`: each kind of breakage planted in small generated vLLM trees (as wheels), and seen reported."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest
from support import ROOT

from servekit.build.portcheck import FINDINGS, port, read_accepted, record_accepted

FILLER = "".join(f"def filler_{i}(x):\n    return x * {i}\n\n\n" for i in range(6))
CORE = FILLER + '''class Runner:
    def run(self, batch):
        total = 0
        return total
'''
UTILS_OLD = '''def old_helper(value):
    return value


def configure(model, dtype="auto", seed=0):
    return model


class Engine:
    def __init__(self, config, *, log_stats=False):
        self.config = config
'''
UTILS_NEW = UTILS_OLD.replace('def old_helper(value):\n    return value\n\n\n', '').replace(
    'dtype="auto"', 'data_type="auto"').replace("log_stats=False):", "log_stats=False, mode):")
OURS = '''class Runner:
    def run(self, batch):
        total = 0
        value = old_helper(batch)  # a name upstream removed
        model = configure(value, dtype="half")
        engine = Engine(model, log_stats=True)
        ours(1)
        self.step_once(batch, 2)
        return total

    def step_once(self, batch):
        return batch


def ours(a, b):
    return a + b
'''


def _wheel(path: Path, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as whl:
        for rel, text in files.items():
            whl.writestr(f"vllm/{rel}", text)
    return path


def _series(tmp: Path) -> Path:
    """A series of one patch, cut against the old tree: Runner.run gains the calls above."""
    old, new = tmp / "a", tmp / "b"
    old.mkdir()
    new.mkdir()
    (old / "core.py").write_text(CORE)
    (new / "core.py").write_text(CORE.replace(CORE[len(FILLER):], "from vllm.utils import configure, Engine, "
                                              "old_helper\n\n\n" + OURS))
    diff = subprocess.run(["diff", "-u", "--label", "a/core.py", "--label", "b/core.py", str(old / "core.py"),
                           str(new / "core.py")], capture_output=True, text=True).stdout
    series = tmp / "patches"
    series.mkdir()
    (series / "runner-calls.patch").write_text("Calls for the test.\n\nKind: fix\nWhat: calls\nCut-against: v0.31.0\n\n"
                                               + diff)
    (series / "series").write_text("runner-calls.patch\n")
    return series


def _wheels(tmp: Path) -> tuple[Path, Path]:
    old = _wheel(tmp / "vllm-0.31.0-py3-none-any.whl", {"__init__.py": "", "utils.py": UTILS_OLD, "core.py": CORE})
    moved = "".join(f"# upstream added line {i}\n" for i in range(10)) + CORE  # the patch's context moves 10 lines
    new = _wheel(tmp / "vllm-0.32.0-py3-none-any.whl", {"__init__.py": "", "utils.py": UTILS_NEW, "core.py": moved})
    return old, new


def test_each_planted_breakage_is_reported(tmp_path):
    series = _series(tmp_path)
    old, new = _wheels(tmp_path)
    report = port(series, old, new, "cpu", "0.31.0", "0.32.0", accepted={})
    text = "\n".join(report.lines)
    removed = [line.split(": ", 1)[1].split("  |")[0] for line in report.lines if line.startswith("REMOVED")]
    assert removed == ["old_helper", "old_helper", "dtype"], text  # the import, the call, the renamed keyword
    assert all(line.startswith("REMOVED  runner-calls.patch  core.py:") for line in report.lines[:3])
    breaks = {line.split(": ", 1)[1].split("(")[0]: line for line in report.lines if line.startswith("BREAKS")}
    assert set(breaks) == {"configure", "Engine.__init__", "ours", "self.step_once"}, text
    assert "no parameter dtype" in breaks["configure"] and "[changed]" in breaks["configure"]
    assert "missing mode" in breaks["Engine.__init__"] and "[changed]" in breaks["Engine.__init__"]
    assert "missing b" in breaks["ours"] and "[the series' own definition]" in breaks["ours"]
    assert "2 positional, it takes 1" in breaks["self.step_once"]
    assert "moved    runner-calls.patch: 1 hunk(s) at an offset (10 lines)" in report.lines
    assert report.summaries[0].startswith("port-removed-names 0.31.0 -> 0.32.0: ") and \
        report.summaries[0].endswith("3 added line(s) of ours use one")
    assert report.summaries[1].endswith("4 BREAKS") and report.summaries[2].startswith("port-applies 0.31.0 -> 0.32.0: 0")
    assert report.failures == 7


def test_accepted_exceptions_are_kept_with_the_series_and_not_counted(tmp_path):
    series = _series(tmp_path)
    old, new = _wheels(tmp_path)
    record_accepted(series, {"old_helper": "reviewed: only in a docstring upstream", "ours": "fixed by vllm #58092"})
    assert read_accepted(series) == {"old_helper": "reviewed: only in a docstring upstream",
                                     "ours": "fixed by vllm #58092"}
    report = port(series, old, new, "cpu", "0.31.0", "0.32.0", accepted=read_accepted(series))
    assert any(line.startswith("accepted core.py:") and "old_helper (reviewed" in line for line in report.lines)
    assert any(line.startswith("accepted core.py:") and "ours (fixed by vllm #58092)" in line for line in report.lines)
    assert report.failures == 4  # the renamed keyword's line, and three calls that do not bind


def test_a_patch_that_no_longer_applies_fails_the_port(tmp_path):
    series = _series(tmp_path)
    old, _ = _wheels(tmp_path)
    rewritten = _wheel(tmp_path / "vllm-0.33.0-py3-none-any.whl", {
        "__init__.py": "", "utils.py": UTILS_OLD, "core.py": CORE.replace("        total = 0\n", "        total = 1\n")})
    report = port(series, old, rewritten, "cpu", "0.31.0", "0.33.0", accepted={})
    assert "FAILS    runner-calls.patch: does not apply at fuzz 0; re-cut it against the new tree" in report.lines
    assert report.summaries[2].startswith("port-applies 0.31.0 -> 0.33.0: 1 of the series fail")


@pytest.mark.slow
@pytest.mark.network
def test_port_to_the_real_next_vllm_with_the_shipped_series(cli):
    """The real 0.32.0 wheels (both distributions, downloaded once) against the shipped series: its summaries."""
    code, out, err = cli("--matrix", str(ROOT / "images.yaml"), "port", "--to", "0.32.0")
    summaries = [line for line in out.splitlines() if ": port-" in line]
    assert [line.split(": ")[0] + " " + line.split(": ")[1].split(" ")[0] for line in summaries] == [
        f"{t} port-{c}" for t in ("cuda", "cpu") for c in ("removed-names", "changed-signatures", "applies")], out
    assert all("0.31.0 -> 0.32.0" in line for line in summaries)
    assert code == (1 if any(line.split(": ", 1)[1].startswith(FINDINGS) for line in out.splitlines()) else 0)
