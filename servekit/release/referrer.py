"""A document attached to an image in its registry as an OCI referrer: an artifact manifest whose `subject` is the
image's manifest, so any OCI tool finds it from the image's digest (OCI distribution 1.1). Where the registry has the
referrers API it lists the artifact itself; where it has none (distribution 2.8, the Debian registry the tests run)
the artifact is also listed in an image index tagged `sha256-<hex of the digest>`, the spec's referrers tag scheme,
which clients read when the API answers 404.

No engine push writes a subject, so this is the one place HTTP of ours reaches a registry: through oras-py, signed
with the credentials `docker login` stored (as the Docker SDK resolves them, credential helpers included), over plain
HTTP only where the engine itself treats the registry as insecure (127.0.0.0/8 by default).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import socket
from dataclasses import dataclass
from typing import Any

import requests

from servekit.engines.registry import RegistryAuthError, TransientRegistryError, host_of

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
EMPTY_CONFIG = {"mediaType": "application/vnd.oci.empty.v1+json", "size": 2,
                "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"}  # of b"{}"
TITLE = "org.opencontainers.image.title"
CREATED = "org.opencontainers.image.created"
# what a manifest of the subject may be: the engine pushes Docker's schema 2 or OCI's, one image or an index
SUBJECT_TYPES = ", ".join((MANIFEST, INDEX, "application/vnd.docker.distribution.manifest.v2+json",
                           "application/vnd.docker.distribution.manifest.list.v2+json"))
HUB_API = "registry-1.docker.io"
REQUEST_TIMEOUT_S = 120  # one request's connect and read: a document of a few MB


def referrers_tag(digest: str) -> str:
    """The referrers tag scheme's name for the referrers of `digest` (sha256:<hex> -> sha256-<hex>)."""
    return digest.replace(":", "-")


def digest_of(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def canonical(document: dict) -> bytes:
    """JSON as pushed: sorted keys, no spaces, so one content is one digest."""
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Attached:
    manifest_digest: str  # the artifact's manifest
    referrers_tag: str | None  # where the registry has no referrers API: the index tag that lists it


class OciRegistry:
    """One repository's registry, spoken to over the OCI distribution API (errors: TransientRegistryError for what
    another try may mend, RegistryAuthError for refused credentials)."""

    def __init__(self, repository: str, credentials: dict[str, str] | None, insecure: bool) -> None:
        import oras.provider  # jsonschema with it: a fifth of a second, paid only by a release
        host = host_of(repository)
        self.name = repository[len(host) + 1:] if repository.startswith(host + "/") else repository
        if host == "docker.io" and "/" not in self.name:
            self.name = "library/" + self.name
        self.host = HUB_API if host == "docker.io" else host
        self.repository = repository
        root = f"{'http' if insecure else 'https'}://{self.host}/v2/"
        self.base = root + self.name
        # a registry behind htpasswd asks for Basic on every request; one behind a token server, a Bearer token
        basic = _challenge(root).startswith("basic")
        if basic and not (credentials and credentials.get("username")):
            raise RegistryAuthError(f"{self.host} asks for credentials this machine has none of: "
                                    f"`docker login {self.host}`")
        self.oras = oras.provider.Registry(hostname=self.host, insecure=insecure,
                                           auth_backend="basic" if basic else "token")
        if credentials and credentials.get("username"):
            self.oras.auth.set_basic_auth(credentials["username"], credentials.get("password") or "")
        for scheme in ("http://", "https://"):  # oras passes no timeout: every request gets ours
            self.oras.session.mount(scheme, _WithDeadline())

    def _request(self, method: str, path: str, what: str, ok: tuple[int, ...], **kw: Any) -> requests.Response:
        try:
            resp = self.oras.do_request(self.base + path, method, **kw)
        except requests.RequestException as exc:
            raise TransientRegistryError(f"{what}: the registry of {self.repository} does not answer "
                                         f"({type(exc).__name__})") from None
        except ValueError:  # oras: a 401 it has no way to answer
            raise RegistryAuthError(f"{what}: {self.host} asks for credentials this machine has none of: "
                                    f"`docker login {self.host}`") from None
        if resp.status_code in ok:
            return resp
        if resp.status_code in (401, 403):
            raise RegistryAuthError(f"{what}: {self.host} refused our credentials ({resp.status_code}): "
                                    f"`docker login {self.host}` as a user who may push to {self.name}")
        raise TransientRegistryError(f"{what}: {self.host} answered {resp.status_code} {resp.text[:200].strip()}")

    def put_blob(self, body: bytes) -> str:
        """Upload one blob (monolithic: POST, then PUT with its digest) unless the registry has it; its digest."""
        digest = digest_of(body)
        if self._request("HEAD", f"/blobs/{digest}", "reading a blob", (200, 404)).status_code == 200:
            return digest
        started = self._request("POST", "/blobs/uploads/", "starting an upload", (202,))
        location = started.headers.get("Location", "")
        if location.startswith("/"):
            location = self.base.split("/v2/")[0] + location
        url = f"{location}{'&' if '?' in location else '?'}digest={digest}"
        try:
            done = self.oras.do_request(url, "PUT", data=body, headers={"Content-Type": "application/octet-stream"})
        except requests.RequestException as exc:
            raise TransientRegistryError(f"uploading a blob: {type(exc).__name__}") from None
        if done.status_code != 201:
            raise TransientRegistryError(f"uploading a blob: {self.host} answered {done.status_code}")
        return digest

    def get_manifest(self, reference: str, accept: str) -> tuple[bytes, str] | None:
        """A manifest's bytes and media type, by tag or digest; None where there is none."""
        resp = self._request("GET", f"/manifests/{reference}", f"reading {self.repository}:{reference}", (200, 404),
                             headers={"Accept": accept})
        if resp.status_code == 404:
            return None
        return resp.content, resp.headers.get("Content-Type", "").split(";")[0]

    def get_blob(self, digest: str) -> bytes:
        return self._request("GET", f"/blobs/{digest}", f"reading {self.repository}@{digest}", (200,)).content

    def put_manifest(self, reference: str, body: bytes, media_type: str) -> requests.Response:
        return self._request("PUT", f"/manifests/{reference}", f"writing {self.repository}:{reference}", (201,),
                             data=body, headers={"Content-Type": media_type})

    def tag_listing(self, subject: str) -> list[dict]:
        """The descriptors the referrers tag of `subject` lists (none where there is no such tag)."""
        index = self.get_manifest(referrers_tag(subject), INDEX)
        return [d for d in (json.loads(index[0]).get("manifests") or []) if isinstance(d, dict)] if index else []

    def referrers(self, subject: str, artifact_type: str) -> list[dict]:
        """The descriptors of the artifacts of `artifact_type` whose subject is `subject`: the referrers API's
        answer, or where the registry has none, the referrers tag's index."""
        resp = self._request("GET", f"/referrers/{subject}?artifactType={artifact_type}", "listing referrers",
                             (200, 404), headers={"Accept": INDEX})
        if resp.status_code == 200 and resp.headers.get("Content-Type", "").startswith(INDEX):
            found = resp.json().get("manifests") or []
        else:
            found = self.tag_listing(subject)
        return [d for d in found if isinstance(d, dict) and d.get("artifactType") == artifact_type]


class _WithDeadline(requests.adapters.HTTPAdapter):
    def send(self, request: requests.PreparedRequest, **kw: Any) -> requests.Response:  # type: ignore[override]
        kw["timeout"] = kw.get("timeout") or REQUEST_TIMEOUT_S
        return super().send(request, **kw)


def _challenge(root: str) -> str:
    """How the registry at `root` (its /v2/) asks to be signed: its WWW-Authenticate, lower case; '' for none."""
    try:
        return requests.get(root, timeout=REQUEST_TIMEOUT_S).headers.get("WWW-Authenticate", "").lower()
    except requests.RequestException as exc:
        raise TransientRegistryError(f"{root} does not answer ({type(exc).__name__})") from None


def attach(registry: OciRegistry, subject: str, document: bytes, media_type: str, filename: str,
           created: str) -> Attached:
    """Push `document` as an artifact whose subject is the manifest `subject` names, and list it where clients look
    for it; the same document for the same subject is the same manifest, so a second attach changes nothing."""
    found = registry.get_manifest(subject, SUBJECT_TYPES)
    if found is None:
        raise TransientRegistryError(f"{registry.repository}@{subject}: the registry does not serve it")
    subject_body, subject_type = found
    registry.put_blob(b"{}")
    layer = {"mediaType": media_type, "digest": registry.put_blob(document), "size": len(document),
             "annotations": {TITLE: filename}}
    manifest = canonical({
        "schemaVersion": 2, "mediaType": MANIFEST, "artifactType": media_type, "config": EMPTY_CONFIG,
        "layers": [layer], "annotations": {CREATED: created},
        "subject": {"mediaType": subject_type, "digest": subject, "size": len(subject_body)},
    })
    digest = digest_of(manifest)
    answer = registry.put_manifest(digest, manifest, MANIFEST)
    if answer.headers.get("OCI-Subject") == subject:  # the registry indexes referrers itself
        return Attached(digest, None)
    tag = referrers_tag(subject)
    listed = [d for d in registry.tag_listing(subject) if d.get("digest") != digest]
    listed.append({"mediaType": MANIFEST, "digest": digest, "size": len(manifest), "artifactType": media_type,
                   "annotations": {CREATED: created}})
    registry.put_manifest(tag, canonical({"schemaVersion": 2, "mediaType": INDEX, "manifests": listed}), INDEX)
    return Attached(digest, tag)


def read_attached(registry: OciRegistry, subject: str, manifest_digest: str, media_type: str) -> tuple[bytes | None,
                                                                                                         list[str]]:
    """The document the artifact `manifest_digest` holds, read as a client finds it from `subject`; the problems."""
    listed = [d.get("digest") for d in registry.referrers(subject, media_type)]
    if manifest_digest not in listed:
        return None, [f"{registry.repository}@{subject} lists no {media_type} referrer {manifest_digest} (it lists "
                      f"{', '.join(str(d) for d in listed) or 'none'})"]
    found = registry.get_manifest(manifest_digest, MANIFEST)
    if found is None or digest_of(found[0]) != manifest_digest:
        return None, [f"{registry.repository}@{manifest_digest}: the registry does not serve that manifest"]
    manifest = json.loads(found[0])
    problems = []
    if (manifest.get("subject") or {}).get("digest") != subject:
        problems.append(f"{registry.repository}@{manifest_digest} refers to {manifest.get('subject')}, not {subject}")
    layers = manifest.get("layers") or [{}]
    document = registry.get_blob(str(layers[0].get("digest")))
    if digest_of(document) != layers[0].get("digest"):
        problems.append(f"{registry.repository}: the blob {layers[0].get('digest')} does not hash to its name")
    return document, problems


def insecure(registry_config: dict, host: str) -> bool:
    """Whether the engine speaks plain HTTP to `host` (its RegistryConfig from `docker info`): marked not secure,
    or an address in its insecure CIDRs (127.0.0.0/8 unless configured otherwise)."""
    index = (registry_config.get("IndexConfigs") or {}).get(host)
    if index is not None:
        return index.get("Secure") is False
    name = host.rsplit(":", 1)[0].strip("[]")
    try:
        address = ipaddress.ip_address(name if name != "localhost" else "127.0.0.1")
    except ValueError:
        try:
            address = ipaddress.ip_address(socket.gethostbyname(name))
        except (OSError, ValueError):
            return False
    return any(address in ipaddress.ip_network(cidr, strict=False)
               for cidr in registry_config.get("InsecureRegistryCIDRs") or [])
