"""The in-image verify step: the image is what the matrix says, or the build fails before a tag.

Checks: installed versions equal the pins, and the environment holds exactly the lock's slices (no package
more, none less); every patch of the series is applied; components;
`import vllm` (and flashinfer where pinned) works without a GPU; every flag the launcher can
emit is accepted by the pinned `vllm serve`; on a GPU target, the toolchain FlashInfer's JIT
needs: nvcc where FlashInfer looks for it, at torch's CUDA major, the curand headers beside it,
and FlashInfer's JIT compiling and linking a small curand kernel for every host's card; Triton's CUDA driver
stub compiling against Python's headers, as the first GPU use compiles it (bootneeds.py). A build
has no GPU: vLLM's argument parser is asked on its CPU platform, and nothing is loaded on a device.
Standard library only (the packages it checks are imported in child processes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, distributions, version
from pathlib import Path

from . import PACKAGE_ROOT, bootneeds, module_command, module_env, readers, recipe

# vLLM picks its platform at import; a build has no GPU, and the CPU platform prints the same parser.
NO_GPU_ENV = {"VLLM_TARGET_DEVICE": "cpu"}
# A small kernel through FlashInfer's own JIT: its include paths, nvcc, the curand headers, and the
# link against libcudart and the driver stub, as a real first request would compile one.
JIT_PROBE = r"""
#include <curand_kernel.h>
#include <flashinfer/vec_dtypes.cuh>

__global__ void servekit_probe_kernel(float* out, unsigned long long seed) {
  curandStatePhilox4_32_10_t state;
  curand_init(seed, threadIdx.x, 0, &state);
  flashinfer::vec_t<float, 4> v;
  v.fill(curand_uniform(&state));
  out[threadIdx.x] = v[0];
}

void servekit_probe(float* out) { servekit_probe_kernel<<<1, 32>>>(out, 0); }
"""
JIT_DRIVER = """
import sys
from pathlib import Path
from flashinfer.jit import gen_jit_spec
spec = gen_jit_spec("servekit_verify_probe", [Path(sys.argv[1])])
spec.build()
print(spec.jit_library_path)
print(spec.ninja_path)
"""


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


def check_installed_set(requirement_files: list[Path]) -> list[str]:
    """The environment holds exactly what the lock's slices name: each layer installed, nothing besides."""
    locked = {}
    for path in requirement_files:
        for name, pinned in re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", path.read_text(), re.M):
            locked[_normal(name)] = pinned
    installed = {_normal(d.metadata["Name"]): d.version for d in distributions()}  # verify runs on the venv's Python
    problems = [f"{name}: locked {v}, installed {installed.get(name, 'nothing')}" for name, v in sorted(locked.items())
                if installed.get(name) != v]
    extra = sorted(set(installed) - set(locked))
    if extra:
        problems.append(f"installed but in no slice of the lock: {', '.join(extra)}")
    if not requirement_files:
        problems.append(f"no requirements-*.txt in {PACKAGE_ROOT}: the build staged no slice of the lock")
    return problems


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check_triton_stub() -> list[str]:
    """Triton's CUDA driver stub, compiled as Triton compiles it at the first GPU use (its sources, its headers,
    Python's); without a driver, compiled, not linked."""
    done = subprocess.run([sys.executable, "-c", "import triton, pathlib; print(pathlib.Path(triton.__file__).parent "
                           "/ 'backends' / 'nvidia')"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return [f"`import triton` fails: {(done.stderr.strip().splitlines() or ['no output'])[-1][-300:]}"]
    backend = Path(done.stdout.strip().splitlines()[-1])
    sources = sorted(backend.glob("*.c"))
    if not sources:
        return [f"Triton's CUDA driver stub is not where Triton keeps it ({backend}/*.c)"]
    found = bootneeds.problems(sources, [backend / "include"])
    if not found:
        print(f"verify: Triton's CUDA driver stub compiles against Python.h ({', '.join(p.name for p in sources)})")
    return found


def check_series(series_dir: Path, target: str) -> list[str]:
    done = subprocess.run([*module_command(sys.executable, "series"), "check", "--series-dir", str(series_dir),
                           "--target", target, "--python", sys.executable,
                           "--settled-by", str(PACKAGE_ROOT / "components" / "component-manifest.json")],
                          capture_output=True, text=True, env=module_env(os.environ))
    return [line.removeprefix("error: ") for line in done.stderr.splitlines() if line.strip()]


def check_components() -> list[str]:
    done = subprocess.run([*module_command(sys.executable, "components"), "verify",
                           "--components-dir", str(PACKAGE_ROOT / "components"), "--python", sys.executable],
                          capture_output=True, text=True, env=module_env(os.environ))
    return [line.removeprefix("error: ") for line in done.stderr.splitlines() if line.strip()]


def check_imports(modules: list[str]) -> list[str]:
    """Each module imports without a GPU, in one interpreter (as a boot imports them), each failure named."""
    script = ("import importlib, sys\n"
              "for m in sys.argv[1:]:\n"
              "    try:\n"
              "        importlib.import_module(m)\n"
              "    except BaseException as e:\n"
              "        print(f'{m}: {type(e).__name__}: {e}'.splitlines()[0][:300], file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", script, *modules], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **NO_GPU_ENV})
    failed = [line for line in done.stderr.splitlines() if line.split(":")[0] in modules]
    problems = [f"`import {line.split(': ', 1)[0]}` fails without a GPU: {line.split(': ', 1)[1]}" for line in failed]
    if done.returncode != 0 and not problems:
        problems.append(f"importing {', '.join(modules)} ended with exit {done.returncode}: "
                        f"{(done.stderr.strip().splitlines() or ['no output'])[-1][-300:]}")
    if not problems:
        print(f"verify: {len(modules)} modules a boot imports import without a GPU")
    return problems


def serve_flags() -> set[str]:
    done = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--help=all"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **NO_GPU_ENV})
    if done.returncode != 0:
        raise SystemExit(f"verify: `vllm serve --help=all` failed: {done.stderr.strip()[-500:]}")
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", done.stdout))


# Each argv through `vllm serve`'s own parser, then into EngineArgs: the values too (enum choices, the KV dtypes,
# the JSON of --speculative-config and --compilation-config), not only the flag names; then the reasoning and tool
# parsers it names, loaded through vLLM's own registries as the API server loads them at boot (they import lazily:
# the qwen3 parsers need mistral_common, which no package import reaches). No model is loaded.
PARSE_ARGV = r"""
import atexit, contextlib, io, json, os, re, shutil, sys, tempfile
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
stub = tempfile.mkdtemp()  # the models are not in a build: a local folder stands in for each path under /app/models
atexit.register(shutil.rmtree, stub, True)  # gone before the layer is taken: a random name would differ each build
for label, argv in json.load(sys.stdin):
    argv = [t.replace("/app/models/", stub + "/") for t in argv]
    for t in argv:
        for path in re.findall(stub + r"/[\w.-]+", t):
            os.makedirs(path, exist_ok=True)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            parsed = parser.parse_args(argv)
            AsyncEngineArgs.from_cli_args(parsed)
        for flag, name, load in (("--reasoning-parser", parsed.reasoning_parser, ReasoningParserManager.get_reasoning_parser),
                                 ("--tool-call-parser", parsed.tool_call_parser, ToolParserManager.get_tool_parser)):
            if name:
                try:
                    load(name)
                except Exception as exc:
                    print(f"{label}: {flag} {name} does not load: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    except SystemExit:
        lines = said.getvalue().strip().splitlines() or ["refused"]
        print(f"{label}: {next((line for line in lines if 'error:' in line), lines[-1])}")
    except Exception as exc:
        print(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
"""


def check_flags(accepted: set[str], profiles_file: Path, components: dict[str, str]) -> list[str]:
    """Every flag the launcher can emit, and every profile's whole command line on every host, as vLLM parses it
    (a profile that needs a component this image lacks is not available, so not asked)."""
    from .launcher import build_command, flags  # the launcher's code, as the image runs it
    problems = [f"the launcher can emit {flag}, which the pinned `vllm serve` does not accept"
                for flag in flags() if flag not in accepted]
    profiles = json.loads(profiles_file.read_text())
    absent = {name for name, state in components.items() if state != "present"}
    argvs = []
    for name, hosts in profiles["profiles"].items():
        if absent & set(profiles.get("needs", {}).get(name, [])):
            print(f"verify: note: profile {name} needs {', '.join(sorted(absent))}, absent here; not asked")
            continue
        for host in hosts:
            argv, _ = build_command(profiles, name, host, {})
            argvs.append((f"profile {name} on {host}", argv))
    done = subprocess.run([sys.executable, "-c", PARSE_ARGV], input=json.dumps(argvs), capture_output=True,
                          text=True, timeout=900, env={**os.environ, **NO_GPU_ENV})
    if done.returncode != 0:
        return problems + [f"vLLM's parser could not be asked: {(done.stderr.strip().splitlines() or ['?'])[-1]}"]
    return problems + [f"{line}" for line in done.stdout.splitlines() if line.startswith("profile ")]


def _flashinfer_cuda_home() -> Path:
    """Where FlashInfer's JIT looks for the toolkit: CUDA_HOME, else nvcc on PATH, else /usr/local/cuda."""
    done = subprocess.run([sys.executable, "-c", "from flashinfer.jit.cpp_ext import get_cuda_path; "
                           "print(get_cuda_path())"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1])
    return Path(done.stdout.strip().splitlines()[-1])


def check_cuda_toolchain(archs: list[str]) -> list[str]:
    try:
        home = _flashinfer_cuda_home()
    except RuntimeError as exc:
        return [f"FlashInfer cannot find a CUDA toolkit: {exc}"]
    nvcc = home / "bin" / "nvcc"
    try:
        done = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60)
    except OSError:
        return [f"nvcc is missing at {nvcc}, where FlashInfer looks: its JIT cannot compile kernels"]
    release = re.search(r"release (\d+)\.(\d+)", done.stdout)
    torch_cuda = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda)"],
                                capture_output=True, text=True, timeout=600).stdout.strip()
    problems = []
    if not release:
        problems.append(f"{nvcc} --version does not say its release: {done.stdout.strip()[-200:]}")
    elif torch_cuda.split(".")[0] != release[1]:
        problems.append(f"nvcc is CUDA {release[1]}.{release[2]}, torch was built for CUDA {torch_cuda}")
    missing = [h for h in ("curand.h", "curand_kernel.h") if not (home / "include" / h).is_file()]
    if missing:
        problems.append(f"{', '.join(missing)} missing from {home / 'include'}, where FlashInfer looks: its sampling "
                        "kernels fall back and run about 5% slower, silently")
    if problems:
        return problems
    return check_jit_compiles(archs)


def check_jit_compiles(archs: list[str]) -> list[str]:
    """FlashInfer's JIT builds the probe for each arch (sm_86 for a 3090, sm_89 for a 4090)."""
    with tempfile.TemporaryDirectory(prefix="servekit-jit-") as tmp:
        source = Path(tmp) / "servekit_probe.cu"
        source.write_text(JIT_PROBE)
        env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": tmp, "FLASHINFER_CUDA_ARCH_LIST": " ".join(archs),
               "MAX_JOBS": str(os.cpu_count() or 1), "FLASHINFER_NVCC_THREADS": str(len(archs))}
        done = subprocess.run([sys.executable, "-c", JIT_DRIVER, str(source)], capture_output=True, text=True,
                              timeout=1800, env=env)
        if done.returncode != 0:
            errors = [line for line in (done.stdout + done.stderr).splitlines() if "error" in line.lower()]
            return [f"FlashInfer's JIT could not build a kernel for sm {', '.join(archs)}: "
                    f"{(errors or (done.stdout + done.stderr).strip().splitlines() or ['no output'])[-1][-400:]}"]
        library, ninja = (Path(p) for p in done.stdout.strip().splitlines()[-2:])
        flags = ninja.read_text() if ninja.is_file() else ""
        absent = [a for a in archs if f"code=sm_{a.replace('.', '')}" not in flags]
        if not library.is_file() or absent:
            return [f"FlashInfer's JIT built no library for sm {', '.join(absent or archs)}"]
        print(f"verify: FlashInfer's JIT compiled and linked a curand kernel for sm {', '.join(archs)} "
              f"({library.stat().st_size} bytes)")
    return []


def record_readers(profiles_file: Path) -> list[str]:
    """Which variables the launcher can export this image's packages read (readers.py): written beside the launcher
    at build (which says which of a profile's are inert), and held to what is there when verify runs again as the
    image's user, who cannot write there; the inert ones are noted."""
    profiles = json.loads(profiles_file.read_text())
    names = sorted(set(recipe.every_variable()) | set(profiles.get("env", {}))
                   | {name for host in profiles["hosts"].values() for name in host["env"]})
    doc = readers.record(names, readers.package_roots())
    record = PACKAGE_ROOT / readers.RECORD_NAME
    if os.access(PACKAGE_ROOT, os.W_OK):
        readers.write(record, doc)
    elif readers.load(record) != doc:
        return [f"{record} is not what this image's packages read: build the image again"]
    print(f"verify: note: {len(doc['read'])} of the {len(names)} variables the launcher can export are read here; "
          f"inert here (nothing in {', '.join(doc['packages'])} reads them): {', '.join(doc['inert']) or 'none'}")
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-info", type=Path, required=True)
    parser.add_argument("--profiles", type=Path, required=True)
    parser.add_argument("--series-dir", type=Path, required=True)
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # notes in order with problems (stderr)
    info = json.loads(args.build_info.read_text())
    problems = check_versions(info["pins"])
    problems += check_installed_set(sorted(PACKAGE_ROOT.glob("requirements-*.txt")))
    problems += check_series(args.series_dir, info["target"])
    problems += check_components()
    problems += check_imports(["vllm"] + (["flashinfer"] if "flashinfer-python" in info["pins"] else [])
                              + info.get("boot_imports", []))
    problems += check_flags(serve_flags(), args.profiles, info["components"])
    if info["gpu"]:
        problems += check_cuda_toolchain(info["cuda_archs"])
        problems += check_triton_stub()
    for name, what in info["omitted"].items():
        print(f"verify: note: {name} is left out of this image: {what}")
    if not problems:
        problems += record_readers(args.profiles)
    for problem in problems:
        print(f"verify: problem: {problem}", file=sys.stderr)
    if problems:
        print(f"verify: {len(problems)} problem(s); the image is not tagged", file=sys.stderr)
        return 1
    print(f"verify: ok ({len(info['pins'])} pins, {len(info['series'])} patches, "
          f"{sum(s == 'present' for s in info['components'].values())} components, every profile's flags accepted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
