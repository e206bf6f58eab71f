"""The release manifest (releases/v<vllm>.json): where it lives, this very build's record in it, and writing it
merged with what an earlier release of the same vLLM recorded."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from servekit.config.matrix import Matrix
from servekit.records.models import ReleaseManifest, ReleaseRecord, load, save


def manifest_path(root: Path, matrix: Matrix) -> Path:
    return root / "releases" / f"v{matrix.vllm}.json"


def released(root: Path, matrix: Matrix, target: str, content_digest: str) -> ReleaseRecord | None:
    """This very build's record in releases/v<vllm>.json (same content digest), or None."""
    path = manifest_path(root, matrix)
    if not path.exists():
        return None
    record = load(path, ReleaseManifest).targets.get(target)
    return record if record and record.content_digest == content_digest else None


def write_manifest(root: Path, matrix: Matrix, releases: list[ReleaseRecord]) -> Path:
    """releases/v<vllm>.json, merged with the targets an earlier release of this version recorded."""
    path = manifest_path(root, matrix)
    earlier = load(path, ReleaseManifest).targets if path.exists() else {}
    doc = ReleaseManifest(version=matrix.vllm, targets={**earlier, **{r.target: r for r in releases}},
                          updated=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    return save(path, doc)  # later trusted by `up`, k8s
