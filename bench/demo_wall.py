"""The whole `make demo` on a warm machine (image cached): wall time split into boot, checks, teardown.

Run: .venv/bin/python bench/demo_wall.py
"""

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
start = time.perf_counter()
done = subprocess.run(["make", "demo"], cwd=ROOT, capture_output=True, text=True)
wall = time.perf_counter() - start
report = json.loads((ROOT / "reports" / "latest" / "report.json").read_text())
phases = dict(report["boot"]["phases"])
boot, checks = phases.get("healthy", 0.0), phases.get("end", 0.0) - phases.get("traffic", 0.0)
print(f"make demo: {'passed' if done.returncode == 0 else 'FAILED'} in {wall:.1f} s wall")
print(f"  boot to healthy {boot:.1f} s, checks {checks:.1f} s, the rest (engine check, image check, "
      f"compose up/down, report) {wall - boot - checks:.1f} s")
for c in report["checks"]:
    print(f"  {c['name']:18} {c['status']:7} {c['seconds']:6.2f} s")
sys.exit(done.returncode)
