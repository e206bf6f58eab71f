"""The fuzz suite's long profile: tests/test_fuzz.py round after round, each round with fresh random inputs (its own
Hypothesis seed) and more examples per target than `make test` runs, until the minutes asked for are spent. Prints
each round's examples and seconds, and every finding with the input Hypothesis shrank it to.

    .venv/bin/python bench/fuzz.py --minutes 10
    make fuzz MINUTES=10

A round that has started runs to its end, so the run ends within one round's time (about two minutes at the
default 400 examples a target) after the minutes. Exits 1 when a round found anything, 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is no package: its flake finder reads the JUnit
from flakes import ROOT, TAIL_LINES, read_junit  # noqa: E402  (pytest writes, and knows its file names)

PASSING = re.compile(r"(\d+) passing\b")  # Hypothesis' statistics: "- 400 passing, 0 failing, and 3 invalid"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10, help="start rounds until this long has passed "
                        "(default 10)")
    parser.add_argument("--examples", type=int, default=400, help="examples per target a round (default 400)")
    parser.add_argument("--seed", type=int, help="the first round's seed (default: random; each later round the "
                        "next number), to run a round again")
    parser.add_argument("--out", type=Path, default=ROOT / ".cache" / "fuzz" / time.strftime("%Y%m%d-%H%M%S"),
                        help="where each round's JUnit XML and log go (default: .cache/fuzz/<now>)")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.examples < 1:
        parser.error(f"--minutes {args.minutes} --examples {args.examples}: expected more than nothing of each")
    args.out.mkdir(parents=True, exist_ok=True)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    env = {**os.environ, "SERVEKIT_FUZZ_PROFILE": "fuzz", "FUZZ_EXAMPLES": str(args.examples)}
    started, number, examples, findings = time.monotonic(), 0, 0, 0
    while time.monotonic() - started < args.minutes * 60:
        number += 1
        junit, log = args.out / f"round-{number}.xml", args.out / f"round-{number}.log"
        argv_ = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--reruns", "0",
                 f"--junitxml={junit}", f"--hypothesis-seed={seed + number - 1}", "--hypothesis-show-statistics",
                 "tests/test_fuzz.py"]
        began = time.monotonic()
        with open(log, "w") as sink:
            code = subprocess.run(argv_, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT).returncode
        counts, failures = read_junit(junit)
        ran = sum(int(n) for n in PASSING.findall(log.read_text(errors="replace")))
        examples += ran
        findings += len(failures) + (code not in (0, 1))
        print(f"fuzz: round {number} (seed {seed + number - 1}): {ran:,} examples over {sum(counts.values())} "
              f"targets in {time.monotonic() - began:.0f} s, {len(failures)} finding(s) (log {log})", flush=True)
        for test, text in sorted(failures.items()):
            print(f"  FINDING {test}:")
            print("\n".join(f"    {line}" for line in text.rstrip().splitlines()[-TAIL_LINES:]))
        if code not in (0, 1):
            print(f"  round {number} exited {code}: see {log}")
    print(f"fuzz: {number} rounds, {examples:,} examples in {(time.monotonic() - started) / 60:.1f} min, "
          f"{findings} finding(s)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
