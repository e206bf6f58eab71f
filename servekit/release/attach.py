"""A released image's SBOM beside it in the registry, and read back from there.

The SBOM the image carries (build/sbom.py) is pushed as an image of one layer holding only that file, tagged
`sha256-<hex of the image's registry digest>.sbom` in the same repository (the tag scheme cosign and the OCI
1.1 referrers fallback use to attach an artifact to a digest) and labelled with the digest it describes. It
goes through the engine, as every push does (registry.py): no registry API of ours, and any registry that
takes an image takes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import tarfile
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

from servekit.build.reproducible import files_image_archive
from servekit.build.sbom import MEDIA_TYPE, SBOM_PATH
from servekit.errors import EnvironmentProblem
from servekit.output import Say
from servekit.records.models import ReleaseRecord, SbomRecord
from servekit.release import registry

if TYPE_CHECKING:  # the SDK's types alone: the SDK is imported where an engine is talked to
    from docker.models.images import Image

    from docker import DockerClient

SUBJECT_LABEL = "io.servekit.sbom.subject"
FILE = "sbom.cdx.json"


def sbom_tag(registry_digest: str) -> str:
    return registry_digest.replace(":", "-") + ".sbom"


def read_file(client: DockerClient, image: str, path: str) -> bytes:
    """One file of an image, read from a container created (never started) from it."""
    container = client.containers.create(image, command=["none"], entrypoint=[])
    try:
        chunks, _ = container.get_archive(path)
        with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
            member = tar.extractfile(tar.getmembers()[0])
            assert member is not None, path
            return member.read()
    finally:
        container.remove(force=True)


def attach_sbom(client: DockerClient, image: Image, repository: str, registry_digest: str, epoch: int,
                push: Callable[[DockerClient, Image, str, str, Say], str], say: Say) -> SbomRecord:
    """Push the SBOM `image` carries beside it; `push(client, image, repository, tag, say)` is the release's own
    push (retried, read back)."""
    import docker  # the SDK takes a third of a second to import: only what talks to an engine pays for it
    try:
        document = read_file(client, image.id, SBOM_PATH)
    except docker.errors.NotFound:
        raise EnvironmentProblem(f"{image.id[:19]} carries no SBOM at {SBOM_PATH}: build it again with this "
                                 "version of servekit") from None
    tag = sbom_tag(registry_digest)
    local_tag = f"{repository}:{tag}"
    with tempfile.TemporaryFile() as archive:
        carrier_id = files_image_archive({FILE: document}, local_tag, epoch, {SUBJECT_LABEL: registry_digest},
                                         archive)
        archive.seek(0)
        client.images.load(archive.read())
    try:
        pushed = push(client, client.images.get(carrier_id), repository, tag, say)
    finally:
        _untag(client, local_tag)
    return SbomRecord(tag=tag, registry_digest=pushed, sha256=hashlib.sha256(document).hexdigest(),
                      media_type=MEDIA_TYPE)


def _untag(client: DockerClient, reference: str) -> None:
    """Take our name off a carrier, never the image by its ID: the same SBOM is the same image ID, so another
    release (another checkout, another registry) may hold it under its own name at this moment."""
    import docker  # the SDK takes a third of a second to import: only what talks to an engine pays for it
    with contextlib.suppress(docker.errors.ImageNotFound):  # already gone: nothing of ours is left
        client.images.remove(reference, noprune=False)


def verify_sbom(client: DockerClient, record: ReleaseRecord) -> list[str]:
    """The registry's SBOM of a release against what the manifest names; the problems (none: it is the one)."""
    if record.sbom is None:
        return [f"{record.target}: the release names no SBOM"]
    ref = f"{record.repository}:{record.sbom.tag}"
    served = registry.digest(client, record.repository, record.sbom.tag)
    if served != record.sbom.registry_digest:
        return [f"{record.target}: {ref} serves {served or 'nothing'}, the release names {record.sbom.registry_digest}"]
    pulled = client.images.pull(record.repository, tag=record.sbom.tag)
    try:
        document = read_file(client, pulled.id, f"/{FILE}")
    finally:
        _untag(client, ref)
    problems = []
    if hashlib.sha256(document).hexdigest() != record.sbom.sha256:
        problems.append(f"{record.target}: {ref} holds an SBOM whose sha256 is not the release's {record.sbom.sha256}")
    subject = (pulled.labels or {}).get(SUBJECT_LABEL)
    if subject != record.registry_digest:
        problems.append(f"{record.target}: {ref} describes {subject}, not the released {record.registry_digest}")
    described = {p["name"]: p["value"] for p in json.loads(document)["metadata"]["component"].get("properties", [])}
    if described.get("servekit:digest") != record.content_digest:
        problems.append(f"{record.target}: {ref} is the SBOM of content digest {described.get('servekit:digest')}, "
                        f"not the released {record.content_digest}")
    return problems

