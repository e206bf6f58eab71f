"""How a container on this host gets the GPU: through the NVIDIA toolkit, or by its device nodes and the driver's folder.

The toolkit route is what Compose's `driver: nvidia` reservation and `--gpus` ask for (the NVIDIA Container
Toolkit, CDI, Docker Desktop on WSL2). The devices route is what the toolkit does underneath, done by hand:
`/dev/nvidia*` passed in and the driver's folder mounted read-only, for a host whose engine has no toolkit but
whose driver lives in one folder (a VM or a cloud image with the driver under /usr/local/nvidia). ACCESS_ENV
chooses; `auto` takes the toolkit where the engine has it, else the devices where this machine has them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from servekit.errors import UserError

ACCESS_ENV = "SERVEKIT_GPU_ACCESS"  # auto, toolkit or devices
DRIVER_DIR_ENV = "SERVEKIT_DRIVER_DIR"  # the host's driver folder for the devices route
DRIVER_DIR = "/usr/local/nvidia"
GPU_DEVICE_ENV = "SERVEKIT_GPU_DEVICE"  # which card's node the devices route passes in
GPU_DEVICE = "/dev/nvidia0"
CONTAINER_DRIVER_DIR = "/usr/local/nvidia"  # where the devices route mounts it; the compose file says the same
COMPOSE_FILE = "compose.gpu-devices.yaml"
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
CHOICES = ("auto", "toolkit", "devices")


@dataclass(frozen=True)
class GpuAccess:
    route: str | None  # toolkit, devices, or None: no GPU for containers here
    how: str  # why, in words

    @property
    def devices(self) -> bool:
        return self.route == "devices"


def asked() -> str:
    value = os.environ.get(ACCESS_ENV, "auto").strip() or "auto"
    if value not in CHOICES:
        raise UserError(f"{ACCESS_ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def driver_dir() -> Path:
    return Path(os.environ.get(DRIVER_DIR_ENV) or DRIVER_DIR)


def gpu_device() -> str:
    return os.environ.get(GPU_DEVICE_ENV) or GPU_DEVICE


def device_nodes() -> list[str]:
    """The nodes the devices route passes in (the compose file names the same): the card's and the control nodes."""
    return [gpu_device(), *CONTROL_DEVICES]


def devices_problem() -> str | None:
    """Why the devices route cannot work on this machine, or None."""
    absent = [node for node in device_nodes() if not Path(node).exists()]
    if absent:
        return (f"this machine has no {', '.join(absent)} (no NVIDIA driver loaded, or {GPU_DEVICE_ENV} names "
                "another card)")
    folder = driver_dir()
    if not (folder / "lib64" / "libcuda.so.1").exists():
        return (f"{folder}/lib64/libcuda.so.1 is missing: the devices route mounts the driver's folder; set "
                f"{DRIVER_DIR_ENV} to the folder that holds the driver's lib64/ and bin/")
    return None


def decide(toolkit: tuple[bool, str], same_machine: bool) -> GpuAccess:
    """The route for an engine whose toolkit verdict is `toolkit` (gpu_access_of), as ACCESS_ENV asks."""
    wanted = asked()
    has_toolkit, why = toolkit
    if wanted == "toolkit" or (wanted == "auto" and has_toolkit):
        return GpuAccess("toolkit" if has_toolkit else None, why)
    if not same_machine:  # the device nodes and driver folder checked here would be another machine's
        return GpuAccess(None, f"{why}; the devices route ({ACCESS_ENV}=devices) needs the engine on this machine")
    problem = devices_problem()
    if problem:
        return GpuAccess(None, f"{why}; and the devices route cannot work: {problem}")
    return GpuAccess("devices", f"by its device nodes ({', '.join(device_nodes())}) and the driver's folder "
                                f"{driver_dir()} mounted read-only, without the NVIDIA toolkit ({COMPOSE_FILE})")


def docker_run_args() -> list[str]:
    """`docker run` flags of the devices route (what COMPOSE_FILE gives a service)."""
    args = [f"--device={node}" for node in device_nodes()]
    return [*args, "-v", f"{driver_dir()}:{CONTAINER_DRIVER_DIR}:ro", "-e", f"LD_LIBRARY_PATH={CONTAINER_DRIVER_DIR}/lib64"]
