"""A released image's SBOM attached to it in the registry, and read back from there.

The SBOM the image carries (build/sbom.py) is pushed as an OCI referrer of the released image (release/referrer.py):
an artifact manifest of one CycloneDX layer whose subject is the image's registry digest, so `release --verify`, and
any OCI tool (`oras discover`, `regctl artifact list`, cosign's tree), finds it from that digest: by the registry's
referrers API, or where it has none, by the referrers tag `sha256-<hex>`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Callable

from servekit.build.sbom import MEDIA_TYPE, SBOM_PATH
from servekit.engines.registry import RegistryDoor, host_of
from servekit.errors import EnvironmentProblem
from servekit.records.models import ReleaseRecord, SbomRecord
from servekit.release import referrer

FILE = "sbom.cdx.json"


def registry_of(door: RegistryDoor, repository: str) -> referrer.OciRegistry:
    """The repository's registry over HTTP, signed and reached as the engine reaches it."""
    return referrer.OciRegistry(repository, door.credentials(repository),
                                referrer.insecure(door.registry_config(), host_of(repository)))


def attach_sbom(door: RegistryDoor, image_id: str, repository: str, registry_digest: str, epoch: int,
                retried: Callable[[Callable[[], referrer.Attached]], referrer.Attached]) -> SbomRecord:
    """Attach the SBOM the image `image_id` carries to `repository@registry_digest`; `retried(call)` is the
    release's retry of a transient registry error. The same SBOM for the same image is the same artifact: a second
    release attaches nothing new."""
    try:
        document = door.read_file(image_id, SBOM_PATH)
    except FileNotFoundError:
        raise EnvironmentProblem(f"{image_id[:19]} carries no SBOM at {SBOM_PATH}: build it again with this "
                                 "version of servekit") from None
    created = dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")  # the build's, not now
    registry = registry_of(door, repository)
    attached = retried(lambda: referrer.attach(registry, registry_digest, document, MEDIA_TYPE, FILE, created))
    return SbomRecord(registry_digest=attached.manifest_digest, referrers_tag=attached.referrers_tag,
                      sha256=hashlib.sha256(document).hexdigest(), media_type=MEDIA_TYPE)


def verify_sbom(door: RegistryDoor, record: ReleaseRecord) -> list[str]:
    """The registry's SBOM of a release, found from the released digest as any OCI client finds it, against what
    the manifest names; the problems (none: it is the one)."""
    if record.sbom is None:
        return [f"{record.target}: the release names no SBOM"]
    document, problems = referrer.read_attached(registry_of(door, record.repository), record.registry_digest,
                                                record.sbom.registry_digest, record.sbom.media_type)
    problems = [f"{record.target}: {p}" for p in problems]
    if document is None:
        return problems
    where = f"{record.repository}@{record.sbom.registry_digest}"
    if hashlib.sha256(document).hexdigest() != record.sbom.sha256:
        problems.append(f"{record.target}: {where} holds an SBOM whose sha256 is not the release's {record.sbom.sha256}")
    described = {p["name"]: p["value"] for p in json.loads(document)["metadata"]["component"].get("properties", [])}
    if described.get("servekit:digest") != record.content_digest:
        problems.append(f"{record.target}: {where} is the SBOM of content digest {described.get('servekit:digest')}, "
                        f"not the released {record.content_digest}")
    return problems
