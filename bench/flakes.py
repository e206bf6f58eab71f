"""The flake finder: run test modules (or the whole suite) several rounds in a row, some of them with the CPUs loaded
by stress-ng, and print every test that ever failed with the last lines of each failure. No reruns: a test that
fails once is what this looks for.

    .venv/bin/python bench/flakes.py --rounds 3 --loaded 1 tests/test_run.py tests/test_fleet.py
    make flakes TESTS="tests/test_run.py" ROUNDS=3 LOADED=1

`--loaded K` runs the last K rounds beside `stress-ng --cpu N` (N: --load-cpus, default this machine's cores), the
load a busy CI machine puts on timing-dependent code. Each round's JUnit XML and log are kept under --out. Exits 1
when any test failed in any round, 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TAIL_LINES = 8


@dataclass
class Round:
    number: int
    loaded: bool
    seconds: float
    exit_code: int
    counts: dict[str, int] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)  # test id -> its failure's text


def read_junit(path: Path) -> tuple[dict[str, int], dict[str, str]]:
    """(outcome counts, failed test id -> failure text) from pytest's JUnit XML; a missing file is one failure."""
    if not path.is_file():
        return {"failed": 1}, {"(the run)": "pytest wrote no JUnit XML: it did not get to the tests"}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            counts["failed"] += 1
            failures[test_id] = (bad.get("message") or "") + "\n" + (bad.text or "")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, failures


def run_round(number: int, tests: list[str], workers: int, loaded: bool, load_cpus: int, out: Path,
              extra: list[str]) -> Round:
    junit, log = out / f"round-{number}.xml", out / f"round-{number}.log"
    load = None
    if loaded:
        load = subprocess.Popen(["stress-ng", "--cpu", str(load_cpus), "--quiet"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--reruns", "0", f"--junitxml={junit}",
            "-q", *(["-n", str(workers), "--dist", "loadgroup"] if workers else []), *extra, *tests]
    started = time.monotonic()
    try:
        with open(log, "w") as sink:
            code = subprocess.run(argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT).returncode
    finally:
        if load:
            os.killpg(load.pid, signal.SIGTERM)  # the load this round started, and nothing else
            load.wait()
    counts, failures = read_junit(junit)
    return Round(number, loaded, time.monotonic() - started, code, counts, failures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Arguments after -- go to pytest as they are (e.g. -- -k boot).")
    parser.add_argument("tests", nargs="*", metavar="TEST", help="test modules or ids (default: the whole suite)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds in a row (default 3)")
    parser.add_argument("--loaded", type=int, default=1, metavar="K", help="the last K rounds run under stress-ng "
                        "(default 1; 0: none)")
    parser.add_argument("--load-cpus", type=int, default=os.cpu_count() or 2, metavar="N",
                        help="stress-ng's CPU workers (default: this machine's cores)")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers, as `make test` (0: one process)")
    parser.add_argument("--out", type=Path, default=ROOT / ".cache" / "flakes" / time.strftime("%Y%m%d-%H%M%S"),
                        help="where each round's JUnit XML and log go (default: .cache/flakes/<now>: not logs/, which "
                        "the tests hold to be as they found it)")
    given = list(sys.argv[1:] if argv is None else argv)
    ours, extra = (given[:given.index("--")], given[given.index("--") + 1:]) if "--" in given else (given, [])
    args = parser.parse_args(ours)
    if args.rounds < 1 or not 0 <= args.loaded <= args.rounds:
        parser.error(f"--rounds {args.rounds} --loaded {args.loaded}: at least one round, and at most that many "
                     "loaded")
    if args.loaded and not shutil.which("stress-ng"):
        parser.error("--loaded needs stress-ng: `python3 build.py engine --test-tools` installs it (Debian's package)")
    args.out.mkdir(parents=True, exist_ok=True)
    rounds = []
    for number in range(1, args.rounds + 1):
        loaded = number > args.rounds - args.loaded
        print(f"flakes: round {number} of {args.rounds}{' under load' if loaded else ''}: "
              f"{' '.join(args.tests) or 'the whole suite'}", flush=True)
        done = run_round(number, args.tests, args.workers, loaded, args.load_cpus, args.out, extra)
        rounds.append(done)
        print(f"flakes: round {number}: {done.counts.get('passed', 0)} passed, {done.counts.get('failed', 0)} "
              f"failed, {done.counts.get('skipped', 0)} skipped in {done.seconds:.0f} s (exit {done.exit_code}; "
              f"log {done_log(args.out, number)})", flush=True)
    failed = {test for r in rounds for test in r.failures}
    for test in sorted(failed):
        seen = [r for r in rounds if test in r.failures]
        print(f"\nFAILED in {len(seen)} of {len(rounds)} rounds: {test}")
        for r in seen:
            tail = r.failures[test].rstrip().splitlines()[-TAIL_LINES:]
            print(f"  round {r.number}{' (loaded)' if r.loaded else ''}:")
            print("\n".join(f"    {line}" for line in tail))
    bad_exits = [r for r in rounds if r.exit_code not in (0, 5) and not r.failures]
    for r in bad_exits:
        print(f"\nround {r.number} exited {r.exit_code} with no failed test: see {done_log(args.out, r.number)}")
    print(f"\nflakes: {len(rounds)} rounds ({sum(r.loaded for r in rounds)} loaded), "
          f"{sum(r.counts.get('passed', 0) for r in rounds)} passes, {len(failed)} tests that ever failed")
    return 1 if failed or bad_exits else 0


def done_log(out: Path, number: int) -> str:
    path = out / f"round-{number}.log"
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


if __name__ == "__main__":
    sys.exit(main())
