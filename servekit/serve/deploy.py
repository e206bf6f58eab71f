"""Deploy a profile: compose/.env, the API key file, starting and stopping it on its engine, and what a running
server says of itself (knobs, port, state).

compose/.env is what a plain `docker compose up alternative` in compose/ reads too, so the CLI
and a person typing compose commands run the same thing. Another engine (`--engine`) gets its own
env file under .cache/engines/; one on another machine also gets compose.remote.yaml, which
bind-mounts nothing from this disk.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import io
import ipaddress
import os
import re
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dotenv import dotenv_values

from servekit.config.derived import USER_SETTINGS
from servekit.config.session import Session
from servekit.engines import PROJECT, Engine, Server, ServerState, address, docker_errors, local_url, resolve
from servekit.engines.card import COMPOSE_FILE as CARD_COMPOSE
from servekit.engines.card import MpsDaemon, mps_dir
from servekit.engines.gpuaccess import COMPOSE_FILE as GPU_DEVICES_COMPOSE
from servekit.errors import UserError
from servekit.image.boundary import (
    Missing,
    Refused,
    control_character,
    header_unsafe,
    read_secret,
    read_text,
    write_text_atomic,
)
from servekit.image.knobs import KNOBS, masked
from servekit.image.launcher import MIN_KEY_CHARS
from servekit.layout import IMAGE_UID
from servekit.output import Say, as_output

MAX_ID = 2**31 - 1  # the largest id Docker and Kubernetes take
MODEL_DIR_COMPOSE = "compose.model-dir.yaml"  # mounts MODEL_DIR read-only; prepare then fetches nothing
DRAFTER_DIR_COMPOSE = "compose.drafter-dir.yaml"  # mounts DRAFTER_DIR read-only, the DFlash2 drafter's folder
USERS_OVERRIDE = "compose.override.yaml"  # a user's own changes; last, so that they win


@dataclass(frozen=True)
class Deployment:
    root: Path
    target: str
    host: str
    image: str
    bind: str
    port: int
    engine: Engine = field(default_factory=lambda: resolve(None))
    reached_at: str | None = None  # the URL through which this machine reaches it, when not the plain one
    overrides: tuple[str, ...] = ()  # the target's Compose override files in compose/ (images.yaml: compose)
    matrix: Any = field(default=None, compare=False)  # the loaded images.yaml (the process engine renders from it)
    pins: dict[str, str] = field(default_factory=dict, compare=False)  # the target's, less what --without leaves out
    gpu_devices: bool = False  # the GPU by its device nodes and driver folder (engines/gpuaccess.py), not the toolkit
    model_dir: str | None = None  # a model folder of this machine served in place of the volume's (MODEL_DIR)
    stand_in: str | None = None  # the matrix model that folder is (stands_in_for the target's): its checks apply
    drafter_dir: str | None = None  # a DFlash2 drafter folder of this machine served in place of the volume's
    card: Any = None  # engines.card.Emulation: a smaller card emulated on this machine's GPU (--card)

    @property
    def compose_dir(self) -> Path:
        return self.root / "compose"

    @property
    def compose_files(self) -> list[Path]:
        names = ["compose.yaml", *self.overrides]
        if self.host == "wsl2":
            names.append("compose.wsl2.yaml")
        if self.gpu_devices:
            names.append(GPU_DEVICES_COMPOSE)
        if self.model_dir:
            names.append(MODEL_DIR_COMPOSE)
        if self.drafter_dir:
            names.append(DRAFTER_DIR_COMPOSE)
        if self.card:
            names.append(CARD_COMPOSE)
        if not self.engine.same_machine:  # this disk's files are not there to bind-mount
            names.append("compose.remote.yaml")
        if (self.compose_dir / USERS_OVERRIDE).is_file():  # Compose's own default, which COMPOSE_FILE turns off
            names.append(USERS_OVERRIDE)
        return [self.compose_dir / n for n in names]

    @property
    def env_file(self) -> Path:
        if self.engine.is_local:
            return self.compose_dir / ".env"
        return self.root / ".cache" / "engines" / f"{self.engine.label}.env"

    @property
    def url(self) -> str:
        return self.reached_at or local_url(self.bind, self.port)

    @property
    def api_key_file(self) -> Path:
        return self.compose_dir / "secrets" / "api_key"


def run_as() -> tuple[int, int]:
    """The uid:gid the containers run as: SERVEKIT_UID/SERVEKIT_GID when set, else yours when you are not root
    (so that your 0600 key file is readable inside), else the image's user."""
    if os.environ.get("SERVEKIT_UID"):
        uid = _id_setting("SERVEKIT_UID")
        return uid, _id_setting("SERVEKIT_GID") if os.environ.get("SERVEKIT_GID") else uid
    return (os.getuid(), os.getgid()) if os.geteuid() != 0 else (IMAGE_UID, IMAGE_UID)


def _id_setting(name: str) -> int:
    """A numeric user or group id from the environment (it becomes Compose's `user:`, where a name or a word would
    be looked up in the image, or be no user at all)."""
    raw = os.environ[name].strip()
    if not raw.isascii() or not raw.isdigit() or int(raw) > MAX_ID:
        raise UserError(f"{name}={raw[:40]!r}: expected a numeric id from 0 to {MAX_ID}, e.g. {IMAGE_UID}")
    return int(raw)


def _owned_by_container(path: Path) -> None:
    """Compose bind-mounts file secrets as they are (no uid/mode outside swarm): make it the containers' user's."""
    if os.geteuid() == 0:
        os.chown(path, *run_as(), follow_symlinks=False)


def _key_in(path: Path) -> str | None:
    """The key a regular file (not a link, not a FIFO) holds, when it is long enough to be one."""
    try:
        key = read_secret(path, follow_links=False)
    except Refused:  # missing, a link, a FIFO, too large: a new key replaces it
        return None
    return key if len(key) >= MIN_KEY_CHARS else None


SOURCE_KEY_FILE = "api_key.txt"  # the source repository's key file, at the root of the checkout


def given_key(root: Path) -> tuple[str, str] | None:
    """(the key, where it came from) where the source's users give one: VLLM_API_KEY in the shell or compose/.env,
    else api_key.txt at the root; None when neither holds one. A key too short to be one is refused."""
    key, where = source_settings(root, "VLLM_API_KEY").get("VLLM_API_KEY"), "VLLM_API_KEY"
    if key is None and os.path.lexists(root / SOURCE_KEY_FILE):
        key, where = read_secret(root / SOURCE_KEY_FILE), SOURCE_KEY_FILE
    if key is None:
        return None
    unsafe = control_character(key) or header_unsafe(key)
    if len(key) < MIN_KEY_CHARS or unsafe:
        raise UserError(f"{where} holds {len(key)} characters" + (f", not one line of visible ASCII ({unsafe})"
                        if unsafe else "") + f"; a key is one line of at least {MIN_KEY_CHARS} visible ASCII "
                        "characters, as an HTTP header carries it (or remove it, and servekit makes one in "
                        "compose/secrets/api_key)")
    return key, where


def ensure_secrets(dep: Deployment) -> Path:
    """The API key file: the key given the source's way (VLLM_API_KEY, api_key.txt) where there is one, else the
    one there, else a new one (made when missing, empty, short or a link; mode 0600, written atomically); and an HF
    token file (empty unless you fill it)."""
    given = given_key(dep.root)
    folder = dep.api_key_file.parent
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # Compose bind-mounts the file itself, so the folder can stay private
    token = folder / "hf_token"
    with open(os.open(folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two commands at once make one key, not two (the second reads the first's)
        if given and _key_in(dep.api_key_file) != given[0]:
            write_text_atomic(dep.api_key_file, given[0] + "\n", mode=0o600)
        elif not given and _key_in(dep.api_key_file) is None:
            write_text_atomic(dep.api_key_file, f"sk-{secrets.token_urlsafe(32)}\n", mode=0o600)
        if token.is_symlink() or not token.is_file():
            write_text_atomic(token, "", mode=0o600)
    for path in (dep.api_key_file, token):  # both regular files now: neither chmod nor chown follows a link
        path.chmod(0o600)
        _owned_by_container(path)
    if not dep.engine.same_machine:  # compose.remote.yaml: Compose copies them into the container from its environment
        os.environ["SERVEKIT_API_KEY"] = read_secret(dep.api_key_file)
        os.environ["SERVEKIT_HF_TOKEN"] = read_secret(token)
    return dep.api_key_file


ENV_BEGIN = "# BEGIN servekit: `python3 build.py image` and `up` rewrite this block, and only it (its keys come last, so"
ENV_BEGIN_2 = "# they win); your own lines above it, knobs such as MAX_SEQS=4 among them, are kept as you wrote them."
ENV_END = "# END servekit"


def check_models_dir(root: Path) -> None:
    """MODELS_DIR (shell or compose/.env) names a folder: a bare word is a named volume to Compose, not the folder
    the source's users mean by it, so it is refused with the spelling that is one."""
    given = source_settings(root, "MODELS_DIR").get("MODELS_DIR", "").strip()
    if problem := control_character(given):  # it becomes a line of a Compose volume
        raise UserError(f"MODELS_DIR={given[:60]!r} (in the shell or compose/.env): expected {problem}")
    if given and not given.startswith(("/", ".", "~")) and "/" not in given:
        raise UserError(f"MODELS_DIR={given[:60]!r} (in the shell or compose/.env): Compose takes a bare name for a "
                        f"named volume, not a folder; write ./{given[:60]} for the folder under compose/, or a full "
                        "path")


def write_env(dep: Deployment) -> Path | None:
    """The env file (compose/.env for the local engine): image, host, address and the compose files, in servekit's
    block; whatever else the file holds (a user's knobs, the source repository's .env lines) stays. A process
    engine has no Compose and gets none."""
    if not dep.engine.serves_images:
        return None
    check_models_dir(dep.root)
    ours = {
        "SERVEKIT_IMAGE": dep.image,
        "SERVEKIT_HOST": dep.host,
        "SERVEKIT_BIND": dep.bind,
        "SERVEKIT_PORT": str(dep.port),
        "COMPOSE_PROJECT_NAME": PROJECT,
        # Compose on Windows splits COMPOSE_FILE at ';' unless told otherwise: PowerShell reads this file too.
        "COMPOSE_PATH_SEPARATOR": ":",
        "COMPOSE_FILE": ":".join(p.name for p in dep.compose_files),
        # Every profile active for the commands that name none: a plain `docker compose down` (or ps, logs, stop)
        # then acts on the profile `docker compose up -d alternative` started, not only on services without one.
        "COMPOSE_PROFILES": "*",
    }
    # What the files named in COMPOSE_FILE read, saved beside it, so that a later plain `docker compose ps` or `up`
    # finds what this command's environment held (the key and token files, unless the user's lines name theirs)
    if dep.card:
        ours.update(dep.card.compose_env())
    ours.update({name: folder for name, folder in (("MODEL_DIR", dep.model_dir), ("DRAFTER_DIR", dep.drafter_dir))
                 if folder})
    users = users_settings(dep.env_file)
    secret_files = {"SERVEKIT_API_KEY_FILE": "./secrets/api_key", "SERVEKIT_HF_TOKEN_FILE": "./secrets/hf_token"}
    ours.update({name: path for name, path in secret_files.items() if name not in users})
    uid, gid = run_as()
    if (uid, gid) != (IMAGE_UID, IMAGE_UID) and dep.engine.same_machine:  # another machine's engine: the image's user
        ours.update(SERVEKIT_UID=str(uid), SERVEKIT_GID=str(gid))
    where = [] if dep.engine.is_local else [f"# For `python3 build.py --engine {dep.engine.given}`; docker compose "
                                            "--env-file reads it."]
    block = [ENV_BEGIN, ENV_BEGIN_2, *where, *(f"{k}={v}" for k, v in ours.items()), ENV_END]
    write_text_atomic(dep.env_file, "".join(line + "\n" for line in [*users_lines(dep.env_file), *block]))
    return dep.env_file


# The keys servekit's block writes (write_env), by name: a user's own SERVEKIT_REGISTRY, say, is theirs.
OWN_KEYS = re.compile(r"^\s*(?:export\s+)?(SERVEKIT_(?:IMAGE|HOST|BIND|PORT|UID|GID|CARD\w*|MPS_PIPE_DIR|API_KEY_FILE|"
                      r"HF_TOKEN_FILE)|MODEL_DIR|DRAFTER_DIR|COMPOSE_PROJECT_NAME|COMPOSE_PATH_SEPARATOR|COMPOSE_FILE|"
                      r"COMPOSE_PROFILES)\s*=")
OWN_COMMENTS = (ENV_BEGIN, ENV_BEGIN_2, "# For `python3 build.py --engine ", "# Written by `python3 build.py")


def _ours(line: str) -> bool:
    return bool(OWN_KEYS.match(line)) or line.startswith(OWN_COMMENTS) or line == ENV_END


def users_lines(env_file: Path) -> list[str]:
    """The lines of `env_file` that are not servekit's: all but its block. Where the block has lost its end line
    (an editor, a merge), or the file is from before the block, only the lines servekit writes go: a line it did
    not write is never dropped."""
    try:
        lines = read_text(env_file, 1 << 20).removeprefix("\ufeff").splitlines()
    except Missing:
        return []
    except Refused as exc:
        raise UserError(f"{exc}; compose/.env must be a text file (servekit keeps your lines in it)") from None
    if ENV_BEGIN in lines and ENV_END in lines[lines.index(ENV_BEGIN):]:
        start = lines.index(ENV_BEGIN)
        end = lines.index(ENV_END, start)
        kept = lines[:start] + lines[end + 1:]
    else:
        kept = [line for line in lines if not _ours(line)]
    while kept and not kept[-1].strip():
        kept.pop()
    return kept


def users_settings(env_file: Path) -> dict[str, str]:
    """The user's lines of `env_file` as Compose reads them: python-dotenv follows its rules (`export`, quotes, a
    comment after a value, ${VAR}); the tests hold the two to the same files."""
    values = dotenv_values(stream=io.StringIO("\n".join(users_lines(env_file)) + "\n"), interpolate=True)
    return {key: value for key, value in values.items() if value is not None}


def unread_settings(dep: Deployment) -> list[str]:
    """The names of the user's lines of the env file that reach nothing: neither a knob, nor a setting the Compose
    files or servekit read (compose/.env.example lists those), nor Compose's or the Docker CLI's own."""
    known = set(KNOBS) | set(USER_SETTINGS)
    return [name for name in users_settings(dep.env_file)
            if name not in known and not OWN_KEYS.match(f"{name}=") and not name.startswith(("COMPOSE_", "DOCKER_"))]


def source_settings(root: Path, *names: str) -> dict[str, str]:
    """`names` (BIND, PORT, VLLM_API_KEY) as the source repository's users set them: in the shell, else in their
    lines of compose/.env (read once, as Compose reads it); only those set."""
    found = {name: value for name, value in users_settings(root / "compose" / ".env").items()
             if name in names and value.strip()}
    return {**found, **{name: os.environ[name] for name in names if os.environ.get(name)}}


def published(root: Path, bind: str, port: int, asked_port: int | None) -> tuple[str, int]:
    """(address, port) a deployment publishes on: --port, else the source's BIND/PORT where set, else images.yaml's
    serve.bind and serve.port. A BIND or PORT that is no address or port is refused, naming where it came from."""
    where, settings = "in the shell or compose/.env", source_settings(root, "BIND", "PORT")
    if given := settings.get("BIND"):
        try:
            ipaddress.ip_address(given)
        except ValueError:
            raise UserError(f"BIND={given!r} ({where}): expected the IP address to publish on, e.g. 127.0.0.1") \
                from None
        bind = given
    if asked_port is None and (given := settings.get("PORT")):
        try:
            port = int(KNOBS["PORT"].normalize(given))
        except ValueError as exc:
            raise UserError(f"PORT={given!r} ({where}): {exc}") from None
    return bind, asked_port or port


def check_bind(bind: str, say: Say) -> None:
    try:
        loopback = ipaddress.ip_address(bind).is_loopback
    except ValueError:
        raise UserError(f"serve.bind: {bind!r} is not an IP address") from None
    if not loopback:
        as_output(say).warn(f"serve.bind is {bind}: the server is reachable from other machines; the API key is all "
                            "that guards it")


def prepare(dep: Deployment, profile: str, knobs: dict[str, str] | None = None,
            on_line: Callable[[str], None] | None = None) -> list[str]:
    """The profile's prepare step on its engine, to its end (its lines to `on_line`); its lines."""
    return dep.engine.prepare(dep, profile, knobs, on_line)


def up(dep: Deployment, profile: str, knobs: dict[str, str] | None = None) -> Server | None:
    """Start the profile on its engine (Compose, or a process); the server when the engine hands it back. An
    emulated card's MPS daemon is started first."""
    if dep.card:
        MpsDaemon(dep.card.mps_dir).start()
    return dep.engine.up(dep, profile, knobs)


def down(dep: Deployment, profile: str | None = None) -> None:
    """Take the profile (every profile when None) down; servekit's MPS daemon quits once no server is left."""
    dep.engine.down(dep, profile)
    folder = dep.card.mps_dir if dep.card else mps_dir()
    if (folder / "pipe" / "control").exists() and not running_profiles(dep.engine):
        MpsDaemon(folder).stop()


def find_server(profile: str, engine: Engine | None = None) -> Server | None:
    found = (engine or resolve(None)).servers(profile)
    return found[0] if found else None


def is_running(profile: str, engine: Engine | None = None) -> bool:
    server = find_server(profile, engine)
    return server is not None and server.state().running


def knobs_of(state: ServerState) -> dict[str, str]:
    """The knobs a server runs with: those set in its environment (the image's, Compose's and the shell's), a secret
    in EXTRA_ARGS masked (the launcher refuses to start with one, but the stopped container still shows it)."""
    return {k: masked(v) for k, v in sorted(state.env.items()) if k in KNOBS}


def running_profiles(engine: Engine | None = None) -> list[str]:
    return sorted({server.profile for server in (engine or resolve(None)).servers()})


def status(engine: Engine | None = None, bind: str = "127.0.0.1") -> list[dict]:
    """`ps`: each container of this Compose project on the engine: profile, state and health, uptime, image, where
    it answers, and the knobs it was started with (its environment)."""

    engine = engine or resolve(None)
    engine.check()
    rows = []
    for server in engine.servers():
        state = server.state()
        started = state.started_at[:26].rstrip("Z")  # RFC 3339 with nanoseconds: keep microseconds
        try:
            up_s = (dt.datetime.now(dt.UTC) - dt.datetime.fromisoformat(started).replace(
                tzinfo=dt.UTC)).total_seconds() if state.running else None
        except ValueError:
            up_s = None
        rows.append({"profile": state.profile, "container": state.name, "state": state.status, "health": state.health,
                     "up_s": round(up_s) if up_s is not None else None, "image": state.image,
                     "url": address(engine, bind, state.port) if state.port else None, "knobs": knobs_of(state)})
    return sorted(rows, key=lambda r: r["profile"] or "")


def logs(profile: str, engine: Engine | None = None, follow: bool = False, tail: int = 200) -> Iterator[str]:
    """`logs`: the profile's log lines (the last `tail`), and with `follow` each new one until it stops."""
    engine = engine or resolve(None)
    engine.check()
    server = find_server(profile, engine)
    if server is None:
        raise UserError(f"{profile} has no container on engine {engine.given}; `python3 build.py ps` lists what runs")
    with docker_errors(f"logs of {profile} on engine {engine.given}"):
        pending = b""
        for chunk in server.follow_log(tail=tail, follow=follow):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.decode("utf-8", "replace")
        if pending:
            yield pending.decode("utf-8", "replace")


def down_profiles(session: Session, engine: Engine | None = None, profile: str | None = None) -> list[str]:
    """Stop and remove `profile`'s containers (every profile's when None) on `engine`; the profiles still there."""
    matrix = session.matrix
    if profile is not None and profile not in matrix.profiles:
        raise UserError(f"profile {profile!r}: expected one of {', '.join(matrix.profiles)}")
    engine = engine or resolve(None)
    engine.check()
    dep = Deployment(session.root, next(iter(matrix.targets)), "native", "unused", matrix.serve.bind,
                     matrix.serve.port, engine=engine)
    if not dep.env_file.exists():
        write_env(dep)
    ensure_secrets(dep)  # Compose checks the secrets' sources even to take a project down
    down(dep, profile)
    return [p for p in running_profiles(engine) if not profile or p == profile]
