"""The one door to a Docker engine: which engine a command talks to (`--engine`), what it holds
(images, containers, logs), Compose and one-off containers on it, and how this machine reaches
what it publishes. The clients' exceptions become the project's one-line errors here.

An engine is named the way Docker names it: a `DOCKER_HOST` URL (unix://, tcp://, ssh://) or a
context name. Containers publish on the engine host's 127.0.0.1, so an engine on another machine
is reached through an SSH tunnel (ssh:// engines), or directly when serve.bind is not loopback.
The docker CLI's own doors (builds, contexts, deadlines) are dockercli.py; registries' is registry.py.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from servekit.engines.compose import PROJECT, compose_dir, compose_files, env_file, write_env
from servekit.engines.dockercli import docker_cli
from servekit.engines.failures import prepare_failure
from servekit.engines.gpuaccess import GpuAccess, decide
from servekit.engines.protocol import Deploying, Engine, ServerState
from servekit.engines.registry import RegistryDoor
from servekit.errors import BootFailed, EnvironmentProblem, UserError
from servekit.image.launcher import CONTAINER_PORT
from servekit.layout import PROFILE_LABEL, PROJECT_LABEL
from servekit.output import Say
from servekit.waiting import until
from servekit.wsl2.detect import is_wsl2

if TYPE_CHECKING:  # the clients' types alone: each client is imported where it is used (the SDK costs a third of a second)
    from docker.models.containers import Container
    from docker.models.images import Image
    from python_on_whales import DockerClient as WhalesClient

    from docker import DockerClient

PREPARE_WAIT_S = 24 * 3600  # its log has ended when this wait begins: the container is exiting, not downloading


class EngineError(EnvironmentProblem):
    """A Docker engine or Compose refused or failed; the message says what was being done and what it said,
    `output` keeps the client's last lines (Compose's own output) for a report."""

    def __init__(self, message: str, reason: str, output: list[str] | None = None) -> None:
        super().__init__(message)
        self.reason = reason  # what the engine or Compose said, alone
        self.output = output or []


def said(exc: BaseException) -> str:
    """What the engine or Compose answered, in one line, for an exception of either client."""
    client = type(exc).__module__.split(".")[0]
    if client == "python_on_whales":  # the CLI's own last words are the reason (Compose's "Error response ...")
        out = getattr(exc, "stderr", None) or str(exc)
        lines = (out.decode(errors="replace") if isinstance(out, bytes) else out).strip().splitlines()
        return lines[-1].strip()[:400] if lines else type(exc).__name__
    text = str(getattr(exc, "explanation", None) or exc).replace("Error while fetching server API version: ", "")
    lines = text.strip().splitlines()
    return lines[0][:400] if lines else type(exc).__name__


def is_client_error(exc: BaseException) -> bool:
    """An exception of the docker SDK, python-on-whales, or the HTTP layer under the SDK."""
    return type(exc).__module__.split(".")[0] in ("docker", "python_on_whales", "requests", "urllib3")


@contextmanager
def docker_errors(what: str) -> Iterator[None]:
    """Run a block against an engine; a client's exception leaves it as an EngineError: `what: <engine said>`."""
    try:
        yield
    except Exception as exc:
        if not is_client_error(exc):
            raise
        out = getattr(exc, "stderr", None) or ""
        out = out.decode(errors="replace") if isinstance(out, bytes) else str(out)
        reason = said(exc)
        raise EngineError(f"{what}: {reason}", reason, out.strip().splitlines()[-12:]) from None

LOCAL = "local"
SCHEMES = ("unix", "tcp", "ssh")
DEFAULT_SOCKET = "unix:///var/run/docker.sock"


@dataclass(frozen=True)
class DockerEngine:
    """A Docker engine, this machine's or another's: images, Compose, containers."""

    given: str  # as typed: "local", a URL, or a context name
    url: str  # the engine's API endpoint
    context: str | None = None

    @property
    def is_local(self) -> bool:
        """This machine's default engine, the one compose/.env is written for."""
        return self.given == LOCAL

    @property
    def scheme(self) -> str:
        return urlparse(self.url).scheme

    @property
    def hostname(self) -> str:
        return urlparse(self.url).hostname or ""

    @property
    def same_machine(self) -> bool:
        """Whether its 127.0.0.1 is ours (a socket here, or TCP on loopback)."""
        if self.scheme == "unix":
            return True
        return self.scheme == "tcp" and _is_loopback(self.hostname)

    @property
    def label(self) -> str:
        """A short name for folders and tables."""
        if self.is_local or self.context:
            return self.given
        parsed = urlparse(self.url)
        if self.scheme == "unix":  # /run/gpu-box/docker.sock -> unix-gpu-box
            path = PurePosixPath(parsed.path)
            where = path.parent.name if path.name == "docker.sock" else path.stem
        else:
            where = (parsed.hostname or "") + (f"-{parsed.port}" if parsed.port else "")
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{self.scheme}-{where}").strip("-")

    @cached_property
    def client(self) -> DockerClient:
        """The SDK client every door below uses (one per engine, made on first use)."""
        return self.sdk()

    def sdk(self, timeout: int = 60) -> DockerClient:
        """A docker SDK client for this engine (ssh:// through the ssh binary, so ~/.ssh/config applies)."""
        import docker  # the SDK takes a third of a second to import: only what talks to an engine pays for it
        if self.is_local:
            return docker.from_env(timeout=timeout)
        return docker.from_env(environment={**os.environ, "DOCKER_HOST": self.url}, timeout=timeout,
                               use_ssh_client=self.scheme == "ssh")

    def registries(self, timeout: int = 600) -> RegistryDoor:
        """The door to registries through this engine (its credentials), and to the images they move."""
        return RegistryDoor(self.sdk(timeout))

    def cli_options(self) -> dict:
        """python-on-whales DockerClient keywords that point the CLI at this engine."""
        if self.is_local:
            return {}
        return {"context": self.context} if self.context else {"host": self.url}

    def host_kind(self) -> str:
        """wsl2 or native, for `--host auto`: this machine's signs for the local engine, the engine's kernel
        (Docker Desktop on WSL2 runs a `...-microsoft-standard-WSL2` one) for any other."""
        if self.is_local:
            return "wsl2" if is_wsl2() else "native"
        return host_kind_of(self.sdk(timeout=15).info())

    def gpu_access(self) -> GpuAccess:
        """How a container here gets an NVIDIA GPU (the toolkit, or the devices route), if it can, and how that was
        decided (its `docker info` and `docker version`, and this machine's device nodes)."""
        client = self.sdk(timeout=15)
        return decide(gpu_access_of(client.info(), client.version()), self.same_machine)

    def gpu_problem(self) -> str | None:
        access = self.gpu_access()
        return None if access.route else access.how

    def answers(self) -> bool:
        try:
            self.sdk(timeout=10).ping()
            return True
        except Exception:  # the SDK raises several kinds for an unreachable engine
            return False

    def image(self, tag: str) -> Image | None:
        """The SDK image `tag`, or None when the engine does not hold it."""
        import docker  # the SDK takes a third of a second to import: only what talks to an engine pays for it
        with docker_errors(f"engine {self.given}: inspect {tag}"):
            try:
                return self.client.images.get(tag)
            except docker.errors.ImageNotFound:
                return None

    def image_exists(self, tag: str) -> bool:
        return self.image(tag) is not None

    def held(self, tag: str) -> Image:
        """The SDK image `tag`, which the caller has just built or tagged; an EngineError when it is not here."""
        image = self.image(tag)
        if image is None:
            raise EngineError(f"engine {self.given}: {tag} is not here", "no such image", [])
        return image

    def tags(self, repository: str) -> list[str]:
        """Every tag the engine holds of `repository`."""
        with docker_errors(f"engine {self.given}: images of {repository}"):
            return [tag for image in self.client.images.list(name=repository) for tag in image.tags]

    def save(self, ref: str, chunk_size: int) -> Iterator[bytes]:
        """The image's `docker save` archive, as it streams."""
        return self.sdk(timeout=3600).api.get_image(ref, chunk_size=chunk_size)

    def load(self, chunks: Iterable[bytes]) -> None:
        """Load a `docker save` archive from its chunks; EngineError with the engine's words when it refuses it."""
        for message in self.sdk(timeout=3600).api.load_image(iter(chunks)):
            if "error" in message:
                raise EngineError(f"engine {self.given}: load: {message['error']}", str(message["error"]))

    def name_image(self, image: str, reference: str) -> None:
        """Give the image `image` (a name or an ID) the name `reference` too."""
        with docker_errors(f"engine {self.given}: tag {image} {reference}"):
            self.client.images.get(image).tag(*reference.rpartition(":")[::2])

    def remove_image(self, ref: str, force: bool = False) -> None:
        """Take the name `ref` off its image (the image goes with its last name; by ID, `force` removes it with
        every name)."""
        with docker_errors(f"engine {self.given}: remove {ref}"):
            self.client.images.remove(ref, force=force, noprune=False)

    def output_of(self, image: str, entrypoint: str, args: list[str]) -> bytes:
        """What `entrypoint ARGS` prints in a throwaway container of `image`, without a network."""
        import docker  # the SDK takes a third of a second to import: only what talks to an engine pays for it
        with docker_errors(f"engine {self.given}: run {entrypoint} in {image}"):
            container = self.sdk(timeout=300).containers.run(image, args, entrypoint=entrypoint, detach=True,
                                                             network_mode="none")
            try:
                code = container.wait(timeout=300)["StatusCode"]
                out = container.logs(stdout=True, stderr=False)
                if code != 0:  # as the SDK's own run says it
                    raise docker.errors.ContainerError(container, code, args, image,
                                                       container.logs(stdout=False, stderr=True))
                return out
            finally:
                container.remove(force=True, v=True)  # the image's VOLUMEs go with it, as `docker run --rm` does

    def versions(self) -> tuple[dict, dict]:
        """The engine's `docker version` and `docker info`."""
        with docker_errors(f"engine {self.given}: version"):
            return self.client.version(), self.client.info()

    def compose(self, **options: Any) -> WhalesClient:
        """A python-on-whales client for Compose on this engine; wrap its calls in docker_errors()."""
        from python_on_whales import DockerClient  # only Compose needs it
        return DockerClient(**self.cli_options(), **options)

    def image_id(self, tag: str) -> str | None:
        image = self.image(tag)
        return image.id if image else None

    def serving(self, tag: str, pins: dict[str, str]) -> tuple[str, dict[str, str]]:
        return tag, {}  # the image carries its stack

    def gpu_by_devices(self) -> bool:
        try:
            return self.gpu_access().devices
        except Exception:  # no engine answers yet: `up` says so itself; the toolkit's reservation is the default
            return False

    def servers(self, profile: str | None = None) -> list[DockerServer]:
        labels = [f"{PROJECT_LABEL}={PROJECT}", *([f"{PROFILE_LABEL}={profile}"] if profile else [])]
        with docker_errors(f"engine {self.given}: list containers"):
            return [DockerServer(self, c) for c in self.client.containers.list(all=True, filters={"label": labels})]

    # --- serving a profile: the process engine (process.py) is the other implementation of these ------------
    serves_images = True  # builds, sends and runs images; Compose starts its profiles

    def write_settings(self, dep: Deploying) -> Path:
        return write_env(dep)

    def settings_file(self, dep: Deploying) -> Path:
        return env_file(dep)

    def compose_for(self, dep: Deploying, profiles: list[str] | None = None,
                    knobs: dict[str, str] | None = None) -> WhalesClient:
        """Compose for deployment `dep` on this engine; `knobs` go into that one process's environment, where they
        win over the shell's (so parallel boots with different knobs do not share them)."""
        # BIND and PORT (the source's spellings, which compose.yaml reads first) as this deployment resolved them
        setting = {**(knobs or {}), "BIND": dep.bind, "PORT": str(dep.port)}
        call = ["env", *(f"{k}={v}" for k, v in setting.items()), "docker"]
        return self.compose(compose_files=compose_files(dep), compose_project_name=PROJECT,
                            compose_project_directory=compose_dir(dep), compose_env_files=[env_file(dep)],
                            compose_profiles=profiles or [], client_call=call)

    def prepare(self, dep: Deploying, profile: str, knobs: dict[str, str] | None = None, on_line: Callable[[str], None] | None = None) -> list[str]:
        """Compose's prepare service for the profile, run to its end with its log followed; its lines."""
        client = self.compose_for(dep, [profile], {**(knobs or {}), "SERVEKIT_PROFILE": profile})
        # A stopped container left by a run that was killed keeps its old mounts (a secret file that is gone),
        # and Compose would start it as it is: remove stopped ones first. A running server stays.
        with docker_errors(f"prepare for {profile} on engine {self.given}"):
            client.compose.rm(stop=False)
            client.compose.up(services=["prepare"], detach=True, quiet=True)
            found = self.client.containers.list(all=True, filters={"label": [
                f"{PROJECT_LABEL}={PROJECT}", f"{PROFILE_LABEL}=prepare"]})
            if not found:
                raise BootFailed("compose started no prepare container", "", [])
            container, lines, pending = found[0], [], b""
            for chunk in container.logs(stream=True, follow=True):
                pending += chunk
                *whole, pending = pending.split(b"\n")
                for raw in whole:
                    lines.append(raw.decode(errors="replace").rstrip("\r"))
                    if on_line:
                        on_line(lines[-1])
            code = container.wait(timeout=PREPARE_WAIT_S)["StatusCode"]
        if pending:
            lines.append(pending.decode(errors="replace"))
        if code != 0:
            raise prepare_failure(lines, code)
        return lines

    def up(self, dep: Deploying, profile: str, knobs: dict[str, str] | None = None) -> None:
        """Start the profile through Compose, its prepare service done (prepare() above); None (the caller finds
        the container)."""
        client = self.compose_for(dep, [profile], {**(knobs or {}), "SERVEKIT_PROFILE": profile})
        with docker_errors(f"up {profile} on engine {self.given}"):
            client.compose.up(services=[profile], detach=True, quiet=True, dependencies=False)
        return None

    def down(self, dep: Deploying, profile: str | None = None) -> None:
        """Stop and remove the profile's container (every one of the project's when None); volumes stay. Compose
        reads the env file even to take a project down: one never written is written first."""
        if not env_file(dep).exists():
            write_env(dep)
        client = self.compose_for(dep, ["*"])
        with docker_errors(f"down {profile or ''} on engine {self.given}".replace("  ", " ")):
            if profile:
                client.compose.rm(services=[profile, "prepare"], stop=True)
            else:
                client.compose.down(remove_orphans=True, quiet=True)

    def run_once(self, image: str, command: list[str], mounts: dict[Path, str], say: Say = print) -> None:
        """Run `command` in a throwaway container of `image` as this machine's user, the host paths of `mounts`
        bound at their container paths, its output shown line by line; raise EngineError unless it exits 0."""
        with docker_errors(f"engine {self.given}: run {image}"):
            container = self.client.containers.run(
                image, command, entrypoint=[], detach=True, user=f"{os.getuid()}:{os.getgid()}",
                environment={"HOME": "/tmp"}, network_mode="none",
                volumes={str(host): {"bind": inside, "mode": "rw"} for host, inside in mounts.items()})
            try:
                for line in container.logs(stream=True, follow=True):
                    say(line.decode(errors="replace").rstrip())
                code = container.wait(timeout=3600)["StatusCode"]
            finally:
                container.remove(force=True, v=True)  # the image's VOLUMEs go with it, as `docker run --rm` does
        if code != 0:
            raise EngineError(f"engine {self.given}: {' '.join(command[:2])} in {image} exited {code}", f"exit {code}")

    def check(self) -> None:
        """Raise EnvironmentProblem, naming the engine, when it does not answer."""
        if self.scheme == "unix" and not Path(urlparse(self.url).path).exists():
            raise EnvironmentProblem(f"no Docker engine answers at {self.url} (engine {self.given}): no socket at "
                                     f"{urlparse(self.url).path}; `make engine` starts this machine's")
        try:
            self.sdk(timeout=15).ping()
        except Exception as exc:  # the SDK raises several kinds for an unreachable engine
            raise EnvironmentProblem(f"no Docker engine answers at {self.url} (engine {self.given}): "
                                     f"{said(exc)[:200]}") from None


class DockerServer:
    """A profile's container, as our Server: what the watcher, `ps`, `logs` and the checks read of it."""

    def __init__(self, engine: DockerEngine, container: Container) -> None:
        self.engine, self.container = engine, container
        self.name = container.name
        self.profile = (container.labels or {}).get(PROFILE_LABEL) or ""

    @property
    def image_id(self) -> str | None:
        return self.container.image.id if self.container.image else None

    def state(self, fresh: bool = False) -> ServerState:
        if fresh:
            with docker_errors(f"engine {self.engine.given}: inspect {self.name}"):
                self.container.reload()
        return state_of(self.container)

    def log(self) -> str:
        with docker_errors(f"engine {self.engine.given}: logs of {self.name}"):
            return self.container.logs().decode("utf-8", "replace")

    def follow_log(self, tail: int | None = None, follow: bool = True, timestamps: bool = False) -> Iterator[bytes]:
        return self.container.logs(stream=True, follow=follow, timestamps=timestamps,
                                   tail="all" if tail is None else tail)

    def memory(self) -> Iterator[int]:
        for stats in self.container.stats(stream=True, decode=True):
            usage = memory_in_use(stats.get("memory_stats") or {})
            if usage:
                yield usage

    def environ(self) -> dict[str, str]:
        """What the launcher exported before it exec'd vLLM, as PID 1 of the container holds it (not only the
        container's own environment)."""
        # Through the CLI, not the SDK's exec_run: over ssh:// that one ends in a BrokenPipeError after the command
        # ran (docker/docker-py#3218), and the CLI's own ssh transport does not.
        try:
            done = docker_cli(["exec", self.name, "cat", "/proc/1/environ"], timeout=60, engine=self.engine,
                              text=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise EngineError(f"the server's environment cannot be read: {said(exc)}", said(exc)) from None
        if done.returncode != 0:
            why = done.stderr.decode("utf-8", "replace").strip()[-200:]
            raise EngineError(f"the server's environment cannot be read: docker exec exited {done.returncode}"
                              + (f": {why}" if why else ""), why)
        return parse_environ(done.stdout)


def memory_in_use(memory_stats: dict) -> int | None:
    """A container's memory as `docker stats` shows it: the cgroup's usage less its inactive page cache (files
    read once, such as the weights, which the kernel gives back under pressure), on cgroup v1 and v2 alike."""
    usage = memory_stats.get("usage")
    if not usage:
        return None
    stats = memory_stats.get("stats") or {}
    for key in ("total_inactive_file", "inactive_file"):  # cgroup v1 names it total_; v2 does not
        if key in stats and stats[key] < usage:
            return usage - stats[key]
    return usage


def state_of(container: Container) -> ServerState:
    """A container's state as our record, from its inspect data (`attrs`); its port, the one CONTAINER_PORT is
    published on."""
    attrs = container.attrs
    state, config = attrs.get("State") or {}, attrs.get("Config") or {}
    ports = ((attrs.get("NetworkSettings") or {}).get("Ports") or {}).get(f"{CONTAINER_PORT}/tcp") or []
    return ServerState(name=container.name, profile=(container.labels or {}).get(PROFILE_LABEL),
                       status=state.get("Status") or "unknown", running=bool(state.get("Running")),
                       exit_code=state.get("ExitCode"), restarts=int(attrs.get("RestartCount") or 0),
                       started_at=state.get("StartedAt") or "",
                       health=(state.get("Health") or {}).get("Status"), image=config.get("Image"),
                       env=dict(e.split("=", 1) for e in config.get("Env") or [] if "=" in e),
                       port=int(ports[0]["HostPort"]) if ports else None)


def parse_environ(raw: bytes) -> dict[str, str]:
    """/proc/PID/environ: NUL-separated NAME=VALUE entries."""
    pairs = (entry.decode("utf-8", "replace").partition("=") for entry in raw.split(b"\0") if b"=" in entry)
    return {name: value for name, _, value in pairs}


def gpu_access_of(info: dict, version: dict) -> tuple[bool, str]:
    """Whether an engine can give a container an NVIDIA GPU, from its `docker info` (GET /info) and `docker version`
    (GET /version), and how that was decided, in words. Yes for an `nvidia` runtime (the NVIDIA Container Toolkit),
    for NVIDIA CDI devices, and for Docker Desktop on its WSL2 backend, which Docker documents as the one way Docker
    Desktop gives containers a GPU: `--gpus all` reaches the card through WSL's GPU paravirtualisation, with no
    runtime listed. Docker Desktop on another backend (Hyper-V, macOS: a linuxkit kernel) has none."""
    runtimes = info.get("Runtimes") or {}
    devices = [d.get("ID", "") for d in info.get("DiscoveredDevices") or []]
    if "nvidia" in runtimes:
        return True, (f"the engine lists the nvidia runtime ({(runtimes['nvidia'] or {}).get('path', 'nvidia')}, the "
                      "NVIDIA Container Toolkit)")
    nvidia_devices = [d for d in devices if d.startswith("nvidia.com/gpu")]
    if nvidia_devices:
        return True, f"the engine has NVIDIA CDI devices ({', '.join(nvidia_devices)})"
    platform = ((version or {}).get("Platform") or {}).get("Name") or ""
    desktop = platform if platform.startswith("Docker Desktop") else \
        ("Docker Desktop" if (info.get("OperatingSystem") or "") == "Docker Desktop" else "")
    kernel = info.get("KernelVersion") or (version or {}).get("KernelVersion") or "?"
    if desktop and host_kind_of({"KernelVersion": kernel}) == "wsl2":
        return True, (f"{desktop} on its WSL2 backend (kernel {kernel}): Docker Desktop gives containers the GPU "
                      "through WSL2's GPU paravirtualisation (`--gpus all`, no nvidia runtime listed), as Docker "
                      "documents for Windows with the WSL2 backend")
    listed = ", ".join(sorted(runtimes)) or "none"
    if desktop:
        return False, (f"{desktop} not on its WSL2 backend (kernel {kernel}): Docker Desktop gives containers a GPU "
                       "only on Windows with the WSL2 backend; turn on 'Use the WSL 2 based engine' in its settings")
    return False, (f"it has no NVIDIA runtime (runtimes: {listed}) and no NVIDIA CDI device, and it is not Docker "
                   "Desktop on WSL2, so no container there can have a GPU; install the NVIDIA Container Toolkit on "
                   "that host")


def host_kind_of(info: dict) -> str:
    """wsl2 or native from an engine's `docker info` (GET /info)."""
    return "wsl2" if "microsoft" in (info.get("KernelVersion") or "").lower() else "native"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve(spec: str | None) -> DockerEngine:
    """`--engine` naming a Docker engine: None or "local" is this machine's default engine, else a URL or a context
    name (servekit.engines.resolve takes venv:PATH too)."""
    if not spec or spec == LOCAL:
        return DockerEngine(LOCAL, os.environ.get("DOCKER_HOST") or DEFAULT_SOCKET)
    if "://" in spec:
        parsed = urlparse(spec)
        if parsed.scheme not in SCHEMES:
            raise UserError(f"--engine {spec}: expected a unix://, tcp:// or ssh:// URL, a Docker context name or "
                            "venv:PATH")
        if parsed.scheme == "unix" and not parsed.path:
            raise UserError(f"--engine {spec}: a unix:// URL names a socket path, e.g. unix:///run/docker.sock")
        if parsed.scheme != "unix" and not parsed.hostname:
            raise UserError(f"--engine {spec}: no host in the URL, e.g. ssh://user@gpu-box or tcp://10.0.0.5:2376")
        return DockerEngine(spec, spec)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", spec):
        raise UserError(f"--engine {spec!r}: expected a unix://, tcp:// or ssh:// URL, a Docker context name or "
                        "venv:PATH")
    found = docker_cli(["context", "inspect", spec, "--format", "{{json .Endpoints.docker}}"], timeout=20)
    if found.returncode != 0:
        raise UserError(f"--engine {spec}: no Docker context of that name (`docker context ls` lists them); or "
                        "pass a URL such as ssh://user@gpu-box")
    return DockerEngine(spec, json.loads(found.stdout)["Host"], context=spec)


def local() -> DockerEngine:
    """This machine's engine: where images are built, bases made and `compose/.env` points."""
    return resolve(None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def tunnel_command(engine: Engine, local_port: int, remote_port: int) -> list[str]:
    parsed = urlparse(engine.url)
    where = f"{parsed.username}@{parsed.hostname}" if parsed.username else parsed.hostname
    assert where, "an ssh:// engine names its host (resolve checks it)"
    return ["ssh", "-N", "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes",
            *(["-p", str(parsed.port)] if parsed.port else []),
            "-L", f"127.0.0.1:{local_port}:127.0.0.1:{remote_port}", where]


def address(engine: Engine, bind: str, port: int) -> str:
    """Where the server is, in words a person can use after this command has ended."""
    if engine.same_machine:
        return local_url(bind, port)
    if not _is_loopback(bind):
        return f"http://{engine.hostname}:{port}"
    command = tunnel_command(engine, port, port)
    tunnel = " ".join(command[:2] + command[-3:])  # ssh -N [-p P] -L ... host, without the batch options
    return f"127.0.0.1:{port} on {engine.hostname} (from here: {tunnel}, then http://127.0.0.1:{port})"


def local_url(bind: str, port: int) -> str:
    """The URL of a port published on this machine at `bind` (an IPv6 address in brackets, as a URL writes it)."""
    host = "127.0.0.1" if bind in ("0.0.0.0", "::") else bind
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


@contextmanager
def reach(engine: Engine, bind: str, port: int, wait_s: float = 20) -> Iterator[str]:
    """Yield the base URL at which this machine reaches port `port` published on the engine's host."""
    if engine.same_machine:
        yield local_url(bind, port)
        return
    if not _is_loopback(bind):  # published on the engine host's own addresses: go straight there
        yield f"http://{engine.hostname}:{port}"
        return
    if engine.scheme != "ssh":
        raise UserError(f"engine {engine.given}: the server publishes on that machine's 127.0.0.1, which cannot be "
                        f"reached from here; use ssh://user@{engine.hostname} (servekit tunnels through it) or set "
                        "serve.bind in images.yaml")
    if not shutil.which("ssh"):
        raise EnvironmentProblem("an ssh:// engine needs the ssh client here (apt-get install openssh-client)")
    local = free_port()
    proc = subprocess.Popen(tunnel_command(engine, local, port), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        def opened() -> bool:
            if proc.poll() is not None:
                raise EnvironmentProblem(f"engine {engine.given}: the SSH tunnel to its port {port} did not open: "
                                         f"{proc.stderr.read().strip()[:300] if proc.stderr else 'ssh exited'}")
            return _accepts(local)
        if not until(opened, wait_s, 0.1):
            raise EnvironmentProblem(f"engine {engine.given}: the SSH tunnel to its port {port} did not open: "
                                     f"timed out after {wait_s:.0f} s")
        yield f"http://127.0.0.1:{local}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
