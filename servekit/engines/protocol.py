"""What servekit asks of an engine, whichever runs the servers: the Docker engine (docker.py) and the process engine
(process.py) are peers behind these two protocols, and what they hand back are our own records, not a client's.

An engine starts and stops a profile's server, finds the servers of this project, says whether it answers, which host
kind it is and whether it can give a server the GPU, and holds or receives images where it runs them. A server says
what it is (its state), its log (whole, or followed as it grows), its memory, and its process's environment.

`serves_images` is the one capability callers ask about: an engine that runs images gets them built, sent and
mounted, and its Compose files written; one that does not serves a Python environment as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from servekit.config.matrix import Matrix
from servekit.engines.card import Emulation
from servekit.engines.registry import RegistryDoor


class Deploying(Protocol):
    """What an engine reads of a deployment (engines/deployment.py's record): what it serves, from where, at which
    address, and what it asks for beside (model folders, the GPU by its devices, an emulated card)."""

    @property
    def root(self) -> Path: ...
    @property
    def target(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def image(self) -> str: ...
    @property
    def bind(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def engine(self) -> Engine: ...
    @property
    def matrix(self) -> Matrix | None: ...
    @property
    def pins(self) -> dict[str, str]: ...
    @property
    def api_key_file(self) -> Path: ...
    @property
    def overrides(self) -> tuple[str, ...]: ...
    @property
    def gpu_devices(self) -> bool: ...
    @property
    def model_dir(self) -> str | None: ...
    @property
    def drafter_dir(self) -> str | None: ...
    @property
    def card(self) -> Emulation | None: ...


@dataclass(frozen=True)
class ServerState:
    """What a server is, read the same way from a Docker container or the process engine's process."""
    name: str
    profile: str | None  # its Compose service
    status: str  # running, exited, dead, created, ...
    running: bool
    exit_code: int | None
    restarts: int  # how often the engine restarted it (restart: unless-stopped): each one follows an exit
    started_at: str  # RFC 3339
    health: str | None  # Docker's healthcheck verdict, where there is one
    image: str | None  # what it was started from: a tag, or the process engine's environment
    env: dict[str, str]  # its environment as started (Compose's and the shell's knobs among it)
    port: int | None  # the host port the container's CONTAINER_PORT is published on


@runtime_checkable
class Server(Protocol):
    """One profile's server on an engine."""

    name: str
    profile: str

    @property
    def image_id(self) -> str | None:
        """The image it runs (sha256:...), or None where it runs no image."""

    def state(self, fresh: bool = False) -> ServerState:
        """What it is now; read again from the engine when `fresh`."""

    def log(self) -> str:
        """Its whole log so far."""

    def follow_log(self, tail: int | None = None, follow: bool = True, timestamps: bool = False) -> Iterator[bytes]:
        """Its log as bytes as they come (from the last `tail` lines; with `timestamps`, each line led by its RFC 3339
        time where the engine keeps one); with `follow`, until the server stops."""

    def memory(self) -> Iterator[int]:
        """The bytes of memory it uses, about once a second, until it stops."""

    def environ(self) -> dict[str, str]:
        """The environment its serving process runs with; EngineError when it cannot be read."""


@runtime_checkable
class Engine(Protocol):
    """Where servers run."""

    @property
    def given(self) -> str:
        """As typed: "local", a URL, a context name, venv:PATH."""

    @property
    def url(self) -> str: ...

    @property
    def serves_images(self) -> bool:
        """Whether it runs images (they are built, sent and mounted for it) rather than an environment as it is."""

    @property
    def is_local(self) -> bool:
        """This machine's default engine, the one compose/.env is written for."""

    @property
    def same_machine(self) -> bool:
        """Whether what it publishes on 127.0.0.1 is this machine's 127.0.0.1."""

    @property
    def hostname(self) -> str: ...

    @property
    def scheme(self) -> str: ...

    @property
    def label(self) -> str:
        """A short name for folders and tables."""

    def check(self) -> None:
        """Raise EnvironmentProblem, naming the engine, when it does not answer."""

    def answers(self) -> bool: ...

    def host_kind(self) -> str:
        """wsl2 or native."""

    def gpu_problem(self) -> str | None:
        """Why a server here cannot have the GPU, or None when it can."""

    def gpu_by_devices(self) -> bool:
        """Whether a server gets the GPU by its device nodes (the devices route's Compose file is then named)."""

    def image_exists(self, tag: str) -> bool: ...

    def image_id(self, tag: str) -> str | None:
        """The ID of the image `tag` here, or None (not here, or no images at all)."""

    def serving(self, tag: str, pins: dict[str, str]) -> tuple[str, dict[str, str]]:
        """What a deployment names as its image, and the pins the engine's own stack must hold (an image carries its
        own: none)."""

    def write_settings(self, dep: Deploying) -> Path | None:
        """Write what a later plain command of the engine's own tool reads to serve `dep` as servekit does (the
        Docker engine: compose/.env, or the engine's own env file); that file, or None where there is none."""

    def settings_file(self, dep: Deploying) -> Path | None:
        """The file write_settings writes for `dep`, whose other lines are the person's; None where there is none."""

    def prepare(self, dep: Deploying, profile: str, knobs: dict[str, str] | None = None,
                on_line: Callable[[str], None] | None = None) -> list[str]:
        """Run the profile's prepare step (the model and its drafter into place) to its end, each line of its output to
        `on_line` as it comes; its lines. BootFailed, with its reason, when it fails."""

    def up(self, dep: Deploying, profile: str, knobs: dict[str, str] | None = None) -> Server | None:
        """Start the prepared profile; its server, or None when the caller finds it (`servers`)."""

    def down(self, dep: Deploying, profile: str | None = None) -> None:
        """Stop and remove the profile's server (every one of the project's when None)."""

    def servers(self, profile: str | None = None) -> Sequence[Server]:
        """This project's servers (the profile's only, when named)."""


class HeldImage(Protocol):
    """An image an engine holds, as the build and release stages read it."""

    @property
    def id(self) -> str: ...
    @property
    def attrs(self) -> dict: ...
    @property
    def labels(self) -> dict[str, str]: ...


@runtime_checkable
class ImageEngine(Engine, Protocol):
    """An engine that holds images (the Docker engine): what building, making a build canonical, the SBOM, the demo
    model's training, `doctor` and releasing ask of it beyond serving."""

    def image(self, tag: str) -> HeldImage | None:
        """The image `tag` (or an ID), or None when the engine does not hold it."""

    def held(self, tag: str) -> HeldImage:
        """The image `tag`, which the caller has just built or tagged; EngineError when it is not here."""

    def tags(self, repository: str) -> list[str]:
        """Every tag the engine holds of `repository`."""

    def save(self, ref: str, chunk_size: int) -> Iterator[bytes]:
        """The image's `docker save` archive, as it streams."""

    def load(self, chunks: Iterable[bytes]) -> None:
        """Load a `docker save` archive from its chunks; EngineError with the engine's words when it refuses it."""

    def name_image(self, image: str, reference: str) -> None:
        """Give the image `image` (a name or an ID) the name `reference` too."""

    def remove_image(self, ref: str, force: bool = False) -> None:
        """Take the name `ref` off its image (the image goes with its last name; by ID, `force` removes it with
        every name)."""

    def run_once(self, image: str, command: list[str], mounts: dict[Path, str], say: Callable[[str], None]) -> None:
        """Run `command` in a throwaway container of `image`, `mounts` bound, its output said line by line."""

    def output_of(self, image: str, entrypoint: str, args: list[str]) -> bytes:
        """What `entrypoint ARGS` prints in a throwaway container of `image`, without a network."""

    def versions(self) -> tuple[dict, dict]:
        """The engine's `docker version` and `docker info`."""

    def registries(self, timeout: int = 600) -> RegistryDoor:
        """The door to registries through this engine (its credentials), and to the images they move."""
