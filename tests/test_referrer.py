"""An SBOM attached to an image as an OCI referrer, against Debian's registry (distribution 2.8, no referrers API) on
127.0.0.1, open and behind a login: the artifact's format as an OCI client reads it, the referrers tag's index, a
second attach that changes nothing, two documents side by side, and what a reader says of a listing tampered with."""

from __future__ import annotations

import json

import pytest
import requests

from servekit.engines.bootstrap import ensure_test_tools
from servekit.engines.docker import free_port
from servekit.engines.registry import RegistryAuthError
from servekit.release import referrer
from servekit.release.localregistry import htpasswd_line, start_registry

CDX = "application/vnd.cyclonedx+json"
CREATED = "2026-01-01T00:00:00Z"
LOOPBACK = {"InsecureRegistryCIDRs": ["::1/128", "127.0.0.0/8"], "IndexConfigs": {}}


@pytest.fixture(autouse=True, scope="module")
def registry_binary():
    """Debian's docker-registry, which `make test` installs with the engine; `make test-fast` starts no engine."""
    ensure_test_tools(say=lambda line: None)


@pytest.fixture
def registry(tmp_path):
    """An open registry holding one image's manifest (config and layer uploaded over HTTP, no engine)."""
    port = free_port()
    proc = start_registry(tmp_path / "storage", port, tmp_path / "registry.log")
    try:
        yield port, _push_image(f"http://127.0.0.1:{port}/v2/serve/app")
    finally:
        proc.kill()
        proc.wait()


def _push_image(base: str, auth: tuple[str, str] | None = None) -> str:
    """Push a one-layer image manifest the way an engine would; its digest."""
    descriptors = []
    for body, media_type in ((b'{"architecture":"amd64","os":"linux"}', "application/vnd.oci.image.config.v1+json"),
                             (b"layer", "application/vnd.oci.image.layer.v1.tar")):
        digest = referrer.digest_of(body)
        location = requests.post(f"{base}/blobs/uploads/", auth=auth, timeout=10).headers["Location"]
        url = location if location.startswith("http") else base.split("/v2/")[0] + location
        assert requests.put(f"{url}&digest={digest}", data=body, auth=auth, timeout=10).status_code == 201
        descriptors.append({"mediaType": media_type, "digest": digest, "size": len(body)})
    manifest = referrer.canonical({"schemaVersion": 2, "mediaType": referrer.MANIFEST, "config": descriptors[0],
                                   "layers": descriptors[1:]})
    put = requests.put(f"{base}/manifests/v1", data=manifest, auth=auth, timeout=10,
                       headers={"Content-Type": referrer.MANIFEST})
    assert put.status_code == 201, put.text
    return put.headers["Docker-Content-Digest"]


def test_an_attached_document_is_an_oci_referrer_found_from_the_image_digest(registry):
    port, image = registry
    oci = referrer.OciRegistry(f"127.0.0.1:{port}/serve/app", None, insecure=True)
    attached = referrer.attach(oci, image, b'{"bomFormat":"CycloneDX"}', CDX, "sbom.cdx.json", CREATED)
    assert attached.referrers_tag == image.replace(":", "-")  # no referrers API here: the tag scheme
    base = f"http://127.0.0.1:{port}/v2/serve/app"
    index = requests.get(f"{base}/manifests/{attached.referrers_tag}", headers={"Accept": referrer.INDEX}, timeout=10)
    assert index.headers["Content-Type"] == referrer.INDEX
    assert [(d["digest"], d["artifactType"]) for d in index.json()["manifests"]] == [(attached.manifest_digest, CDX)]
    artifact = requests.get(f"{base}/manifests/{attached.manifest_digest}", timeout=10,
                            headers={"Accept": referrer.MANIFEST}).json()
    assert artifact["artifactType"] == CDX and artifact["config"] == referrer.EMPTY_CONFIG
    assert artifact["subject"] == {"mediaType": referrer.MANIFEST, "digest": image, "size": artifact["subject"]["size"]}
    assert artifact["layers"][0]["annotations"] == {referrer.TITLE: "sbom.cdx.json"}
    assert requests.get(f"{base}/blobs/{referrer.EMPTY_CONFIG['digest']}", timeout=10).content == b"{}"
    # the same document again is the same artifact, listed once; another document is listed beside it
    assert referrer.attach(oci, image, b'{"bomFormat":"CycloneDX"}', CDX, "sbom.cdx.json", CREATED) == attached
    other = referrer.attach(oci, image, b'{"bomFormat":"CycloneDX","version":2}', CDX, "sbom.cdx.json", CREATED)
    assert [d["digest"] for d in oci.referrers(image, CDX)] == [attached.manifest_digest, other.manifest_digest]
    assert referrer.read_attached(oci, image, attached.manifest_digest, CDX) == (b'{"bomFormat":"CycloneDX"}', [])
    # taken off the listing behind our back: the reader says so rather than read the artifact by its digest alone
    requests.put(f"{base}/manifests/{attached.referrers_tag}", timeout=10, headers={"Content-Type": referrer.INDEX},
                 data=json.dumps({"schemaVersion": 2, "mediaType": referrer.INDEX, "manifests": []}))
    document, problems = referrer.read_attached(oci, image, attached.manifest_digest, CDX)
    assert document is None and problems == [f"127.0.0.1:{port}/serve/app@{image} lists no {CDX} referrer "
                                             f"{attached.manifest_digest} (it lists none)"]


def test_behind_a_login_attach_signs_with_the_credentials_and_refuses_without(tmp_path):
    htpasswd = tmp_path / "htpasswd"
    htpasswd.write_text(htpasswd_line("ci", "s3cret") + "\n")
    port = free_port()
    proc = start_registry(tmp_path / "storage", port, tmp_path / "registry.log", htpasswd)
    try:
        image = _push_image(f"http://127.0.0.1:{port}/v2/locked/app", auth=("ci", "s3cret"))
        signed = referrer.OciRegistry(f"127.0.0.1:{port}/locked/app", {"username": "ci", "password": "s3cret"}, True)
        attached = referrer.attach(signed, image, b"{}", CDX, "sbom.cdx.json", CREATED)
        assert referrer.read_attached(signed, image, attached.manifest_digest, CDX) == (b"{}", [])
        with pytest.raises(RegistryAuthError, match=f"docker login 127.0.0.1:{port}"):
            referrer.OciRegistry(f"127.0.0.1:{port}/locked/app", None, True)
        wrong = referrer.OciRegistry(f"127.0.0.1:{port}/locked/app", {"username": "ci", "password": "no"}, True)
        with pytest.raises(RegistryAuthError, match="refused our credentials"):
            referrer.attach(wrong, image, b"{}", CDX, "sbom.cdx.json", CREATED)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("host,config,plain", [
    ("127.0.0.1:5000", LOOPBACK, True),  # the engine's default: loopback is insecure
    ("localhost:5000", LOOPBACK, True),
    ("10.1.2.3:5000", LOOPBACK, False),
    ("10.1.2.3:5000", {**LOOPBACK, "InsecureRegistryCIDRs": ["10.0.0.0/8"]}, True),
    ("registry.test:443", {**LOOPBACK, "IndexConfigs": {"registry.test:443": {"Secure": False}}}, True),
    ("ghcr.io", {**LOOPBACK, "IndexConfigs": {"ghcr.io": {"Secure": True}}}, False),
])
def test_plain_http_only_where_the_engine_speaks_it(host, config, plain):
    assert referrer.insecure(config, host) is plain
