"""The one door to registries, through the Docker engine (`DockerEngine.registries()`): every read and write is
signed with what `docker login` stored for that registry (credential helpers included), as the docker CLI would; a
tag's digest comes from the engine's distribution API; names resolve as Docker resolves them (`user/image` and
`docker.io/user/image` are Docker Hub's, `ghcr.io/org/image` GHCR's). No HTTP of ours reaches a registry but the
SBOM's referrer, which no engine push can write (release/referrer.py, signed with the credentials this door resolves),
and no stage holds the SDK: images go in and out of this door by ID and reference.
"""

from __future__ import annotations

import contextlib
import io
import re
import tarfile
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import requests
from packaging.version import InvalidVersion, Version

from servekit.errors import EnvironmentProblem

if TYPE_CHECKING:  # the types alone: rich is imported where a terminal draws the bars, the SDK where it is used
    from rich.console import Console

    from docker import DockerClient

VERSION_LABEL = "org.opencontainers.image.version"
DENIED = re.compile(r"unauthorized|authentication required|denied|forbidden|incorrect username or password|"
                    r"no basic auth credentials", re.I)
UNREACHABLE = re.compile(r"connection refused|no such host|i/o timeout|connect: |EOF|server misbehaving", re.I)
ACCESS_PROBE_TAG = "servekit-access-probe"  # a tag no release writes: reading it says whether we may read
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")  # what a registry may name a manifest by; anything else is not believed


class TransientRegistryError(EnvironmentProblem):
    """The registry did not answer or failed (5xx, a dropped connection): worth another try."""


class RegistryAuthError(EnvironmentProblem):
    """The registry refused our credentials, or we have none for it: another try cannot help."""


def host_of(repository: str) -> str:
    """The registry a repository lives in, as Docker resolves the name (docker.io for Docker Hub's)."""
    from docker.auth import resolve_repository_name  # the SDK's 0.3 s import: paid only by what needs an engine
    return resolve_repository_name(repository)[0]


def _said(exc: Exception) -> str:
    return str(getattr(exc, "explanation", None) or exc).strip().splitlines()[0][:300]


def refused(repository: str, what: str, reason: str) -> RegistryAuthError:
    host = host_of(repository)
    return RegistryAuthError(f"registry {host} refused {what} ({reason}); log in with `docker login {host}` as the "
                             "user this engine's client config belongs to, then run release again")


def _digest_or_none(found: object, what: str) -> str | None:
    """A digest as the registry gave it, checked: a value of another form would become a reference and a record."""
    if found is None:
        return None
    if not isinstance(found, str) or not DIGEST.fullmatch(found):
        raise TransientRegistryError(f"{what}: the registry named {str(found)[:80]!r}, which is no sha256 digest")
    return found


class PushProgress:
    """The engine's per-layer push (or pull) events as one figure: bytes moved of the layers being moved, the
    rate, layers done. On a terminal one line rewritten in place; otherwise a plain line every `every_s`."""

    DONE = ("Pushed", "Layer already exists", "Mounted from", "Pull complete", "Already exists")

    def __init__(self, label: str, say: Callable[[str, bool], None], terminal: bool, every_s: float = 5.0, verb: str = "push") -> None:
        self.label, self.say, self.terminal, self.every_s, self.verb = label, say, terminal, every_s, verb
        self.clock = time.monotonic
        self.started = self.last = self.clock()
        self.layers: dict[str, tuple[int, int]] = {}  # layer id -> (bytes sent, size)
        self.done: set[str] = set()

    def __enter__(self) -> PushProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __call__(self, event: dict) -> None:
        layer, status = event.get("id"), event.get("status") or ""
        detail = event.get("progressDetail") or {}
        if layer and isinstance(detail, dict) and isinstance(detail.get("total"), int):  # a figure, or not counted
            current = detail.get("current")
            self.layers[layer] = (current if isinstance(current, int) else 0, detail["total"])
        if layer and status.startswith(self.DONE):
            self.done.add(layer)
            if layer in self.layers:
                self.layers[layer] = (self.layers[layer][1], self.layers[layer][1])
        self.show(layer, status)

    def show(self, layer: str | None, status: str) -> None:
        if self.terminal or self.clock() - self.last >= self.every_s:
            self.last = self.clock()
            self.say(self.line(), True)

    def line(self) -> str:
        sent = sum(current for current, _ in self.layers.values())
        total = sum(size for _, size in self.layers.values())
        rate = sent / max(self.clock() - self.started, 1e-3)
        return (f"{self.verb} {self.label}: {sent / 1e6:.0f} of {total / 1e6:.0f} MB, {rate / 1e6:.1f} MB/s, "
                f"{len(self.done)} layers done")


class LayerBars(PushProgress):
    """On a terminal: a bar for each layer (bytes of its size, rate, what the engine says of it) drawn by rich, as
    `docker pull` draws them; line() still sums them up for the log."""

    def __init__(self, label: str, verb: str = "pull", console: Console | None = None) -> None:
        from rich.console import Console  # rich only where a terminal draws the bars
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn  # the same
        super().__init__(label, lambda text, live: None, terminal=True, verb=verb)
        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                             console=console or Console(stderr=True))
        self.tasks: dict[str, Any] = {}  # layer id -> rich's TaskID

    def __enter__(self) -> LayerBars:
        self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bars.stop()

    def show(self, layer: str | None, status: str) -> None:
        if not layer or layer not in self.layers:
            return  # a layer with no size yet (Waiting, Preparing) gets its bar with its first figure
        current, total = self.layers[layer]
        description = f"{self.verb} {layer[:12]} {status}"[:48]
        if layer not in self.tasks:
            self.tasks[layer] = self.bars.add_task(description, total=total)
        self.bars.update(self.tasks[layer], completed=current, total=total, description=description)


def _follow(start: Callable[[], Iterable[Any]], repository: str, tag: str, verb: str,
            progress: PushProgress | None = None) -> str | None:
    """Start a push or pull (`start()` gives the engine's stream of events; the request may fail as it starts) and
    read it to its end; the last digest it reports. A refusal of our credentials raises RegistryAuthError at once;
    anything else the engine reports raises TransientRegistryError."""
    reported = None
    try:
        for event in start():
            if "error" in event:
                reason = str(event["error"])[:300]
                if DENIED.search(reason):
                    raise refused(repository, f"the {verb} of {repository}:{tag}", reason)
                raise TransientRegistryError(reason)
            if progress:
                progress(event)
            aux = event.get("aux")
            if isinstance(aux, dict) and aux.get("Digest") is not None:
                reported = _digest_or_none(aux["Digest"], f"the {verb} of {repository}:{tag}")
    except requests.RequestException as exc:
        raise TransientRegistryError(f"the engine lost the {verb}: {type(exc).__name__}") from None
    return reported



class RegistryDoor:
    """What a release, `pull` and `release --verify` ask of registries and of the images they move, through one
    engine's client: digests, pushes and pulls (errors: TransientRegistryError, RegistryAuthError), and the images
    by ID or reference."""

    def __init__(self, client: DockerClient) -> None:
        self.client = client

    def digest(self, repository: str, tag: str) -> str | None:
        """The digest `repository:tag` names in its registry, or None when there is no such tag."""
        import docker  # the SDK takes a third of a second to import: only what talks to an engine pays for it
        try:
            found = (self.client.api.inspect_distribution(f"{repository}:{tag}").get("Descriptor") or {}).get("digest")
            return _digest_or_none(found, f"reading {repository}:{tag}")
        except docker.errors.NotFound:
            return None
        except docker.errors.APIError as exc:
            reason = _said(exc)
            if "manifest unknown" in reason or "not found" in reason.lower():
                return None
            if DENIED.search(reason):
                raise refused(repository, f"reading {repository}:{tag}", reason) from None
            if UNREACHABLE.search(reason):
                raise TransientRegistryError(f"the registry of {repository} does not answer: {reason}") from None
            raise TransientRegistryError(f"reading {repository}:{tag}: {reason}") from None
        except requests.RequestException as exc:
            raise TransientRegistryError(f"the engine lost the request: {type(exc).__name__}") from None
        except AttributeError:  # an answer that is not an object
            raise TransientRegistryError(f"reading {repository}:{tag}: the engine's answer has no descriptor") from None

    def check_access(self, repository: str) -> None:
        """Refuse in one line, before anything is pushed, a registry that does not answer or will not let us read."""
        try:
            self.digest(repository, ACCESS_PROBE_TAG)
        except TransientRegistryError as exc:
            raise EnvironmentProblem(f"{exc}; start it (docs/release.md) or pass --registry") from None

    def vllm_version(self, repository: str, tag: str) -> Version | None:
        """The vLLM version the image a tag names carries (its version label), when the tag exists: the engine pulls
        it by digest with our credentials (only its manifest and config when its layers are here) and forgets it
        again when it was not here before."""
        import docker  # the SDK takes a third of a second to import: only what talks to an engine pays for it
        found = self.digest(repository, tag)
        if found is None:
            return None
        reference = f"{repository}@{found}"
        try:
            present = self.client.images.get(reference) is not None
        except docker.errors.ImageNotFound:
            present = False
        try:
            image = self.client.images.pull(repository, tag=found)
        except docker.errors.APIError as exc:
            if DENIED.search(_said(exc)):
                raise refused(repository, f"pulling {reference}", _said(exc)) from None
            raise TransientRegistryError(f"pulling {reference}: {_said(exc)}") from None
        label = (image.labels or {}).get(VERSION_LABEL, "")
        if not present:
            with contextlib.suppress(docker.errors.APIError):  # in use under another name: it stays, as it was
                self.client.images.remove(reference)
        try:
            return Version(label.split("-")[0])
        except InvalidVersion:
            return None

    def push(self, repository: str, tag: str, progress: PushProgress | None = None) -> str | None:
        """Push one tag through the engine; the digest the engine reports (errors: _follow)."""
        return _follow(lambda: self.client.images.push(repository, tag=tag, stream=True, decode=True), repository,
                       tag, "push", progress)

    def pull(self, repository: str, tag: str, progress: PushProgress | None = None) -> str:
        """Pull one tag through the engine, signed as `docker pull` would be (errors: _follow); the image's ID."""
        _follow(lambda: self.client.api.pull(repository, tag=tag, stream=True, decode=True), repository, tag, "pull",
                progress)
        return self.client.images.get(f"{repository}:{tag}").id

    def credentials(self, repository: str) -> dict[str, str] | None:
        """What `docker login` stored for the repository's registry, as the SDK resolves it (credential helpers
        included): {"username", "password"}, or None. For the one write no engine makes (release/referrer.py)."""
        from docker import auth  # the SDK takes a third of a second to import: only what talks to an engine pays for it
        host = host_of(repository)
        found = auth.resolve_authconfig(auth.load_config(), None if host == "docker.io" else host) or {}
        username = found.get("username") or found.get("Username")
        return {"username": username, "password": found.get("password") or found.get("Password") or ""} \
            if username else None

    def registry_config(self) -> dict:
        """The engine's registry settings (`docker info`'s RegistryConfig): which registries it speaks HTTP to."""
        return self.client.info().get("RegistryConfig") or {}

    def labels(self, image: str) -> dict[str, str]:
        """An image's labels, by ID or reference."""
        return dict(self.client.images.get(image).labels or {})

    def tag(self, image: str, repository: str, tag: str) -> None:
        """Name an image (by ID or reference) `repository:tag` on the engine."""
        self.client.images.get(image).tag(repository, tag)

    def untag(self, reference: str) -> None:
        """Take a name off an image, never the image by its ID (another name may hold it); gone already is fine."""
        import docker  # the SDK takes a third of a second to import: only what talks to an engine pays for it
        with contextlib.suppress(docker.errors.ImageNotFound):
            self.client.images.remove(reference, noprune=False)

    def load(self, archive: bytes) -> None:
        """Load a `docker save` archive into the engine."""
        self.client.images.load(archive)

    def read_file(self, image: str, path: str) -> bytes:
        """One file of an image, read from a container created (never started) from it; FileNotFoundError when the
        image has no such file."""
        import docker  # the SDK takes a third of a second to import: only what talks to an engine pays for it
        container = self.client.containers.create(image, command=["none"], entrypoint=[])
        try:
            chunks, _ = container.get_archive(path)
            with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
                member = tar.extractfile(tar.getmembers()[0])
                if member is None:
                    raise FileNotFoundError(path)
                return member.read()
        except docker.errors.NotFound:
            raise FileNotFoundError(path) from None
        finally:
            container.remove(force=True, v=True)  # the anonymous volumes of the image's VOLUMEs with it
