"""The image's SBOM: every locked distribution with its hashes, the base's Debian packages, the series and
components with their SHA-256; the same inputs give the same bytes; and the one baked into the cpu image."""

from __future__ import annotations

import hashlib
import json

import pytest
from support import ROOT, docker

from servekit.build import sbom
from servekit.build.plan import plan_targets
from servekit.config.load import load_matrix

LOCK = """# a lock
certifi==2026.11.1 \\
    --hash=sha256:{a} \\
    --hash=sha256:{b}
    # via requests
torch==2.13.0+cpu \\
    --hash=sha256:{c}
""".format(a="a" * 64, b="b" * 64, c="c" * 64)
DEBIAN = [("libc6", "2.36-9+deb12u13", "amd64"), ("python3.11", "3.11.2-6+deb12u6", "amd64")]


def _document(series: dict[str, bytes]) -> dict:
    matrix = load_matrix(ROOT / "images.yaml")
    plan = plan_targets(matrix, ROOT, ["cpu"])[0]
    text = sbom.document(plan, LOCK, DEBIAN, series, {"kvarn": "d" * 64}, matrix.image.source_date_epoch)
    assert text == sbom.document(plan, LOCK, DEBIAN, series, {"kvarn": "d" * 64}, matrix.image.source_date_epoch)
    return json.loads(text)


def test_the_sbom_names_every_part_with_its_hashes_and_the_same_inputs_give_the_same_bytes():
    doc = _document({"one.patch": b"--- a\n+++ b\n"})
    parts = sbom.read_components(doc)
    assert doc["bomFormat"] == "CycloneDX" and doc["specVersion"] == "1.6"
    assert doc["serialNumber"].startswith("urn:uuid:") and doc["metadata"]["timestamp"].startswith("2026-12-01T00:00")
    certifi = parts["pkg:pypi/certifi@2026.11.1"]
    assert [h["content"] for h in certifi["hashes"]] == ["a" * 64, "b" * 64]
    assert parts["pkg:pypi/torch@2.13.0%2Bcpu"]["version"] == "2.13.0+cpu"
    assert parts["pkg:deb/debian/libc6@2.36-9%2Bdeb12u13?arch=amd64"]["version"] == "2.36-9+deb12u13"
    assert parts["patch:one.patch"]["hashes"][0]["content"] == hashlib.sha256(b"--- a\n+++ b\n").hexdigest()
    assert parts["component:kvarn"]["hashes"][0]["content"] == "d" * 64
    assert len(parts) == 2 + 2 + 1 + 1
    assert doc["metadata"]["component"]["type"] == "container"


def test_another_patch_is_another_sbom():
    assert _document({"one.patch": b"x"})["serialNumber"] == _document({"one.patch": b"y"})["serialNumber"]
    assert _document({"one.patch": b"x"}) != _document({"one.patch": b"y"})


@pytest.mark.slow
@pytest.mark.engine
def test_the_cpu_image_carries_the_sbom_of_what_it_installed(cpu_image):
    from servekit.build.locks import lock_file, read
    said = docker("run", "--rm", "--entrypoint", "cat", cpu_image, sbom.SBOM_PATH)
    assert said.returncode == 0, said.stderr[-2000:]
    parts = sbom.read_components(json.loads(said.stdout))
    pypi = {c["name"]: c for c in parts.values() if c.get("purl", "").startswith("pkg:pypi/")}
    assert {name: c["version"] for name, c in pypi.items()} == read(ROOT / lock_file("cpu", "3.11")).packages
    assert all(c["hashes"] for c in pypi.values())
    dpkg = docker("run", "--rm", "--entrypoint", "dpkg-query", cpu_image, "-W", "-f=${Package}\\n").stdout.split()
    debian = {c["name"] for c in parts.values() if c.get("purl", "").startswith("pkg:deb/")}
    assert debian == set(dpkg) and "libc6" in debian
    patches = {c["name"] for c in parts.values() if c["bom-ref"].startswith("patch:")}
    assert patches and all((ROOT / "docker/patches" / name).is_file() for name in patches)
