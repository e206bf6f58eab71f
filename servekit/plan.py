"""Targets to build steps: the inputs of each image, their content digest and the tag.

The digest covers everything that changes what the image holds: the target's pins and base,
the Dockerfile, the requirement file, the patch series, the components and the launcher. An
image already tagged with that digest is not built again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .matrix import Matrix

# Files of this repository that go into every image (paths relative to the repository root).
COMMON_INPUTS = ("docker/Dockerfile", ".dockerignore", "servekit/launcher.py", "servekit/knobs.py",
                 "servekit/series.py", "servekit/components.py", "servekit/prepare.py",
                 "docker/verify_image.py")
# Files that go into the cpu image only: the generator of the embedded demo model.
MODEL_INPUTS = ("servekit/demomodel.py",)


@dataclass
class TargetPlan:
    target: str
    base: str
    python: str
    pins: dict[str, str]
    digest: str
    tag: str
    exists: bool | None  # None: no engine to ask
    components: dict[str, str] = field(default_factory=dict)  # name -> present | absent
    unavailable_profiles: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return []


def build_inputs(matrix: Matrix, target: str, root: Path) -> list[Path]:
    spec = matrix.targets[target]
    paths = [root / p for p in COMMON_INPUTS]
    paths.append(root / "docker" / "requirements" / f"{target}.txt")
    if matrix.models[spec.model].source == "generated":
        paths += [root / p for p in MODEL_INPUTS]
    paths += _files_under(root / matrix.series.dir)
    for name in spec.components:
        paths += _files_under(root / matrix.components[name].source)
    return [p for p in paths if p.is_file()]


def content_digest(matrix: Matrix, target: str, root: Path) -> tuple[str, list[Path]]:
    spec = matrix.targets[target]
    h = hashlib.sha256()
    facts = {"target": target, "pins": matrix.target_pins(target), "python": spec.python,
             "base": matrix.bases[spec.base].image, "model": matrix.models[spec.model].model_dump(),
             "knobs": spec.knobs, "image": matrix.image.name}
    h.update(json.dumps(facts, sort_keys=True).encode())
    inputs = build_inputs(matrix, target, root)
    for path in inputs:
        rel = path.relative_to(root).as_posix()
        h.update(f"\0{rel}\0".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest(), inputs


def image_tag(matrix: Matrix, target: str, digest: str) -> str:
    return f"{matrix.image.name}:{matrix.vllm}-{target}-{digest[:12]}"


def component_states(matrix: Matrix, target: str, root: Path) -> dict[str, str]:
    return {name: ("present" if (root / matrix.components[name].source).is_dir() else "absent")
            for name in matrix.targets[target].components}


def unavailable_profiles(matrix: Matrix, target: str, states: dict[str, str]) -> list[str]:
    """Profiles on this target that need a component whose source is absent."""
    absent = {n for n, s in states.items() if s == "absent"}
    return [name for name, p in matrix.profiles.items() if target in p.targets and absent & set(p.components)]


def plan_targets(matrix: Matrix, root: Path, targets: list[str] | None = None, image_exists=None) -> list[TargetPlan]:
    """One plan per target. `image_exists(tag)` answers True/False, or None when no engine answers."""
    plans = []
    for name in targets or list(matrix.targets):
        spec = matrix.targets[name]
        digest, inputs = content_digest(matrix, name, root)
        tag = image_tag(matrix, name, digest)
        states = component_states(matrix, name, root)
        plans.append(TargetPlan(
            target=name, base=matrix.bases[spec.base].image, python=spec.python, pins=matrix.target_pins(name),
            digest=digest, tag=tag, exists=image_exists(tag) if image_exists else None, components=states,
            unavailable_profiles=unavailable_profiles(matrix, name, states),
            inputs=[p.relative_to(root).as_posix() for p in inputs]))
    return plans
