"""`series export`: a git branch that carries one commit per topic on top of a vLLM tag, turned into the series
folder: one patch per commit in commit order, the commit message's prose and trailers kept, `Cut-against` set to
the tag, paths relative to the `vllm` package. Nothing in a patch depends on when it was exported, so exporting
the same branch twice gives identical files.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from servekit.errors import UserError
from servekit.image.boundary import write_text_atomic
from servekit.image.series import REQUIRED, TRAILERS, trailer

PACKAGE = "vllm/"  # the diff is taken inside the package, as the series applies it (patch -p1 in site-packages/vllm)
SERIES_HEADER = ("# The patch series, applied in this order with `patch -p1 --forward --fuzz 0` inside the vllm package.\n"
                 "# Exported by `python3 build.py series export` from {branch} on {base}; one patch per commit.\n")


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["failed"])[-1]
        raise UserError(f"git {' '.join(args)} in {repo}: {said}")
    return done.stdout


def patch_name(subject: str) -> str:
    """The file name a commit's subject gives: lower case, words joined by '-'."""
    slug = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")[:60].rstrip("-")
    return f"{slug or 'patch'}.patch"


def _message_parts(message: str) -> tuple[list[str], dict[str, str]]:
    """(prose lines, trailers) of a commit message; trailers are `Key: value` lines of the series' keys."""
    prose, trailers = [], {}
    for line in message.rstrip().splitlines():
        found = trailer(line)
        if found:
            trailers[found[0]] = found[1]
        else:
            prose.append(line.rstrip())
    while prose and not prose[-1]:
        prose.pop()
    return prose, trailers


def _commit(repo: Path, what: str, name: str) -> str:
    """The commit a tag or branch name names; refused when it is no name (an option, a range, a line break), so that
    nothing given here reaches git as anything but a revision."""
    if not name or name.startswith("-") or ".." in name or any(c.isspace() or not c.isprintable() for c in name):
        raise UserError(f"--{what} {name[:80]!r}: expected a {what} name such as "
                        f"{'v0.31.0' if what == 'tag' else 'servekit-series'}")
    done = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", "--end-of-options",
                           f"{name}^{{commit}}"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise UserError(f"--{what} {name}: {repo} has no such {what}")
    return done.stdout.strip()


def _binary_files(repo: Path, sha: str) -> list[str]:
    """The files under the package a commit changes as binary (git's numstat counts no lines for them): a patch
    applied with `patch` carries text only, so their change would be exported as nothing."""
    numstat = _git(repo, "diff", "--numstat", "--no-renames", f"--relative={PACKAGE}", f"{sha}^", sha, "--", PACKAGE)
    return [line.split("\t", 2)[2] for line in numstat.splitlines() if line.startswith("-\t-\t")]


def export(repo: Path, base: str, branch: str, out: Path) -> list[str]:
    """Write the series for `branch` over `base` into `out` (its .patch files and `series` replaced); the names."""
    base_sha, branch_sha = _commit(repo, "tag", base), _commit(repo, "branch", branch)
    commits = _git(repo, "rev-list", "--reverse", "--topo-order", f"{base_sha}..{branch_sha}").split()
    if not commits:
        raise UserError(f"{branch} has no commit on top of {base} in {repo}")
    cut = base.split("/")[-1]
    patches: dict[str, str] = {}
    for sha in commits:
        subject = _git(repo, "log", "-1", "--format=%s", sha).strip()
        prose, trailers = _message_parts(_git(repo, "log", "-1", "--format=%b", sha))
        missing = [key for key in REQUIRED if key != "Cut-against" and key not in trailers]
        if missing:
            raise UserError(f"commit {sha[:12]} ({subject}): no {', '.join(k + ':' for k in missing)} trailer in its "
                            "message; the series needs them (docs/build.md)")
        if binary := _binary_files(repo, sha):
            raise UserError(f"commit {sha[:12]} ({subject}) changes {binary[0]}, a binary file: a patch of the series "
                            "carries text only; ship the file as a component (docs/build.md) or leave it out")
        diff = _git(repo, "diff", "--no-color", "--no-ext-diff", "--no-renames", f"--relative={PACKAGE}",
                    f"{sha}^", sha, "--", PACKAGE)
        if not diff.strip():
            raise UserError(f"commit {sha[:12]} ({subject}) changes nothing under {PACKAGE}")
        name = patch_name(subject)
        if name in patches:
            raise UserError(f"commit {sha[:12]}: another commit's subject gives {name} too; make the subjects differ")
        trailers["Cut-against"] = cut
        head = [subject, "", *prose, *([""] if prose else []),
                *(f"{key}: {trailers[key]}" for key in TRAILERS if key in trailers),
                "", f"Exported from commit {sha} of {branch} by `python3 build.py series export`.", ""]
        patches[name] = "\n".join(head) + "\n" + diff
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.patch"):
        if stale.name not in patches:
            stale.unlink()
    for name, text in patches.items():
        write_text_atomic(out / name, text, mode=0o644)
    write_text_atomic(out / "series", SERIES_HEADER.format(branch=branch, base=base) + "".join(f"{n}\n" for n in patches),
               mode=0o644)
    return list(patches)
