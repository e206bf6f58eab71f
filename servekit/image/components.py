"""Components (KVarN): installed after the series, verified by file hashes and by import.

A component's source is a folder laid out as in the source document's repository:
`files/vllm/` (copied into the vllm package as is) and patches named in images.yaml (applied at
fuzz 0, like the series). The install writes a manifest of every file it put or changed, with
its hash; verify re-hashes them and imports each module the component added.

Standard library only: the image build runs this file as a script.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from .series import PATCH_ARGS, SeriesError, parse_patch, patch_failure, site_vllm_dir

MANIFEST = "component-manifest.json"


def file_sha256(path: Path) -> str:
    """The file's sha256 in hex, read a MiB at a time (a wheel need not fit in memory). Here, not in boundary.py:
    the build's components stage holds this file and series.py alone."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_digest(source: Path, patches: list[str]) -> str:
    """The digest images.yaml pins a component's source to: its files and its patches."""
    h = hashlib.sha256()
    files = sorted(p for p in (source / "files").rglob("*") if p.is_file()) if (source / "files").is_dir() else []
    for path in files + [source / name for name in patches]:
        h.update(f"\0{path.relative_to(source).as_posix()}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def install(name: str, source: Path, patches: list[str], vllm_dir: Path, checks: list[str] | None = None,
            say: Callable[[str], None] = print) -> dict:
    files_root = source / "files" / "vllm"
    added = []
    if files_root.is_dir():
        for src in sorted(p for p in files_root.rglob("*") if p.is_file()):
            rel = src.relative_to(files_root)
            (vllm_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, vllm_dir / rel)
            added.append(rel.as_posix())
    changed = []
    for patch_name in patches:
        patch = parse_patch(source / patch_name)
        for args in ([*PATCH_ARGS, "--dry-run"], PATCH_ARGS):
            done = subprocess.run(["patch", *args, "-i", str(patch.path.resolve())], cwd=vllm_dir, capture_output=True,
                                  text=True)
            if done.returncode != 0:  # a hunk that did not land is an error, never skipped
                raise SeriesError(f"component {name}: " + patch_failure(patch, done.stdout + done.stderr))
        changed += patch.files
    say(f"== component {name}: {len(added)} files, {len(patches)} patches")
    return {"name": name, "files": {rel: file_sha256(vllm_dir / rel) for rel in sorted(set(added + changed))},
            "modules": [f"vllm.{rel[:-3].replace('/', '.')}" for rel in added if rel.endswith(".py")
                        and not rel.endswith("__init__.py")], "checks": checks or []}


def verify(manifest: list[dict], vllm_dir: Path, python: str) -> list[str]:
    problems = []
    for comp in manifest:
        for rel, digest in comp["files"].items():
            path = vllm_dir / rel
            if not path.is_file():
                problems.append(f"component {comp['name']}: {rel} is missing")
            elif file_sha256(path) != digest:
                problems.append(f"component {comp['name']}: {rel} does not match its installed hash")
        for module in comp["modules"]:
            done = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                problems.append(f"component {comp['name']}: import {module} failed: {last}")
        for check in comp.get("checks", []):  # the component's own post-install checks (images.yaml)
            done = subprocess.run([python, "-c", check], capture_output=True, text=True)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                problems.append(f"component {comp['name']}: check `{check[:80]}` failed: {last}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="install or verify components (inside the image)")
    parser.add_argument("action", choices=("install", "verify"))
    parser.add_argument("--spec", type=Path, help="install: JSON [{name, patches}] in install order")
    parser.add_argument("--components-dir", type=Path, required=True, help="holds one source folder per component")
    parser.add_argument("--python", required=True)
    args = parser.parse_args(argv)
    vllm_dir = site_vllm_dir(args.python)
    manifest_path = args.components_dir / MANIFEST
    try:
        if args.action == "install":
            if args.spec is None:
                parser.error("install needs --spec")
            manifest = [install(c["name"], args.components_dir / c["name"], c["patches"], vllm_dir, c.get("checks"))
                        for c in json.loads(args.spec.read_text())]
            manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
            return 0
        problems = verify(json.loads(manifest_path.read_text()), vllm_dir, args.python)
    except SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
