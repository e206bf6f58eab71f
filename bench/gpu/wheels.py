"""The wheels a GPU machine without network needs for the cuda target, packed in parts small enough to carry.

Resolves the cuda target's pins (images.yaml) for Python 3.12 on manylinux x86_64 with pip's resolver, leaves
out what the GPU host already has at a version torch accepts (its CUDA libraries but NCCL, OpenCV) and
what no boot imports (the video codec, a second Triton, CUTLASS's DSL, TileLang), adds the host tool's own
dependencies (pyproject.toml: build.py and its checks run in that environment too), downloads each wheel once into
a cache, and writes PARTS_DIR/NNN/part-NNN as pack.py lays out the image's parts (one folder a call, beside the
tree without pack.TRAVEL_ONCE), with 000/SHA256SUMS over the parts and the wheels.

    python bench/gpu/wheels.py PARTS_DIR

On the GPU machine: `bench/gpu/acceptance.sh take PARTS_DIR/NNN` per carried folder, then `install` (cat part-* |
tar -x; sha256sum -c; pip install --no-index --no-deps *.whl into a venv beside the machine's site-packages).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pack import part_bytes, split  # noqa: E402
from servekit.build.locks import HOST_LOCK, lock_file, normalize, read  # noqa: E402

# What the GPU host has (torch 2.11's CUDA 13 wheels, OpenCV, numba) or no boot of ours imports.
LEAVE_OUT = ("nvidia-cublas", "nvidia-cufft", "nvidia-cusolver", "nvidia-cusparse", "nvidia-cusparselt-cu13",
             "nvidia-cuda-nvrtc", "nvidia-nvvm", "nvidia-nvshmem-cu13", "nvidia-curand", "nvidia-cuda-nvcc",
             "nvidia-nvjitlink", "nvidia-cuda-cupti", "nvidia-cuda-runtime", "nvidia-cufile", "nvidia-nvtx",
             "nvidia-cuda-cccl", "nvidia-cuda-crt", "nvidia-cuda-nvdisasm", "nvidia-cudnn-cu13", "cuda-toolkit",
             "opencv-python-headless", "pynvvideocodec", "tokenspeed-triton", "nvidia-cutlass-dsl-libs-cu12",
             "llvmlite", "numba", "tilelang", "z3-solver", "torchcodec")  # the cu13 CUTLASS DSL stays: GDN prefill
PYTHON = "3.12"  # the GPU host's
# pip matches a platform tag exactly: every glibc a manylinux wheel may name, up to Ubuntu 24.04's 2.39.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(5, 40)] + ["manylinux2014_x86_64", "linux_x86_64"]


def resolve(requirements: list[str]) -> list[dict]:
    """pip's resolution for the GPU machine's Python and platform: name, version, URL and hash per wheel."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                        "--report", str(report), "--target", tmp, "--python-version", PYTHON, "--implementation",
                        "cp", "--only-binary=:all:", *(f"--platform={p}" for p in PLATFORMS), *requirements],
                       check=True)
        return [{"name": i["metadata"]["name"], "version": i["metadata"]["version"],
                 "url": i["download_info"]["url"], "sha256": i["download_info"]["archive_info"]["hashes"]["sha256"]}
                for i in json.loads(report.read_text())["install"]]


def host_tool() -> list[str]:
    """The host tool's own dependencies (pyproject.toml): the checks import them in the process engine's
    environment (one missing broke `streaming` and `api` there). Each at the image's version where the image has
    it, else at requirements.lock's."""
    from packaging.requirements import Requirement
    image, host = (read(ROOT / path).packages for path in (lock_file("cuda", PYTHON), HOST_LOCK))
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [normalize(Requirement(d).name) for d in declared]
    return [f"{name}=={image.get(name) or host[name]}" for name in names]


def fetch(wheel: dict, cache: Path) -> Path:
    path = cache / wheel["url"].rsplit("/", 1)[1]
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != wheel["sha256"]:
        urllib.request.urlretrieve(wheel["url"], path)
        if hashlib.sha256(path.read_bytes()).hexdigest() != wheel["sha256"]:
            raise SystemExit(f"{path.name}: sha256 differs from the index's")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cache", type=Path, default=ROOT / ".cache" / "gpu-wheels")
    args = parser.parse_args()
    from servekit.session import Session
    session = Session.open(ROOT / "images.yaml", without=["flashinfer-cubin"])  # FlashInfer's index: not here
    pins = session.plan("cuda").pins
    wanted = [f"{n}=={v}" for n, v in pins.items()] + host_tool()
    wheels = [w for w in resolve(wanted) if normalize(w["name"]) not in LEAVE_OUT]
    args.cache.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        paths = list(pool.map(lambda w: fetch(w, args.cache), wheels))
    total = sum(p.stat().st_size for p in paths)
    print(f"{len(paths)} wheels, {total / 1e6:.0f} MB", file=sys.stderr)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    sums = [f"{w['sha256']}  wheels/{p.name}" for w, p in zip(wheels, paths)]
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "wheels.tar"
        with tarfile.open(bundle, "w") as tar:
            for path in paths:
                tar.add(path, arcname=f"wheels/{path.name}")
        with open(bundle, "rb") as stream:
            n = split(stream, "part", args.out, sums, 0, part_bytes())
    (args.out / "000" / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    print(f"{args.out}: {n} parts, one folder each", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
