"""GPUs through NVML (standard library and nvidia-ml-py only: this runs on the GPU machine too)."""

from __future__ import annotations

from dataclasses import dataclass


class NvmlUnavailable(Exception):
    """No NVML here: no driver, no library, or no GPU. The message says which."""


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int


def nvml_init():
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable("nvidia-ml-py is not installed") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        raise NvmlUnavailable("no NVIDIA driver library (libnvidia-ml.so.1): no GPU on this machine") from None
    except pynvml.NVMLError_DriverNotLoaded:
        raise NvmlUnavailable("the NVIDIA driver is not loaded") from None
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML failed to start: {exc}") from None
    return pynvml


def list_gpus() -> list[GpuInfo]:
    nvml = nvml_init()
    try:
        out = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(handle)
            out.append(GpuInfo(i, name.decode() if isinstance(name, bytes) else name,
                               nvml.nvmlDeviceGetMemoryInfo(handle).total))
        return out
    finally:
        nvml.nvmlShutdown()
