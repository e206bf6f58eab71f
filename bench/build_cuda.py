"""Build benchmark for the cuda target, the product; prints its figures (not a timed test).

1. cold build: the image, the base made here (debootstrap and the CUDA toolchain wheels, downloaded
   anew) and the builder cache (pip's cache mount included) all removed first; every stage, the
   in-image verify with its FlashInfer JIT compile included;
2. a no-op `build.py image --target cuda` (no build started);
3. image size unpacked and gzipped (about what a pull moves), and the venv inside it;
beside the source repository's figures: about 20 min to build its image and about 9.5 GB to pull.

It builds what `make image TARGET=cuda` builds (the base made here, FlashInfer compiling at first use), or
with the settings given as arguments (`--base cuda-devel`). Removing the builder cache costs the cpu image's
build cache too. Per-layer sizes and what a change re-sends: bench/image_size.py.
Run: .venv/bin/python bench/build_cuda.py [--skip-cold] [SETTINGS...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_BUILD_S, SOURCE_PULL_GB = 20 * 60, 9.5
DEFAULT_SETTINGS: list[str] = []  # what `make image TARGET=cuda` builds


def image_json(settings: list[str]) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "build.py", *settings, "image", "--target", "cuda", "--json"], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"build failed: {done.stderr[-2000:]}")
    return {**json.loads(done.stdout)["images"][0], "wall": time.perf_counter() - start}


def planned(settings: list[str]) -> dict:
    plan = subprocess.run([sys.executable, "build.py", *settings, "plan", "--json", "--target", "cuda"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    return json.loads(plan.stdout)["targets"][0]


def make_cold(settings: list[str]) -> None:
    plan = planned(settings)
    subprocess.run(["docker", "image", "rm", "-f", plan["tag"], plan["base"]], capture_output=True)
    subprocess.run(["docker", "builder", "prune", "-af"], capture_output=True, check=True)
    shutil.rmtree(ROOT / ".cache" / "bases", ignore_errors=True)


def gzipped_bytes(tag: str) -> int:
    """About what a pull moves: the image as `docker save` streams it, gzip level 1 (registries gzip layers)."""
    save = subprocess.Popen(["docker", "save", tag], stdout=subprocess.PIPE)
    packer, total = zlib.compressobj(1, zlib.DEFLATED, 31), 0
    assert save.stdout is not None
    while chunk := save.stdout.read(1 << 22):
        total += len(packer.compress(chunk))
    save.wait()
    return total + len(packer.flush())


def sizes(tag: str) -> dict:
    image = int(subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", tag], capture_output=True, text=True,
                               check=True).stdout)
    venv = subprocess.run(["docker", "run", "--rm", "--entrypoint", "du", tag, "-sb", "/opt/venv"],
                          capture_output=True, text=True, check=True).stdout.split()[0]
    return {"image_bytes": image, "venv_bytes": int(venv), "gzipped_bytes": gzipped_bytes(tag)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-cold", action="store_true", help="only the no-op build and the sizes")
    parser.add_argument("settings", nargs="*", help="build.py settings (default: none, as make image)")
    args = parser.parse_args()
    settings = args.settings or DEFAULT_SETTINGS
    figures = {}
    if not args.skip_cold:
        make_cold(settings)
        cold = image_json(settings)
        figures["cold_build_s"] = round(cold["wall"], 1)
    noop = image_json(settings)
    figures.update(noop_s=round(noop["wall"], 2), noop_started_build=noop["built"], **sizes(noop["tag"]))
    print(f"settings: {' '.join(settings) or 'none'}; image {noop['tag']}")
    if "cold_build_s" in figures:
        print(f"cold cuda build (base made, wheels, series, verify with the JIT compile): "
              f"{figures['cold_build_s']:7.1f} s = {figures['cold_build_s'] / SOURCE_BUILD_S:.2f} of the source's "
              f"~{SOURCE_BUILD_S // 60} min")
    print(f"no-op image: {figures['noop_s']:.2f} s; build started: {figures['noop_started_build']}")
    print(f"image size: {figures['image_bytes'] / 1e9:.2f} GB unpacked, {figures['gzipped_bytes'] / 1e9:.2f} GB "
          f"gzipped (about what a pull moves; the source's pull is ~{SOURCE_PULL_GB} GB); "
          f"venv {figures['venv_bytes'] / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
