"""The demo model's full training (`demo-model`, the shipped model's steps) in a throwaway copy of the repository:
its wall time, first and final loss, and whether the model it made does what the checks ask, beside the shipped one.
The tests train 40 steps only (tests/test_build.py); this is the run that proves the full one still converges.

Run: .venv/bin/python bench/demo_model.py   (the cpu image is built first if need be; about 5 CPU minutes alone)
"""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from support import tracked_copy  # noqa: E402

with tempfile.TemporaryDirectory(prefix="servekit-bench-demo-model-") as tmp:
    root = tracked_copy(Path(tmp))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "build.py"), "demo-model"], cwd=root, capture_output=True,
                          text=True)
    wall = time.perf_counter() - start
    folder = root / "docker" / "demo-model"
    trained = json.loads((folder / "servekit-demo.json").read_text())
    shipped = json.loads((ROOT / "docker" / "demo-model" / "servekit-demo.json").read_text())
    print(f"demo-model: {'replaced the copy' if done.returncode == 0 else 'FAILED'} in {wall:.0f} s wall")
    print(f"  {trained['steps']} steps: loss {trained.get('first_loss', '?')} -> {trained['final_loss']} "
          f"(the shipped model's final loss: {shipped['final_loss']})")
    if done.returncode != 0:
        print("  " + "\n  ".join(done.stderr.strip().splitlines()[-5:]))
    sys.exit(done.returncode)
