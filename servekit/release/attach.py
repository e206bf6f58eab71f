"""A released image's SBOM beside it in the registry, and read back from there.

The SBOM the image carries (build/sbom.py) is pushed as an image of one layer holding only that file, tagged
`sha256-<hex of the image's registry digest>.sbom` in the same repository (the tag scheme cosign and the OCI
1.1 referrers fallback use to attach an artifact to a digest) and labelled with the digest it describes. It
goes through the engine, as every push does (registry.py): no registry API of ours, and any registry that
takes an image takes it.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable

from servekit.build.reproducible import files_image_archive
from servekit.build.sbom import MEDIA_TYPE, SBOM_PATH
from servekit.engines.registry import RegistryDoor
from servekit.errors import EnvironmentProblem
from servekit.output import Say
from servekit.records.models import ReleaseRecord, SbomRecord

SUBJECT_LABEL = "io.servekit.sbom.subject"
FILE = "sbom.cdx.json"


def sbom_tag(registry_digest: str) -> str:
    return registry_digest.replace(":", "-") + ".sbom"


def attach_sbom(door: RegistryDoor, image_id: str, repository: str, registry_digest: str, epoch: int,
                push: Callable[[RegistryDoor, str, str, str, Say], str], say: Say) -> SbomRecord:
    """Push the SBOM the image `image_id` carries beside it; `push(door, image_id, repository, tag, say)` is the
    release's own push (retried, read back)."""
    try:
        document = door.read_file(image_id, SBOM_PATH)
    except FileNotFoundError:
        raise EnvironmentProblem(f"{image_id[:19]} carries no SBOM at {SBOM_PATH}: build it again with this "
                                 "version of servekit") from None
    tag = sbom_tag(registry_digest)
    local_tag = f"{repository}:{tag}"
    with tempfile.TemporaryFile() as archive:
        carrier_id = files_image_archive({FILE: document}, local_tag, epoch, {SUBJECT_LABEL: registry_digest},
                                         archive)
        archive.seek(0)
        door.load(archive.read())
    try:  # our name comes off the carrier, never the image by its ID: the same SBOM is the same image ID, so
        # another release (another checkout, another registry) may hold it under its own name at this moment
        pushed = push(door, carrier_id, repository, tag, say)
    finally:
        door.untag(local_tag)
    return SbomRecord(tag=tag, registry_digest=pushed, sha256=hashlib.sha256(document).hexdigest(),
                      media_type=MEDIA_TYPE)


def verify_sbom(door: RegistryDoor, record: ReleaseRecord) -> list[str]:
    """The registry's SBOM of a release against what the manifest names; the problems (none: it is the one)."""
    if record.sbom is None:
        return [f"{record.target}: the release names no SBOM"]
    ref = f"{record.repository}:{record.sbom.tag}"
    served = door.digest(record.repository, record.sbom.tag)
    if served != record.sbom.registry_digest:
        return [f"{record.target}: {ref} serves {served or 'nothing'}, the release names {record.sbom.registry_digest}"]
    pulled = door.pull(record.repository, record.sbom.tag)
    try:
        document = door.read_file(pulled, f"/{FILE}")
        subject = door.labels(pulled).get(SUBJECT_LABEL)
    finally:
        door.untag(ref)
    problems = []
    if hashlib.sha256(document).hexdigest() != record.sbom.sha256:
        problems.append(f"{record.target}: {ref} holds an SBOM whose sha256 is not the release's {record.sbom.sha256}")
    if subject != record.registry_digest:
        problems.append(f"{record.target}: {ref} describes {subject}, not the released {record.registry_digest}")
    described = {p["name"]: p["value"] for p in json.loads(document)["metadata"]["component"].get("properties", [])}
    if described.get("servekit:digest") != record.content_digest:
        problems.append(f"{record.target}: {ref} is the SBOM of content digest {described.get('servekit:digest')}, "
                        f"not the released {record.content_digest}")
    return problems

