"""Deploy: compose/.env, the API key file, and Compose up/down (python-on-whales).

compose/.env is what a plain `docker compose up alternative` in compose/ reads too, so the CLI
and a person typing compose commands run the same thing.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError

PROJECT = "servekit"
IMAGE_UID = 10001  # the image's non-root user


@dataclass(frozen=True)
class Deployment:
    root: Path
    target: str
    host: str
    image: str
    bind: str
    port: int

    @property
    def compose_dir(self) -> Path:
        return self.root / "compose"

    @property
    def compose_files(self) -> list[Path]:
        names = ["compose.yaml"]
        if self.target == "cpu":
            names.append("compose.cpu.yaml")
        if self.host == "wsl2":
            names.append("compose.wsl2.yaml")
        return [self.compose_dir / n for n in names]

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.bind in ("0.0.0.0", "::") else self.bind
        return f"http://{host}:{self.port}"

    @property
    def api_key_file(self) -> Path:
        return self.compose_dir / "secrets" / "api_key"


def _owned_by_container(path: Path) -> None:
    """Compose bind-mounts file secrets as they are (no uid/mode outside swarm): make it the image user's."""
    if os.geteuid() == 0:
        os.chown(path, IMAGE_UID, IMAGE_UID)


def ensure_secrets(dep: Deployment) -> Path:
    """The API key (generated on first use, mode 0600) and an HF token file (empty unless you fill it)."""
    folder = dep.api_key_file.parent
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # Compose bind-mounts the file itself, so the folder can stay private
    for path, make in ((dep.api_key_file, lambda: f"sk-{secrets.token_urlsafe(32)}\n"), (folder / "hf_token", str)):
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(make())
        path.chmod(0o600)
        _owned_by_container(path)
    return dep.api_key_file


def write_env(dep: Deployment) -> Path:
    """compose/.env: the image, host, address and the compose files for this target and host."""
    lines = [
        "# Written by `python build.py image` / `up`; edit by hand if you like.",
        f"SERVEKIT_IMAGE={dep.image}",
        f"SERVEKIT_HOST={dep.host}",
        f"SERVEKIT_BIND={dep.bind}",
        f"SERVEKIT_PORT={dep.port}",
        f"COMPOSE_FILE={os.pathsep.join(p.name for p in dep.compose_files)}",
    ]
    if os.geteuid() != 0:  # run as you, so that your 0600 key file is readable inside
        lines += [f"SERVEKIT_UID={os.getuid()}", f"SERVEKIT_GID={os.getgid()}"]
    path = dep.compose_dir / ".env"
    path.write_text("\n".join(lines) + "\n")
    return path


def check_bind(bind: str, warn) -> None:
    try:
        loopback = ipaddress.ip_address(bind).is_loopback
    except ValueError:
        raise UserError(f"serve.bind: {bind!r} is not an IP address") from None
    if not loopback:
        warn(f"serve.bind is {bind}: the server is reachable from other machines; the API key is all that "
             "guards it")


def compose_client(dep: Deployment, profiles: list[str] | None = None):
    from python_on_whales import DockerClient
    return DockerClient(compose_files=dep.compose_files, compose_project_name=PROJECT,
                        compose_project_directory=dep.compose_dir, compose_env_files=[dep.compose_dir / ".env"],
                        compose_profiles=profiles or [])


def up(dep: Deployment, profile: str) -> None:
    compose_client(dep, [profile]).compose.up(services=[profile], detach=True, quiet=True)


def down(dep: Deployment, profile: str | None = None) -> None:
    client = compose_client(dep, ["*"])
    if profile:
        client.compose.rm(services=[profile, "prepare"], stop=True)
    else:
        client.compose.down(remove_orphans=True, quiet=True)


def find_container(profile: str):
    import docker
    client = docker.from_env()
    found = client.containers.list(all=True, filters={"label": [f"com.docker.compose.project={PROJECT}",
                                                                f"com.docker.compose.service={profile}"]})
    return found[0] if found else None


def running_profiles() -> list[str]:
    import docker
    client = docker.from_env()
    return sorted({c.labels.get("com.docker.compose.service") for c in client.containers.list(
        all=True, filters={"label": f"com.docker.compose.project={PROJECT}"})})
