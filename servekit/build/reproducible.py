"""An image's bytes as a function of its inputs alone: every layer rewritten with file times clamped to the
matrix's epoch and its metadata fixed, the config's times set to that epoch; and two images compared layer by
layer, naming the first files that differ.

Why here and not in BuildKit: the engines users have (Debian's 20.10 among them) embed a BuildKit older than
`SOURCE_DATE_EPOCH` and `rewrite-timestamp`, and a layer's bytes carry every file's time of the build. So a build
is exported (`docker save`), each layer re-written as one canonical tar (same entries in the same order, each
time min(mtime, epoch), no atime/ctime, owner names dropped, extended attributes kept), the config given the
epoch as every time it holds, and the result loaded under the tag. The image ID is the digest of that config,
which names each layer by the digest of its canonical tar: the same contents give the same ID on any engine.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import functools
import hashlib
import io
import json
import posixpath
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from servekit.engines import EngineError
from servekit.engines.protocol import ImageEngine
from servekit.engines.transfer import ChunkStream
from servekit.errors import EnvironmentProblem
from servekit.image.boundary import write_text_atomic
from servekit.output import Say

CHUNK = 4 << 20
# Which canonical form an image is in: part of every image's digest, so a change of the form is a new tag.
CANONICAL_FORMAT = 1
# The metadata a canonical entry keeps from its PAX header: extended attributes (file capabilities) change what
# a file does; atime, ctime and sub-second times are when the build ran.
KEPT_PAX = "SCHILY.xattr."


def epoch_seconds(epoch: str | dt.datetime) -> int:
    when = epoch if isinstance(epoch, dt.datetime) else dt.datetime.fromisoformat(epoch.replace("Z", "+00:00"))
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int(when.timestamp())


def epoch_iso(seconds: int) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Hashing:
    """A write-only file that hashes and counts what passes through it on its way to `out`."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.sha, self.size = out, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.out.write(data)
        self.sha.update(data)
        self.size += len(data)
        return len(data)


def canonical_entry(info: tarfile.TarInfo, epoch: int) -> tarfile.TarInfo:
    out = copy.copy(info)
    out.mtime = min(int(info.mtime), epoch)
    out.uname = out.gname = ""
    out.pax_headers = {k: v for k, v in sorted(info.pax_headers.items()) if k.startswith(KEPT_PAX)}
    return out


def canonical_layer(layer: IO[bytes], out: IO[bytes], epoch: int) -> tuple[str, int]:
    """Write `layer` (a tar stream) to `out` as its canonical tar; (sha256 hex, size) of what was written."""
    sink = _Hashing(out)
    with tarfile.open(fileobj=layer, mode="r|*") as src, \
            tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as dst:  # type: ignore[call-overload]
        dst.copybufsize = CHUNK
        for info in src:
            dst.addfile(canonical_entry(info, epoch), src.extractfile(info) if info.isreg() else None)
    return sink.sha.hexdigest(), sink.size


def canonical_config(config: dict, diff_ids: list[str], epoch: int, labels: dict[str, str]) -> bytes:
    """The config with the epoch as every time it records, `labels` set, and the canonical layers' digests."""
    config = copy.deepcopy(config)
    when = epoch_iso(epoch)
    config["created"] = when
    for step in config.get("history", []):
        step["created"] = when
    for key in ("container", "container_config", "docker_version"):  # the builder's, not the image's
        config.pop(key, None)
    inner = config.setdefault("config", {})
    inner["Labels"] = {**(inner.get("Labels") or {}), **labels}
    config["rootfs"] = {"type": "layers", "diff_ids": [f"sha256:{d}" for d in diff_ids]}
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


def _open(tar: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes]:
    """A regular member's contents (extractfile answers None only for other kinds)."""
    fh = tar.extractfile(member)
    assert fh is not None, member.name
    return fh


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    return info


def _write_placeholder(out: IO[bytes]) -> int:
    at = out.tell()
    out.write(b"\0" * tarfile.BLOCKSIZE)
    return at


def _close_member(out: IO[bytes], header_at: int, name: str, size: int) -> None:
    """Pad the member just written and put its header (now that its name and size are known) before it."""
    out.write(b"\0" * (-size % tarfile.BLOCKSIZE))
    end = out.tell()
    out.seek(header_at)
    out.write(_member(name, size).tobuf(format=tarfile.USTAR_FORMAT))
    out.seek(end)


def _add_bytes(out: IO[bytes], name: str, data: bytes) -> None:
    out.write(_member(name, len(data)).tobuf(format=tarfile.USTAR_FORMAT))
    out.write(data + b"\0" * (-len(data) % tarfile.BLOCKSIZE))


@dataclass
class Canonical:
    image_id: str
    seconds: float
    layers: int
    reused: int = 0  # layers whose canonical form the engine had from an earlier build


@dataclass(frozen=True)
class Archive:
    """A canonical `docker load` archive written: its image ID (the config's digest), its layers' digests, and each
    saved layer's path with the digest of its canonical form (what `known` takes on the next pass)."""
    image_id: str
    diff_ids: list[str]
    by_path: dict[str, str] = field(default_factory=dict, compare=False)  # how this save named them
    reused: int = field(default=0, compare=False)


class _Prefixed(io.RawIOBase):
    """A readable file: `head` (bytes already read from `rest`), then the rest of `rest`."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        self._head, self._rest = head, rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n], self._head = self._head[:n], self._head[n:]
            return n
        data = self._rest.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


def _is_layer(name: str, head: bytes) -> bool:
    """A layer: named so in the classic layout; else a tar stream (ustar magic, or only the end-of-archive zeros of
    an empty layer, such as a WORKDIR step leaves), or one gzip-compressed as an image store may keep it."""
    return (name.endswith("/layer.tar") or head[257:262] == b"ustar" or head[:2] == b"\x1f\x8b"
            or (len(head) == tarfile.BLOCKSIZE and not head.strip(b"\0")))


def _read_saved(saved: Iterator[bytes], on_layer: Callable[[str, IO[bytes]], None]) -> tuple[dict, list]:
    """Walk a `docker save` stream once: each layer handed to `on_layer` as it passes (as a tar stream); (config,
    manifest), the manifest naming each layer by the file that holds it. Both layouts Docker writes: the classic
    (`<id>/layer.tar`, a layer the image repeats saved once and linked to) and the OCI one of the containerd image
    store (`blobs/sha256/<hex>`, layers perhaps gzipped), told apart by what each file holds, since
    manifest.json, which names them, may come last."""
    documents: dict[str, object] = {}
    links: dict[str, str] = {}
    with tarfile.open(fileobj=ChunkStream(saved), mode="r|") as tar:
        for member in tar:
            if member.issym():
                links[member.name] = posixpath.normpath(posixpath.join(posixpath.dirname(member.name),
                                                                       member.linkname))
                continue
            if not member.isreg():
                continue
            fh = _open(tar, member)
            head = fh.read(tarfile.BLOCKSIZE)
            if _is_layer(member.name, head):
                on_layer(member.name, io.BufferedReader(_Prefixed(head, fh), CHUNK))
            elif head.lstrip()[:1] in (b"{", b"[") and member.size < (16 << 20):
                with contextlib.suppress(ValueError):
                    documents[member.name] = json.loads(head + fh.read())
    manifest = documents.get("manifest.json")
    if not isinstance(manifest, list) or not manifest:
        return {}, []
    for image in manifest:
        image["Layers"] = [links.get(path, path) for path in image["Layers"]]
    config = documents.get(links.get(manifest[0]["Config"], manifest[0]["Config"]))
    return (config if isinstance(config, dict) else {}), manifest


def canonical_archive(saved: Iterator[bytes], tag: str, epoch: int, labels: dict[str, str], out: IO[bytes],
                      say: Say = print, known: dict[str, str] | None = None) -> Archive:
    """`saved` (the chunks of `docker save` of one image) written to `out` as a `docker load` archive of the
    canonical image, tagged `tag`. One pass, each layer re-written as it streams by, except a layer `known` names
    by its saved path (a classic save's `<id>/layer.tar`, whose id the engine derives from the layer and every layer
    below it): its canonical form is already in the engine, so the archive names it without holding it, and the
    engine's load, which reads a layer only where it lacks the layer's chain, takes it from there."""
    layers: dict[str, tuple[str, int]] = {}  # the archive's layer path -> (canonical digest, size)
    reused = 0

    def rewrite(path: str, layer: IO[bytes]) -> None:
        nonlocal reused
        started = time.monotonic()
        if known and path in known and path.endswith("/layer.tar"):
            while layer.read(CHUNK):  # the stream passes on; nothing is parsed or written
                pass
            layers[path] = (known[path], 0)
            reused += 1
            say(f"layer {len(layers)}: unchanged since it was last made canonical, reused")
            return
        header_at = _write_placeholder(out)
        digest, size = canonical_layer(layer, out, epoch)
        _close_member(out, header_at, f"{digest}/layer.tar", size)
        layers[path] = (digest, size)
        say(f"layer {len(layers)}: {size / 1e6:,.0f} MB made canonical in {time.monotonic() - started:.0f} s")

    config, manifest = _read_saved(saved, rewrite)
    if not manifest or not config or len(manifest) != 1:
        raise EnvironmentProblem("docker save gave no single image's manifest and config; nothing was tagged")
    order = [layers[path][0] for path in manifest[0]["Layers"]]
    config_bytes = canonical_config(config, order, epoch, labels)
    image_id = hashlib.sha256(config_bytes).hexdigest()
    _add_bytes(out, f"{image_id}.json", config_bytes)
    _add_bytes(out, "manifest.json", json.dumps([{"Config": f"{image_id}.json", "RepoTags": [tag],
                                                   "Layers": [f"{d}/layer.tar" for d in order]}]).encode())
    out.write(b"\0" * (2 * tarfile.BLOCKSIZE))
    return Archive(f"sha256:{image_id}", [f"sha256:{d}" for d in order],
                   {path: digest for path, (digest, _) in layers.items()}, reused)


def files_image_archive(files: dict[str, bytes], tag: str, epoch: int, labels: dict[str, str],
                        out: IO[bytes]) -> str:
    """A `docker load` archive of an image of one layer holding `files` (path -> contents, mode 0644, time the
    epoch) and nothing else, tagged `tag`; returns its image ID. The same files give the same ID."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, data in sorted(files.items()):
            info = _member(path, len(data))
            info.mtime = epoch
            tar.addfile(info, io.BytesIO(data))
    data = layer.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    config = {"architecture": "amd64", "os": "linux", "config": {}, "history": [{"created_by": "servekit"}]}
    config_bytes = canonical_config(config, [digest], epoch, labels)
    image_id = hashlib.sha256(config_bytes).hexdigest()
    _add_bytes(out, f"{digest}/layer.tar", data)
    _add_bytes(out, f"{image_id}.json", config_bytes)
    _add_bytes(out, "manifest.json", json.dumps([{"Config": f"{image_id}.json", "RepoTags": [tag],
                                                   "Layers": [f"{digest}/layer.tar"]}]).encode())
    out.write(b"\0" * (2 * tarfile.BLOCKSIZE))
    return f"sha256:{image_id}"


def make_canonical(engine: ImageEngine, built: str, tag: str, epoch: int, labels: dict[str, str], workdir: Path,
                   say: Say = print) -> Canonical:
    """The image `built` re-made canonical on `engine` under `tag`; `built`'s own tag is removed.

    The classic image store names an image by its config's digest; the containerd store (Docker Desktop's
    choice) by its manifest's, which it writes itself: there the loaded image is checked by its layers instead."""
    started = time.monotonic()
    check_room(workdir, int(engine.held(built).attrs.get("Size") or 0))
    memory = _CanonicalMemory(workdir / CANONICAL_MEMORY, engine, f"{CANONICAL_FORMAT}:{epoch}")
    known = memory.known()
    try:
        archive = _canonical_load(engine, built, tag, epoch, labels, workdir, say, known)
    except EnvironmentProblem:
        if not known:
            raise
        say("loading with the reused layers failed; every layer made canonical again")
        memory.forget()
        archive = _canonical_load(engine, built, tag, epoch, labels, workdir, say, {})
    loaded = engine.image(tag)
    if loaded is None or (loaded.id != archive.image_id
                          and loaded.attrs.get("RootFS", {}).get("Layers") != archive.diff_ids):
        raise EnvironmentProblem(f"after loading, {tag} is {loaded.id[:19] if loaded else 'missing'}, not the "
                                 f"canonical {archive.image_id[:19]}")
    memory.remember(archive.by_path, loaded.id)
    if built != tag:
        engine.remove_image(built)
    return Canonical(archive.image_id, time.monotonic() - started, len(archive.diff_ids), archive.reused)


def check_room(workdir: Path, image_bytes: int) -> None:
    """The canonical pass writes the image's archive to a temporary file in `workdir` (up to the image's size): refuse
    before it starts where that does not fit, rather than minutes in with the disk full."""
    free = shutil.disk_usage(workdir).free
    if free < image_bytes:
        raise EnvironmentProblem(f"the canonical pass needs up to {image_bytes / 1e9:.1f} GB free in {workdir} for "
                                 f"the image's archive, and {free / 1e9:.1f} GB is: free some (old images: `docker "
                                 "image prune`; the builder's cache: `docker builder prune`) and build again")


def _canonical_load(engine: ImageEngine, built: str, tag: str, epoch: int, labels: dict[str, str], workdir: Path,
                    say: Say, known: dict[str, str]) -> Archive:
    with tempfile.TemporaryFile(dir=workdir, prefix="canonical-") as file:
        archive = canonical_archive(engine.save(built, CHUNK), tag, epoch, labels, file, say, known)
        file.seek(0)
        try:
            engine.load(iter(lambda: file.read(CHUNK), b""))
        except EngineError as exc:
            raise EnvironmentProblem(f"loading the canonical {tag} failed: {exc.reason}") from None
    return archive


CANONICAL_MEMORY = "canonical-layers.json"


class _CanonicalMemory:
    """Which saved layer (by its path in the builder's save) has which canonical digest under which canonical form
    (the format and the epoch), and in which canonical image the engine holds it: a layer is reused only while that
    image is there, so that its chain is the engine's."""

    def __init__(self, path: Path, engine: ImageEngine, form: str) -> None:
        self.path, self.form = path, form
        try:
            images = json.loads(path.read_text())["images"]
            self.images: dict[str, dict] = {image: {"form": str(entry["form"]), "layers": dict(entry["layers"])}
                                            for image, entry in images.items()}
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            self.images = {}  # none yet, or not ours: every layer is made canonical, as on a first build
        for image, entry in list(self.images.items()):  # only what the engine still holds, in that very image
            held = engine.image(image)
            layers = set(held.attrs.get("RootFS", {}).get("Layers") or []) if held is not None else set()
            entry["layers"] = {path: digest for path, digest in entry["layers"].items() if f"sha256:{digest}" in layers}
            if not entry["layers"]:
                del self.images[image]

    def known(self) -> dict[str, str]:
        return {path: digest for entry in self.images.values() if entry["form"] == self.form
                for path, digest in entry["layers"].items()}

    def forget(self) -> None:
        self.images = {}
        self._write()

    def remember(self, by_path: dict[str, str], image_id: str) -> None:
        self.images[image_id] = {"form": self.form, "layers": by_path}
        self._write()

    def _write(self) -> None:
        write_text_atomic(self.path, json.dumps({"images": self.images}, indent=1, sort_keys=True))


# --- comparing two images ------------------------------------------------------------------------------------

@dataclass
class Difference:
    """Where two images part: the config keys that differ, and per differing layer the first files."""
    config: list[str] = field(default_factory=list)
    layers: list[tuple[int, str, list[str]]] = field(default_factory=list)  # (index, step, first differing paths)

    def lines(self) -> list[str]:
        out = [f"config: {', '.join(self.config)} differ" if self.config else ""]
        for index, step, paths in self.layers:
            out.append(f"layer {index + 1} ({step}): {', '.join(paths) or 'the same files, in another order'}")
        return [line for line in out if line]


def _entries(layer: IO[bytes]) -> dict[str, tuple]:
    """path -> what the path is in a layer: kind, mode, owner, size, time, link, contents' digest."""
    out: dict[str, tuple] = {}
    with tarfile.open(fileobj=layer, mode="r|*") as tar:
        for info in tar:
            digest = ""
            if info.isreg():
                sha = hashlib.sha256()
                fh = _open(tar, info)
                for block in iter(functools.partial(fh.read, CHUNK), b""):
                    sha.update(block)
                digest = sha.hexdigest()[:16]
            out[info.name] = (info.type, info.mode, info.uid, info.gid, info.size, int(info.mtime), info.linkname,
                              digest, tuple(sorted(info.pax_headers.items())))
    return out


def _saved_layers(engine: ImageEngine, ref: str, wanted: set[int]) -> tuple[dict, dict[int, dict[str, tuple]]]:
    """An image's config, and the entries of its layers numbered in `wanted` (0 = the base)."""
    by_path: dict[str, dict[str, tuple]] = {}

    def read(path: str, layer: IO[bytes]) -> None:
        by_path[path] = _entries(layer)

    config, manifest = _read_saved(engine.save(ref, CHUNK), read)
    paths = manifest[0]["Layers"] if manifest else []
    return config, {i: by_path[p] for i, p in enumerate(paths) if i in wanted and p in by_path}


def compare(engine: ImageEngine, ref_a: str, ref_b: str, first: int = 5) -> Difference:
    """What differs between images `ref_a` and `ref_b` on `engine` (empty when they are the same image)."""
    a, b = engine.image(ref_a), engine.image(ref_b)
    if a is None or b is None:
        raise EnvironmentProblem(f"cannot compare: {ref_a if a is None else ref_b} is not on {engine.given}")
    diff = Difference()
    if a.id == b.id:
        return diff
    la, lb = a.attrs["RootFS"]["Layers"], b.attrs["RootFS"]["Layers"]
    wanted = {i for i in range(max(len(la), len(lb))) if i >= len(la) or i >= len(lb) or la[i] != lb[i]}
    config_a, layers_a = _saved_layers(engine, ref_a, wanted)
    config_b, layers_b = _saved_layers(engine, ref_b, wanted)
    ca = {k: v for k, v in config_a.items() if k != "rootfs"}
    cb = {k: v for k, v in config_b.items() if k != "rootfs"}
    diff.config = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
    history = [h for h in config_a.get("history", []) if not h.get("empty_layer")]
    for index in sorted(wanted):
        ea, eb = layers_a.get(index, {}), layers_b.get(index, {})
        differing = sorted(p for p in set(ea) | set(eb) if ea.get(p) != eb.get(p))
        step = (history[index].get("created_by", "") if index < len(history) else "")[-80:] or "a step"
        diff.layers.append((index, step, [f"{p} ({_why(ea.get(p), eb.get(p))})" for p in differing[:first]]))
    return diff


_FIELDS = ("kind", "mode", "uid", "gid", "size", "mtime", "link", "contents", "xattrs")


def _why(a: tuple | None, b: tuple | None) -> str:
    if a is None or b is None:
        return "only in the " + ("second" if a is None else "first")
    return ", ".join(name for name, x, y in zip(_FIELDS, a, b, strict=True) if x != y)
