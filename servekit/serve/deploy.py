"""Deploy a profile: the API key file, the address it is published on, starting and stopping it on its engine (which
writes what its own tool reads: the Docker engine's compose/.env, engines/compose.py), and what a running server
says of itself (knobs, port, state)."""

from __future__ import annotations

import datetime as dt
import fcntl
import ipaddress
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

from servekit.config.session import Session
from servekit.config.userenv import source_settings
from servekit.engines import Engine, Server, ServerState, address, docker_errors, resolve
from servekit.engines.card import MpsDaemon, mps_dir
from servekit.engines.deployment import Deployment
from servekit.engines.runas import run_as
from servekit.errors import UserError
from servekit.image.boundary import (
    Refused,
    control_character,
    header_unsafe,
    read_secret,
    write_text_atomic,
)
from servekit.image.knobs import KNOBS, masked
from servekit.image.launcher import MIN_KEY_CHARS
from servekit.output import Say, as_output


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
    ensure_secrets(dep)  # Compose checks the secrets' sources even to take a project down
    down(dep, profile)
    return [p for p in running_profiles(engine) if not profile or p == profile]
