"""Where a release goes and what it is called: the registry path (--registry, SERVEKIT_REGISTRY, images.yaml), the
immutable tag `v<vllm>-<target>-<digest12>` and the moving `v<vllm>-<target>` and `latest-<target>`."""

from __future__ import annotations

import os
from pathlib import Path

from servekit.build.plan import TargetPlan
from servekit.config.matrix import Matrix
from servekit.config.userenv import source_settings
from servekit.errors import UserError
from servekit.image.boundary import REGISTRY

ENV_REGISTRY = "SERVEKIT_REGISTRY"


def release_tags(matrix: Matrix, plan: TargetPlan) -> list[str]:
    base = f"v{matrix.vllm}-{plan.target}"
    return [f"{base}-{plan.digest[:12]}", base, f"latest-{plan.target}"]


def registry_path(matrix: Matrix, given: str | None = None, root: Path | None = None) -> str:
    """Where releases go and come from: --registry, else SERVEKIT_REGISTRY (in the shell, else in the checkout's
    compose/.env, as Compose reads it there too), else images.yaml's release.registry."""
    settings = source_settings(root, ENV_REGISTRY) if root else {}
    setting = os.environ.get(ENV_REGISTRY) or settings.get(ENV_REGISTRY)
    if not given and setting and not REGISTRY.fullmatch(setting.rstrip("/")):  # it becomes an image: line of Compose
        where = "the shell" if os.environ.get(ENV_REGISTRY) else "compose/.env"
        raise UserError(f"{ENV_REGISTRY}={setting[:60]!r} ({where}): expected HOST[:PORT][/NAMESPACE] such as "
                        "127.0.0.1:5000/serve (no scheme, one line)")
    return (given or setting or matrix.release.registry).rstrip("/")


def released_reference(matrix: Matrix, plan: TargetPlan, given: str | None = None, root: Path | None = None) -> str:
    """The immutable reference `release` pushes this build as (its content digest is in the tag)."""
    return f"{registry_path(matrix, given, root)}/{matrix.image.name}:{release_tags(matrix, plan)[0]}"
