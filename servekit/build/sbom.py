"""The image's software bill of materials (CycloneDX 1.6 JSON, made with cyclonedx-python-lib): every Python
distribution the lock installs with its version and hashes, vLLM with its pedigree (each patch of the series
applied to it, with its diff), every Debian package of the base, and the patch series and components with their
SHA-256. Baked into the image at SBOM_PATH; `release` pushes it beside it.

The same inputs give the same bytes (a serial number derived from the content digest, the matrix's epoch as its
time), so the SBOM does not make two builds of one tag differ.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import uuid
from pathlib import Path

from cyclonedx.model import AttachedText, HashAlgorithm, HashType, Property
from cyclonedx.model.bom import Bom, BomMetaData
from cyclonedx.model.component import Component, ComponentType, Diff, Patch, PatchClassification, Pedigree
from cyclonedx.output.json import JsonV1Dot6
from packageurl import PackageURL
from packaging.utils import canonicalize_name

from servekit.build.plan import TargetPlan
from servekit.engines.protocol import ImageEngine
from servekit.errors import EnvironmentProblem
from servekit.image.series import preamble_trailers

SBOM_PATH = "/opt/servekit/sbom.cdx.json"
MEDIA_TYPE = "application/vnd.cyclonedx+json"
_PACKAGE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
_DPKG_FORMAT = r"${Package}\t${Version}\t${Architecture}\n"


def locked_distributions(lock_text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, the SHA-256 of every file the lock accepts for it), from a hash-checked lock."""
    out: dict[str, tuple[str, list[str]]] = {}
    current = ""
    for line in lock_text.splitlines():
        if found := _PACKAGE.match(line):
            current = canonicalize_name(found[1])
            out.setdefault(current, (found[2], []))
        elif current and line.startswith((" ", "\t")):
            out[current][1].extend(_HASH.findall(line))
        else:
            current = ""
    return out


def debian_packages(engine: ImageEngine, image: str) -> list[tuple[str, str, str]]:
    """(package, version, architecture) of every Debian package installed in `image`, as dpkg records them."""
    try:
        said = engine.output_of(image, "dpkg-query", ["-W", f"-f={_DPKG_FORMAT}"])
    except EnvironmentProblem as exc:
        raise EnvironmentProblem(f"cannot list the Debian packages of {image} for its SBOM: {exc}") from None
    rows = [line.split("\t") for line in said.decode().splitlines() if line.count("\t") == 2]
    return sorted((name, version, arch) for name, version, arch in rows)


def _sha256(text_or_bytes: bytes) -> HashType:
    return HashType(alg=HashAlgorithm.SHA_256, content=hashlib.sha256(text_or_bytes).hexdigest())


def pedigree(series: dict[str, bytes]) -> Pedigree | None:
    """The series as CycloneDX patches of the distribution it is applied to: each its diff (the patch file, header
    and all) and its kind (a `Kind: backport` one a backport, the rest unofficial). CycloneDX's library writes them
    sorted; the order they were applied in is each patch file component's `servekit:applied`."""
    patches = []
    for data in series.values():
        text = data.decode()
        patches.append(Patch(type=PatchClassification.BACKPORT if preamble_trailers(text).get("Kind") == "backport"
                             else PatchClassification.UNOFFICIAL,
                             diff=Diff(text=AttachedText(content=text, content_type="text/x-diff"))))
    return Pedigree(patches=patches) if patches else None


def document(plan: TargetPlan, lock_text: str, debian: list[tuple[str, str, str]], series: dict[str, bytes],
             components: dict[str, str], epoch: str, patched: str) -> str:
    """The SBOM of the image `plan` builds. `series`: patch file name -> its bytes, in the order applied to the
    distribution `patched` (the target's vLLM); `components`: name -> the SHA-256 of its source
    (builder.component_digest)."""
    parts: list[Component] = []
    for name, (version, hashes) in sorted(locked_distributions(lock_text).items()):
        purl = PackageURL(type="pypi", name=name, version=version)
        parts.append(Component(name=name, version=version, purl=purl, bom_ref=purl.to_string(),
                               hashes=[HashType(alg=HashAlgorithm.SHA_256, content=h) for h in hashes],
                               pedigree=pedigree(series) if name == canonicalize_name(patched) else None))
    for name, version, arch in debian:
        purl = PackageURL(type="deb", namespace="debian", name=name, version=version, qualifiers={"arch": arch})
        parts.append(Component(name=name, version=version, purl=purl, bom_ref=purl.to_string(),
                               properties=[Property(name="servekit:layer", value="base")]))
    for applied, (name, data) in enumerate(series.items(), 1):  # CycloneDX sorts the pedigree: the order is here
        parts.append(Component(name=name, type=ComponentType.FILE, bom_ref=f"patch:{name}", hashes=[_sha256(data)],
                               properties=[Property(name="servekit:layer", value="patch series"),
                                           Property(name="servekit:applied", value=str(applied))]))
    for name, digest in sorted(components.items()):
        parts.append(Component(name=name, type=ComponentType.LIBRARY, bom_ref=f"component:{name}",
                               hashes=[HashType(alg=HashAlgorithm.SHA_256, content=digest)],
                               properties=[Property(name="servekit:layer", value="components")]))
    image_name, _, version = plan.tag.rpartition(":")
    image = Component(name=image_name, version=version, type=ComponentType.CONTAINER, bom_ref=plan.tag,
                      properties=[Property(name="servekit:digest", value=plan.digest),
                                  Property(name="servekit:target", value=plan.target),
                                  Property(name="servekit:base", value=plan.base)])
    when = dt.datetime.fromisoformat(epoch.replace("Z", "+00:00"))
    bom = Bom(components=parts, serial_number=uuid.uuid5(uuid.NAMESPACE_URL, f"servekit:{plan.digest}"),
              metadata=BomMetaData(component=image, timestamp=when))
    bom.register_dependency(image, parts)  # the image holds every part directly
    return JsonV1Dot6(bom).output_as_string(indent=2) + "\n"


def read_components(sbom: dict) -> dict[str, dict]:
    """bom-ref -> component, from a parsed SBOM (what `release --verify` and the tests read back)."""
    return {c["bom-ref"]: c for c in sbom.get("components", [])}


def series_files(series_dir: Path, names: list[str]) -> dict[str, bytes]:
    return {name: (series_dir / name).read_bytes() for name in names}
