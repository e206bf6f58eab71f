"""The in-image verify step: the image is what the matrix says, or the build fails before a tag.

Checks: installed versions equal the pins; every patch of the series is applied; every flag the
launcher can emit is accepted by the pinned `vllm serve`; on the cuda target, the toolchain
FlashInfer's JIT needs (nvcc at the CUDA runtime's version, curand headers). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

HERE = Path(__file__).resolve().parent


def check_versions(pins: dict[str, str]) -> list[str]:
    problems = []
    for dist, pinned in pins.items():
        try:
            installed = version(dist)
        except PackageNotFoundError:
            problems.append(f"{dist}: pinned {pinned}, not installed")
            continue
        if installed != pinned:
            problems.append(f"{dist}: pinned {pinned}, installed {installed}")
    return problems


def check_series(series_dir: Path, target: str) -> list[str]:
    done = subprocess.run([sys.executable, str(HERE / "series.py"), "check", "--series-dir", str(series_dir),
                           "--target", target, "--python", sys.executable], capture_output=True, text=True)
    return [line.removeprefix("error: ") for line in done.stderr.splitlines() if line.strip()]


def check_components() -> list[str]:
    done = subprocess.run([sys.executable, str(HERE / "components.py"), "verify",
                           "--components-dir", str(HERE / "components"), "--python", sys.executable],
                          capture_output=True, text=True)
    return [line.removeprefix("error: ") for line in done.stderr.splitlines() if line.strip()]


def serve_flags() -> set[str]:
    done = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--help=all"],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"verify: `vllm serve --help=all` failed: {done.stderr.strip()[-500:]}")
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", done.stdout))


def check_flags(accepted: set[str], profiles_file: Path) -> list[str]:
    """Every flag the launcher can emit, and every flag of every profile's command line on every host."""
    sys.path.insert(0, str(HERE))
    from launcher import FLAGS, build_command
    problems = [f"the launcher can emit {flag}, which the pinned `vllm serve` does not accept"
                for flag in FLAGS if flag not in accepted]
    profiles = json.loads(profiles_file.read_text())
    for name, hosts in profiles["profiles"].items():
        for host in hosts:
            argv, _ = build_command(profiles, name, host, {})
            problems += [f"profile {name} on {host}: `vllm serve` does not accept {token.split('=')[0]}"
                         for token in argv if token.startswith("--") and token.split("=")[0] not in accepted]
    return problems


def check_cuda_toolchain() -> list[str]:
    problems = []
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True)
    if nvcc.returncode != 0:
        return ["nvcc is missing: FlashInfer's JIT cannot compile kernels"]
    release = re.search(r"release (\d+\.\d+)", nvcc.stdout)
    import torch
    if release and torch.version.cuda and not torch.version.cuda.startswith(release[1]):
        problems.append(f"nvcc is CUDA {release[1]}, torch was built for CUDA {torch.version.cuda}")
    if not list(Path("/usr/local/cuda/include").glob("curand*.h")):
        problems.append("curand headers are missing (/usr/local/cuda/include/curand.h): FlashInfer's sampling "
                        "kernels fall back and run about 5% slower, silently")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-info", type=Path, required=True)
    parser.add_argument("--profiles", type=Path, required=True)
    parser.add_argument("--series-dir", type=Path, required=True)
    args = parser.parse_args()
    info = json.loads(args.build_info.read_text())
    problems = check_versions(info["pins"])
    problems += check_series(args.series_dir, info["target"])
    problems += check_components()
    problems += check_flags(serve_flags(), args.profiles)
    if info["target"] == "cuda":
        problems += check_cuda_toolchain()
    for problem in problems:
        print(f"verify: {problem}", file=sys.stderr)
    if problems:
        print(f"verify: {len(problems)} problem(s); the image is not tagged", file=sys.stderr)
        return 1
    print(f"verify: ok ({len(info['pins'])} pins, {len(info['series'])} patches, "
          f"{sum(s == 'present' for s in info['components'].values())} components, every profile's flags accepted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
