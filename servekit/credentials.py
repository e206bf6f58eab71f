"""Index credentials: read from the environment only (never images.yaml, which is committed), sent to an
index by the orchestrator as HTTP auth, and into a build as a BuildKit secret (a pip configuration file
mounted for the one RUN that installs wheels): never a build argument, a label, a log line or a layer."""

from __future__ import annotations

import os
import re
from urllib.parse import quote, urlsplit, urlunsplit

ENV_PREFIX = "SERVEKIT_INDEX_AUTH_"


def env_name(index_key: str) -> str:
    """SERVEKIT_INDEX_AUTH_<KEY>, e.g. SERVEKIT_INDEX_AUTH_PYTORCH_CPU for the index pytorch-cpu."""
    return ENV_PREFIX + re.sub(r"[^A-Z0-9]", "_", index_key.upper())


def auth(index_key: str) -> tuple[str, str] | None:
    """(user, token) for the index, from SERVEKIT_INDEX_AUTH_<KEY>=user:token (a bare token: user `__token__`)."""
    value = os.environ.get(env_name(index_key), "").strip()
    if not value:
        return None
    user, sep, token = value.partition(":")
    return (user, token) if sep else ("__token__", value)


def with_auth(url: str, index_key: str) -> str:
    """The index URL as pip takes it, credentials included when the environment has them."""
    found = auth(index_key)
    if not found:
        return url
    parts = urlsplit(url)
    netloc = f"{quote(found[0], safe='')}:{quote(found[1], safe='')}@{parts.hostname}" + \
        (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def pip_config(index: str, extra: list[str]) -> str:
    """A pip configuration file naming the indexes (the build mounts it as the secret pip_conf)."""
    lines = ["[global]", f"index-url = {index}"]
    if extra:
        lines.append("extra-index-url = " + "\n    ".join(extra))
    return "\n".join(lines) + "\n"
