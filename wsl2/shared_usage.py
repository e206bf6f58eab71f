"""Sample the Windows GPU adapter memory counters from inside WSL2.

Going over the usable dedicated memory under WSL2 does not fail: the driver spills into shared
system memory and everything runs 2-6 times slower, with nothing in any log. Windows counts
that spill as `\\GPU Adapter Memory(*)\\Shared Usage`. One long-lived powershell.exe runs
Get-Counter continuously (a process per sample would cost 1-2 s each) and writes each sample as
one line of JSON. Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field

FALLBACK_POWERSHELL = "/mnt/c/Windows/System32/WindowsPowerShell/v1.0/powershell.exe"
COUNTERS = r"'\GPU Adapter Memory(*)\Shared Usage','\GPU Adapter Memory(*)\Dedicated Usage'"
# Each sample's values projected to three fields, one compressed JSON line per sample.
SCRIPT = ("Get-Counter -Counter " + COUNTERS + " -SampleInterval {interval} -Continuous | ForEach-Object { "
          "$_.CounterSamples | Select-Object Path,InstanceName,CookedValue | ConvertTo-Json -Compress }")
LUID = re.compile(r"(luid_0x[0-9a-f]+_0x[0-9a-f]+)", re.I)


class SharedUsageUnavailable(Exception):
    """No powershell.exe to ask (interop off, or not WSL2); the message says which and how to fix."""


def find_powershell() -> str:
    found = shutil.which("powershell.exe") or (FALLBACK_POWERSHELL if os.access(FALLBACK_POWERSHELL, os.X_OK) else None)
    if not found:
        raise SharedUsageUnavailable(
            "powershell.exe is not on PATH nor at " + FALLBACK_POWERSHELL + ": Windows interop looks off; enable it "
            "in /etc/wsl.conf ([interop] enabled=true, appendWindowsPath=true) and restart WSL (wsl --shutdown)")
    return found


def parse_sample(line: str) -> dict[str, dict[str, float]]:
    """One Get-Counter sample line -> {adapter LUID: {"shared": bytes, "dedicated": bytes}}.

    ConvertTo-Json writes a lone object, not an array, when a sample holds one counter value.
    """
    line = line.strip().lstrip("\ufeff")
    if not line:
        return {}
    items = json.loads(line)
    if isinstance(items, dict):
        items = [items]
    out: dict[str, dict[str, float]] = {}
    for item in items:
        path, instance = str(item.get("Path", "")).lower(), str(item.get("InstanceName", ""))
        luid = LUID.search(instance) or LUID.search(path)
        kind = "shared" if path.endswith("\\shared usage") else "dedicated" if path.endswith("\\dedicated usage") else None
        if not luid or not kind:
            continue
        adapter = out.setdefault(luid[1].lower(), {})
        adapter[kind] = adapter.get(kind, 0.0) + float(item.get("CookedValue") or 0.0)  # phys_0, phys_1 add up
    return out


@dataclass
class AdapterSeries:
    times: list[float] = field(default_factory=list)
    shared: list[float] = field(default_factory=list)
    dedicated: list[float] = field(default_factory=list)


def pick_adapter(series: dict[str, AdapterSeries], nvml_used: int | None = None, named: str | None = None) -> str:
    """The NVIDIA adapter: the one named, else the one whose dedicated usage matches NVML's used,
    else the one with the largest dedicated usage."""
    if named:
        match = [luid for luid in series if named.lower() in luid]
        if match:
            return match[0]
    if nvml_used is not None:
        return min(series, key=lambda luid: abs((series[luid].dedicated or [0])[-1] - nvml_used))
    return max(series, key=lambda luid: max(series[luid].dedicated or [0]))


def summarize(series: dict[str, AdapterSeries], adapter: str) -> dict:
    s = series[adapter]
    baseline = s.shared[0]  # taken before the container starts: never zero, about 0.3 GB on a 4090
    peak = max(s.shared)
    return {"adapter": adapter, "baseline_bytes": int(baseline), "peak_bytes": int(peak), "end_bytes": int(s.shared[-1]),
            "spill_bytes": int(max(0.0, peak - baseline)), "samples": len(s.shared),
            "peak_dedicated_bytes": int(max(s.dedicated)) if s.dedicated else None,
            "series": {"t": [round(t, 3) for t in s.times], "shared": [int(v) for v in s.shared]}}


class SharedUsageSampler:
    """Runs powershell.exe's Get-Counter in the background and keeps every adapter's series."""

    def __init__(self, interval_s: int = 1, powershell: str | None = None):
        self.powershell = powershell or find_powershell()
        self.interval_s = interval_s
        self.series: dict[str, AdapterSeries] = {}
        self.errors: list[str] = []
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._t0 = 0.0
        self.first_sample = threading.Event()

    def start(self) -> "SharedUsageSampler":
        self._t0 = time.monotonic()
        self._proc = subprocess.Popen(
            [self.powershell, "-NoProfile", "-NonInteractive", "-Command",
             SCRIPT.replace("{interval}", str(self.interval_s))],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, name="shared-usage", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for raw in self._proc.stdout:
            line = raw.replace("\r", "")
            try:
                sample = parse_sample(line)
            except (ValueError, TypeError) as exc:
                self.errors.append(f"unreadable sample ({exc}): {line[:120]!r}")
                continue
            now = time.monotonic() - self._t0
            for luid, values in sample.items():
                s = self.series.setdefault(luid, AdapterSeries())
                s.times.append(now)
                s.shared.append(values.get("shared", 0.0))
                s.dedicated.append(values.get("dedicated", 0.0))
            if sample:
                self.first_sample.set()

    def wait_for_baseline(self, timeout_s: float = 15) -> bool:
        return self.first_sample.wait(timeout_s)

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._reader:
            self._reader.join(timeout=5)
        if self._proc and self._proc.stderr and not self.series:
            err = self._proc.stderr.read().strip()
            if err:
                self.errors.append(err.replace("\r", "")[-300:])

    def summary(self, nvml_used: int | None = None, named: str | None = None) -> dict | None:
        if not self.series:
            return None
        return summarize(self.series, pick_adapter(self.series, nvml_used, named))
