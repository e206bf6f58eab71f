"""Who a deployment's containers run as: SERVEKIT_UID and SERVEKIT_GID, else you, else the image's user."""

from __future__ import annotations

import os

from servekit.errors import UserError
from servekit.layout import IMAGE_UID

MAX_ID = 2**31 - 1  # the largest id Docker and Kubernetes take


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
