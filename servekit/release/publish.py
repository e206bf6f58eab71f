"""Release: each target's image that passed the gate (gate.py) pushed under its tags (naming.py), its SBOM attached
to it as an OCI referrer (attach.py), and the manifest written; with --git-tag, recorded in git (gitrecord.py).

Each push is retried on transient errors and its digest read back from the
registry; the manifest (releases/v<vllm>.json) is written only after every push of the release
succeeded, so a re-run after a failure completes it without duplicating anything.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from packaging.version import Version
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from servekit.build.builder import component_digest
from servekit.build.plan import TargetPlan, plans_for
from servekit.build.reproducible import epoch_seconds
from servekit.config.matrix import Matrix
from servekit.config.profiles import render_profiles
from servekit.config.session import Session
from servekit.engines import local
from servekit.engines.protocol import ImageEngine
from servekit.engines.registry import PushProgress, RegistryDoor, TransientRegistryError
from servekit.errors import CheckFailed, EnvironmentProblem, UserError
from servekit.image.boundary import number_setting
from servekit.image.launcher import build_command, served_parts
from servekit.image.prepare import identity
from servekit.output import Say
from servekit.records.models import ReleaseRecord
from servekit.records.releases import write_manifest
from servekit.release import attach
from servekit.release.gate import gate
from servekit.release.gitrecord import commit_manifest, dirty, git_tag, head_revision
from servekit.release.naming import registry_path, release_tags

T = TypeVar("T")


def _attempts() -> int:
    """SERVEKIT_PUSH_ATTEMPTS: how many times a push is tried (default 5), a whole number from 1 to 100."""
    return int(number_setting(os.environ, "SERVEKIT_PUSH_ATTEMPTS", 5, 1, 100, whole=True))


def push(door: RegistryDoor, image_id: str, repository: str, tag: str, say: Say) -> str:
    """Tag and push one tag, retried with backoff on transient errors (never on refused credentials); the
    registry's digest read back through the engine."""
    door.tag(image_id, repository, tag)

    def attempt() -> str:
        shown = PushProgress(tag, lambda text, live: _show(say, text, live), sys.stderr.isatty())
        pushed = door.push(repository, tag, progress=shown)
        _show(say, shown.line(), False)
        confirmed = door.digest(repository, tag)
        if not pushed or confirmed != pushed:
            raise TransientRegistryError(f"pushed {pushed}, the registry serves {confirmed}")
        return pushed
    return retried(f"push {tag}", say)(attempt)


def retried(what: str, say: Say) -> Callable[[Callable[[], T]], T]:
    """Call a registry write, again with backoff on a transient error (never on refused credentials), up to
    SERVEKIT_PUSH_ATTEMPTS times."""
    def run(call: Callable[[], T]) -> T:
        @retry(retry=retry_if_exception_type(TransientRegistryError), stop=stop_after_attempt(_attempts()),
               wait=wait_exponential(multiplier=1, max=20), reraise=True,
               before_sleep=lambda state: say(f"  {what}: {state.outcome and state.outcome.exception()}; retrying"))
        def attempt() -> T:
            return call()
        return attempt()
    return run


def _show(say: Say, text: str, live: bool) -> None:
    """A progress line: rewritten in place on a terminal while live, else said as a line of its own."""
    if live and sys.stderr.isatty():
        print(f"\r  {text}\033[K", end="", file=sys.stderr, flush=True)
    else:
        if sys.stderr.isatty():
            print("\r\033[K", end="", file=sys.stderr)
        say(f"  {text}")


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
                                      retried("attach the SBOM", say))
        except TransientRegistryError as exc:
            raise EnvironmentProblem(f"{target}: pushing its SBOM failed after {_attempts()} attempts ({exc}); no "
                                     "manifest written: run release again to complete it") from None
        releases.append(ReleaseRecord(target=target, repository=repository, tags=tags,
                                      registry_digest=released, image_id=image.id, sbom=sbom,
                                      revision=head_revision(root),
                                      content_digest=plan.digest, pins=plan.pins, lock=plan.build_info["lock"],
                                      series=series_hashes(matrix, root, plan.build_info["series"]),
                                      components=component_digests(matrix, root, plan), smoke=smoke,
                                      models=served_models(matrix, root, target)))
        listed = f"listed by the tag {sbom.referrers_tag}" if sbom.referrers_tag else "listed by the referrers API"
        say(f"release: {target}: pushed {len(tags)} tags, {repository}@{released}; its SBOM refers to it as "
            f"{repository}@{sbom.registry_digest} ({listed})")
    return releases


def release(session: Session, registry: str | None = None, targets: list[str] | None = None, dry_run: bool = False,
            tag_git: bool = False, say: Say = print) -> tuple[Path | None, list[ReleaseRecord]]:
    """Push each target's checked image (all targets, or those named); (the manifest written, the records)."""
    matrix, root = session.matrix, session.root
    _attempts()  # a bad setting is refused before anything is looked at, not between two pushes
    if left_out := [name for name in session.settings.without if name not in matrix.may_omit]:  # (checked: patches)
        raise UserError(f"--without {', '.join(left_out)}: a patch of the series left out builds an image to "
                        "measure, never one to release; unset it (and SERVEKIT_WITHOUT)")
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
