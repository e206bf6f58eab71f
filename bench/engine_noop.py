"""How long `build.py engine` takes when everything is already there (goal: under 2 s)."""

import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
times = []
for _ in range(5):
    start = time.perf_counter()
    subprocess.run([sys.executable, "build.py", "engine"], cwd=ROOT, check=True, capture_output=True)
    times.append(time.perf_counter() - start)
print(f"build.py engine, no-op: median {statistics.median(times):.2f} s, max {max(times):.2f} s over {len(times)} runs")
