"""Where things are: the names every stage shares (the image's code folder, what a build stages, the image's user
and its mount points, the labels that say which project and profile a server belongs to), each said once here.

The Dockerfile and the Compose files are not Python: a test ties them to these (tests/test_layout.py).
"""

from __future__ import annotations

from pathlib import Path

# The folder of the code that runs inside the image: the Dockerfile copies it, .dockerignore admits it
# (rendered from this by `derive`), and the image's digest covers every file in it.
IMAGE_CODE = "servekit/image"
# What the build writes into the context before it starts: per target under STAGE_DIR (plan.STAGED_FILES), and the
# pinned wheels offered from folders of wheels (during a build only).
STAGE_DIR = ".cache/build"
WHEELHOUSE = ".cache/wheelhouse"
STAGED = (STAGE_DIR, WHEELHOUSE)

# Where the API key and the HF token files live in a checkout (Compose mounts them as secrets; a process engine's
# launcher reads them there).
SECRETS_DIR = "compose/secrets"

# The image's non-root user (uid and gid), and where its volumes are mounted.
IMAGE_UID = 10001
MODELS_MOUNT = "/app/models"
CACHE_MOUNT = "/cache"

# Compose's labels on a container: which project (SERVEKIT_PROJECT) and which profile (its service) it serves.
PROJECT_LABEL = "com.docker.compose.project"
PROFILE_LABEL = "com.docker.compose.service"


def staged_env(root: Path, target: str) -> Path:
    """Where patch-env stages the series and components for an environment of `target` (its manifest stays)."""
    return root / STAGE_DIR / f"{target}-env"
