"""`monitor`: GPU memory (NVML) and, on WSL2, Shared Usage for N seconds or until Ctrl-C.

Imports only the standard library, nvidia-ml-py and (for the adapter name) PyYAML, so that it
runs on a GPU machine without the rest of the stack.
"""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from servekit.gpu import NvmlSampler, NvmlUnavailable
from servekit.output import Say
from servekit.wsl2.detect import is_wsl2
from servekit.wsl2.shared_usage import SharedUsageSampler, SharedUsageUnavailable


def monitor(seconds: float | None, interval_s: float = 0.05, adapter: str | None = None,
            matrix_path: str | Path = "images.yaml", say: Say = print) -> dict:
    """Sample until `seconds` have passed (None: until Ctrl-C); {gpu, gpus, shared_usage} summaries."""
    gpu_sampler = shared_sampler = None
    try:
        gpu_sampler = NvmlSampler(interval_s=interval_s)
    except NvmlUnavailable as exc:
        say(f"monitor: GPU memory not sampled: {exc}")
    if is_wsl2():
        try:
            shared_sampler = SharedUsageSampler().start()
            if not shared_sampler.wait_for_samples(1, 20):
                say("monitor: Get-Counter gave no sample within 20 s")
        except SharedUsageUnavailable as exc:
            say(f"monitor: Shared Usage not sampled: {exc}")
    else:
        say("monitor: not WSL2: Shared Usage not sampled")
    if gpu_sampler:
        gpu_sampler.start()
    try:
        deadline = time.monotonic() + seconds if seconds else None
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass
    finally:
        if gpu_sampler:
            gpu_sampler.stop()
        if shared_sampler:
            shared_sampler.stop()
    gpus = gpu_sampler.summary() if gpu_sampler else []
    shared = shared_sampler.summary(adapter or wsl2_adapter(matrix_path),
                                    "--adapter" if adapter else "hosts.wsl2.adapter in images.yaml") \
        if shared_sampler else None
    if shared:
        shared.pop("series", None)
    return {"gpu": ({k: v for k, v in gpus[0].items() if k != "phases"} if gpus else None), "gpus": gpus,
            "shared_usage": shared}


def wsl2_adapter(matrix_path: str | Path) -> str | None:
    """hosts.wsl2.adapter from the matrix, read with PyYAML alone (no pydantic on a bare GPU machine)."""
    try:
        data = yaml.safe_load(Path(matrix_path).read_text())
        return ((data or {}).get("hosts") or {}).get("wsl2", {}).get("adapter")
    except (ImportError, OSError, yaml.YAMLError, AttributeError):
        return None
