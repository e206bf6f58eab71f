"""The host's GPUs through NVML: a 50 ms memory sampler (standard library and nvidia-ml-py only).

It runs on a GPU host without Docker too (the process engine), where neither the Docker SDK nor pydantic may be. `used` is the
v1 figure, which is what nvidia-smi shows (it counts the driver's reserved memory); samples
are taken in a background thread, and per-process lists, which take the driver's lock, at
most once a second.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from servekit.errors import EnvironmentProblem


class NvmlUnavailable(EnvironmentProblem):
    """No NVML here: no driver, no library, or no GPU. The message says which."""


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    cuda_arch: str = ""  # compute capability, e.g. 9.0


def nvml_init() -> Any:  # the pynvml module, initialized
    try:
        import pynvml  # nvidia-ml-py: only where a GPU is sampled; a host without it gets NvmlUnavailable
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
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            out.append(GpuInfo(i, name.decode() if isinstance(name, bytes) else name,
                               nvml.nvmlDeviceGetMemoryInfo(handle).total, f"{major}.{minor}"))
        return out
    finally:
        nvml.nvmlShutdown()


def driver_version() -> str:
    """The NVIDIA driver's version, e.g. 580.159.04 (on WSL2, the Windows driver's)."""
    nvml = nvml_init()
    try:
        version = nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    finally:
        nvml.nvmlShutdown()


@dataclass
class GpuSeries:
    index: int
    name: str
    total_bytes: int
    times: list[float] = field(default_factory=list)  # seconds since the sampler started
    used: list[int] = field(default_factory=list)
    processes: list[tuple[float, list[tuple[int, int | None]]]] = field(default_factory=list)  # (t, [(pid, bytes)])
    not_supported: set[str] = field(default_factory=set)
    card: tuple[str, int] | None = None  # (name, bytes): a smaller card emulated on this GPU (--card)

    def peak(self, start: float = 0.0, end: float = float("inf")) -> int | None:
        window = [u for t, u in zip(self.times, self.used, strict=True) if start <= t <= end]
        return max(window) if window else None

    @property
    def idle(self) -> int:
        """What an emulated card's figures are counted above: the GPU's use before the boot (the first sample)."""
        return self.used[0] if self.card and self.used else 0

    def summary(self, phases: list[tuple[str, float]], end: float) -> dict:
        """Peak and margin over the run and each phase. On an emulated card they are the card's: what the GPU held
        above its use before the boot, against the card's memory."""
        idle = self.idle
        total = self.card[1] if self.card else self.total_bytes

        def used(p: int | None) -> int | None:
            return None if p is None else p - idle
        peak = used(self.peak())
        out: dict = {"index": self.index, "name": self.card[0] if self.card else self.name, "total_bytes": total,
                     "samples": len(self.used), "peak_used_bytes": peak,
                     "min_margin_bytes": None if peak is None else total - peak,
                     "end_used_bytes": used(self.used[-1] if self.used else None), "phases": {},
                     "not_supported": sorted(self.not_supported)}
        if self.card:
            out["emulated_on"] = {"name": self.name, "total_bytes": self.total_bytes, "idle_used_bytes": idle}
        bounds = phases + [("", end)]
        for (name, start), (_, stop) in zip(bounds, bounds[1:], strict=False):
            p = used(self.peak(start, stop))
            out["phases"][name] = {"start_s": round(start, 3), "end_s": round(stop, 3), "peak_used_bytes": p,
                                   "min_margin_bytes": None if p is None else total - p}
        return out


class NvmlSampler:
    """Samples every GPU's memory every `interval_s` in a thread; phases mark the boot's stages."""

    def __init__(self, interval_s: float = 0.05, process_interval_s: float = 1.0,
                 card: tuple[str, int] | None = None) -> None:
        self.nvml = nvml_init()  # raises NvmlUnavailable, with the reason, when there is no GPU
        self.interval_s, self.process_interval_s = interval_s, process_interval_s
        self.handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.nvml.nvmlDeviceGetCount())]
        self.series = []
        for i, handle in enumerate(self.handles):
            name = self.nvml.nvmlDeviceGetName(handle)
            self.series.append(GpuSeries(i, name.decode() if isinstance(name, bytes) else name,
                                         self.nvml.nvmlDeviceGetMemoryInfo(handle).total, card=card if i == 0 else None))
        self.phases: list[tuple[str, float]] = [("before load", 0.0)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._t0 = 0.0

    def __enter__(self) -> NvmlSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread.start()

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def mark(self, phase: str) -> None:
        self.phases.append((phase, self.elapsed()))

    def _processes(self, handle: Any, series: GpuSeries) -> None:
        if "processes" in series.not_supported:
            return
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            series.processes.append((self.elapsed(), [(p.pid, p.usedGpuMemory) for p in procs]))
        except self.nvml.NVMLError_NotSupported:  # WSL2 has no per-process figures
            series.not_supported.add("processes")

    def _run(self) -> None:
        next_processes = 0.0
        while not self._stop.is_set():
            now = self.elapsed()
            for handle, series in zip(self.handles, self.series, strict=True):
                series.times.append(now)
                series.used.append(self.nvml.nvmlDeviceGetMemoryInfo(handle).used)
                if now >= next_processes:
                    self._processes(handle, series)
            if now >= next_processes:
                next_processes = now + self.process_interval_s
            # Sleep to the next tick rather than a fixed interval, so the rate holds under load.
            self._stop.wait(max(0.0, self.interval_s - (self.elapsed() - now)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._end = self.elapsed()
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()

    def summary(self) -> list[dict]:
        end = getattr(self, "_end", self.elapsed())
        return [s.summary(self.phases, end) for s in self.series]
