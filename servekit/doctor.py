"""`doctor`: what this machine has for building and serving, each line ok / warn / fail with the fix."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from wsl2.detect import wsl2_signs

from .errors import EnvironmentProblem
from .gpu import NvmlUnavailable, list_gpus
from .engines import gpu_problem_of, local


@dataclass
class Finding:
    name: str
    status: str  # ok, warn, fail
    detail: str
    fix: str = ""


def _docker(*args: str, timeout: float = 15) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def diagnose() -> list[Finding]:
    out: list[Finding] = []
    if not shutil.which("docker"):
        out.append(Finding("engine", "fail", "no docker client on PATH", "run `make engine` (Debian/Ubuntu as root) "
                           "or install Docker Engine / Docker Desktop"))
        return out
    engine = local()
    try:
        engine.check()
        server, info = engine.client.version(), engine.client.info()
    except EnvironmentProblem as exc:
        out.append(Finding("engine", "fail", str(exc), "run `make engine`, or start Docker"))
        return out
    out.append(Finding("engine", "ok", f"Docker {server.get('Version')} (API {server.get('ApiVersion')})"))
    compose = _docker("compose", "version", "--short")
    out.append(Finding("compose", "ok", f"Compose {compose.stdout.strip()}") if compose.returncode == 0 else
               Finding("compose", "fail", "`docker compose` is missing", "run `make engine`"))
    buildx = _docker("buildx", "version")
    if buildx.returncode == 0:
        out.append(Finding("builder", "ok", f"buildx: {buildx.stdout.strip()}"))
    elif compose.returncode == 0:
        out.append(Finding("builder", "ok", "BuildKit through `docker compose build` (no buildx here)"))
    else:
        out.append(Finding("builder", "fail", "no BuildKit-capable builder (no buildx, no Compose)",
                           "install the buildx or Compose plugin (`make engine`)"))
    problem = gpu_problem_of(info)
    out.append(Finding("nvidia runtime", "ok", "containers can have a GPU") if problem is None else
               Finding("nvidia runtime", "warn", f"no GPU for containers: {problem}", "`up` of a GPU target "
                       "stops here at once; serve a target without a GPU, or install the toolkit"))
    signs = wsl2_signs()
    out.append(Finding("wsl2", "ok", "WSL2: " + "; ".join(signs)) if signs else
               Finding("wsl2", "ok", "not WSL2 (native host defaults apply)"))
    try:
        gpus = list_gpus()
        out.append(Finding("gpus", "ok" if gpus else "warn",
                           ", ".join(f"{g.index}: {g.name} ({g.total_bytes / 2**30:.1f} GiB)" for g in gpus)
                           or "NVML answers but lists no GPU"))
    except NvmlUnavailable as exc:
        out.append(Finding("gpus", "warn", str(exc), "the cpu target needs none; GPU memory will not be sampled"))
    return out


def base_findings(matrix) -> list[Finding]:
    """Each base a target can build on: here, to be made by the first build that needs it, or to be pulled."""
    from .bases import made_base_current
    out = []
    for name, base in matrix.bases.items():
        if not any(name in t.bases for t in matrix.targets.values()):
            continue
        if base.debootstrap:
            out.append(Finding(f"base {name}", "ok", f"{base.image} made here" if made_base_current(base) else
                               f"{base.image} is made here (debootstrap) by the first build that needs it"))
        else:
            out.append(Finding(f"base {name}", "ok", f"{base.image} present") if local().image_exists(base.image)
                       else Finding(f"base {name}", "warn", f"{base.image} is not here; the build pulls it",
                                    "where its registry cannot be reached, build with --base naming a base made here"))
    return out


def doctor(matrix_path) -> list[Finding]:
    """Every finding: the engine and the machine, then (when the engine answers) the bases of the matrix."""
    from .errors import UserError
    from .matrix import load_matrix
    findings = diagnose()
    if findings and findings[0].status == "ok":
        try:
            findings += base_findings(load_matrix(matrix_path))
        except UserError as exc:
            findings.append(Finding("matrix", "fail", str(exc), "fix images.yaml"))
    return findings
