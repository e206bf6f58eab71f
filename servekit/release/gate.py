"""The release gate: only an image whose required profiles passed their checks in reports of that very image ID,
and for a GPU target a run on a GPU and a full-size run on a 24 GB card, each proof judged on its figures."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from servekit.config.matrix import Matrix
from servekit.engines.card import mps_cap_bytes
from servekit.errors import CheckFailed, UserError
from servekit.records.models import OtherKind, ProfileGate, RunReport
from servekit.records.report import load_report, report_files


def _reports(root: Path) -> tuple[list[tuple[Path, RunReport]], list[str]]:
    """The run reports under root, and why each report file that is no readable run report was refused (a sweep's
    table is another kind, not broken: left out of both). Neither a broken nor another version's file gates a
    release; the refusal names them, since a proof the gate cannot read is as good as none."""
    out, unread = [], []
    for path in report_files(root):
        try:
            out.append((path, load_report(path)))
        except OtherKind:
            continue
        except UserError as exc:
            unread.append(str(exc).replace(f"{path}: ", f"{path.relative_to(root)}: ", 1))
    return out, unread


def _finite(value: object) -> bool:
    """Every number in `value` (a check's figures, nested) is a finite one: NaN or infinity measured nothing."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


def proof_problem(matrix: Matrix, report: RunReport) -> str | None:
    """Why a report that says it passed proves nothing for a release, or None. It must hold every check images.yaml
    requires of its profile on its target and host (for the model it served), each passed, once; a check called not
    required only where images.yaml says so; every figure finite."""
    if report.host not in matrix.hosts:
        return f"its host {report.host!r} is none of images.yaml's ({', '.join(matrix.hosts)})"
    if report.stand_in is not None and report.stand_in not in matrix.models:
        return f"it served {report.stand_in!r}, a model images.yaml does not name"
    required = matrix.profile_checks(report.profile, report.target, report.host, report.stand_in)
    excused = matrix.not_required(report.profile, report.target, report.stand_in)
    named = Counter(c.name for c in report.checks)
    if twice := sorted(name for name, n in named.items() if n > 1):
        return f"it holds {', '.join(twice)} more than once"
    if missing := [name for name in required if name not in named]:
        return (f"it holds {len(set(named) & set(required))} of the {len(required)} checks images.yaml requires "
                f"(missing: {', '.join(missing)}); a run limited by --check proves only what it ran")
    for result in report.checks:
        if result.status == "not_required" and result.name not in excused:
            return f"it calls {result.name} not required, and images.yaml requires it of {report.profile}"
        if result.status not in ("passed", "not_required"):
            return f"{result.name} is {result.status.replace('_', ' ')}"
        if not _finite(result.figures):
            return f"{result.name}'s figures hold a number that is not finite"
    if not _finite(report.boot.model_dump()):
        return "its boot figures hold a number that is not finite"
    return None


def gpu_proof_problem(report: RunReport) -> str | None:
    """Why a passing report of a GPU target does not prove the image on a GPU, or None: it must come from a Docker
    engine (a process engine serves a venv, not the image) and carry NVML's memory samples of a GPU, each entry with
    its total, its sample count and its peak (whole numbers: the report's reader holds them so) fitting the card."""
    if report.served_from != "image":
        return f"it was served from an environment ({report.engine}), not by the image in a container"
    if not report.memory.gpus:
        return "it holds no GPU memory samples (NVML did not answer where it ran)"
    for i, entry in enumerate(report.memory.gpus):
        total, samples, peak = entry["total_bytes"], entry["samples"], entry["peak_used_bytes"]
        if peak is None:
            return f"its GPU memory entry {i} has no peak (no sample came)"
        if report.card and peak > total > 0 and samples >= 1:
            return (f"its peak ({peak / 2**30:.2f} GiB) passed the memory of the card it emulated "
                    f"({total / 2**30:.2f} GiB): on that card it would not have fit")
        if total <= 0 or samples < 1 or not 0 <= peak <= total:
            return (f"its GPU memory entry {i} is not a measurement (total {total}, {samples} samples, peak "
                    f"{peak})")
    return None


def gate(matrix: Matrix, target: str, image_id: str, root: Path) -> dict[str, ProfileGate]:
    """The passing report of each profile required for a release, matched by image ID; refuses otherwise. A report
    that says it passed but proves nothing (proof_problem; on a GPU target gpu_proof_problem too) is refused with
    why, where it is the only one of the image."""
    required = [p for p, spec in matrix.profiles.items() if spec.required_for_release and target in spec.targets]
    found = {}
    reports, unread = _reports(root)  # read once for every profile
    unread_note = f"; {len(unread)} report(s) could not be read, the last: {unread[-1]}" if unread else ""
    gpu = matrix.targets[target].gpu
    for profile in required:
        mine = [(p, r) for p, r in reports if r.profile == profile and r.target == target]
        same = [(p, r) for p, r in mine if r.image.id == image_id and r.gate_passes]
        judged = [(p, r, proof_problem(matrix, r) or (gpu_proof_problem(r) if gpu else None)) for p, r in same]
        answering = [(p, r, why) for p, r, why in judged if _proves(matrix, r, "function")]
        working = [(p, r) for p, r, why in answering if not why]
        if not working and answering:
            path, _, why = answering[-1]
            fix = "on a GPU host through a Docker engine" if gpu else "with every check"
            raise CheckFailed(f"{target}: the passing {profile} report of {image_id[:19]}... proves nothing "
                              f"({path.relative_to(root)}): {why}; run `python3 build.py run --target {target} "
                              f"--profile {profile}` {fix}")
        if not working:
            others = [(r.image.id or "?")[:19] for _, r in mine if r.gate_passes]
            if others and not same:
                raise CheckFailed(f"{target}: the passing {profile} reports are of another image ({others[-1]}...), "
                                  f"not of {image_id[:19]}...; run `python3 build.py run --target {target} "
                                  f"--profile {profile}` on this image")
            raise CheckFailed(f"{target}: no passing {profile} report for image {image_id[:19]}..."
                              + ("; those there served a model whose answers prove nothing (random weights)" if same
                                 else "") + unread_note + f"; run `python3 build.py run --target {target} --profile "
                              f"{profile}` with the model or a trained stand-in")
        sizing = [(p, r, why or size_proof_problem(matrix, r)) for p, r, why in judged if _proves(matrix, r, "size")]
        sized = [(p, r) for p, r, why in sizing if not why]
        if gpu and not sized:
            refused = [why for _, _, why in sizing if why]
            raise CheckFailed(f"{target}: no passing full-size {profile} report on a 24 GB card for image "
                              f"{image_id[:19]}..." + (f" (the one there proves nothing: {refused[-1]})" if refused
                                                       else "") + unread_note + "; write the checkpoint's layout with `python "
                              f"build.py stand-in` and run `python3 build.py run --target {target} --profile "
                              f"{profile} --card rtx3090` with MODEL_DIR naming it (docs/gpu/README.md)")
        path, report = working[-1]
        found[profile] = ProfileGate(report=str(path.relative_to(root)), passed=True, run_id=report.run_id,
                                     checks={c.name: c.status for c in report.checks},
                                     size_report=str(sized[-1][0].relative_to(root)) if sized else None)
    return found


def _proves(matrix: Matrix, report: RunReport, what: str) -> bool:
    """Whether the model a report served proves `what` (function, size): the served model both, a stand-in what
    images.yaml says of it."""
    model = matrix.models.get(report.stand_in) if report.stand_in else None
    return model is None or what in model.proves  # a model images.yaml does not name is refused with why elsewhere


def size_proof_problem(matrix: Matrix, report: RunReport) -> str | None:
    """Why a report does not show its profile fitting a 24 GB card, or None. An emulated card (--card) must be one of
    images.yaml, with that card's bytes as the matrix has them, and its GPU entry that card's MPS cap (its memory, or
    where the card gives what vLLM finds free, that and the server's context: engines.card.mps_cap_bytes); a real card at most the largest of images.yaml's cards. Either way each GPU entry peaks above 0
    and within its total."""
    card, gpus = report.card, report.memory.gpus
    spec = None
    if card is not None:  # its fields' types are the report reader's (records.models.CardUsed)
        name = card["card"]
        spec = matrix.cards.get(name)
        if spec is None:
            return f"the card it emulated ({name[:40]!r}) is none of images.yaml's ({', '.join(matrix.cards)})"
        if card["total_bytes"] != spec.total_bytes:
            return (f"its card {name} holds {str(card['total_bytes'])[:40]} bytes, not the {spec.total_bytes:,} "
                    "images.yaml gives it")
    if not gpus:
        return "it holds no GPU memory samples"
    for i, entry in enumerate(gpus):
        total, peak = entry["total_bytes"], entry["peak_used_bytes"]
        if peak is None:
            return f"its GPU memory entry {i} has no peak (no sample came)"
        if spec is not None and total != (cap := mps_cap_bytes(spec.total_bytes, spec.free_bytes)):
            return f"its GPU memory entry {i} totals {str(total)[:40]} bytes, not its card's {cap:,}"
        if spec is None and not 0 < total <= max(c.total_bytes for c in matrix.cards.values()):
            return f"its GPU {entry.get('name', i)!s:.40} has {str(total)[:40]} bytes: not a 24 GB card"
        if not 0 < peak <= total:
            return f"its GPU memory entry {i} peaks at {str(peak)[:40]} bytes: no peak within its {total:,}"
    return None
