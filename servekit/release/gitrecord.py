"""A release in git (`release --git-tag`): a clean working tree first, the manifest committed on its own, and the
annotated tag on that commit."""

from __future__ import annotations

import subprocess
from pathlib import Path

from servekit.errors import CheckFailed, EnvironmentProblem


def head_revision(root: Path) -> str | None:
    said = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    return said.stdout.strip() if said.returncode == 0 else None


def commit_manifest(root: Path, manifest: Path, message: str) -> None:
    """The release manifest committed on its own, so that the tag names the commit that records what was released."""
    rel = str(manifest.relative_to(root))
    subprocess.run(["git", "add", "--", rel], cwd=root, check=True, capture_output=True)
    staged = subprocess.run(["git", "diff", "--cached", "--quiet", "--", rel], cwd=root)
    if staged.returncode:
        subprocess.run(["git", "commit", "-q", "-m", message, "--", rel], cwd=root, check=True, capture_output=True)


def git_tag(root: Path, name: str, message: str) -> None:
    existing = subprocess.run(["git", "rev-parse", "-q", "--verify", f"refs/tags/{name}^{{commit}}"], cwd=root,
                              capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    if existing and existing != head:
        raise CheckFailed(f"git tag {name} already exists on another commit ({existing[:12]})")
    if not existing:
        subprocess.run(["git", "tag", "-a", name, "-m", message], cwd=root, check=True, capture_output=True)


def dirty(root: Path) -> list[str]:
    out = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
    if out.returncode != 0:
        raise EnvironmentProblem(f"--git-tag: {root} is not a git working tree")
    return out.stdout.splitlines()
