"""Release: only an image whose required profiles passed their checks, matched by image ID.

Tags: an immutable `v<vllm>-<target>-<digest12>` and the moving `v<vllm>-<target>` and
`latest-<target>`. Each push is retried on transient errors and its digest read back from the
registry; the manifest (releases/v<vllm>.json) is written only after every push of the release
succeeded, so a re-run after a failure completes it without duplicating anything.
"""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from packaging.version import Version
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from servekit.build.builder import component_digest
from servekit.build.plan import TargetPlan, plans_for
from servekit.build.reproducible import epoch_seconds
from servekit.config.matrix import Matrix
from servekit.config.profiles import render_profiles
from servekit.config.session import Session
from servekit.engines import local
from servekit.engines.card import mps_cap_bytes
from servekit.engines.process import SCHEME as PROCESS_SCHEME
from servekit.engines.protocol import ImageEngine
from servekit.engines.registry import PushProgress, RegistryDoor, TransientRegistryError
from servekit.errors import CheckFailed, EnvironmentProblem, UserError
from servekit.image.boundary import REGISTRY, number_setting
from servekit.image.launcher import build_command, served_parts
from servekit.image.prepare import identity
from servekit.output import Say
from servekit.records.models import OtherKind, ProfileGate, ReleaseManifest, ReleaseRecord, RunReport, load
from servekit.records.releases import manifest_path, write_manifest
from servekit.records.report import load_report, report_files
from servekit.release import attach
from servekit.serve.deploy import source_settings

ENV_REGISTRY = "SERVEKIT_REGISTRY"


def release_tags(matrix: Matrix, plan: TargetPlan) -> list[str]:
    base = f"v{matrix.vllm}-{plan.target}"
    return [f"{base}-{plan.digest[:12]}", base, f"latest-{plan.target}"]


def registry_path(matrix: Matrix, given: str | None = None, root: Path | None = None) -> str:
    """Where releases go and come from: --registry, else SERVEKIT_REGISTRY (in the shell, else in the checkout's
    compose/.env, as Compose reads it there too), else images.yaml's release.registry."""
    settings = source_settings(root, ENV_REGISTRY) if root else {}
    setting = os.environ.get(ENV_REGISTRY) or settings.get(ENV_REGISTRY)
    if not given and setting and not REGISTRY.fullmatch(setting.rstrip("/")):  # it becomes an image: line of Compose
        where = "the shell" if os.environ.get(ENV_REGISTRY) else "compose/.env"
        raise UserError(f"{ENV_REGISTRY}={setting[:60]!r} ({where}): expected HOST[:PORT][/NAMESPACE] such as "
                        "127.0.0.1:5000/serve (no scheme, one line)")
    return (given or setting or matrix.release.registry).rstrip("/")


def released_reference(matrix: Matrix, plan: TargetPlan, given: str | None = None, root: Path | None = None) -> str:
    """The immutable reference `release` pushes this build as (its content digest is in the tag)."""
    return f"{registry_path(matrix, given, root)}/{matrix.image.name}:{release_tags(matrix, plan)[0]}"


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
    if report.engine.startswith(f"{PROCESS_SCHEME}:"):
        return f"it was served by the process engine ({report.engine}), not by the image in a container"
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


def _attempts() -> int:
    """SERVEKIT_PUSH_ATTEMPTS: how many times a push is tried (default 5), a whole number from 1 to 100."""
    return int(number_setting(os.environ, "SERVEKIT_PUSH_ATTEMPTS", 5, 1, 100, whole=True))


def push(door: RegistryDoor, image_id: str, repository: str, tag: str, say: Say) -> str:
    """Tag and push one tag, retried with backoff on transient errors (never on refused credentials); the
    registry's digest read back through the engine."""
    door.tag(image_id, repository, tag)

    @retry(retry=retry_if_exception_type(TransientRegistryError), stop=stop_after_attempt(_attempts()),
           wait=wait_exponential(multiplier=1, max=20), reraise=True,
           before_sleep=lambda state: say(f"  push {tag}: {state.outcome and state.outcome.exception()}; retrying"))
    def attempt() -> str:
        shown = PushProgress(tag, lambda text, live: _show(say, text, live), sys.stderr.isatty())
        pushed = door.push(repository, tag, progress=shown)
        _show(say, shown.line(), False)
        confirmed = door.digest(repository, tag)
        if not pushed or confirmed != pushed:
            raise TransientRegistryError(f"pushed {pushed}, the registry serves {confirmed}")
        return pushed
    return attempt()


def _show(say: Say, text: str, live: bool) -> None:
    """A progress line: rewritten in place on a terminal while live, else said as a line of its own."""
    if live and sys.stderr.isatty():
        print(f"\r  {text}\033[K", end="", file=sys.stderr, flush=True)
    else:
        if sys.stderr.isatty():
            print("\r\033[K", end="", file=sys.stderr)
        say(f"  {text}")


def _revision(root: Path) -> str | None:
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


def served_models(matrix: Matrix, root: Path, target: str) -> dict[str, dict[str, str]]:
    """Per profile of the target, the model and the drafter (when its launch uses one) it serves: repo@revision, or
    for a generated model the hash of its files (what prepare marks); worked out by the launcher's own recipe."""
    rendered = render_profiles(matrix, target)
    model = rendered["model"]
    spec = matrix.models[matrix.targets[target].model]
    name = (lambda part: f"{part['repo']}@{part.get('revision') or 'main'}" if part.get("repo")  # noqa: E731
            else f"generated {spec.dir} " + identity({"source": "generated", "baked": root / str(spec.dir)}))
    out = {}
    for profile in rendered["profiles"]:
        try:
            argv, _ = build_command(rendered, profile, "native", {})
        except Exception:  # a profile whose knobs the launcher refuses serves nothing; verify reports it
            continue
        model_part, *drafters = served_parts(model, argv)
        out[profile] = {"model": name(model_part), **({"drafter": name(drafters[0])} if drafters else {})}
    return out


def series_hashes(matrix: Matrix, root: Path, names: list[str]) -> dict[str, str]:
    folder = root / matrix.series.dir
    return {name: "sha256:" + hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in names}


def component_digests(matrix: Matrix, root: Path, plan: TargetPlan) -> dict[str, str]:
    return {name: component_digest(matrix, name, root) if state == "present" else "absent"
            for name, state in plan.components.items()}


def verify_release(session: Session, say: Say = print) -> list[str]:
    """`release --verify`: read releases/v<vllm>.json back and ask the registry, through the engine, whether every
    tag still serves the digest it names; the problems (none: the registry serves what was released)."""
    path = manifest_path(session.root, session.matrix)
    if not path.exists():
        raise UserError(f"{path.relative_to(session.root)}: no release of vLLM {session.matrix.vllm} to verify")
    manifest = load(path, ReleaseManifest)
    engine = local()
    engine.check()
    door = engine.registries(timeout=120)
    problems = []
    for target, record in manifest.targets.items():
        for tag in record.tags:
            served = door.digest(record.repository, tag)
            if served != record.registry_digest:
                problems.append(f"{target}: {record.repository}:{tag} serves {served or 'nothing'}, the release "
                                f"names {record.registry_digest}")
        problems += attach.verify_sbom(door, record)
        say(f"release: {target}: {len(record.tags)} tags and the SBOM checked against {record.repository}")
    return problems


def summary_text(matrix: Matrix, releases: list[ReleaseRecord]) -> str:
    lines = [f"vLLM {matrix.vllm} release"]
    for r in releases:
        lines.append(f"{r.target}: {r.repository}@{r.registry_digest}")
        lines.append(f"  tags: {', '.join(r.tags)}")
        for profile, g in r.smoke.items():
            counts = Counter(g.checks.values())
            waived = f", {counts['not_required']} not required" if counts["not_required"] else ""
            lines.append(f"  {profile}: {counts['passed']}/{len(g.checks) - counts['not_required']} checks passed"
                         f"{waived} ({g.report})")
    return "\n".join(lines)


def release_targets(matrix: Matrix, root: Path, engine: ImageEngine, registry_path: str, plans: dict[str, TargetPlan],
                    explicit: bool, dry_run: bool, say: Say) -> list[ReleaseRecord]:
    """Gate, check the moving tags, push and read back, per target; the records for the manifest.

    Everything that can refuse is checked for a target before any of its tags is pushed: the reports first (they are
    here), then the registry."""
    releases = []
    gated = []
    for target, plan in plans.items():
        image = engine.image(plan.tag)
        if image is None:
            if explicit:
                raise CheckFailed(f"{target}: image {plan.tag} is not built: run `python3 build.py run --target "
                                  f"{target}` first")
            say(f"release: {target}: no image {plan.tag} here; skipped")
            continue
        gated.append((target, plan, image, gate(matrix, target, image.id, root)))
    door = engine.registries(timeout=600)
    repository = f"{registry_path}/{matrix.image.name}"
    door.check_access(repository)
    for target, plan, image, smoke in gated:
        tags = release_tags(matrix, plan)
        for moving in tags[1:]:
            current = door.vllm_version(repository, moving)
            if current and current > Version(matrix.vllm):
                raise CheckFailed(f"{target}: {repository}:{moving} carries vLLM {current}; moving it to "
                                  f"{matrix.vllm} would go backwards (docs/release.md says how to roll back)")
        say(f"release: {target}: {image.id[:19]}... passed {', '.join(smoke)}; tags {', '.join(tags)}")
        if dry_run:
            continue
        try:
            digests = {tag: push(door, image.id, repository, tag, say) for tag in tags}
        except TransientRegistryError as exc:
            raise EnvironmentProblem(f"{target}: the push failed after {_attempts()} attempts ({exc}); no manifest "
                                     "written: run release again to complete it") from None
        if len(set(digests.values())) != 1:
            raise CheckFailed(f"{target}: the tags read back different digests: {digests}")
        released = next(iter(digests.values()))
        try:
            sbom = attach.attach_sbom(door, image.id, repository, released, epoch_seconds(matrix.image.source_date_epoch),
                               push, say)
        except TransientRegistryError as exc:
            raise EnvironmentProblem(f"{target}: pushing its SBOM failed after {_attempts()} attempts ({exc}); no "
                                     "manifest written: run release again to complete it") from None
        releases.append(ReleaseRecord(target=target, repository=repository, tags=tags,
                                      registry_digest=released, image_id=image.id, sbom=sbom,
                                      revision=_revision(root),
                                      content_digest=plan.digest, pins=plan.pins, lock=plan.build_info["lock"],
                                      series=series_hashes(matrix, root, plan.build_info["series"]),
                                      components=component_digests(matrix, root, plan), smoke=smoke,
                                      models=served_models(matrix, root, target)))
        say(f"release: {target}: pushed {len(tags)} tags, {repository}@{released}, its SBOM as {sbom.tag}")
    return releases


def release(session: Session, registry: str | None = None, targets: list[str] | None = None, dry_run: bool = False,
            tag_git: bool = False, say: Say = print) -> tuple[Path | None, list[ReleaseRecord]]:
    """Push each target's checked image (all targets, or those named); (the manifest written, the records)."""
    matrix, root = session.matrix, session.root
    _attempts()  # a bad setting is refused before anything is looked at, not between two pushes
    if tag_git and not dry_run:
        changes = dirty(root)
        if changes:
            raise CheckFailed(f"--git-tag: the working tree has uncommitted changes ({len(changes)} path(s), e.g. "
                              f"{changes[0].strip()}); commit or stash them first")
    engine = local()
    engine.check()
    names = [session.check_target(t) for t in (targets or list(matrix.targets))]
    plans = {p.target: p for p in plans_for(session, names)}
    releases = release_targets(matrix, root, engine, registry_path(matrix, registry, root), plans,
                               explicit=bool(targets), dry_run=dry_run, say=say)
    if dry_run:
        return None, releases
    if not releases:
        raise CheckFailed("nothing released: no target has a built image")
    manifest = write_manifest(root, matrix, releases)
    if tag_git:
        summary = summary_text(matrix, releases)
        commit_manifest(root, manifest, f"Release v{matrix.vllm}\n\n{summary}")
        git_tag(root, f"v{matrix.vllm}", summary)
    return manifest, releases
