"""The files servekit writes and later trusts, as typed models: run reports, sweep reports, fleet
summaries and release manifests. Each carries its kind and schema version; every writer validates
through its model and every reader goes through `load`, which refuses a file of another kind or
version in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal, NotRequired, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator, with_config
from typing_extensions import TypedDict  # pydantic validates typing's TypedDict only from Python 3.12

from servekit.errors import UserError
from servekit.image import boundary
from servekit.image.boundary import Refused, read_text, write_text_atomic
from servekit.smoke import Result, all_passed

SCHEMA_VERSION = 1


FIGURES = ConfigDict(extra="forbid", allow_inf_nan=False)  # a record's numbers are finite: NaN compares to nothing


class Record(BaseModel):
    model_config = FIGURES


class Document(Record):
    """A file of its own: what kind it is and which schema version wrote it."""
    schema_version: Literal[1] = 1  # SCHEMA_VERSION: a Literal takes the number itself


# --- a run -----------------------------------------------------------------------------------------

# Memory in bytes, any card's with room to spare, never past what a float holds (reports divide it into GiB).
Bytes = Annotated[int, Field(ge=-(2**62), le=2**62)]
Count = Annotated[int, Field(ge=0, le=2**62)]


@with_config(FIGURES)
class GpuPhaseMemory(TypedDict):
    start_s: float
    end_s: float
    peak_used_bytes: Bytes | None
    min_margin_bytes: Bytes | None


@with_config(FIGURES)
class EmulatingGpu(TypedDict):
    name: str
    total_bytes: Bytes
    idle_used_bytes: NotRequired[Bytes]
    cuda_arch: NotRequired[str]


@with_config(FIGURES)
class GpuMemory(TypedDict):
    """One GPU over a run (servekit.gpu.GpuSeries.summary): on an emulated card, the card's figures."""
    index: Count
    name: str
    total_bytes: Bytes
    samples: Count
    peak_used_bytes: Bytes | None
    min_margin_bytes: Bytes | None
    end_used_bytes: NotRequired[Bytes | None]
    phases: NotRequired[dict[str, GpuPhaseMemory]]
    not_supported: NotRequired[list[str]]
    emulated_on: NotRequired[EmulatingGpu]


@with_config(FIGURES)
class ContainerMemory(TypedDict):
    peak_bytes: Bytes | None
    samples: Count


@with_config(FIGURES)
class SharedPhase(TypedDict):
    start_s: float | None
    end_s: float | None
    samples: Count
    first_bytes: Bytes | None
    peak_bytes: Bytes | None
    last_bytes: Bytes | None
    peak_dedicated_bytes: Bytes | None


@with_config(FIGURES)
class SharedUsageNotRead(TypedDict):
    adapter: None
    chosen_because: str


@with_config(FIGURES)
class SharedUsageRead(TypedDict):
    """WSL2's Shared Usage of the adapter read (servekit.wsl2.shared_usage.summarize, less its series)."""
    adapter: str
    adapter_name: str | None
    chosen_because: str
    samples: Count
    baseline_bytes: Bytes
    peak_bytes: Bytes
    end_bytes: Bytes
    peak_dedicated_bytes: Bytes | None
    phases: dict[str, SharedPhase]
    adapters: dict[str, dict[str, Bytes | str | None]]
    traffic_start_bytes: NotRequired[Bytes | None]
    traffic_end_bytes: NotRequired[Bytes | None]
    traffic_peak_bytes: NotRequired[Bytes | None]
    traffic_rise_bytes: NotRequired[Bytes | None]


@with_config(FIGURES)
class ForcedKernel(TypedDict):
    variable: str
    value: str
    why: str


@with_config(FIGURES)
class CardUsed(TypedDict):
    """The card emulated on the GPU (servekit.engines.card.Emulation.to_json)."""
    card: str
    description: str
    total_bytes: Bytes
    cap_bytes: NotRequired[Bytes]
    cuda_arch: str
    emulated_on: EmulatingGpu
    forced: list[ForcedKernel]


class ImageUsed(Record):
    tag: str
    id: str | None = None
    arrived: str | None = None  # how it reached the engine: already there, pulled, sent
    left_out: list[str] = []  # the series' patches its build left out (--without): to measure them by, never released


class BootFigures(Record):
    time_to_healthy_s: float | None = None
    kv_pool_tokens: Count | None = None
    detection_lag_s: float | None = None
    phases: list[tuple[str, float]] = []
    budget: dict[str, Bytes | float | str] = {}  # vLLM's memory budget from the boot's log (records/budget.py), as far as it got
    compile_cache: str | None = None  # warm or cold: torch.compile's graphs loaded from the cache volume, or compiled
    prepare: dict[str, float] = {}  # before the boot, not in its time: download_gb, download_s, conversion_s, total_s


class Memory(Record):
    gpus: list[GpuMemory] = []
    shared_usage: SharedUsageRead | SharedUsageNotRead | None = None
    container: ContainerMemory | None = None


class RunReport(Document):
    kind: Literal["run"] = "run"
    run_id: str
    created: str
    profile: str
    target: str
    host: str
    engine: str = "local"
    served_from: Literal["image", "environment"] = "image"  # the engine's word, written at run time
    url: str
    image: ImageUsed
    stand_in: str | None = None  # the matrix model served in the target's model's place (its checks applied)
    card: CardUsed | None = None  # the card emulated on the GPU (--card)
    pins: dict[str, str]
    knobs: dict[str, str] = {}
    boot: BootFigures = BootFigures()
    source_budget: dict[str, Bytes | float | str] | None = None  # the source's figures for this profile and host (images.yaml)
    memory: Memory = Memory()
    checks: list[Result] = []
    passed: bool = False  # set from the checks, by the one rule (smoke.all_passed)
    notes: list[str] = []

    @model_validator(mode="before")
    @classmethod
    def _served_from_before_it_was_written(cls, doc: Any) -> Any:
        # reports written before the field: only the process engine (`venv:PATH`) served an environment
        if isinstance(doc, dict) and "served_from" not in doc and str(doc.get("engine", "")).startswith("venv:"):
            return {**doc, "served_from": "environment"}
        return doc

    @field_validator("checks", mode="before")
    @classmethod
    def _skipped_is_not_run(cls, value: Any) -> Any:  # reports written before the three outcomes said "skipped" for "not run"
        return [{**c, "status": "not_run"} if isinstance(c, dict) and c.get("status") == "skipped" else c
                for c in value] if isinstance(value, list) else value

    @property
    def gate_passes(self) -> bool:
        """Passed by today's rule: every check passed or was not required (an older report's word is not taken)."""
        return self.passed and all_passed(c.status for c in self.checks)


# --- a sweep and a fleet run --------------------------------------------------------------------------

class Table(Record):
    header: list[str]
    rows: list[list[Any]]


class SweepCell(Record):
    knobs: dict[str, str]
    boots: list[dict[str, Any]]


class SweepReport(Document):
    kind: Literal["sweep"] = "sweep"
    title: str
    profile: str
    target: str
    host: str
    image: str
    boots_per_cell: int = Field(ge=1)
    interrupted: bool
    advice: str | None = None
    cells: list[SweepCell]
    table: Table
    notes: list[str] = []


class FleetEngine(Record):
    engine: str
    label: str
    url: str
    port: int
    passed: bool
    error: str | None = None
    reports: list[str] = []


class FleetSummary(Document):
    kind: Literal["fleet"] = "fleet"
    passed: bool
    engines: list[FleetEngine]
    table: Table


# --- a release --------------------------------------------------------------------------------------

class ProfileGate(Record):
    report: str  # the report that proves the profile works (its checks below)
    passed: bool
    run_id: str
    checks: dict[str, str]
    size_report: str | None = None  # a GPU target's: the report that proves it fits its 24 GB card at full size


DIGEST = r"^sha256:[0-9a-f]{64}$"
# A pattern's meaning, for the error line a reader gets instead of the pattern.
PATTERN_WORDS = {DIGEST: "sha256: and 64 hex digits",
                 f"^{boundary.REPOSITORY.pattern}$": "a repository HOST[:PORT]/path, of lowercase letters and digits",
                 f"^{boundary.TAG.pattern}$": "a tag of letters, digits, '.', '_' and '-' (at most 128)"}


class SbomRecord(Record):
    """Where a release's SBOM lives: an OCI referrer of the released image (an artifact manifest whose subject is its
    digest) in the same repository, listed by the registry's referrers API or, where it has none, by the referrers
    tag; the document's hash."""
    registry_digest: str = Field(pattern=DIGEST)  # the artifact's manifest
    referrers_tag: str | None = Field(default=None, pattern=r"^sha256-[0-9a-f]{64}$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    media_type: str


class ReleaseRecord(Record):
    """One target's release: what was pushed where. Every name is checked here, where the manifest is read, since
    `--verify` asks the registry for them and `render` writes them into a Deployment."""
    target: str = Field(pattern=r"^[a-z][a-z0-9-]{0,39}$")
    repository: str = Field(pattern=f"^{boundary.REPOSITORY.pattern}$")
    tags: list[Annotated[str, Field(pattern=f"^{boundary.TAG.pattern}$")]] = Field(min_length=1)
    registry_digest: str = Field(pattern=DIGEST)
    image_id: str = Field(pattern=DIGEST)
    content_digest: str = Field(pattern=r"^[0-9a-f]{12,64}$")
    pins: dict[str, str]
    lock: dict[str, str | None] = {}  # {"file": docker/locks/..., "sha256": ...}: every package the image holds
    series: dict[str, str] = {}  # patch file -> sha256:...
    components: dict[str, str] = {}  # name -> its source digest, or "absent"
    smoke: dict[str, ProfileGate]
    # profile -> what it serves: {"model": "repo@revision", "drafter": "repo@revision"} (revision "main" = unpinned)
    models: dict[str, dict[str, str]] = {}
    revision: str | None = None  # the commit it was released from (not a label: a label would make builds differ)
    sbom: SbomRecord | None = None  # its SBOM, pushed beside it

    @field_validator("series", mode="before")
    @classmethod
    def _names_only(cls, value: Any) -> Any:  # a manifest written before the series carried hashes listed names only
        return {name: "" for name in value} if isinstance(value, list) and all(isinstance(n, str) for n in value) \
            else value


class ReleaseManifest(Document):
    kind: Literal["release"] = "release"
    version: str
    targets: dict[str, ReleaseRecord] = Field(min_length=1)  # a manifest is written after a target's pushes
    updated: str | None = None

    @model_validator(mode="after")
    def _each_under_its_own_name(self) -> ReleaseManifest:
        if wrong := [name for name, record in self.targets.items() if record.target != name]:
            raise ValueError(f"targets.{wrong[0]} holds the release of {self.targets[wrong[0]].target}")
        return self


KINDS: dict[str, type[Document]] = {"run": RunReport, "sweep": SweepReport, "fleet": FleetSummary,
                                    "release": ReleaseManifest}


MAX_RECORD_BYTES = 64 << 20  # a report with every check's figures is some KB; a sweep's table some hundred
MAX_RECORD_DEPTH = 16  # a report nests about six levels (checks, figures, per-GPU samples)


def _depth(doc: Any) -> int:
    """How deep `doc` nests, walked without recursion (a hostile file must not exhaust the stack here either)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_RECORD_DEPTH:
                stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


class OtherKind(UserError):
    """A servekit file of another kind than the one asked for (a sweep's report among the runs'): not broken."""


D = TypeVar("D", bound=Document)


def load(path: Path, model: type[D]) -> D:
    """The file at `path` as `model`, or a UserError in one line saying what it is instead."""
    wanted = model.model_fields["kind"].default
    try:
        doc = json.loads(read_text(path, MAX_RECORD_BYTES))
    except Refused as exc:
        raise UserError(f"{exc}; expected a {wanted} file") from None
    except ValueError as exc:
        raise UserError(f"{path}: not a {wanted} file: not JSON ({exc})") from None
    except RecursionError:
        raise UserError(f"{path}: not a {wanted} file: JSON nested deeper than any servekit record") from None
    if _depth(doc) > MAX_RECORD_DEPTH:
        raise UserError(f"{path}: not a {wanted} file: nested deeper than any servekit record ({MAX_RECORD_DEPTH} "
                        "levels)")
    if isinstance(doc, dict) and "kind" not in doc and model is ReleaseManifest and {"version", "targets"} <= set(doc):
        doc = {**doc, "kind": "release", "schema_version": SCHEMA_VERSION}  # written before files said their kind
    if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str) or doc["kind"] not in KINDS:
        raise UserError(f"{path}: not a servekit file (a JSON object with kind: {', '.join(KINDS)})")
    if doc["kind"] != wanted:
        raise OtherKind(f"{path}: a {doc['kind']} file; this reads {wanted} files")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"{path}: {wanted} schema_version {doc.get('schema_version')!r}; this servekit reads "
                        f"{SCHEMA_VERSION}")
    try:
        return model.model_validate(doc)
    except RecursionError:
        raise UserError(f"{path}: not a {wanted} file: nested deeper than any servekit record") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top)"
        said = PATTERN_WORDS.get(str((first.get("ctx") or {}).get("pattern")))
        what = f"expected {said}, found {repr(first['input'])[:80]}" if said else first["msg"]
        raise UserError(boundary.printable(f"{path}: {where}: {what} ({exc.error_count()} problem(s) in this "
                                           f"{wanted} file)")) from None


def save(path: Path, record: Document) -> Path:
    """Write `record` atomically (a reader never finds it half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, record.model_dump_json(indent=2) + "\n")
    return path
