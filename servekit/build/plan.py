"""Targets to build steps: what each image bakes in, its content digest and the tag.

The digest covers everything the image holds, by construction: the facts written into the image
(build-info.json: pins, base and how it is made, pins left out, series, components, the archs
verify compiles for), the rendered profiles (profiles.json: every knob, host default and env),
every repository file the build context carries, and the code that writes its SBOM. An image already tagged with that digest
is not built again; anything it bakes that changes gives a new tag.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from servekit.build.bases import definition_digest
from servekit.build.locks import LAYERS, lock_file
from servekit.build.reproducible import CANONICAL_FORMAT
from servekit.config.matrix import Matrix
from servekit.config.profiles import render_profiles
from servekit.config.session import Session
from servekit.config.settings import BuildSettings
from servekit.image.series import SeriesError, read_series
from servekit.layout import IMAGE_CODE

# What the build writes into each target's folder under STAGE_DIR before it starts (inputs staged from images.yaml and
# the repository): the builder writes exactly these, the Dockerfile copies them; a test reads the Dockerfile against
# this list.
STAGED_FILES = (*(f"requirements-{layer}.txt" for layer in LAYERS), "patches", "components", "model", "profiles.json",
                "build-info.json", "sbom.cdx.json")
# Files of this repository that shape every image besides that folder and what the build stages.
# The Dockerfile, what the context holds, and the code that writes the SBOM the image carries (sbom.cdx.json): a
# change to how it is written is a change to the image.
COMMON_INPUTS = ("docker/Dockerfile", ".dockerignore", "servekit/build/sbom.py")
# What build-info's `omitted` says of a patch of the series left out (--without): the release refuses such an image.
PATCH_LEFT_OUT = "left out of the series to measure what it does: the image behaves as released vLLM does there"


@dataclass
class TargetPlan:
    target: str
    base_name: str
    base: str  # the image reference it starts FROM
    base_made_here: bool
    python: str
    pins: dict[str, str]  # what is installed: the target's pins less those left out
    omitted: dict[str, str]  # pin -> what the image does without it
    digest: str
    tag: str
    exists: bool | None  # None: no engine to ask
    components: dict[str, str] = field(default_factory=dict)  # name -> present | absent
    unavailable_profiles: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    build_info: dict = field(default_factory=dict)  # written into the image as build-info.json
    profiles: dict = field(default_factory=dict)  # written into the image as profiles.json

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def notes(self) -> list[str]:
        return [f"{name} left out: {what}" for name, what in self.omitted.items()]

    @property
    def patches_left_out(self) -> list[str]:
        """The series' patches (NAME.patch) this build leaves out (--without)."""
        return [name for name in self.omitted if name.endswith(".patch")]


def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return []


def build_inputs(matrix: Matrix, target: str, root: Path, python: str) -> list[Path]:
    spec = matrix.targets[target]
    paths = [root / p for p in COMMON_INPUTS] + _files_under(root / IMAGE_CODE)
    paths.append(root / lock_file(target, python))  # what the image installs, every package hash-checked
    model = matrix.models[spec.model]
    if model.source == "generated" and model.dir:
        paths += _files_under(root / model.dir)
    paths += _files_under(root / matrix.series.dir)
    for name in spec.components:
        paths += _files_under(root / matrix.components[name].source)
    return [p for p in paths if p.is_file()]


def component_states(matrix: Matrix, target: str, root: Path) -> dict[str, str]:
    return {name: ("present" if (root / matrix.components[name].source).is_dir() else "absent")
            for name in matrix.targets[target].components}


def unavailable_profiles(matrix: Matrix, target: str, states: dict[str, str]) -> list[str]:
    """Profiles on this target that need a component whose source is absent."""
    absent = {n for n, s in states.items() if s == "absent"}
    return [name for name, p in matrix.profiles.items() if target in p.targets and absent & set(p.components)]


def installed_pins(matrix: Matrix, target: str, settings: BuildSettings) -> dict[str, str]:
    """What the target installs: its pins less those this machine leaves out (--without)."""
    omitted = settings.omitted(matrix, target)
    return {dist: v for dist, v in matrix.target_pins(target).items() if matrix.pin_key(target, dist) not in omitted}


def build_facts(matrix: Matrix, target: str, root: Path, settings: BuildSettings) -> dict:
    """What the image is, as build-info.json records it inside the image (less its digest and tag)."""
    spec = matrix.targets[target]
    base_name = settings.base_for(matrix, target)
    pins_left_out = settings.omitted(matrix, target)
    pins = installed_pins(matrix, target, settings)
    try:
        applying = [p.name for p in read_series(root / matrix.series.dir) if p.applies_to(target)]
    except SeriesError:  # reported by the build's preflight, in one line
        applying = []
    series = [name for name in applying if not settings.leaves_out_patch(name)]
    omitted = {**{name: matrix.may_omit[name] for name in pins_left_out},
               **{name: PATCH_LEFT_OUT for name in applying if settings.leaves_out_patch(name)}}
    archs = sorted({matrix.cards[h.card].cuda_arch for h in matrix.hosts.values() if h.card}) if spec.gpu else []
    lock = root / lock_file(target, matrix.bases[base_name].python)
    return {"target": target, "vllm": matrix.vllm, "image": matrix.image.name, "pins": pins,
            # what the image's labels say of it (builder.labels): a new description is a new image
            "about": matrix.image.model_dump(include={"title", "description", "licenses", "source"}),
            "epoch": matrix.image.source_date_epoch, "canonical_format": CANONICAL_FORMAT,
            "omitted": omitted,
            "base": {"name": base_name, **matrix.bases[base_name].model_dump(),
                     **({"made": definition_digest(matrix.bases[base_name])} if matrix.bases[base_name].debootstrap
                        else {})},
            # what only the host reads of a stand-in (which folder may be served in a model's place): not the image's
            "model": matrix.models[spec.model].model_dump(exclude={"stands_in_for", "not_required"}),
            "gpu": spec.gpu, "cuda_archs": archs,
            "boot_imports": spec.boot_imports,
            "lock": {"file": lock.relative_to(root).as_posix(),
                     "sha256": hashlib.sha256(lock.read_bytes()).hexdigest() if lock.is_file() else None},
            "series": series, "components": component_states(matrix, target, root),
            "component_checks": {name: matrix.components[name].checks for name in spec.components}}


def content_digest(facts: dict, profiles: dict, inputs: list[Path], root: Path) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"facts": facts, "profiles": profiles}, sort_keys=True).encode())
    for path in inputs:
        rel = path.relative_to(root).as_posix()
        h.update(f"\0{rel}\0".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def image_tag(matrix: Matrix, target: str, digest: str) -> str:
    return f"{matrix.image.name}:{matrix.vllm}-{target}-{digest[:12]}"


def plan_targets(matrix: Matrix, root: Path, targets: list[str] | None = None, image_exists: Callable[[str], bool] | None = None,
                 settings: BuildSettings | None = None) -> list[TargetPlan]:
    """One plan per target. `image_exists(tag)` answers True/False, or None when no engine answers."""
    settings = settings or BuildSettings()
    plans = []
    for name in targets or list(matrix.targets):
        facts = build_facts(matrix, name, root, settings)
        inputs = build_inputs(matrix, name, root, matrix.bases[facts["base"]["name"]].python)
        profiles = render_profiles(matrix, name)
        digest = content_digest(facts, profiles, inputs, root)
        tag = image_tag(matrix, name, digest)
        base = matrix.bases[facts["base"]["name"]]
        plans.append(TargetPlan(
            target=name, base_name=facts["base"]["name"], base=base.image, base_made_here=bool(base.debootstrap),
            python=base.python, pins=facts["pins"], omitted=facts["omitted"], digest=digest, tag=tag,
            exists=image_exists(tag) if image_exists else None, components=facts["components"],
            unavailable_profiles=unavailable_profiles(matrix, name, facts["components"]),
            inputs=[p.relative_to(root).as_posix() for p in inputs],
            build_info={**facts, "digest": digest, "tag": tag}, profiles=profiles))
    return plans


def plans_for(session: Session, targets: list[str] | None = None, image_exists: Callable[[str], bool] | None = None) -> list[TargetPlan]:
    """Each target's plan under this machine's settings: the tag every command agrees on."""
    return plan_targets(session.matrix, session.root, targets, image_exists, session.settings)


def plan_for(session: Session, target: str) -> TargetPlan:
    return plans_for(session, [target])[0]
