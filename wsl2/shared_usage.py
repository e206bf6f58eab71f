"""Sample the Windows GPU adapter memory counters from inside WSL2.

Going over the usable dedicated memory under WSL2 does not fail: the driver spills into shared
system memory and everything runs 2-6 times slower, with nothing in any log. Windows counts
that spill as `\\GPU Adapter Memory(*)\\Shared Usage`. One long-lived powershell.exe runs
shared_usage.ps1: the adapters' names once, then Get-Counter continuously (a process per sample
would cost 1-2 s each), each sample one line of JSON. Standard library only.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from servekit.errors import EnvironmentProblem

FALLBACK_POWERSHELL = "/mnt/c/Windows/System32/WindowsPowerShell/v1.0/powershell.exe"
# The adapters' names once, then Get-Counter's samples, one compressed JSON line each.
SCRIPT = Path(__file__).with_name("shared_usage.ps1")
LUID = re.compile(r"(luid_0x[0-9a-f]+_0x[0-9a-f]+)", re.I)


class SharedUsageUnavailable(EnvironmentProblem):
    """No powershell.exe to ask (interop off, or not WSL2); the message says which and how to fix."""


def find_powershell() -> str:
    found = shutil.which("powershell.exe") or (FALLBACK_POWERSHELL if os.access(FALLBACK_POWERSHELL, os.X_OK) else None)
    if not found:
        raise SharedUsageUnavailable(
            "powershell.exe is not on PATH nor at " + FALLBACK_POWERSHELL + ": Windows interop looks off; enable it "
            "in /etc/wsl.conf ([interop] enabled=true, appendWindowsPath=true) and restart WSL (wsl --shutdown)")
    return found


def encoded_command(interval_s: int) -> str:
    """The script for `powershell.exe -EncodedCommand`: base64 of its UTF-16LE text, as PowerShell documents it, so
    that no quoting on the way through WSL's interop can change it."""
    script = SCRIPT.read_text().replace("SAMPLE_INTERVAL_S", str(interval_s))
    return base64.b64encode(script.encode("utf-16-le")).decode("ascii")


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
    times: list[float] = field(default_factory=list)  # time.time() of each sample, so phases line up with a boot's
    shared: list[float] = field(default_factory=list)
    dedicated: list[float] = field(default_factory=list)


def _luid(text: str) -> str:
    """`luid_0x00000000_0x0000c3a1_phys_0`, a LUID or its last part, as the key the series use."""
    return re.sub(r"_phys_\d+$", "", text.strip().lower())


def choose_adapter(series: dict[str, AdapterSeries], named: str | None = None,
                   named_by: str = "hosts.wsl2.adapter in images.yaml",
                   names: dict[str, str] | None = None) -> tuple[str | None, str]:
    """The adapter to read and why. The one `named`: by its LUID (whole, its last part, or its counter instance) or
    by its name (`names`, LUID to the display driver's name; any part of it, any case: "RTX 4090"); else the one
    with the most dedicated memory in use at any sample. Shared memory never decides: an integrated GPU has all of
    its memory shared and often more of it in use than the card. None, with the reason, when the name matches no
    adapter or several (a wrong adapter would judge a spill it cannot see)."""
    names = names or {}
    listed = ", ".join(f"{luid} ({names[luid]})" if luid in names else luid for luid in sorted(series)) or "none"
    if named:
        match = [luid for luid in series if _luid(named) in luid or named.strip().lower() in names.get(luid, "").lower()]
        if len(match) == 1:
            return match[0], f"named by {named_by} ({named}" + (f": {names[match[0]]})" if match[0] in names else ")")
        return None, (f"{named_by} names {named!r}, which matches {'several' if match else 'none'} of the adapters "
                      f"Get-Counter lists ({listed}); name one of them, or leave it out to read the card with the "
                      "most dedicated memory")
    if not series:
        return None, "Get-Counter listed no adapter"

    def most(luid: str) -> float:
        return max(series[luid].dedicated or [0.0])
    ranked = sorted(series, key=most, reverse=True)
    others = "; ".join(f"{luid}{f' ({names[luid]})' if luid in names else ''} {most(luid) / 1e9:.1f} GB"
                       for luid in ranked[1:])
    return ranked[0], (f"the most dedicated memory in use ({most(ranked[0]) / 1e9:.1f} GB at its peak"
                       + (f"; {others}" if others else "") + "): the card, never an integrated GPU, whose memory is "
                       "all shared")


def summarize(series: dict[str, AdapterSeries], adapter: str, why: str, phases: Sequence[tuple[str, float]] = (),
              origin: float | None = None, names: dict[str, str] | None = None) -> dict:
    """The figures of one adapter: overall, and per phase. `phases` are (name, seconds since `origin`), the
    boot's marks (load, warm-up, healthy, traffic, end); samples before the first mark are the `before load`
    phase, whose last sample is the baseline (without marks: the first sample). The level at the start of traffic is the last sample before the
    first request; at its end, the last sample of the traffic phase."""
    s = series[adapter]
    origin = s.times[0] if origin is None else origin
    t = [x - origin for x in s.times]
    bounds = [("before load", float("-inf")), *phases, ("", float("inf"))]
    per_phase: dict[str, dict] = {}
    for (name, start), (_, stop) in zip(bounds, bounds[1:], strict=False):
        picked = [i for i, x in enumerate(t) if start <= x < stop]
        shared, dedicated = [s.shared[i] for i in picked], [s.dedicated[i] for i in picked]
        per_phase[name] = {"start_s": None if start == float("-inf") else start,
                           "end_s": None if stop == float("inf") else stop, "samples": len(picked),
                           "first_bytes": int(shared[0]) if shared else None,
                           "peak_bytes": int(max(shared)) if shared else None, "last_bytes": int(shared[-1]) if shared else None,
                           "peak_dedicated_bytes": int(max(dedicated)) if dedicated else None}
    before = per_phase["before load"]
    traffic = per_phase.get("traffic")
    healthy_level = next((per_phase[n]["last_bytes"] for n in ("healthy", "warm-up", "load", "before load")
                          if n in per_phase and per_phase[n]["last_bytes"] is not None), None)
    out = {"adapter": adapter, "adapter_name": (names or {}).get(adapter), "chosen_because": why,
           "samples": len(s.shared),
           "baseline_bytes": before["last_bytes"] if phases and before["samples"] else int(s.shared[0]),
           "peak_bytes": int(max(s.shared)), "end_bytes": int(s.shared[-1]),
           "peak_dedicated_bytes": int(max(s.dedicated)) if s.dedicated else None,
           "phases": per_phase,
           "adapters": {luid: {"name": (names or {}).get(luid), "peak_shared_bytes": int(max(a.shared or [0])),
                               "peak_dedicated_bytes": int(max(a.dedicated or [0]))} for luid, a in series.items()},
           "series": {"t": [round(x, 3) for x in t], "shared": [int(v) for v in s.shared]}}
    if traffic is not None:
        out["traffic_start_bytes"] = healthy_level
        out["traffic_end_bytes"] = traffic["last_bytes"]
        out["traffic_peak_bytes"] = traffic["peak_bytes"]
        out["traffic_rise_bytes"] = (None if healthy_level is None or traffic["peak_bytes"] is None
                                     else max(0, traffic["peak_bytes"] - healthy_level))
    return out


class SharedUsageSampler:
    """Runs powershell.exe's Get-Counter in the background and keeps every adapter's series."""

    def __init__(self, interval_s: int = 1, powershell: str | None = None) -> None:
        self.powershell = powershell or find_powershell()
        self.interval_s = interval_s
        self.series: dict[str, AdapterSeries] = {}
        self.names: dict[str, str] = {}  # LUID -> the display driver's name, where Windows gave them
        self.errors: list[str] = []
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._arrived = threading.Condition()
        self.count = 0  # samples read so far

    def start(self) -> SharedUsageSampler:
        self._proc = subprocess.Popen(
            [self.powershell, "-NoProfile", "-NonInteractive", "-EncodedCommand", encoded_command(self.interval_s)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, name="shared-usage", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for raw in self._proc.stdout:
            line = raw.replace("\r", "")
            if self._names_line(line):
                continue
            try:
                sample = parse_sample(line)
            except (ValueError, TypeError) as exc:
                self.errors.append(f"unreadable sample ({exc}): {line[:120]!r}")
                continue
            now = time.time()
            for luid, values in sample.items():
                s = self.series.setdefault(luid, AdapterSeries())
                s.times.append(now)
                s.shared.append(values.get("shared", 0.0))
                s.dedicated.append(values.get("dedicated", 0.0))
            if sample:
                with self._arrived:
                    self.count += 1
                    self._arrived.notify_all()

    def _names_line(self, line: str) -> bool:
        """The script's first line: the adapters' names by LUID, or why Windows gave none."""
        if '"Adapters"' not in line and '"AdapterNamesError"' not in line:
            return False
        try:
            said = json.loads(line.strip().lstrip("\ufeff"))
        except ValueError:
            return False
        if isinstance(said, dict) and isinstance(said.get("Adapters"), dict):
            self.names = {_luid(luid): str(name) for luid, name in said["Adapters"].items()}
            return True
        if isinstance(said, dict) and "AdapterNamesError" in said:
            self.errors.append(f"adapter names not read: {str(said['AdapterNamesError'])[:200]}")
            return True
        return False

    def wait_for_samples(self, count: int, timeout_s: float) -> bool:
        """Block until `count` samples more than now have been read (False at the timeout). Two make a level
        fresh: the first may have been taken before the moment that matters, the second was not."""
        with self._arrived:
            wanted = self.count + count
            return self._arrived.wait_for(lambda: self.count >= wanted, timeout_s)

    def fresh_level_timeout(self) -> float:
        """How long two fresh samples may take: Get-Counter lags its interval by up to a few seconds."""
        return 2 * self.interval_s + 5

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

    def summary(self, named: str | None = None, named_by: str = "hosts.wsl2.adapter in images.yaml",
                phases: Sequence[tuple[str, float]] = (), origin: float | None = None) -> dict | None:
        """The chosen adapter's figures (see summarize), or None when no sample came; a name that matches no
        adapter gives {"adapter": None, "chosen_because": why}, which the spill check fails on."""
        if not self.series:
            return None
        adapter, why = choose_adapter(self.series, named, named_by, self.names)
        if adapter is None:
            return {"adapter": None, "chosen_because": "; ".join([why, *self.errors])}
        return summarize(self.series, adapter, why, list(phases), origin, self.names)


def describe(summary: dict) -> str:
    """One line for a terminal: which adapter and why, then its baseline, peak (and the phase of the peak) and end."""
    if summary.get("adapter") is None:
        return f"Shared Usage not read: {summary['chosen_because']}"
    peaks = [(p["peak_bytes"], name) for name, p in summary["phases"].items() if p["peak_bytes"] is not None]
    where = f" during {max(peaks)[1]}" if len(peaks) > 1 else ""
    name = f" {summary['adapter_name']}" if summary.get("adapter_name") else ""
    return (f"Shared Usage of {summary['adapter']}{name} ({summary['chosen_because']}): baseline "
            f"{summary['baseline_bytes'] / 1e6:.0f} MB, peak {summary['peak_bytes'] / 1e6:.0f} MB{where}, end "
            f"{summary['end_bytes'] / 1e6:.0f} MB, {summary['samples']} samples")
