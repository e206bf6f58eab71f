"""Compose the stages of one boot: samplers, compose up, watch; so `up` and `run` share one path.

The samplers start before the container (their first sample is the baseline) and the phases
are marked from what the watcher sees: `load` from the container start, `warm-up` once the
weights are in memory, `traffic` when the caller starts sending requests.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field

from wsl2.shared_usage import SharedUsageSampler, SharedUsageUnavailable

from . import deploy
from .gpu import NvmlSampler, NvmlUnavailable
from .watch import BootFailed, BootRecord, watch_boot

WEIGHTS_LOADED = re.compile(r"Model loading took|Loading weights took|Loading model weights took")


@dataclass
class Boot:
    dep: deploy.Deployment
    profile: str
    record: BootRecord = field(default_factory=lambda: BootRecord(started=time.time()))
    gpu: NvmlSampler | None = None
    shared: SharedUsageSampler | None = None
    container: object = None
    notes: list[str] = field(default_factory=list)
    phases: list[tuple[str, float]] = field(default_factory=list)  # (name, seconds since the boot started)

    def mark(self, phase: str) -> None:
        if phase in dict(self.phases):
            return
        self.phases.append((phase, round(time.time() - self.record.started, 3)))
        if self.gpu:
            self.gpu.mark(phase)

    def start_samplers(self) -> None:
        try:
            self.gpu = NvmlSampler()
            self.gpu.start()
        except NvmlUnavailable as exc:
            self.notes.append(f"GPU memory not sampled: {exc}")
        if self.dep.host == "wsl2":
            try:
                self.shared = SharedUsageSampler().start()
                if not self.shared.wait_for_baseline(20):
                    self.notes.append("Shared Usage: Get-Counter gave no sample within 20 s")
            except SharedUsageUnavailable as exc:
                self.notes.append(f"Shared Usage not sampled: {exc}")

    def stop_samplers(self) -> None:
        if self.gpu:
            self.gpu.stop()
        if self.shared:
            self.shared.stop()

    def memory(self) -> dict:
        """The figures for the report: GPU summaries with phases, Shared Usage with its series."""
        gpus = self.gpu.summary() if self.gpu else []
        series = [{"t": s.times, "used": s.used} for s in self.gpu.series] if self.gpu else []
        shared = self.shared.summary(nvml_used=gpus[0]["end_used_bytes"] if gpus else None,
                                     named=None) if self.shared else None
        return {"gpus": gpus, "gpu_series": series, "shared_usage": shared, "phases": self.phases,
                "notes": self.notes}


def boot(dep: deploy.Deployment, profile: str, timeout_s: float, say=None) -> Boot:
    """Start the samplers, then the profile, and watch it to healthy; on any failure take it down."""
    b = Boot(dep, profile)
    b.start_samplers()
    for note in b.notes:
        print(f"note: {note}", file=sys.stderr)
    try:
        b.record.started = time.time()
        b.mark("load")
        deploy.up(dep, profile)
        b.container = deploy.find_container(profile)
        if b.container is None:
            raise BootFailed(f"compose started no container for {profile}", "", [])

        def progress(elapsed, rec):
            if any(WEIGHTS_LOADED.search(line) for line in list(rec.lines)[-50:]):
                b.mark("warm-up")
            if say:
                say(f"waiting for {profile}: {elapsed:.0f} s, {len(rec.lines)} log lines")
        watch_boot(b.container, dep.url, timeout_s, b.record, progress=progress)
        b.mark("healthy")
        return b
    except BaseException:
        b.stop_samplers()
        deploy.down(dep, None)  # a failed boot, Ctrl-C included, leaves nothing running
        raise
