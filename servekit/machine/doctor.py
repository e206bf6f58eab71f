"""`doctor`: what this machine has for building and serving, each line ok / warn / fail with the fix."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from servekit.build.bases import made_base_current
from servekit.config.load import load_matrix
from servekit.config.matrix import Matrix
from servekit.engines import local
from servekit.engines.card import doctor_line
from servekit.engines.dockercli import docker_cli
from servekit.engines.gpuaccess import (
    ACCESS_ENV,
    CONTAINER_DRIVER_DIR,
    DRIVER_DIR_ENV,
    GPU_DEVICE_ENV,
    GpuAccess,
    docker_run_args,
)
from servekit.engines.protocol import ImageEngine
from servekit.errors import EnvironmentProblem, UserError
from servekit.gpu import NvmlUnavailable, driver_version, list_gpus
from servekit.records.fit import summary
from servekit.wsl2.detect import wsl2_signs


@dataclass
class Finding:
    name: str
    status: str  # ok, warn, fail
    detail: str
    fix: str = ""


# CUDA 13 (the cuda image's torch is cu130) needs driver branch R580 or newer, on Linux and on Windows for WSL2.
DRIVER_MAJOR = 580
# Measured here: the cuda image is 9.7 GB, the cpu image 3.7 GB; a build needs about as much again for its cache.
DISK_FAIL_GB, DISK_WARN_GB = 12, 30


def driver_finding(version: str) -> Finding:
    try:
        major = int(version.split(".")[0])
    except ValueError:
        return Finding("driver", "warn", f"NVIDIA driver {version!r}: not a version this can read")
    if major >= DRIVER_MAJOR:
        return Finding("driver", "ok", f"NVIDIA driver {version} (CUDA 13 needs R{DRIVER_MAJOR} or newer)")
    return Finding("driver", "fail", f"NVIDIA driver {version} is older than R{DRIVER_MAJOR}, which CUDA 13 (the cuda "
                   "image) needs", f"install driver {DRIVER_MAJOR} or newer (on WSL2: the Windows driver)")


def disk_finding(free_bytes: int, where: str) -> Finding:
    free_gb = free_bytes / 1e9
    detail = f"{free_gb:.0f} GB free for images at {where}"
    if free_gb < DISK_FAIL_GB:
        return Finding("disk", "fail", detail + "; the cuda image alone is about 10 GB",
                       "free space (`docker image prune`, `docker builder prune`) or move the engine's data root")
    if free_gb < DISK_WARN_GB:
        return Finding("disk", "warn", detail + "; building the cuda image takes about 20 GB",
                       "free space before building the cuda image (`docker builder prune`)")
    return Finding("disk", "ok", detail)


def engine_disk(info: dict) -> Finding:
    """Free space where the engine keeps images, when that folder is on this machine (not a VM's or a remote's)."""
    root = info.get("DockerRootDir") or ""
    try:
        return disk_finding(shutil.disk_usage(root).free, root)
    except OSError:
        return Finding("disk", "ok", f"the engine keeps images at {root or '?'}, not on this machine: not checked")


def images_to_try(engine: ImageEngine, matrix: Matrix) -> list[str]:
    """The matrix's images built (or loaded) here, then its bases: a GPU host given only the product image (the
    H200 visits, by `docker load`) holds no base."""
    return engine.tags(matrix.image.name) + [base.image for base in matrix.bases.values()]


def gpu_container(engine: ImageEngine, images: list[str], access: GpuAccess) -> Finding:
    """Run a container with the GPU once, as `up` will (by the toolkit or by the devices route), from the first of
    `images` the engine has: the driver answers, or say why not."""
    image = next((name for name in images if engine.image_exists(name)), None)
    if image is None:
        return Finding("gpu container", "warn", "no image here to try a GPU container with yet",
                       "run `doctor` again after the first build")
    if access.devices:
        how, smi = docker_run_args(), f"{CONTAINER_DRIVER_DIR}/bin/nvidia-smi"
    else:
        how, smi = ["--gpus", "all", "-e", "NVIDIA_DRIVER_CAPABILITIES=utility"], "nvidia-smi"
    done = docker_cli(["run", "--rm", *how, "--entrypoint", smi, image, "-L"], timeout=120)
    if done.returncode == 0 and "GPU " in done.stdout:
        return Finding("gpu container", "ok", f"{access.route}: " + "; ".join(done.stdout.strip().splitlines()))
    said = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
    if access.devices:
        return Finding("gpu container", "fail", f"a container with the GPU's device nodes failed: {said}",
                       f"check {DRIVER_DIR_ENV} (the driver's folder, with lib64/ and bin/) and {GPU_DEVICE_ENV}")
    return Finding("gpu container", "fail", f"a container with --gpus all failed: {said}",
                   "check the NVIDIA Container Toolkit (`nvidia-ctk runtime configure --runtime=docker`, then "
                   "restart the engine; on WSL2, Docker Desktop's WSL integration and the Windows driver)")


def diagnose() -> list[Finding]:
    out: list[Finding] = []
    if not shutil.which("docker"):
        out.append(Finding("engine", "fail", "no docker client on PATH", "run `make engine` (Debian/Ubuntu as root) "
                           "or install Docker Engine / Docker Desktop"))
        return out
    engine = local()
    try:
        engine.check()
        server, info = engine.versions()
    except EnvironmentProblem as exc:
        out.append(Finding("engine", "fail", str(exc), "run `make engine`, or start Docker"))
        return out
    out.append(Finding("engine", "ok", f"Docker {server.get('Version')} (API {server.get('ApiVersion')})"))
    compose = docker_cli(["compose", "version", "--short"], timeout=15)
    out.append(Finding("compose", "ok", f"Compose {compose.stdout.strip()}") if compose.returncode == 0 else
               Finding("compose", "fail", "`docker compose` is missing", "run `make engine`"))
    buildx = docker_cli(["buildx", "version"], timeout=15)
    if buildx.returncode == 0:
        out.append(Finding("builder", "ok", f"buildx: {buildx.stdout.strip()}"))
    elif compose.returncode == 0:
        out.append(Finding("builder", "ok", "BuildKit through `docker compose build` (no buildx here)"))
    else:
        out.append(Finding("builder", "fail", "no BuildKit-capable builder (no buildx, no Compose)",
                           "install the buildx or Compose plugin (`make engine`)"))
    out.append(engine_disk(info))
    access = engine.gpu_access()
    out.append(Finding("gpu access", "ok", f"containers can have a GPU, {access.route}: {access.how}")
               if access.route else
               Finding("gpu access", "warn", f"no GPU for containers: {access.how}", "`up` of a GPU target "
                       "stops here at once; serve a target without a GPU, install the toolkit, or give containers "
                       f"the card's devices ({ACCESS_ENV}=devices)"))

    signs = wsl2_signs()
    out.append(Finding("wsl2", "ok", "WSL2: " + "; ".join(signs)) if signs else
               Finding("wsl2", "ok", "not WSL2 (native host defaults apply)"))
    try:
        gpus = list_gpus()
        out.append(Finding("gpus", "ok" if gpus else "warn",
                           ", ".join(f"{g.index}: {g.name} ({g.total_bytes / 2**30:.1f} GiB)" for g in gpus)
                           or "NVML answers but lists no GPU"))
        out.append(driver_finding(driver_version()))
    except NvmlUnavailable as exc:
        out.append(Finding("gpus", "warn", str(exc), "the cpu target needs none; GPU memory will not be sampled"))
    return out


def base_findings(matrix: Matrix) -> list[Finding]:
    """Each base a target can build on: here, to be made by the first build that needs it, or to be pulled."""
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


def doctor(matrix_path: str | Path) -> list[Finding]:
    """Every finding: the engine and the machine, then (when the engine answers) the bases of the matrix, the target
    commands default to and, where the engine can give a container a GPU, one GPU container."""
    findings = diagnose()
    if findings and findings[0].status == "ok":
        try:
            matrix = load_matrix(matrix_path)
        except UserError as exc:
            return findings + [Finding("matrix", "fail", str(exc), "fix images.yaml")]
        findings += base_findings(matrix)
        gpu = any(f.name == "gpu access" and f.status == "ok" for f in findings)
        findings.append(Finding("target", "ok", f"commands default to the {matrix.default_target(gpu)} target: the engine "
                                f"{'can' if gpu else 'cannot'} give a container a GPU (gpu access above); "
                                "--target overrides"))
        if gpu:
            engine = local()
            findings.append(gpu_container(engine, images_to_try(engine, matrix), engine.gpu_access()))
        host = "wsl2" if wsl2_signs() else "native"
        if host in matrix.hosts:
            findings.append(Finding("fit", "ok", summary(matrix, Path(matrix_path).resolve().parent, host)))
        can, why = doctor_line(matrix)  # information, not a fault: most hosts are the card itself
        findings.append(Finding("card emulation", "ok", f"--card: {why}" if can else
                                f"--card cannot emulate a card here: {why}"))
    return findings
