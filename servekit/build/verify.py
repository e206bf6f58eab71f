"""`verify`: the matrix against everything that repeats or derives from it, without an image: pin mirrors,
derived files, the package locks, vLLM's declared requirements (co-pins) and the series on pristine vLLM trees."""

from __future__ import annotations

from servekit.build.findings import Findings
from servekit.build.index import IndexUnreachable, NotOnIndex, download_wheel
from servekit.build.locks import problems as lock_problems
from servekit.build.pins import copin_problems, mirror_problems
from servekit.build.portcheck import trailer_findings
from servekit.config.derived import stale
from servekit.config.session import Session
from servekit.image.series import SeriesError, prove_on_pristine, read_series
from servekit.output import Say


def verify(session: Session, offline: bool = False, series: bool = True, say: Say = print) -> Findings:
    matrix, root = session.matrix, session.root
    findings = Findings()
    findings.extend(mirror_problems(matrix, root))
    try:
        findings.extend(trailer_findings(read_series(root / matrix.series.dir), matrix.vllm))
    except SeriesError as exc:
        findings.problems.append(f"series: {exc}")
    findings.problems += stale(matrix, root)
    stale_locks, lock_notes = lock_problems(matrix, root)
    findings.problems += stale_locks
    findings.notes += lock_notes
    if offline:
        findings.notes.append("--offline: co-pins checked only from the metadata cache")
    findings.extend(copin_problems(matrix, session.cache / "metadata"))
    for name, model in matrix.models.items():
        unpinned = [model.repo] if model.repo and not model.revision else []
        unpinned += [d.repo for d in model.drafters.values() if not d.revision]
        findings.notes += [f"models.{name}: {repo} is fetched at main, not a commit; pin revision: in images.yaml"
                           for repo in unpinned]
    if series:
        findings.extend(prove_series(session, offline, say))
    return findings


def prove_series(session: Session, offline: bool, say: Say = print) -> Findings:
    """The series applied, per target, to a pristine tree of that target's pinned vLLM wheel."""
    matrix = session.matrix
    out = Findings()
    pristine = session.cache / "pristine"
    for name, target in matrix.targets.items():
        dist = target.vllm_distribution
        cached = sorted(pristine.glob(f"{dist.replace('-', '_')}-{matrix.vllm}-*.whl"))
        if cached:
            wheel = cached[-1]
        elif offline:
            out.notes.append(f"--offline: no cached {dist} {matrix.vllm} wheel; series not proven for {name}")
            continue
        else:
            say(f"fetching the pristine {dist} {matrix.vllm} wheel (once; cached)")
            try:
                wheel = download_wheel(dist, matrix.vllm, matrix.indexes["pypi"].url, pristine)
            except (IndexUnreachable, NotOnIndex) as exc:
                out.notes.append(f"series not proven on a pristine {dist} tree: {exc}")
                continue
        try:
            problems = prove_on_pristine(session.root / matrix.series.dir, wheel, name, say=lambda s: None)
        except SeriesError as exc:
            problems = [str(exc)]
        out.problems += [f"series on pristine {dist} {matrix.vllm} ({name}): {p}" for p in problems]
        if not problems:
            out.notes.append(f"series applies at fuzz 0 to a pristine {dist} {matrix.vllm} tree ({name})")
    return out
