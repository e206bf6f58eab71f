"""A card of images.yaml emulated on this host's bigger NVIDIA GPU (`--card`): CUDA MPS caps what the server may
allocate at the card's memory, vLLM sizes from the card (the series' emulated-card patch), and the kernels follow
the card where vLLM would pick others on the bigger GPU.

The MPS control daemon is servekit's own: private pipe and log folders, started before the server and asked to
quit after it; the pipe folder is mounted into the container (compose.card.yaml, with `ipc: host`), and the
server's process gets the card's memory as its pinned device-memory limit. The legacy limit counts what the process
allocates, not the context the MPS server holds for it, so the emulation is a few hundred MiB optimistic.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from servekit.config.matrix import Card, Matrix
from servekit.engines.gpuaccess import driver_dir
from servekit.errors import EnvironmentProblem, UserError
from servekit.gpu import GpuInfo, NvmlUnavailable, list_gpus
from servekit.output import Say
from servekit.records.models import CardUsed
from servekit.waiting import until

MPS_CONTROL = "nvidia-cuda-mps-control"
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"  # where compose.card.yaml mounts the daemon's pipe folder
COMPOSE_FILE = "compose.card.yaml"
MPS_DIR_ENV = "SERVEKIT_MPS_DIR"  # where the daemon's pipe/ and log/ folders live (default: a folder in /tmp)
GiB = 2**30
# What the server's own CUDA context takes inside its MPS cap: vLLM found 0.50 GiB less free than the cap at its start
# on both cards a full-size run capped (23.56 -> 23.06 GiB, 22.75 -> 22.25 GiB; an H100, driver 580, 2026-12-06).
# A card whose free memory is given (WSL2) is capped that much above it, so vLLM finds the card's figure free.
CONTEXT_IN_CAP_BYTES = GiB // 2
START_S = 20  # the daemon answers in well under a second when the driver is there
STOP_S = 30


def mps_cap_bytes(total_bytes: int, free_bytes: int | None) -> int:
    """The MPS allocation cap of a card: its memory, whose context the card's total holds too; where the card gives
    what vLLM finds free, that and the context the cap holds. What the run's GPU samples total to."""
    return free_bytes + CONTEXT_IN_CAP_BYTES if free_bytes else total_bytes


@dataclass(frozen=True)
class Forced:
    variable: str
    value: str
    why: str


@dataclass(frozen=True)
class Emulation:
    card: str
    description: str
    total_bytes: int
    cuda_arch: str
    gpu_name: str
    gpu_total_bytes: int
    gpu_arch: str
    mps_dir: Path
    forced: tuple[Forced, ...] = ()
    free_bytes: int | None = None  # what vLLM finds free at its start where the card shows less than its total (WSL2)

    @property
    def cap_bytes(self) -> int:
        return mps_cap_bytes(self.total_bytes, self.free_bytes)

    @property
    def pipe_dir(self) -> Path:
        return self.mps_dir / "pipe"

    def compose_env(self) -> dict[str, str]:
        """What compose.card.yaml reads (servekit's block of compose/.env, so a plain `docker compose` agrees)."""
        forced = {f.variable: f.value for f in self.forced}
        return {"SERVEKIT_CARD": self.card, "SERVEKIT_CARD_BYTES": str(self.total_bytes),
                "SERVEKIT_CARD_MIB": str(self.cap_bytes // 2**20), "SERVEKIT_MPS_PIPE_DIR": str(self.pipe_dir),
                **{compose_variable(v): forced.get(v, "") for v in FORCED_VARIABLES}}

    def to_json(self) -> CardUsed:
        return {"card": self.card, "description": self.description, "total_bytes": self.total_bytes,
                "cap_bytes": self.cap_bytes,
                "cuda_arch": self.cuda_arch, "emulated_on": {"name": self.gpu_name, "total_bytes": self.gpu_total_bytes,
                                                             "cuda_arch": self.gpu_arch},
                "forced": [{"variable": f.variable, "value": f.value, "why": f.why} for f in self.forced]}

    def said(self) -> str:
        forced = "; forced: " + "; ".join(f"{f.variable}={f.value} ({f.why})" for f in self.forced) if self.forced \
            else "; no kernel forced (vLLM picks on this GPU what it picks on the card)"
        free = f", {self.free_bytes / GiB:.2f} GiB of it free" if self.free_bytes else ""
        return (f"card {self.card} ({self.total_bytes / GiB:.2f} GiB{free}, sm_{self.cuda_arch.replace('.', '')}) "
                "emulated on "
                f"{self.gpu_name} ({self.gpu_total_bytes / GiB:.2f} GiB, sm_{self.gpu_arch.replace('.', '')}) by CUDA "
                f"MPS{forced}")


# What forced_kernels may set, each passed by compose.card.yaml from its compose_variable (empty: vLLM's choice).
FORCED_VARIABLES = ("VLLM_DISABLED_KERNELS", "VLLM_FLASH_ATTN_VERSION", "VLLM_GDN_PREFILL_BACKEND",
                    "VLLM_FLASHINFER_Q_QUANTIZATION", "VLLM_FLASHINFER_AUTOTUNE")


def compose_variable(variable: str) -> str:
    return "SERVEKIT_CARD_" + variable.removeprefix("VLLM_")


def forced_kernels(card_arch: str, gpu_arch: str) -> tuple[Forced, ...]:
    """The settings that make vLLM pick, on a GPU of `gpu_arch`, the kernels it picks on a card of `card_arch`, and
    skip the warm-up steps that card never runs."""
    card, gpu = int(card_arch.split(".")[0]), int(gpu_arch.split(".")[0])
    if card >= 9 or gpu < 9:
        return ()
    return (Forced("VLLM_DISABLED_KERNELS", "MacheteLinearKernel", "Marlin rather than Machete for W4A16: Machete "
                   "is Hopper's, Marlin what a card before Hopper runs"),
            Forced("VLLM_FLASH_ATTN_VERSION", "2", "FlashAttention 2 rather than 3: 3 is Hopper's"),
            Forced("VLLM_GDN_PREFILL_BACKEND", "triton", "FLA's GDN prefill rather than FlashInfer's: FlashInfer's is "
                   "Hopper's and Blackwell's (its buffers in the worst prefill step are not a 3090's)"),
            Forced("VLLM_FLASHINFER_Q_QUANTIZATION", "0", "FlashInfer's prefill with 16-bit queries beside an FP8 KV "
                   "cache (FA2) rather than FP8 queries (FA3): FA3 is Hopper's"),
            Forced("VLLM_FLASHINFER_AUTOTUNE", "0", "no FlashInfer autotune: vLLM runs it on Hopper and later only, "
                   "after the KV cache is allocated"))


def mps_control() -> Path | None:
    """The MPS control program: on PATH, else in the driver's folder (SERVEKIT_DRIVER_DIR)."""
    found = shutil.which(MPS_CONTROL)
    if found:
        return Path(found)
    candidate = driver_dir() / "bin" / MPS_CONTROL
    return candidate if os.access(candidate, os.X_OK) else None


def mps_dir() -> Path:
    return Path(os.environ.get(MPS_DIR_ENV) or Path(tempfile.gettempdir()) / f"servekit-mps-{os.getuid()}")


def card_spec(matrix: Matrix, card: str) -> Card:
    """images.yaml's card `card`, or a one-line refusal naming those there are."""
    if card not in matrix.cards:
        raise UserError(f"--card {card}: expected one of {', '.join(matrix.cards)} (images.yaml cards)")
    return matrix.cards[card]


def plan(matrix: Matrix, card: str, gpu: GpuInfo) -> Emulation:
    """The emulation of `card` on `gpu` (servekit.gpu.GpuInfo with its compute capability), or a one-line refusal."""
    spec = card_spec(matrix, card)
    if spec.total_bytes > gpu.total_bytes:
        raise UserError(f"--card {card}: its {spec.memory_gib} GiB is more than this GPU's "
                        f"({gpu.name}, {gpu.total_bytes / GiB:.2f} GiB); a card is emulated on a bigger GPU only")
    if mps_control() is None:
        raise EnvironmentProblem(f"--card {card}: this host has no {MPS_CONTROL} (CUDA MPS, which caps the server's "
                                 f"memory at the card's), on PATH or in {driver_dir()}/bin; set SERVEKIT_DRIVER_DIR "
                                 "to the driver's folder")
    return Emulation(card, spec.description, spec.total_bytes, spec.cuda_arch, gpu.name, gpu.total_bytes,
                     gpu.cuda_arch, mps_dir(), forced_kernels(spec.cuda_arch, gpu.cuda_arch), spec.free_bytes)


class MpsDaemon:
    """servekit's MPS control daemon, by its pipe folder: started when none answers there, asked to quit after."""

    def __init__(self, folder: Path, program: Path | None = None) -> None:
        self.folder, self.program = folder, program or mps_control()

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.folder / "pipe"),
                "CUDA_MPS_LOG_DIRECTORY": str(self.folder / "log")}

    def _run(self, args: list[str], timeout: float, command: str | None = None) -> subprocess.CompletedProcess:
        """The control program once, within `timeout`; one that cannot run or never returns is an
        EnvironmentProblem that says which and what to do."""
        try:
            return subprocess.run([str(self.program), *args], input=None if command is None else command + "\n",
                                  env=self.env, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise EnvironmentProblem(f"{self.program} {' '.join(args) or command} did not return in {timeout:g} s; "
                                     f"stop what holds the MPS folder {self.folder} and try again") from None
        except OSError as exc:  # a folder, no execute permission, not a program of this machine
            raise EnvironmentProblem(f"{self.program} cannot run ({exc.strerror}); set SERVEKIT_DRIVER_DIR to the "
                                     f"driver's folder, whose bin/ holds {MPS_CONTROL}") from None

    def _ask(self, command: str, timeout: float = 10) -> subprocess.CompletedProcess:
        return self._run([], timeout, command)

    def answers(self) -> bool:
        if not (self.folder / "pipe" / "control").exists():
            return False
        try:
            return self._ask("get_server_list", timeout=5).returncode == 0
        except EnvironmentProblem:  # a daemon that does not answer in time is no daemon to use
            return False

    def _folders(self) -> None:
        """pipe/ and log/, each writable by the server the daemon starts as the container's user (1777, as /tmp)."""
        for path in (self.folder, self.folder / "pipe", self.folder / "log"):
            try:
                path.mkdir(mode=0o755, exist_ok=True)
                info = path.lstat()
            except OSError as exc:  # a file in its place, a parent that is missing or not ours
                raise EnvironmentProblem(f"the MPS folder {path}: {exc.strerror}; set {MPS_DIR_ENV} to a folder of "
                                         "your own whose parent exists") from None
            if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                raise EnvironmentProblem(f"{path} is a link, not a folder or not yours: remove it, or set "
                                         f"{MPS_DIR_ENV} to a folder of your own")
        for path in (self.folder / "pipe", self.folder / "log"):
            path.chmod(0o1777)

    def start(self, say: Say = print) -> bool:
        """Start the daemon unless one answers at this folder; True when this call started it."""
        if self.answers():
            return False
        self._folders()
        say(f"card: starting the MPS control daemon ({self.folder / 'pipe'}, up to {START_S} s)")
        started = self._run(["-d"], START_S)
        if started.returncode != 0:
            raise EnvironmentProblem(f"{self.program} -d failed ({started.returncode}): "
                                     f"{(started.stderr or started.stdout).strip()[:300]}")
        if not until(self.answers, START_S, 0.2):
            raise EnvironmentProblem(f"the MPS control daemon did not answer at {self.folder / 'pipe'} in {START_S} s "
                                     f"(its log: {self.folder / 'log' / 'control.log'})")
        say("card: MPS control daemon started")
        return True

    def stop(self, say: Say = print) -> None:
        if not self.answers():
            return
        say(f"card: asking the MPS control daemon to quit (up to {STOP_S} s)")
        self._ask("quit")
        if not until(lambda: not self.answers(), STOP_S, 0.2):
            raise EnvironmentProblem(f"the MPS control daemon at {self.folder / 'pipe'} did not quit in {STOP_S} s")
        say("card: MPS control daemon stopped")


def doctor_line(matrix: Matrix) -> tuple[bool, str]:
    """Whether this host can emulate the cards of images.yaml, and why."""
    try:
        gpus = list_gpus()
    except NvmlUnavailable as exc:
        return False, f"no: {exc}"
    if not gpus:
        return False, "no: NVML lists no GPU"
    gpu, program = gpus[0], mps_control()
    fits = [name for name, c in matrix.cards.items() if c.total_bytes <= gpu.total_bytes]
    if program is None:
        return False, f"no: no {MPS_CONTROL} on PATH or in {driver_dir()}/bin"
    if not fits:
        return False, f"no: {gpu.name} ({gpu.total_bytes / GiB:.1f} GiB) is no bigger than any card"
    return True, f"yes: {', '.join(fits)} on {gpu.name} ({gpu.total_bytes / GiB:.1f} GiB) by CUDA MPS ({program})"
