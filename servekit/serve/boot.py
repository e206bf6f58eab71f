"""One boot: the profile's prepare step run first with its lines shown (a download is not the boot's time), the samplers
started before the container (their first sample is the baseline), the profile started on its engine and watched to
healthy, its phases marked from what the watcher sees (`load` from the start, `warm-up` once the weights are in
memory, `traffic` when the caller starts sending requests); `up` and `run` share it."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field

from servekit.engines import EngineError, Server
from servekit.engines.deployment import Deployment
from servekit.errors import BootFailed
from servekit.gpu import NvmlSampler, NvmlUnavailable
from servekit.output import Say, as_output
from servekit.serve import deploy
from servekit.serve.watch import BootRecord, milestone, watch_boot
from servekit.wsl2.shared_usage import SharedUsageSampler, SharedUsageUnavailable


class ContainerMemory(threading.Thread):
    """The server's memory use about once a second (docker stats, or its process group's): the curve when there is
    no GPU."""

    def __init__(self, server: Server, started: float) -> None:
        super().__init__(daemon=True, name="container-memory")
        self.server, self.started = server, started
        self.t: list[float] = []
        self.used: list[int] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            for usage in self.server.memory():
                self.t.append(round(time.time() - self.started, 3))
                self.used.append(usage)
                if self.stopped.is_set():
                    return
        except Exception:  # the container is gone: the series ends there
            return


class BootInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (a `timeout`) while a profile booted, with how far it got: a run's report says it."""

    def __init__(self, elapsed_s: float, last_lines: list[str]) -> None:
        super().__init__(f"interrupted {elapsed_s:.0f} s into the boot")
        self.last_lines = last_lines


class Stopped(Exception):
    """The run was told to stop (Ctrl-C on a fleet run): the boot in this thread takes its profile down."""


WEIGHTS_LOADED = re.compile(r"Model loading took|Loading weights took|Loading model weights took")
PREPARE_SAID = re.compile(r"prepare: ")  # prepare's own lines (the hub client's warnings stay in its log)
# What prepare says of its work (servekit/image/hub.py and convert.py write these lines; test_deploy holds the two)
DOWNLOADED = re.compile(r"prepare: .+: downloaded ([\d.]+) GB in ([\d.]+) s")
CONVERTED = re.compile(r"prepare: .+ to int8 in ([\d.]+) s")


def prepare_figures(lines: list[str]) -> dict[str, float]:
    """The download's GB and seconds, and the conversions' seconds, from prepare's lines (zeros where it had
    nothing to do: the model was in place)."""
    downloads = [m.groups() for m in map(DOWNLOADED.search, lines) if m]
    conversions = [m[1] for m in map(CONVERTED.search, lines) if m]
    return {"download_gb": round(sum(float(gb) for gb, _ in downloads), 2),
            "download_s": round(sum(float(s) for _, s in downloads), 1),
            "conversion_s": round(sum(map(float, conversions)), 1)}


@dataclass
class Boot:
    dep: Deployment
    profile: str
    record: BootRecord = field(default_factory=lambda: BootRecord(started=time.time()))
    gpu: NvmlSampler | None = None
    shared: SharedUsageSampler | None = None
    server: Server | None = None  # the profile's server, once its engine has started it
    container_memory: ContainerMemory | None = None
    notes: list[str] = field(default_factory=list)
    phases: list[tuple[str, float]] = field(default_factory=list)  # (name, seconds since the boot started)
    prepare: dict[str, float] = field(default_factory=dict)  # prepare's figures (prepare_figures), before the boot

    def mark(self, phase: str) -> None:
        """Phase `phase` starts now. Traffic and its end first wait (bounded) for two fresh Shared Usage samples,
        so the level the first request met, and the level the traffic left, are read, not a sample from before."""
        if phase in dict(self.phases):
            return
        if self.shared and phase in ("traffic", "end"):
            limit = self.shared.fresh_level_timeout()
            if not self.shared.wait_for_samples(2, limit):
                self.notes.append(f"Shared Usage: no fresh sample at the start of {phase} within {limit:.0f} s")
        self.phases.append((phase, round(time.time() - self.record.started, 3)))
        if self.gpu:
            self.gpu.mark(phase)

    def end_traffic(self) -> dict | None:
        """Close the traffic phase (`end`) and give the Shared Usage figures so far: what the spill check judges."""
        self.mark("end")
        return self.shared_summary()

    def shared_summary(self) -> dict | None:
        if not self.shared:
            return None
        host = self.dep.matrix.hosts.get(self.dep.host) if self.dep.matrix else None
        return self.shared.summary(host.adapter if host else None, phases=self.phases, origin=self.record.started)

    def start_samplers(self) -> None:
        if not self.dep.engine.same_machine:  # NVML and Get-Counter read this machine, not the engine's
            self.notes.append(f"GPU memory and Shared Usage not sampled: engine {self.dep.engine.given} is on "
                              "another machine (the container's memory from docker stats is plotted)")
            return
        try:
            card = self.dep.card
            self.gpu = NvmlSampler(card=(f"{card.card} (emulated)", card.cap_bytes) if card else None)
            self.gpu.start()
        except NvmlUnavailable as exc:
            self.notes.append(f"GPU memory not sampled: {exc}")
        if self.dep.host == "wsl2":
            try:
                self.shared = SharedUsageSampler().start()
                if not self.shared.wait_for_samples(1, 20):
                    self.notes.append("Shared Usage: Get-Counter gave no sample within 20 s")
            except SharedUsageUnavailable as exc:
                self.notes.append(f"Shared Usage not sampled: {exc}")

    def stop_samplers(self) -> None:
        if self.container_memory:
            self.container_memory.stopped.set()
        if self.gpu:
            self.gpu.stop()
        if self.shared:
            self.shared.stop()

    def memory(self) -> dict:
        """The figures for the report: GPU summaries with phases, Shared Usage with its series."""
        gpus = self.gpu.summary() if self.gpu else []
        # on an emulated card, the card's use, as the summary counts it
        series = [{"t": s.times, "used": [u - s.idle for u in s.used]} for s in self.gpu.series] if self.gpu else []
        shared = self.shared_summary()
        cm = self.container_memory
        container = {"peak_bytes": max(cm.used), "samples": len(cm.used)} if cm and cm.used else None
        said = [f"Shared Usage: {error}" for error in (self.shared.errors if self.shared else [])]
        return {"gpus": gpus, "gpu_series": series, "shared_usage": shared, "phases": self.phases,
                "container": container, "container_series": {"t": cm.t, "used": cm.used} if cm else None,
                "notes": self.notes + said}


def boot(dep: Deployment, profile: str, timeout_s: float, say: Say | None = None, knobs: dict | None = None,
         stop: threading.Event | None = None) -> Boot:
    """Start the samplers, then the profile, and watch it to healthy; on any failure take it down.

    `knobs` are set in the environment of this boot's compose only (it passes them to the launcher);
    `stop`, when set, ends the wait with Stopped (a Ctrl-C reaches only the main thread)."""
    out = as_output(say)
    b = Boot(dep, profile)
    try:
        began = time.time()
        try:
            lines = deploy.prepare(dep, profile, knobs, on_line=lambda line: out(line) if PREPARE_SAID.match(line)
                                   else None)
        except EngineError as exc:
            raise BootFailed(f"compose up failed: {exc.reason}", "", exc.output) from None
        b.prepare = {**prepare_figures(lines), "total_s": round(time.time() - began, 1)}
        # The samplers start with the boot, not before a download: their first samples are the level the server
        # starts from (Shared Usage's baseline), however long prepare took.
        b.start_samplers()
        for line in b.notes:
            out.note(line)
        b.record.started = time.time()  # the boot begins with the model in place: a download is not its time
        b.mark("load")
        try:
            started = deploy.up(dep, profile, knobs)
        except EngineError as exc:  # a port in use, a missing image, an engine that went away
            last = exc.reason
            if "could not select device driver" in last:  # the engine has no way to give it a GPU
                last = f"no GPU: the engine has no NVIDIA runtime ({last.strip()})"
            raise BootFailed(f"compose up failed: {last}", "", exc.output) from None
        b.server = started or deploy.find_server(profile, dep.engine)
        if b.server is None:
            raise BootFailed(f"compose started no container for {profile}", "", [])
        b.container_memory = ContainerMemory(b.server, b.record.started)
        b.container_memory.start()

        def progress(elapsed: float, rec: BootRecord) -> None:
            if stop and stop.is_set():
                raise Stopped(f"stopped while {profile} was booting")
            if any(WEIGHTS_LOADED.search(line) for line in list(rec.lines)[-50:]):
                b.mark("warm-up")
            out.progress(f"{profile} booting, {elapsed:.0f} s: {milestone(rec.lines) or f'{len(rec.lines)} log lines'}")
        watch_boot(b.server, dep.url, timeout_s, b.record, progress=progress)
        b.mark("healthy")
        return b
    except BaseException as exc:
        elapsed, last_lines = time.time() - (b.record.started or time.time()), list(b.record.lines)[-12:]
        b.stop_samplers()
        ended: BaseException = exc
        try:
            deploy.down(dep, profile)  # a failed boot, Ctrl-C included, leaves nothing of its own running
        except Exception as down_failed:  # the boot's own failure is the one to report; this one rides along
            exc.add_note(f"taking {profile} down afterwards failed too: {down_failed}")
        except KeyboardInterrupt:  # a signal while taking it down (a `timeout` after the boot's own): stop
            ended = KeyboardInterrupt()
        if isinstance(ended, KeyboardInterrupt):
            ended = BootInterrupted(elapsed, last_lines)
            if ended is not exc and not isinstance(exc, KeyboardInterrupt):
                ended.add_note(f"after the boot had failed: {exc}")
        # The boot's log and memory up to the end, whatever ended it: a refused or interrupted boot's budget and
        # peak are what its report is for.
        ended.boot = b  # type: ignore[attr-defined]
        if ended is exc:
            raise
        raise ended from None
