"""Reproducible builds, measured: each target built, then built again with the builder's cache unused
(`build.py reproduce`); prints both image IDs, both build times and whether they are one image.

Goal: one image ID per target. The first build is skipped where the image is already there (its time then
reads "already built"); build on a fresh engine for both times.
Run: .venv/bin/python bench/reproduce.py [--target cpu --target cuda]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", help="a target (repeatable; default: cpu and cuda)")
    targets = parser.parse_args().target or ["cpu", "cuda"]
    same = True
    for target in targets:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "build.py", "reproduce", "--target", target, "--json"], cwd=ROOT,
                              capture_output=True, text=True)
        wall = time.perf_counter() - started
        try:
            result = json.loads(done.stdout)
        except json.JSONDecodeError:
            print(f"{target}: reproduce gave no result (exit {done.returncode}): {done.stderr.strip()[-500:]}")
            same = False
            continue
        first = f"{result['first_seconds']:.0f} s" if result["first_seconds"] is not None else "already built"
        print(f"{target}: {result['tag']}\n"
              f"  first build  {result['first_id']}  {first}\n"
              f"  rebuild      {result['second_id']}  {result['second_seconds']:.0f} s (cache unused)\n"
              f"  one image:   {'yes' if result['same'] else 'NO'}   (wall {wall:.0f} s)")
        for line in result["differences"]:
            print(f"    {line}")
        same = same and result["same"]
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
