"""Put the image built here on another engine: already there, pulled from the release's registry, or
streamed `docker save | docker load` (no registry needed, nothing written to disk on either side)."""

from __future__ import annotations

import hashlib
import io
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import IO, TYPE_CHECKING, Any

from servekit.engines.docker import DockerEngine
from servekit.engines.docker import local as local_engine
from servekit.engines.protocol import Engine
from servekit.errors import EnvironmentProblem, UserError
from servekit.output import Say
from servekit.records.models import ReleaseRecord

if TYPE_CHECKING:  # the clients' types alone: each client is imported where it is used (the SDK costs a third of a second)
    from docker import DockerClient

CHUNK = 4 << 20


def _counted(chunks: Iterable[bytes], total: int, say: Say, every_s: float = 5.0) -> Iterator[bytes]:
    sent, last = 0, time.monotonic()
    for chunk in chunks:
        sent += len(chunk)
        if time.monotonic() - last >= every_s:
            say(f"{sent / 1e9:.1f} of about {total / 1e9:.1f} GB sent")
            last = time.monotonic()
        yield chunk


def _pull(remote: DockerClient, release: ReleaseRecord, tag: str, say: Say) -> bool:
    """Pull the release by digest and give it the local tag; False (and why) when that does not work."""
    import docker  # the SDK takes a third of a second to import: only what talks to an engine pays for it
    ref = f"{release.repository}@{release.registry_digest}"
    try:
        image = remote.images.pull(ref)
    except docker.errors.APIError as exc:
        say(f"pulling {ref} failed ({exc.explanation or exc}); sending it instead")
        return False
    if image.id != release.image_id:
        say(f"{ref} is image {image.id[:19]}, not the release's {release.image_id[:19]}; sending it instead")
        return False
    repository, _, name = tag.rpartition(":")
    image.tag(repository, name)
    return True


def ensure_image(engine: Engine, tag: str, release: ReleaseRecord | None = None, say: Say = print) -> str:
    """Make `tag` on `engine` the very image `tag` is here; say how, in a few words, for the report.

    `release` is this build's record in releases/v<vllm>.json, when it was released: the engine then
    pulls it from the registry by digest (falling back to a stream if the registry is out of its reach)."""
    if not isinstance(engine, DockerEngine):
        return "not needed: a process engine serves from its environment"
    import docker  # the SDK takes a third of a second to import: only what talks to an engine pays for it
    this_machine = local_engine()
    local = this_machine.image(tag)
    if local is None:
        raise UserError(f"image {tag} is not here: `python3 build.py pull` fetches this checkout's release from "
                        "the registry (SERVEKIT_REGISTRY), or `python3 build.py image` builds it")
    if engine.url == this_machine.url or engine.image_id(tag) == local.id:
        return "already there"
    here, remote = this_machine.sdk(timeout=3600), engine.sdk(timeout=3600)
    started = time.monotonic()
    if release and release.image_id == local.id:
        say(f"pulling {release.repository}@{release.registry_digest[:19]}... on {engine.given}")
        if _pull(remote, release, tag, say):
            return f"pulled from the registry in {time.monotonic() - started:.0f} s"
    size = local.attrs.get("Size") or 0
    say(f"sending {tag} ({size / 1e9:.1f} GB) to {engine.given}: docker save | docker load")
    try:
        for message in remote.api.load_image(_counted(here.api.get_image(tag, chunk_size=CHUNK), size, say)):
            if "error" in message:
                raise EnvironmentProblem(f"loading {tag} into {engine.given} failed: {message['error']}")
    except docker.errors.APIError as exc:
        raise EnvironmentProblem(f"loading {tag} into {engine.given} failed: {exc.explanation or exc}") from None
    if engine.image_id(tag) != local.id:
        raise EnvironmentProblem(f"after loading, {engine.given} has no {tag} of image {local.id[:19]}")
    return f"sent (save+load) in {time.monotonic() - started:.0f} s"


def shared_prefix(layers: list[str], host_layers: list[str]) -> list[str]:
    """The layers (DiffIDs, lowest first) an image shares with one the host has, counted from the bottom: a layer
    counts only with every layer under it, since an engine keys a layer by its whole chain."""
    shared = []
    for mine, theirs in zip(layers, host_layers, strict=False):
        if mine != theirs:
            break
        shared.append(mine)
    return shared


def save_on_top_of(tag: str, host_layers: list[str], out: IO[bytes], say: Say = print) -> dict[str, int]:
    """`docker save TAG` into the binary stream `out`, less the layers the host has: those TAG shares with
    `host_layers` (an image of the host's, its DiffIDs lowest first). What it writes loads on top of that image
    as TAG, the same image ID: Docker 20.10's `docker load` (the kit's engine) reads a layer's tar only where its
    chain is missing (moby's tarexport/load.go). Each layer's tar is hashed as it streams by (its DiffID) and
    spilled to a temporary file until the hash says whether it is the host's. Returns the counts: layers,
    layers carried, bytes of the carried layers."""
    here = local_engine()
    image = here.image(tag)
    if image is None:
        raise UserError(f"image {tag} is not built here: run `python3 build.py image` for its target first")
    layers = list(image.attrs["RootFS"]["Layers"])
    skip = set(shared_prefix(layers, host_layers))
    stream = io.BufferedReader(ChunkStream(here.sdk(timeout=3600).api.get_image(tag, chunk_size=CHUNK)), CHUNK)
    counts = {"layers": len(layers), "carried": 0, "bytes": 0}
    with tarfile.open(fileobj=stream, mode="r|") as source, tarfile.open(fileobj=out, mode="w|") as sink:
        for member in source:
            data = source.extractfile(member) if member.isfile() else None
            if data is None or not member.name.endswith("/layer.tar"):
                sink.addfile(member, data)
                continue
            digest = hashlib.sha256()
            with tempfile.TemporaryFile() as spill:
                while chunk := data.read(CHUNK):
                    digest.update(chunk)
                    spill.write(chunk)
                if f"sha256:{digest.hexdigest()}" in skip:
                    continue
                spill.seek(0)
                sink.addfile(member, spill)
                counts["carried"] += 1
                counts["bytes"] += member.size
                say(f"carrying layer {member.name.split('/')[0][:12]}: {member.size / 2**20:.1f} MiB")
    return counts


class ChunkStream(io.RawIOBase):
    """A raw stream over an iterator of byte chunks (the SDK's `docker save`), for tarfile's stream mode: no chunk is
    copied but into the reader's buffer. Slicing off the rest of a 4 MiB chunk at each of tarfile's 10 KiB reads
    cost 3.7 s a 200 MiB in a bare read; the canonical pass of the cpu image took 109 s with it and 97 s without, the
    same image ID (both beside a test run, 2026-12-06)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self.chunks, self.pending = iter(chunks), memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.pending:
            chunk = next(self.chunks, None)
            if chunk is None:
                return 0
            self.pending = memoryview(chunk)
        n = min(len(buffer), len(self.pending))
        buffer[:n] = self.pending[:n]
        self.pending = self.pending[n:]
        return n
