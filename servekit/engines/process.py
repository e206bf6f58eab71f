"""The process engine (`--engine venv:PATH`): each profile served as a process of a Python environment
instead of a container, for a host without Docker (an air-gapped GPU host, a box where the stack was
installed by hand from docs/install.md).

It runs what the image runs: the launcher from servekit/image/ with profiles.json rendered from
images.yaml (the model's folders under this engine's own), the same knobs from the same places, and
the prepare step before each serve. A ProcessServer is a Server (protocol.py) as a container's DockerServer
is, so the watcher, the memory sampler, `ps` and `logs` stay one code path. What it starts
is recorded beside the environment (PATH/var/servekit/<project>/): a record per profile (pid, the
process's start time, so a reused pid is never taken for it, the port and knobs) and its log.
`down` stops the whole process group and removes both.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
from packaging.utils import canonicalize_name

from servekit.config.matrix import Matrix
from servekit.config.profiles import render_profiles
from servekit.engines.docker import PROJECT, EngineError
from servekit.engines.failures import prepare_failure
from servekit.engines.protocol import Deploying, ServerState
from servekit.errors import EnvironmentProblem, UserError
from servekit.gpu import NvmlUnavailable, list_gpus
from servekit.image import module_command, module_env
from servekit.image.boundary import write_text_atomic
from servekit.image.components import MANIFEST
from servekit.image.knobs import KNOBS
from servekit.image.series import check_applied, settled_files, site_vllm_dir
from servekit.layout import staged_env
from servekit.waiting import until
from servekit.wsl2.detect import is_wsl2

SCHEME = "venv"
STOP_GRACE_S = 30.0  # SIGTERM, then this long for vLLM to shut down, then SIGKILL
# What a distribution's version is read with, inside the environment (importlib.metadata: no import of vLLM).
# Every distribution in path order; the first of a name wins, as import does (an environment can shadow what a
# folder later on its path holds).
VERSIONS = ("import importlib.metadata as m, json; "
            "print(json.dumps([[d.metadata['Name'], d.version] for d in m.distributions()]))")


def _started(pid: int) -> float | None:
    """When process `pid` started (psutil's create time), or None when there is none or it has exited (a zombie):
    with the pid, its identity."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except psutil.Error:
        return None


def _group_members(pgid: int) -> list[int]:
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc.pid)
        except OSError:  # gone between the listing and the question
            continue
    return members


def _rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total


@dataclass(frozen=True)
class ProcessEngine:
    """An engine whose servers are processes of the Python environment at `prefix` (a venv's folder)."""
    given: str  # as typed: venv:PATH
    url: str  # venv:<the folder, resolved>
    prefix: Path
    serves_images = False  # its environment is the image: nothing to build or send

    is_local = False  # compose/.env is not its
    same_machine = True  # its servers publish on this machine's addresses
    hostname = "127.0.0.1"
    scheme = SCHEME

    def write_settings(self, dep: Deploying) -> None:
        return None  # no tool of its own reads a file: the launcher's environment is made at each start

    def settings_file(self, dep: Deploying) -> None:
        return None

    def prepare(self, dep: Deploying, profile: str, knobs: dict[str, str] | None = None, on_line: Callable[[str], None] | None = None) -> list[str]:
        return prepare(self, dep, profile, knobs, on_line)

    def up(self, dep: Deploying, profile: str, knobs: dict[str, str] | None = None) -> ProcessServer:
        return up(self, dep, profile, knobs)

    def down(self, dep: Deploying, profile: str | None = None) -> None:
        down(self, profile)

    def gpu_by_devices(self) -> bool:
        return False  # no container: the process has this machine's devices

    def image_id(self, tag: str) -> str | None:
        return None

    def serving(self, tag: str, pins: dict[str, str]) -> tuple[str, dict[str, str]]:
        return self.describe(pins), pins  # the environment must hold the target's pins

    @property
    def label(self) -> str:
        return f"{SCHEME}-{self.prefix.name}"

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"

    @property
    def state(self) -> Path:
        return self.prefix / "var" / "servekit" / PROJECT

    def check(self) -> None:
        if not os.access(self.python, os.X_OK):
            raise EnvironmentProblem(f"engine {self.given}: no Python environment there ({self.python} is missing); "
                                     "make one as docs/install.md says")

    def answers(self) -> bool:
        return os.access(self.python, os.X_OK)

    def host_kind(self) -> str:
        return "wsl2" if is_wsl2() else "native"

    def gpu_problem(self) -> str | None:
        try:
            return None if list_gpus() else "NVML sees no GPU on this machine"
        except NvmlUnavailable as exc:
            return str(exc)

    def image_exists(self, tag: str) -> bool:  # nothing to build or send: the environment is the image
        return True

    def versions(self) -> dict[str, str]:
        """Every distribution installed in the environment: its normalized name (PEP 503) to its version."""
        self.check()
        done = subprocess.run([str(self.python), "-c", VERSIONS], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise EnvironmentProblem(f"engine {self.given}: its Python failed: "
                                     f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
        found: dict[str, str] = {}
        for name, version in json.loads(done.stdout):
            found.setdefault(canonicalize_name(name), version)
        return found

    def describe(self, pins: dict[str, str]) -> str:
        """What stands for the image tag in reports and `ps`: the environment and the vLLM pinned in it."""
        vllm = next((f"{name} {version}" for name, version in pins.items() if name.startswith("vllm")), "vllm")
        return f"{self.prefix} ({vllm})"

    def servers(self, profile: str | None = None) -> list[ProcessServer]:
        """The servers this engine records (the profile's only, when named)."""
        found = []
        for record in sorted(self.state.glob("*.json")) if self.state.is_dir() else []:
            server = ProcessServer.read(self, record)
            if server and (profile is None or server.profile == profile):
                found.append(server)
        return found


def resolve(spec: str) -> ProcessEngine:
    path = spec.split(":", 1)[1]
    if not path:
        raise UserError(f"--engine {spec}: name the environment's folder, e.g. --engine venv:/opt/venv")
    prefix = Path(path).expanduser().resolve()
    return ProcessEngine(spec, f"{SCHEME}:{prefix}", prefix=prefix)


class ProcessServer:
    """One profile's server process, as our Server."""

    image_id = None  # it runs an environment, not an image

    def __init__(self, engine: ProcessEngine, record: dict, popen: subprocess.Popen | None = None) -> None:
        self.engine, self.record, self.popen = engine, record, popen
        self.name = f"{PROJECT}-{record['profile']}"
        self.profile: str = record["profile"]

    @classmethod
    def read(cls, engine: ProcessEngine, path: Path) -> ProcessServer | None:
        try:
            return cls(engine, json.loads(path.read_text()))
        except (OSError, ValueError, KeyError):
            return None

    @property
    def log_path(self) -> Path:
        return self.engine.state / f"{self.record['profile']}.log"

    @property
    def running(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return _started(self.record["pid"]) == self.record["started"]

    def state(self, fresh: bool = False) -> ServerState:
        running = self.running
        code = self.popen.returncode if self.popen is not None and not running else None
        return ServerState(name=self.name, profile=self.record["profile"], status="running" if running else "exited",
                           running=running, exit_code=code, restarts=0, started_at=self.record["started_at"], health=None,
                           image=self.record["image"], env=dict(self.record["knobs"]), port=self.record["port"])

    def log(self) -> str:
        return self.log_path.read_bytes().decode("utf-8", "replace") if self.log_path.exists() else ""

    def follow_log(self, tail: int | None = None, follow: bool = True,
                   timestamps: bool = False) -> Iterator[bytes]:
        """The log's bytes as they come (its lines carry no time of their own); with `follow`, until the process has
        exited and its last lines are read."""
        return self._stream(follow, tail)

    def _stream(self, follow: bool, tail: int | None) -> Iterator[bytes]:
        with open(self.log_path, "rb") as f:
            if tail is not None:
                lines = f.read().splitlines(keepends=True)
                yield b"".join(lines[-tail:] if tail else [])
            while True:
                chunk = f.read(65536)
                if chunk:
                    yield chunk
                    continue
                if not follow or not self.running:
                    rest = f.read()
                    if rest:
                        yield rest
                    return
                time.sleep(0.1)

    def environ(self) -> dict[str, str]:
        """The serving process's environment as the kernel holds it (the launcher execs vLLM in its own pid)."""
        try:
            return psutil.Process(self.record["pid"]).environ()
        except psutil.Error as exc:
            why = f"the environment of process {self.record['pid']} cannot be read ({exc})"
            raise EngineError(f"the server's environment cannot be read: {why}", why) from None

    def memory(self) -> Iterator[int]:
        """Memory of the whole process group (vLLM's engine core is a child), once a second."""
        while self.running:
            yield _rss_bytes(_group_members(self.record["pid"]))
            time.sleep(1.0)


# --- starting and stopping ---------------------------------------------------------------------

def _matrix(dep: Deploying) -> Matrix:
    """The matrix the deployment serves from, which a process engine renders the image's files from."""
    if dep.matrix is None:
        raise UserError(f"engine {dep.engine.given}: a process engine serves from images.yaml, and this deployment "
                        "names none")
    return dep.matrix


def _profiles(dep: Deploying, state: Path) -> dict:
    """profiles.json as the image has it, with the model's folders under this engine's and the generated model
    read from the repository (where the image has it baked)."""
    matrix = _matrix(dep)
    rendered = render_profiles(matrix, dep.target)
    spec = matrix.targets[dep.target]
    model = rendered["model"]
    model["path"] = str(state / "models" / spec.model)
    for name, drafter in model["drafters"].items():
        drafter["path"] = str(state / "models" / f"{spec.model}-{name}")
    if model["baked"]:  # a generated model: its folder is in the repository (the matrix names one, checked at load)
        model["baked"] = str(dep.root / (matrix.models[spec.model].dir or ""))
    return rendered


def check_environment(engine: ProcessEngine, dep: Deploying) -> None:
    """Refuse an environment that is not the target's: a pinned package at another version (pins left out with
    --without excepted), or a patch of the series not applied to its vLLM (docs/install.md says how to make one)."""
    have = engine.versions()
    pins = dep.pins
    wrong = [f"{name} {have.get(canonicalize_name(name), 'missing')} (pinned {version})"
             for name, version in pins.items() if have.get(canonicalize_name(name)) != version]
    if wrong:
        raise UserError(f"engine {engine.given}: not the {dep.target} target's stack: {'; '.join(wrong)}; install "
                        "it as docs/install.md says")
    unapplied = check_applied(dep.root / _matrix(dep).series.dir, site_vllm_dir(str(engine.python)), dep.target,
                              settled_files(staged_env(dep.root, dep.target) / "components" / MANIFEST))
    if unapplied:
        raise UserError(f"engine {engine.given}: {unapplied[0]}; apply the series with `python3 build.py patch-env "
                        f"--python {engine.python} --target {dep.target}`")


def _environment(engine: ProcessEngine, dep: Deploying, profiles_file: Path,
                 knobs: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, "SERVEKIT_PROFILES": str(profiles_file), "SERVEKIT_HOST": dep.host,
           "API_KEY_FILE": str(dep.api_key_file), "HF_TOKEN_FILE": str(dep.api_key_file.parent / "hf_token"),
           "HOST": dep.bind, "PORT": str(dep.port), "PYTHONUNBUFFERED": "1",
           "PATH": f"{engine.prefix / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", **knobs}
    env.pop("PYTHONPATH", None)  # the environment's own packages, and the launcher's package from this checkout
    return module_env(env)


def _launched(engine: ProcessEngine, dep: Deploying, profile: str,
              knobs: dict[str, str] | None) -> tuple[list[str], dict[str, str], Path]:
    """The launcher's command, its environment and the profile's log, its profiles file written."""
    check_environment(engine, dep)  # which checks that the environment is there first
    state = engine.state
    state.mkdir(parents=True, exist_ok=True)
    profiles_file = state / "profiles" / f"{dep.target}.json"  # beside the records (*.json), not among them
    write_text_atomic(profiles_file, json.dumps(_profiles(dep, state), indent=2) + "\n")
    launcher = module_command(str(engine.python), "launcher")
    return launcher, _environment(engine, dep, profiles_file, knobs or {}), state / f"{profile}.log"


def prepare(engine: ProcessEngine, dep: Deploying, profile: str, knobs: dict[str, str] | None = None,
            on_line: Callable[[str], None] | None = None) -> list[str]:
    """The model (and the drafter the profile serves with, no other) into place, each line of the launcher's prepare
    to `on_line` and the profile's log as it comes; its lines. A running server's folders are in place already."""
    existing = next(iter(engine.servers(profile)), None)
    if existing and existing.running:
        return []  # its log is the running server's
    launcher, env, log_path = _launched(engine, dep, profile, knobs)
    lines: list[str] = []
    with open(log_path, "w") as log, subprocess.Popen(
            [*launcher, "prepare", profile], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, cwd=engine.state, text=True, errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            lines.append(line.rstrip("\n"))
            if on_line:
                on_line(lines[-1])
    if proc.returncode != 0:
        log_path.unlink()
        raise prepare_failure(lines, proc.returncode)
    return lines


# vLLM names its ZMQ sockets by a fresh uuid in VLLM_RPC_BASE_PATH (the temporary folder by default) and leaves them
# when stopped: each server gets a folder of its own there, which `down` removes.
RPC_PREFIX = "servekit-rpc-"


def rpc_dir_of(record: dict) -> Path | None:
    """The server's socket folder, where its record names one this engine makes: a record is a file, and `down`
    removes nothing else."""
    folder = record.get("rpc_dir")
    path = Path(folder) if isinstance(folder, str) else None
    if path and path.parent == Path(tempfile.gettempdir()) and path.name.startswith(RPC_PREFIX):
        return path
    return None


def up(engine: ProcessEngine, dep: Deploying, profile: str, knobs: dict[str, str] | None = None) -> ProcessServer:
    """Start the prepared profile's server (prepare() above) in its own process group; its record written."""
    existing = next(iter(engine.servers(profile)), None)
    if existing and existing.running:
        return existing  # as `docker compose up` leaves a running service alone
    launcher, env, log_path = _launched(engine, dep, profile, knobs)
    state = engine.state
    rpc_dir = tempfile.mkdtemp(prefix=RPC_PREFIX)
    with open(log_path, "ab") as log:
        popen = subprocess.Popen([*launcher, "serve", profile],
                                 env={**env, "HF_HUB_OFFLINE": "1", "VLLM_RPC_BASE_PATH": rpc_dir},
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=state,
                                 start_new_session=True)  # its own group: `down` stops vLLM's children with it
    record = {"profile": profile, "pid": popen.pid, "started": _started(popen.pid), "port": dep.port,
              "bind": dep.bind, "target": dep.target, "image": dep.image,
              "started_at": dt.datetime.now(dt.UTC).isoformat(), "rpc_dir": rpc_dir,
              "knobs": {k: v for k, v in env.items() if k in _knob_names()}}
    write_text_atomic(state / f"{profile}.json", json.dumps(record, indent=2) + "\n")
    return ProcessServer(engine, record, popen)


def _knob_names() -> set[str]:
    return set(KNOBS)


def down(engine: ProcessEngine, profile: str | None = None) -> None:
    """Stop the profile's process group (every profile's when None) and remove what it left."""
    for server in engine.servers(profile):
        if server.running:
            stop_group(server.record["pid"])
        (engine.state / f"{server.record['profile']}.json").unlink(missing_ok=True)
        server.log_path.unlink(missing_ok=True)
        if rpc_dir := rpc_dir_of(server.record):
            shutil.rmtree(rpc_dir, ignore_errors=True)


def stop_group(pgid: int, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the group, SIGKILL to what is left after `grace_s`; returns once none of it runs."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        def gone() -> bool:
            _reap(pgid)
            return not [p for p in _group_members(pgid) if _started(p) is not None]
        if until(gone, wait_s, 0.1):
            return
    print(f"warning: process group {pgid} still has members after SIGKILL", file=sys.stderr)


def _reap(pid: int) -> None:
    """Collect the exit of a server this process started (else it stays a zombie and counts as present)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
