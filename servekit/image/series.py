"""The patch series: parse `series` and each patch's trailers, apply at fuzz 0, prove it applied.

The format is the one the source document's repository already uses, so its `patches/` folder
works unchanged: `series` lists basenames in order (`#` comments allowed); each patch opens with
free prose, then trailer lines (Kind, What, Upstream, Cut-against, Retires-when, optionally
Supersedes, Requires and Targets), then the hunks, with paths relative to the `vllm` package.

Standard library only: the image build runs this file as a script.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ServekitError

TRAILERS = ("Kind", "What", "Upstream", "Cut-against", "Retires-when", "Supersedes", "Requires", "Targets")
KINDS = ("backport", "fix", "feature", "local")
REQUIRED = ("Kind", "What", "Cut-against")
PATCH_ARGS = ["-p1", "--forward", "--fuzz", "0", "--no-backup-if-mismatch", "--reject-file", "-"]


class SeriesError(ServekitError):
    """The series, a patch or its application is wrong; the message names the patch (and hunk)."""


@dataclass
class Patch:
    name: str
    path: Path
    trailers: dict[str, str]
    files: list[str] = field(default_factory=list)  # paths the hunks touch, relative to vllm/

    @property
    def targets(self) -> list[str] | None:
        value = self.trailers.get("Targets")
        return [t.strip() for t in value.split(",")] if value else None

    @property
    def supersedes(self) -> list[str]:
        value = self.trailers.get("Supersedes")
        return [t.strip() for t in value.split(",")] if value else []

    @property
    def requires(self) -> list[str]:
        """Patches (basenames) whose code this one calls: a build leaving one of them out must leave this out too."""
        value = self.trailers.get("Requires")
        return [t.strip() for t in value.split(",")] if value else []

    def applies_to(self, target: str) -> bool:
        return self.targets is None or target in self.targets


def read_series(series_dir: Path) -> list[Patch]:
    """Every patch of the series, in order; the series file and the folder must agree."""
    series_file = series_dir / "series"
    if not series_file.is_file():
        raise SeriesError(f"{series_file}: missing; list the patches there, one basename a line")
    names = []
    for lineno, raw in enumerate(series_file.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "/" in line or line in names:
            raise SeriesError(f"{series_file}:{lineno}: {line!r}: expected a basename listed once")
        names.append(line)
    on_disk = {p.name for p in series_dir.glob("*.patch")}
    missing = [n for n in names if not (series_dir / n).is_file()]
    if missing:
        raise SeriesError(f"{series_file}: lists {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                          f"not in {series_dir}")
    unlisted = sorted(on_disk - set(names))
    if unlisted:
        raise SeriesError(f"{series_dir}: {', '.join(unlisted)} not listed in {series_file}; add or delete")
    patches = [parse_patch(series_dir / n) for n in names]
    for patch in patches:  # a patch replaces what it supersedes: both at once would apply the change twice
        both = [old for old in patch.supersedes if old in names]
        if both:
            raise SeriesError(f"{patch.name} supersedes {', '.join(both)}, which the series lists too; drop "
                              f"{', '.join(both)} from {series_file}")
        later = [needed for needed in patch.requires if needed not in names[:names.index(patch.name)]]
        if later:
            raise SeriesError(f"{patch.name} requires {', '.join(later)}, which the series does not list before it; "
                              f"list {', '.join(later)} earlier in {series_file}")
    return patches


def trailer(line: str) -> tuple[str, str] | None:
    """(key, value) when the line is one of the series' trailers, `Key: value`."""
    mo = re.match(r"^([A-Z][A-Za-z-]+):\s*(.*)$", line)
    return (mo[1], mo[2].strip()) if mo and mo[1] in TRAILERS else None


def preamble_trailers(text: str) -> dict[str, str]:
    """The trailers of a patch's preamble (what precedes its first `--- ` line), by key."""
    return dict(found for line in text.partition("\n--- ")[0].splitlines() if (found := trailer(line)))


def parse_patch(path: Path) -> Patch:
    text = path.read_text()
    if "\n--- " not in text:
        raise SeriesError(f"{path.name}: no hunks (expected a unified diff after the preamble)")
    trailers = preamble_trailers(text)
    for key in REQUIRED:
        if key not in trailers:
            raise SeriesError(f"{path.name}: missing trailer {key}: (expected {', '.join(REQUIRED)})")
    if trailers["Kind"] not in KINDS:
        raise SeriesError(f"{path.name}: Kind: {trailers['Kind']!r}, expected one of {', '.join(KINDS)}")
    files = [re.sub(r"^[^/]+/", "", m) for m in re.findall(r"^\+\+\+ (\S+)", text, flags=re.M)]
    return Patch(path.name, path, trailers, files)


def run_patch(args: list[str], patch: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["patch", *args, "-i", str(patch.resolve())], cwd=cwd, capture_output=True, text=True)


def patch_failure(patch: Patch, output: str) -> str:
    current, failed = None, []
    for line in output.splitlines():
        mo = re.match(r"^(?:patching|checking) file (.+)$", line)
        if mo:
            current = mo[1].strip("'")
        mo = re.match(r"Hunk #(\d+) FAILED at (\d+)", line)
        if mo:
            failed.append(f"hunk #{mo[1]} of {current} (at line {mo[2]})")
        if "can't find file to patch" in line or "No file to patch" in line:
            failed.append(f"a file it patches is missing ({current or 'unknown'})")
        if "Reversed (or previously applied) patch detected" in line:
            failed.append(f"{current}: already applied or reversed")
    return (f"patch {patch.name} does not apply at fuzz 0: " + ("; ".join(failed) or output.strip()[-300:]) +
            f" (Cut-against: {patch.trailers.get('Cut-against')}); re-cut it against the pinned vLLM")


def apply_series(series_dir: Path, vllm_dir: Path, target: str, say: Callable[[str], None] = print) -> list[tuple[str, int]]:
    """Apply each patch for `target`, checking it first so a reject leaves nothing half applied."""
    applied = []
    for patch in read_series(series_dir):
        if not patch.applies_to(target):
            say(f"-- {patch.name} (not for {target})")
            continue
        check = run_patch([*PATCH_ARGS, "--dry-run"], patch.path, vllm_dir)
        if check.returncode != 0:
            raise SeriesError(patch_failure(patch, check.stdout + check.stderr))
        done = run_patch(PATCH_ARGS, patch.path, vllm_dir)
        if done.returncode != 0:
            raise SeriesError(patch_failure(patch, done.stdout + done.stderr))
        offsets = len(re.findall(r"^Hunk #\d+ succeeded at \d+ \(offset", done.stdout, flags=re.M))
        say(f"== {patch.name}" + (f" ({offsets} hunk{'s' if offsets != 1 else ''} at an offset)" if offsets else ""))
        applied.append((patch.name, offsets))
    return applied


def settled_files(manifest: Path | None) -> set[str]:
    """The files a component manifest pins (relative to vllm/); none when there is no manifest."""
    if manifest is None or not manifest.is_file():
        return set()
    return {f for comp in json.loads(manifest.read_text()) for f in comp["files"]}


def check_applied(series_dir: Path, vllm_dir: Path, target: str, settled: set[str] | None = None) -> list[str]:
    """Problems: a patch for `target` whose reverse does not apply. A patch touching a file in `settled` (one a
    component patched after the series, its final content pinned by the component's manifest) is excused: the
    component's change may sit in its context."""
    patches = [p for p in read_series(series_dir) if p.applies_to(target)]
    problems = []
    for patch in patches:
        if settled and settled & set(patch.files):
            continue
        reverse = run_patch(["-R", "--dry-run", *PATCH_ARGS[:1], "--fuzz", "0", "-f"], patch.path, vllm_dir)
        if reverse.returncode != 0:
            problems.append(f"patch {patch.name} is not applied in {vllm_dir}")
    return problems


def prove_on_pristine(series_dir: Path, wheel: Path, target: str, say: Callable[[str], None] = print) -> list[str]:
    """Apply the series for `target` to the `vllm/` tree of a pristine wheel; problems, if any.

    Beyond applying at fuzz 0, the files that end up changed must be exactly the files the
    applied patches name: a hunk that lands in an unexpected file, or a patch that changes
    nothing, is a problem.
    """
    import filecmp
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory(prefix="servekit-pristine-") as tmp:
        with zipfile.ZipFile(wheel) as whl:
            members = [m for m in whl.namelist() if m.startswith("vllm/") and not m.endswith((".so", "/"))]
            whl.extractall(tmp, members)
            for m in members:
                whl.extract(m, Path(tmp) / "pristine")
        tree, pristine = Path(tmp) / "vllm", Path(tmp) / "pristine" / "vllm"
        try:
            applied = apply_series(series_dir, tree, target, say=say)
        except SeriesError as exc:
            return [str(exc)]
        expected = {f for p in read_series(series_dir) if p.name in dict(applied) for f in p.files}
        changed = {str(path.relative_to(tree)) for path in tree.rglob("*") if path.is_file()
                   and (not (pristine / path.relative_to(tree)).exists()
                        or not filecmp.cmp(path, pristine / path.relative_to(tree), shallow=False))}
        problems = [f"{f}: changed, but no applied patch names it" for f in sorted(changed - expected)]
        problems += [f"{f}: named by a patch, but unchanged" for f in sorted(expected - changed)]
        return problems


def site_vllm_dir(python: str) -> Path:
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    return Path(purelib) / "vllm"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="apply or check the patch series (inside the image)")
    parser.add_argument("action", choices=("apply", "check"))
    parser.add_argument("--series-dir", type=Path, required=True)
    parser.add_argument("--target", required=True)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--vllm-dir", type=Path)
    where.add_argument("--python", help="the interpreter whose site-packages holds vllm")
    parser.add_argument("--settled-by", type=Path, help="check: a component manifest whose files' content is pinned "
                        "after the series (their series patches are excused)")
    args = parser.parse_args(argv)
    vllm_dir = args.vllm_dir or site_vllm_dir(args.python)
    try:
        if args.action == "apply":
            apply_series(args.series_dir, vllm_dir, args.target)
        else:
            problems = check_applied(args.series_dir, vllm_dir, args.target, settled_files(args.settled_by))
            for p in problems:
                print(f"error: {p}", file=sys.stderr)
            return 1 if problems else 0
    except SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
