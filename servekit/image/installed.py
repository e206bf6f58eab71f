"""Which file of each locked distribution the image installed, and the SBOM narrowed to it (inside the image).

The lock accepts several files for most distributions (one wheel per platform and Python), and the SBOM made on
the host lists the SHA-256 of each. The build downloads every wheel of a slice into a folder of its own before it
installs from there (install_locked.sh), so what was installed is known file by file:

    python3 -m servekit.image.installed record DOWNLOADED OUT.json   # name -> the wheel and its SHA-256
    python3 -m servekit.image.installed narrow SBOM INSTALLED_DIR    # each pypi component: that one hash

`narrow` refuses an SBOM whose Python distributions are not exactly the ones installed, or an installed file the
lock did not accept for it: the build stops there, nothing tagged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

from .errors import ServekitError

PYPI = "pkg:pypi/"


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares them (what the SBOM's purls hold)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def record(downloaded: Path) -> dict[str, dict[str, str]]:
    """name -> {file, sha256} of every wheel in the folder a slice was installed from."""
    out = {}
    for wheel in sorted(downloaded.glob("*.whl")):
        with wheel.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        out[canonical(wheel.name.split("-", 1)[0])] = {"file": wheel.name, "sha256": digest}
    return out


def narrow(sbom: dict, installed: dict[str, dict[str, str]]) -> dict:
    """The SBOM with each Python distribution's hashes cut to the one file installed."""
    listed = set()
    for component in sbom.get("components", []):
        if not component.get("purl", "").startswith(PYPI):
            continue
        name = canonical(component["name"])
        listed.add(name)
        if name not in installed:
            raise ServekitError(f"the SBOM lists {name}, which the build did not install")
        chosen = installed[name]
        accepted = {h["content"] for h in component.get("hashes", [])}
        if chosen["sha256"] not in accepted:
            raise ServekitError(f"{chosen['file']} (sha256 {chosen['sha256']}) is not a file the lock accepts for "
                                f"{name}")
        component["hashes"] = [{"alg": "SHA-256", "content": chosen["sha256"]}]
    unlisted = sorted(set(installed) - listed)
    if unlisted:
        raise ServekitError(f"installed but not in the SBOM: {', '.join(unlisted)}")
    return sbom


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="record what a slice installed; narrow the SBOM to it")
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="the wheels of a download folder, each with its SHA-256")
    rec.add_argument("downloaded", type=Path)
    rec.add_argument("out", type=Path)
    nar = commands.add_parser("narrow", help="each Python distribution of the SBOM cut to the file installed")
    nar.add_argument("sbom", type=Path)
    nar.add_argument("installed_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "record":
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record(args.downloaded), indent=2, sort_keys=True) + "\n")
            return 0
        installed: dict[str, dict[str, str]] = {}
        for part in sorted(args.installed_dir.glob("*.json")):
            installed.update(json.loads(part.read_text()))
        sbom = narrow(json.loads(args.sbom.read_text()), installed)
        args.sbom.write_text(json.dumps(sbom, indent=2) + "\n")
    except ServekitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
