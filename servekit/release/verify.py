"""`release --verify`: the manifest of a release read back against its registry, through the engine."""

from __future__ import annotations

from servekit.config.session import Session
from servekit.engines import local
from servekit.errors import UserError
from servekit.output import Say
from servekit.records.models import ReleaseManifest, load
from servekit.records.releases import manifest_path
from servekit.release import attach


def verify_release(session: Session, say: Say = print) -> list[str]:
    """`release --verify`: read releases/v<vllm>.json back and ask the registry, through the engine, whether every
    tag still serves the digest it names; the problems (none: the registry serves what was released)."""
    path = manifest_path(session.root, session.matrix)
    if not path.exists():
        raise UserError(f"{path.relative_to(session.root)}: no release of vLLM {session.matrix.vllm} to verify")
    manifest = load(path, ReleaseManifest)
    engine = local()
    engine.check()
    door = engine.registries(timeout=120)
    problems = []
    for target, record in manifest.targets.items():
        for tag in record.tags:
            served = door.digest(record.repository, tag)
            if served != record.registry_digest:
                problems.append(f"{target}: {record.repository}:{tag} serves {served or 'nothing'}, the release "
                                f"names {record.registry_digest}")
        problems += attach.verify_sbom(door, record)
        say(f"release: {target}: {len(record.tags)} tags and the SBOM checked against {record.repository}")
    return problems
