"""The names servekit/layout.py says once, as the files that are not Python spell them: the Dockerfile, Compose and
the image's own code (which imports nothing of the host's)."""

from __future__ import annotations

import re

import yaml
from support import ROOT

from servekit.layout import CACHE_MOUNT, IMAGE_CODE, IMAGE_UID, MODELS_MOUNT

DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()


def test_the_dockerfile_makes_the_user_and_the_mount_points_layout_names():
    assert re.search(rf"useradd [^\n]*--uid {IMAGE_UID}\b", DOCKERFILE)
    assert re.search(rf"groupadd [^\n]*--gid {IMAGE_UID}\b", DOCKERFILE)
    assert f"\nUSER {IMAGE_UID}:{IMAGE_UID}\n" in DOCKERFILE
    assert f'VOLUME ["{CACHE_MOUNT}", "{MODELS_MOUNT}"]' in DOCKERFILE
    assert f"COPY {IMAGE_CODE}/ " in DOCKERFILE


def test_compose_runs_as_the_images_user_with_its_volumes_where_the_image_has_them():
    compose = yaml.safe_load((ROOT / "compose" / "compose.yaml").read_text())
    services = [s for s in compose["services"].values() if "user" in s]
    assert services
    for service in services:
        assert service["user"] == f"${{SERVEKIT_UID:-{IMAGE_UID}}}:${{SERVEKIT_GID:-{IMAGE_UID}}}"
        assert f"${{MODELS_DIR:-models}}:{MODELS_MOUNT}" in service["volumes"]  # the source's MODELS_DIR, else ours
    for override in ("compose.model-dir.yaml", "compose.drafter-dir.yaml"):
        text = (ROOT / "compose" / override).read_text()
        assert re.findall(r"/app/\S*", text) and all(p.startswith(MODELS_MOUNT + "/") for p in re.findall(r"/app/\S*", text))


def test_the_images_verify_step_stubs_the_models_where_the_image_mounts_them():
    assert f'"{MODELS_MOUNT}/"' in (ROOT / IMAGE_CODE / "verify.py").read_text()
