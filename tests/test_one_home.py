"""A fact lives in one place; where a file cannot derive it (a Dockerfile, Compose's YAML), a test holds it to that
place: the container's port (the launcher's), the boot's start period (images.yaml's serve.boot_timeout_s) and
the host tool's huggingface_hub (images.yaml's pin)."""

from __future__ import annotations

import re

import yaml
from support import ROOT

from servekit.config.load import load_matrix
from servekit.image.launcher import CONTAINER_PORT

MATRIX = load_matrix(ROOT / "images.yaml")
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((ROOT / "compose" / "compose.yaml").read_text())


def test_the_dockerfile_serves_and_checks_health_on_the_launchers_port_with_the_matrixs_start_period():
    assert re.findall(r"^EXPOSE (\d+)$", DOCKERFILE, re.M) == [str(CONTAINER_PORT)]
    health = re.search(r"^HEALTHCHECK .*?--start-period=(\d+)s.*?\n.*?get\('PORT', '(\d+)'\)", DOCKERFILE, re.M | re.S)
    assert health and health.groups() == (str(MATRIX.serve.boot_timeout_s), str(CONTAINER_PORT))


def test_compose_publishes_and_checks_the_launchers_port_with_the_matrixs_start_period():
    serve = COMPOSE["x-serve"]
    assert [p.rsplit(":", 1)[1] for p in serve["ports"]] == [str(CONTAINER_PORT)]
    assert f"127.0.0.1:{CONTAINER_PORT}/health" in " ".join(serve["healthcheck"]["test"])
    assert serve["healthcheck"]["start_period"] == f"{MATRIX.serve.boot_timeout_s}s"


def test_the_host_tool_runs_prepare_with_the_images_huggingface_hub():
    """The tests drive prepare's download on the host's Python: its huggingface_hub is the pin the images install."""
    host = re.search(r"^huggingface_hub==(\S+)", (ROOT / "requirements.in").read_text(), re.M)
    assert host and host.group(1) == MATRIX.pins["huggingface_hub"]
