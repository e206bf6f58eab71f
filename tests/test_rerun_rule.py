"""The rerun rule `make test` runs under, proven on a tiny suite of its own in a subprocess (two workers, as CI):
a test that fails once then passes shows as FLAKY with its first failure and the run passes; a test that fails
twice fails the run. And the SLOW line, for a slow test whose docstring does not say what it buys (the tiny suite's
bound is a fifth of a second, not a minute)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT

pytestmark = pytest.mark.slow  # each runs a pytest of its own, two workers and all: seconds that test-fast leaves out

CONFTEST = f"""
import sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import pytest
import grouping
import summary_lines

def pytest_configure(config):
    config.addinivalue_line("markers", "slow: as the suite's own")
    summary_lines.SLOW_S = 0.2
    summary_lines.register(config)

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    grouping.by_module(items)
"""

# The first run of test_once_then_passes leaves a mark and fails; its rerun finds the mark and passes.
TESTS = """
import time
from pathlib import Path

MARK = Path(__file__).with_name("failed-once")

def test_once_then_passes():
    if not MARK.exists():
        MARK.write_text("")
        assert 6 * 7 == 41, "the first try's own words"

def test_always_fails():
    assert False, "fails every time"

def test_steady():
    pass

def test_slow_and_silent():
    time.sleep(0.4)  # taking time is what it is for

def test_slow_and_explained():
    '''Buys what no cheaper test can.'''
    time.sleep(0.4)
"""


def _tiny_suite(folder: Path, *argv: str, files: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    folder.mkdir()
    (folder / "conftest.py").write_text(CONFTEST)
    for name, text in (files or {"test_tiny.py": TESTS}).items():
        (folder / name).write_text(text)
    # its temporary folders under its own: in the machine's pytest-of-<user>, a tiny run would clean up (and warn
    # about) what other runs of the suite left there
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(folder),
                           "--basetemp", str(folder / "tmp"), "-c", "/dev/null", "-n", "2", "--dist", "loadgroup",
                           "--reruns", "1", *argv, *(str(folder / name) for name in files or ["test_tiny.py"])],
                          cwd=folder, capture_output=True, text=True, timeout=300)


def _outcomes(stdout: str) -> dict[str, int]:
    """The counts of pytest's last line ('4 passed, 1 rerun in 4.86s'), warnings left out: how many there are
    is the interpreter's business, not the rule's."""
    last = stdout.strip().splitlines()[-1]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", last.split(" in ")[0])}
    counts.pop("warnings", None)
    counts.pop("warning", None)
    return counts


def test_a_test_that_passes_on_its_rerun_is_flaky_and_the_run_passes(tmp_path):
    done = _tiny_suite(tmp_path / "suite", "-k", "not always")
    assert done.returncode == 0, done.stdout[-3000:]
    flaky = [line for line in done.stdout.splitlines() if line.startswith("FLAKY:")]
    assert flaky[0].startswith("FLAKY: test_tiny.py::test_once_then_passes passed only on its rerun"), done.stdout
    assert any("the first try's own words" in line for line in flaky[1:]), flaky
    assert not any("test_steady" in line for line in flaky)
    assert _outcomes(done.stdout) == {"passed": 4, "rerun": 1}, done.stdout[-500:]
    slow = [line for line in done.stdout.splitlines() if line.startswith("SLOW:")]
    assert len(slow) == 1 and slow[0].startswith("SLOW: test_tiny.py::test_slow_and_silent took 0 s"), slow


def test_a_test_that_fails_twice_fails_the_run(tmp_path):
    done = _tiny_suite(tmp_path / "suite", "-k", "always or steady")
    assert done.returncode == 1, done.stdout[-3000:]
    assert "FLAKY:" not in done.stdout
    assert _outcomes(done.stdout) == {"failed": 1, "passed": 1, "rerun": 1}, done.stdout[-500:]


def test_each_modules_slow_tests_run_on_one_worker_and_its_fast_ones_on_any(tmp_path):
    """The grouping `make test` runs under (tests/grouping.py): every slow test of a module on one worker, so its
    module-wide fixtures run once (it silently stopped under pytest 9.2: each test went its own way, and the cuda
    image's module fixture ran on both workers, 404 s and 282 s of one CI run); the fast ones on whichever worker is
    free, so that a module of many is not one worker's queue."""
    slow = "".join(f"@pytest.mark.slow\ndef test_slow_{i}():\n    time.sleep(0.05)\n\n" for i in range(4))
    fast = "".join(f"def test_fast_{i}():\n    time.sleep(0.05)\n\n" for i in range(12))
    module = "import time\n\nimport pytest\n\n" + slow + fast
    done = _tiny_suite(tmp_path / "suite", "-v", files={"test_one.py": module, "test_two.py": module})
    assert done.returncode == 0, done.stdout[-3000:]
    ran = re.findall(r"^\[(gw\d+)\].* (test_one|test_two)\.py::test_(slow|fast)_\d+", done.stdout, re.M)
    assert len(ran) == 32, done.stdout[-3000:]
    assert all(len({worker for worker, m, kind in ran if m == name and kind == "slow"}) == 1
               for name in ("test_one", "test_two")), ran
    assert len({worker for worker, m, kind in ran if m == "test_one" and kind == "fast"}) == 2, ran
