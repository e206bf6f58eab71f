"""compose/.env as its person writes it: the source repository's settings (BIND, PORT, VLLM_API_KEY, MODELS_DIR) and
knobs on lines of their own, beside the block servekit writes and rewrites (engines/compose.py writes it; every
command reads the person's lines through here, whichever engine serves)."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

from dotenv import dotenv_values

from servekit.config.derived import USER_SETTINGS
from servekit.errors import UserError
from servekit.image.boundary import Missing, Refused, read_text
from servekit.image.knobs import KNOBS

ENV_FILE = Path("compose") / ".env"  # under the checkout: what a plain `docker compose` in compose/ reads too
ENV_BEGIN = "# BEGIN servekit: `python3 build.py image` and `up` rewrite this block, and only it (its keys come last, so"
ENV_BEGIN_2 = "# they win); your own lines above it, knobs such as MAX_SEQS=4 among them, are kept as you wrote them."
ENV_END = "# END servekit"



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


def unread_names(env_file: Path) -> list[str]:
    """The names of the user's lines of `env_file` that reach nothing: neither a knob, nor a setting the Compose
    files or servekit read (compose/.env.example lists those), nor Compose's or the Docker CLI's own."""
    known = set(KNOBS) | set(USER_SETTINGS)
    return [name for name in users_settings(env_file)
            if name not in known and not OWN_KEYS.match(f"{name}=") and not name.startswith(("COMPOSE_", "DOCKER_"))]


def source_settings(root: Path, *names: str) -> dict[str, str]:
    """`names` (BIND, PORT, VLLM_API_KEY) as the source repository's users set them: in the shell, else in their
    lines of compose/.env (read once, as Compose reads it); only those set."""
    found = {name: value for name, value in users_settings(root / ENV_FILE).items()
             if name in names and value.strip()}
    return {**found, **{name: os.environ[name] for name in names if os.environ.get(name)}}
