"""`doctor`: what this machine has for building and serving, each line ok / warn / fail with the fix."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass

from wsl2.detect import wsl2_signs

from . import engine
from .gpu import NvmlUnavailable, list_gpus


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
    version = _docker("version", "--format", "{{json .}}")
    if version.returncode != 0:
        out.append(Finding("engine", "fail", "no Docker engine answers", "run `make engine`, or start Docker"))
        return out
    info = json.loads(version.stdout)
    server = info.get("Server") or {}
    out.append(Finding("engine", "ok", f"Docker {server.get('Version')} (API {server.get('ApiVersion')}), "
                       f"client {info.get('Client', {}).get('Version')}"))
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
    runtimes = _docker("info", "--format", "{{json .Runtimes}}")
    names = sorted(json.loads(runtimes.stdout or "{}")) if runtimes.returncode == 0 else []
    out.append(Finding("nvidia runtime", "ok", "nvidia runtime registered") if "nvidia" in names else
               Finding("nvidia runtime", "warn", f"no nvidia runtime (runtimes: {', '.join(names) or 'none'}); "
                       "only the cpu target can serve", "install the NVIDIA Container Toolkit for the cuda target"))
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


def local_base_findings(images: list[str]) -> list[Finding]:
    return [Finding(f"base {image}", "ok", "present") if engine.image_present(image) else
            Finding(f"base {image}", "fail", "missing", "run `make engine` (it builds it with debootstrap)")
            for image in images]
