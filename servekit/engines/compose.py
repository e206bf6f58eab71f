"""Compose, as the Docker engine serves a deployment with it: the project, the files a deployment names (compose.yaml
and the overrides it asks for) and the env file a plain `docker compose` in compose/ reads too (servekit's block in
it, the person's lines kept: config/userenv.py). Only the Docker engine calls this module; its client is docker.py's."""

from __future__ import annotations

import os
import re
from pathlib import Path

from servekit.config.userenv import (
    ENV_BEGIN,
    ENV_BEGIN_2,
    ENV_END,
    ENV_FILE,
    source_settings,
    users_lines,
    users_settings,
)
from servekit.engines.card import COMPOSE_FILE as CARD_COMPOSE
from servekit.engines.gpuaccess import COMPOSE_FILE as GPU_DEVICES_COMPOSE
from servekit.engines.protocol import Deploying
from servekit.engines.runas import run_as
from servekit.errors import UserError
from servekit.image.boundary import control_character, write_text_atomic
from servekit.layout import IMAGE_UID

MODEL_DIR_COMPOSE = "compose.model-dir.yaml"  # mounts MODEL_DIR read-only; prepare then fetches nothing
DRAFTER_DIR_COMPOSE = "compose.drafter-dir.yaml"  # mounts DRAFTER_DIR read-only, the DFlash2 drafter's folder
USERS_OVERRIDE = "compose.override.yaml"  # a user's own changes; last, so that they win

# The Compose project every command acts on; another name (the tests use their own) keeps two sets of
# servers, volumes and `down`s apart on one engine.
PROJECT = os.environ.get("SERVEKIT_PROJECT") or "servekit"
if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", PROJECT):
    raise SystemExit(f"error: SERVEKIT_PROJECT={PROJECT!r}: a Compose project name is lowercase letters, digits, "
                     "'-' and '_'")


def compose_dir(dep: Deploying) -> Path:
    return dep.root / "compose"


def compose_files(dep: Deploying) -> list[Path]:
    """The Compose files, in order, that serve `dep`: compose.yaml, the target's overrides, then one per thing the
    deployment asks for (WSL2, the GPU by its devices, model folders, a card, another machine), the user's last."""
    names = ["compose.yaml", *dep.overrides]
    if dep.host == "wsl2":
        names.append("compose.wsl2.yaml")
    if dep.gpu_devices:
        names.append(GPU_DEVICES_COMPOSE)
    if dep.model_dir:
        names.append(MODEL_DIR_COMPOSE)
    if dep.drafter_dir:
        names.append(DRAFTER_DIR_COMPOSE)
    if dep.card:
        names.append(CARD_COMPOSE)
    if not dep.engine.same_machine:  # this disk's files are not there to bind-mount
        names.append("compose.remote.yaml")
    if (compose_dir(dep) / USERS_OVERRIDE).is_file():  # Compose's own default, which COMPOSE_FILE turns off
        names.append(USERS_OVERRIDE)
    return [compose_dir(dep) / n for n in names]


def env_file(dep: Deploying) -> Path:
    """The env file Compose reads for `dep`: compose/.env for this machine's engine, else the engine's own."""
    if dep.engine.is_local:
        return dep.root / ENV_FILE
    return dep.root / ".cache" / "engines" / f"{dep.engine.label}.env"


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


def write_env(dep: Deploying) -> Path:
    """The env file (compose/.env for the local engine): image, host, address and the compose files, in servekit's
    block; whatever else the file holds (a user's knobs, the source repository's .env lines) stays."""
    check_models_dir(dep.root)
    ours = {
        "SERVEKIT_IMAGE": dep.image,
        "SERVEKIT_HOST": dep.host,
        "SERVEKIT_BIND": dep.bind,
        "SERVEKIT_PORT": str(dep.port),
        "COMPOSE_PROJECT_NAME": PROJECT,
        # Compose on Windows splits COMPOSE_FILE at ';' unless told otherwise: PowerShell reads this file too.
        "COMPOSE_PATH_SEPARATOR": ":",
        "COMPOSE_FILE": ":".join(p.name for p in compose_files(dep)),
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
    env = env_file(dep)
    users = users_settings(env)
    secret_files = {"SERVEKIT_API_KEY_FILE": "./secrets/api_key", "SERVEKIT_HF_TOKEN_FILE": "./secrets/hf_token"}
    ours.update({name: path for name, path in secret_files.items() if name not in users})
    uid, gid = run_as()
    if (uid, gid) != (IMAGE_UID, IMAGE_UID) and dep.engine.same_machine:  # another machine's engine: the image's user
        ours.update(SERVEKIT_UID=str(uid), SERVEKIT_GID=str(gid))
    where = [] if dep.engine.is_local else [f"# For `python3 build.py --engine {dep.engine.given}`; docker compose "
                                            "--env-file reads it."]
    block = [ENV_BEGIN, ENV_BEGIN_2, *where, *(f"{k}={v}" for k, v in ours.items()), ENV_END]
    write_text_atomic(env, "".join(line + "\n" for line in [*users_lines(env), *block]))
    return env
