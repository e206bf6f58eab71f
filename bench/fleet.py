"""A fleet run on this machine's engine and a second one: the image sent cold, then the parallel run's
wall time against the same two runs one after the other.

Run: .venv/bin/python bench/fleet.py   (starts a second engine of its own, in .cache/bench-fleet-engine, and stops
it at the end: never the tests' second engine, which a run of the suite may be using)
"""

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from second_engine import Dockerd  # noqa: E402

from servekit.build.plan import plan_targets  # noqa: E402
from servekit.config.load import load_matrix  # noqa: E402
from servekit.engines import resolve  # noqa: E402
from servekit.engines.transfer import ensure_image  # noqa: E402


def build_py(*argv: str) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "build.py"), *argv], cwd=ROOT, capture_output=True, text=True)
    return time.perf_counter() - start, done


second = Dockerd(ROOT / ".cache" / "bench-fleet-engine", Path("/run/servekit-bench-fleet"), "sk-bench-fleet",
                 "10.212.200.1/24", "10.217.0.0/20")
second.start()
url = second.url
tag = plan_targets(load_matrix(ROOT / "images.yaml"), ROOT, ["cpu"])[0].tag
subprocess.run(["docker", "--host", url, "image", "rm", "-f", tag], capture_output=True)
start = time.perf_counter()
how = ensure_image(resolve(url), tag, say=lambda line: None)
size = int(subprocess.run(["docker", "image", "inspect", tag, "--format", "{{.Size}}"], capture_output=True,
                          text=True).stdout)
seconds = time.perf_counter() - start
print(f"image {tag}, {size / 1e9:.2f} GB: {how}; {size / 1e6 / seconds:.0f} MB/s")

alone = {}
for engine in ("local", url):
    wall, done = build_py("run", "--target", "cpu", "--profile", "default", "--engine", engine)
    alone[engine] = wall
    print(f"run on {engine} alone: {'passed' if done.returncode == 0 else 'FAILED'} in {wall:.1f} s")
wall, done = build_py("run", "--target", "cpu", "--profile", "default", "--engines", f"local,{url}", "--json")
out = json.loads(done.stdout)
print(f"run --engines local,{url}: {'passed' if out['passed'] else 'FAILED'} in {wall:.1f} s wall, against "
      f"{sum(alone.values()):.1f} s one after the other ({sum(alone.values()) / wall:.2f}x)")
for engine in out["engines"]:
    report = json.loads((Path(engine["reports"][0]) / "report.json").read_text())
    burst = next(c for c in report["checks"] if c["name"] == "burst")["figures"].get("tokens_per_s")
    print(f"  {engine['label']}: healthy in {report['boot']['time_to_healthy_s']} s, burst {burst} tokens/s")
print(f"  (this machine has {len(__import__('os').sched_getaffinity(0))} cores, which both servers share)")
second.stop()
sys.exit(0 if out["passed"] else 1)
