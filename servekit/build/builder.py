"""Run an image build: prepare the context, pick the builder, stream progress, keep the log.

One Dockerfile for every builder: buildx where present (Docker Desktop, Docker CE), otherwise
Compose v2's embedded BuildKit client. The tag is applied by the builder only when every stage,
the in-image verify step included, has succeeded, so a failed build leaves no tag behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import requests
import yaml
from packaging.utils import canonicalize_name

from servekit import credentials
from servekit.build import sbom
from servekit.build.bases import ensure_made_base
from servekit.build.index import IndexUnreachable, release_exists
from servekit.build.locks import for_build, layers
from servekit.build.plan import STAGED_FILES, TargetPlan, plan_for, plans_for
from servekit.build.reproducible import epoch_seconds, make_canonical
from servekit.config.matrix import Matrix, substitute
from servekit.config.session import Session
from servekit.config.settings import ENV_BASE, ENV_WHEELS, ENV_WITHOUT, BuildSettings
from servekit.engines import Engine, choice, local
from servekit.engines.dockercli import docker_cli, docker_process
from servekit.errors import EnvironmentProblem, UserError
from servekit.exclusive import machine_wide, one_buildkit_solve
from servekit.image import components as components_mod
from servekit.image import series as series_mod
from servekit.image.boundary import write_text_atomic
from servekit.layout import STAGE_DIR, WHEELHOUSE
from servekit.output import Output, Say, as_output
from servekit.trust import ca_bundle, requests_verify

DOCKERFILE = "docker/Dockerfile"
LABEL_PREFIX = "io.servekit"


@dataclass
class BuildResult:
    target: str
    tag: str
    built: bool  # False: an image for this digest already existed
    seconds: float
    log: Path | None


def has_buildx() -> bool:
    return docker_cli(["buildx", "version"], timeout=60).returncode == 0


def _reachable(url: str) -> bool:  # any HTTP answer, even 401, means the host can be reached
    try:
        requests.head(url, timeout=10, verify=requests_verify(), allow_redirects=True)
        return True
    except requests.RequestException:
        return False


def _registry_url(image: str) -> str:
    first = image.split("/", 1)[0]
    host = first if "/" in image and ("." in first or ":" in first or first == "localhost") else \
        "registry-1.docker.io"
    return f"https://{host}/v2/"


def _wheel_version(wheel: Path) -> tuple[str, str]:
    """(normalized name, version) from a wheel's file name (PEP 427)."""
    name, version = wheel.name.split("-")[:2]
    return canonicalize_name(name), version


def offered_wheels(plan: TargetPlan, settings: BuildSettings) -> dict[str, Path]:
    """dist -> a wheel of exactly the pinned version in the folders of wheels. Only exact versions: a
    folder holding torch 2.13.0+cpu must not satisfy the cuda target's torch 2.13.0."""
    wanted: dict[str, tuple[str, str]] = {canonicalize_name(dist): (dist, version) for dist, version in plan.pins.items()}
    found: dict[str, Path] = {}
    for folder in settings.wheel_dirs:
        for wheel in sorted(folder.glob("*.whl")):
            name, version = _wheel_version(wheel)
            if name in wanted and wanted[name][1] == version:
                found.setdefault(wanted[name][0], wheel)
    return found


def _ensure_base(matrix: Matrix, plan: TargetPlan, root: Path, say: Say) -> None:
    base = matrix.bases[plan.base_name]
    if base.debootstrap:
        ensure_made_base(plan.base_name, base, root / ".cache" / "bases", say=say)
        return
    if local().image_exists(base.image):
        return
    if not _reachable(_registry_url(base.image)):
        others = [b for b in matrix.targets[plan.target].bases if matrix.bases[b].debootstrap]
        way_out = (f"build on the base made here: --base {others[0]} (or {ENV_BASE}={others[0]})" if others else
                   "pull or load it first")
        raise EnvironmentProblem(f"base image {base.image} is not here and its registry "
                                 f"({_registry_url(base.image)}) cannot be reached; {way_out}")


def preflight(matrix: Matrix, plan: TargetPlan, root: Path, settings: BuildSettings,
              say: Say) -> tuple[list[str], dict[str, Path]]:
    """Fail early, in one line, on what would fail twenty minutes into a build: the engine, the series, each pin on
    its index or in a folder of wheels. Returns the keys of the extra indexes the build must ask (those of pins no
    folder of wheels holds) and the wheels offered. Asks nothing of the machine's other builds, so a build of the
    same tag under way elsewhere does not hold up a refusal."""
    local().check()
    try:
        series_mod.read_series(root / matrix.series.dir)
    except series_mod.SeriesError as exc:
        raise UserError(f"series: {exc}") from None
    wheels = offered_wheels(plan, settings)
    extra: set[str] = set()
    for dist, version in plan.pins.items():
        if dist in wheels:
            say(f"{dist}=={version} from {wheels[dist]}")
            continue
        pin = matrix.pin_key(plan.target, dist)
        key = matrix.index_key_of(plan.target, pin)
        index = matrix.indexes[key].url
        try:
            present = release_exists(dist, version, index, credentials.auth(key))
        except IndexUnreachable:
            if pin in matrix.may_omit:
                raise UserError(f"{dist}=={version} is on {index} only, which cannot be reached from here: put its "
                                f"wheel in a folder named by --wheels ({ENV_WHEELS}), or build without it with "
                                f"--without {pin} ({ENV_WITHOUT}={pin}): {matrix.may_omit[pin]}") from None
            raise EnvironmentProblem(f"index {index} (for {dist}=={version}) cannot be reached from here; put the "
                                     f"wheel in a folder named by --wheels ({ENV_WHEELS})") from None
        if not present:
            raise UserError(f"pins: {dist}=={version} is not on {index}; fix the pin in images.yaml")
        if key != "pypi":
            extra.add(key)
    return sorted(extra), wheels


def lock_and_base(matrix: Matrix, plan: TargetPlan, root: Path, say: Say) -> str:
    """The lock the image installs (less the pins this build leaves out), its base made if need be, and the series
    proven on the pristine wheel where `verify` cached one: the rest of the early refusals, under the build's turn."""
    lock = for_build(matrix, root, plan.target, plan.python, set(plan.omitted))  # the pins are there: is the lock?
    _ensure_base(matrix, plan, root, say)
    spec = matrix.targets[plan.target]
    pristine = sorted((root / ".cache" / "pristine").glob(f"{spec.vllm_distribution.replace('-', '_')}-"
                                                          f"{matrix.vllm}-*.whl"))
    if pristine:  # proven in seconds on the pristine tree `verify` cached, not after the wheels install
        try:
            problems = series_mod.prove_on_pristine(root / matrix.series.dir, pristine[-1], plan.target,
                                                    say=lambda line: None)
        except series_mod.SeriesError as exc:
            raise UserError(f"series: {exc}") from None
        if problems:
            raise UserError(f"series: {problems[0]}")
    return lock


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _prepare_context(matrix: Matrix, plan: TargetPlan, root: Path, wheels: dict[str, Path], lock: str) -> Path:
    """The generated inputs the Dockerfile copies: wheelhouse, the lock, profiles, build-info, series."""
    wheelhouse = root / WHEELHOUSE
    if wheelhouse.exists():
        shutil.rmtree(wheelhouse)
    wheelhouse.mkdir(parents=True)
    for wheel in wheels.values():
        # A copy, not a hard link: a link changes the user's file's ctime, which uv takes for a new file, so every
        # lock after a build unpacked torch into uv's cache once more (700 MB a time). It lives for the build only.
        shutil.copy2(wheel, wheelhouse / wheel.name)
    out = root / STAGE_DIR / plan.target
    model_dir = plan.build_info["model"]["dir"]
    writers: dict[str, Callable[[Path], None]] = {  # one per entry of STAGED_FILES
        **{f"requirements-{layer}.txt": partial(_write, text=text) for layer, text in layers(lock).items()},
        "patches": lambda path: stage_series(path, root / matrix.series.dir, plan.patches_left_out),
        "components": lambda path: stage_components(matrix, plan, root, path),
        "model": lambda path: replace_tree(path, root / model_dir if model_dir else None),
        "profiles.json": lambda path: _write(path, json.dumps(plan.profiles, indent=2) + "\n"),
        "build-info.json": lambda path: _write(path, json.dumps(plan.build_info, indent=2) + "\n"),
        "sbom.cdx.json": lambda path: _write(path, sbom.document(
            plan, lock, sbom.debian_packages(local(), plan.base),
            sbom.series_files(root / matrix.series.dir, plan.build_info["series"]),
            {name: component_digest(matrix, name, root) for name, state in plan.components.items()
             if state != "absent"}, matrix.image.source_date_epoch, matrix.targets[plan.target].vllm_distribution)),
    }
    for name in STAGED_FILES:
        writers[name](out / name)
    return out


def replace_tree(dest: Path, source: Path | None) -> None:
    """dest becomes a copy of source (an empty folder when there is none: the Dockerfile copies it either way)."""
    if dest.exists():
        shutil.rmtree(dest)
    if source is None:
        dest.mkdir(parents=True)
    else:
        shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))


def stage_series(dest: Path, source: Path, left_out: list[str]) -> None:
    """dest becomes the series folder less the patches the build leaves out (--without): their files gone and their
    lines out of the series file, so that the image applies, verifies and lists what it holds."""
    replace_tree(dest, source)
    for name in left_out:
        (dest / name).unlink()
    series = dest / "series"
    kept = [line for line in series.read_text().splitlines() if line.split("#", 1)[0].strip() not in left_out]
    series.write_text("".join(f"{line}\n" for line in kept))


def component_digest(matrix: Matrix, name: str, root: Path) -> str:
    """The digest of a present component's source: its files and its patches for the pinned vLLM."""
    comp = matrix.components[name]
    patches = [substitute(p, matrix) for p in comp.patches]
    missing = [p for p in patches if not (root / comp.source / p).is_file()]
    if missing:
        raise UserError(f"components.{name}: {', '.join(missing)} not in {comp.source}/")
    return components_mod.source_digest(root / comp.source, patches)


def stage_components(matrix: Matrix, plan: TargetPlan, root: Path, dest: Path) -> None:
    """Copy each present component's source into the context, checked against its pinned digest."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    spec = []
    for name in matrix.targets[plan.target].components:
        if plan.components[name] != "present":
            continue  # said by `image` before the build; the profiles that need it are unavailable
        comp = matrix.components[name]
        source = root / comp.source
        patches = [substitute(p, matrix) for p in comp.patches]
        digest = component_digest(matrix, name, root)
        if comp.sha256 and digest != comp.sha256:
            raise UserError(f"components.{name}: the source in {comp.source}/ has digest {digest[:16]}..., "
                            f"images.yaml expects {comp.sha256[:16]}...; update sha256 only if the change is wanted")
        (dest / name).mkdir(parents=True)
        if (source / "files").is_dir():
            shutil.copytree(source / "files", dest / name / "files")
        for p in patches:
            shutil.copy2(source / p, dest / name / p)
        spec.append({"name": name, "patches": patches, "checks": comp.checks})
    (dest / "components.json").write_text(json.dumps(spec, indent=2) + "\n")


def labels(matrix: Matrix, plan: TargetPlan) -> dict[str, str]:
    """The image's labels: facts of its inputs only (no build time, no commit), so a rebuild is the same image."""
    out = {
        "org.opencontainers.image.title": matrix.image.title,
        "org.opencontainers.image.description": matrix.image.description,
        "org.opencontainers.image.version": f"{matrix.vllm}-{plan.target}",
        "org.opencontainers.image.created": matrix.image.source_date_epoch,
        "org.opencontainers.image.base.name": plan.base,
        f"{LABEL_PREFIX}.target": plan.target,
        f"{LABEL_PREFIX}.digest": plan.digest,
        f"{LABEL_PREFIX}.base": plan.base_name,
    }
    out.update({f"{LABEL_PREFIX}.omitted.{name}": what for name, what in plan.omitted.items()})
    if matrix.image.licenses:
        out["org.opencontainers.image.licenses"] = matrix.image.licenses
    if matrix.image.source:
        out["org.opencontainers.image.source"] = matrix.image.source
    out.update({f"{LABEL_PREFIX}.pin.{name}": version for name, version in plan.pins.items()})
    return out


def build_args(plan: TargetPlan) -> dict[str, str]:
    """Everything that differs between targets and bases, as the Dockerfile's arguments: read from the facts
    the digest covers (build-info.json), so the tag and the build cannot disagree."""
    info = plan.build_info
    return {"TARGET": plan.target, "BASE": info["base"]["image"], "BASE_APT_PACKAGES": " ".join(info["base"]["apt"]),
            "MODEL_SOURCE": info["model"]["source"], "GPU": "1" if info["gpu"] else "0",
            # pip compiles bytecode that checks its source by hash, not by the install's time (py_compile)
            "SOURCE_DATE_EPOCH": str(epoch_seconds(info["epoch"]))}


def provisional_tag(plan: TargetPlan) -> str:
    """What the builder tags; the image becomes `plan.tag` only once it is made canonical (reproducible.py)."""
    return f"{plan.tag}-build"


def _command(matrix: Matrix, plan: TargetPlan, root: Path, workdir: Path, secret_files: dict[str, Path],
             no_cache: bool = False) -> list[str]:
    """The build command, tagging provisional_tag; `secret_files` (id -> file) reach the Dockerfile's secret
    mounts, nothing else does."""
    args, labs = build_args(plan), labels(matrix, plan)
    bundle = ca_bundle()
    secret_files = {**secret_files, **({"cacert": bundle} if bundle else {})}
    if has_buildx():
        cmd = ["buildx", "build", "--load", "--progress", "plain", "-f", DOCKERFILE, "--target", "runtime",
               "-t", provisional_tag(plan), *(["--no-cache"] if no_cache else [])]
        cmd += [x for k, v in args.items() for x in ("--build-arg", f"{k}={v}")]
        cmd += [x for k, v in labs.items() for x in ("--label", f"{k}={v}")]
        cmd += [x for name, path in secret_files.items() for x in ("--secret", f"id={name},src={path}")]
        return cmd + [str(root)]
    # Compose v2 embeds a BuildKit client: the build is described in a compose file of its own.
    build = {"context": str(root), "dockerfile": DOCKERFILE, "target": "runtime", "args": args, "labels": labs,
             "no_cache": no_cache, "secrets": list(secret_files)}
    doc: dict = {"name": "servekit-build", "services": {"image": {"image": provisional_tag(plan), "build": build}},
                 "secrets": {name: {"file": str(path)} for name, path in secret_files.items()}}
    compose_file = workdir / "compose.build.yaml"
    compose_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    return ["compose", "-f", str(compose_file), "build", "--progress", "plain", "image"]


def _stream(args: list[str], log_path: Path, root: Path, show: Callable[[str], None]) -> int:
    """Run the build (`docker ARGS`), writing every line to the log and the current step to `show`. The CLI is run
    directly: its plain progress is read line by line, and Ctrl-C must stop the very process (neither client hands
    it over)."""
    env = dict(os.environ, DOCKER_BUILDKIT="1", BUILDKIT_PROGRESS="plain")
    with open(log_path, "w", buffering=1) as log:  # line-buffered: `tail -f` the log while it builds
        log.write(f"$ docker {' '.join(args)}\n")
        proc = docker_process(args, root, env)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.write(line)
                show(line.rstrip())
            return proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait(timeout=30)
            raise


def _failure_summary(log_path: Path) -> str:
    """The failing step and its last line of output: BuildKit frames them between two `------` lines."""
    lines = log_path.read_text(errors="replace").splitlines()
    marks = [i for i, line in enumerate(lines) if line.strip() == "------"]
    if len(marks) >= 2:
        block = [line for line in lines[marks[-2] + 1:marks[-1]] if line.strip()]
        step = next((line.strip()[2:].split("]")[0] + "]" for line in block if line.startswith(" > [")), "a step")
        output = [said for line in block if not line.startswith(" > [") and (said := line.split(" ", 1)[-1].strip())]
        errors = [i for i, line in enumerate(output) if line.startswith("ERROR")]
        if errors:  # pip's own words: what failed, then the first line of detail (which package)
            said = output[errors[0]][:200] + (f" | {output[errors[0] + 1][:200]}" if errors[0] + 1 < len(output) else "")
            return f"{step}: {said}"
        counted = re.match(r"^(\S+: )\d+ problem", output[-1]) if output else None
        if counted:  # a tool that lists its problems, then counts them (the image's verify): the first, and the count
            lines_said = [line for line in output[:-1] if line.startswith(counted[1])]
            problems = [line for line in lines_said if line.startswith(f"{counted[1]}problem: ")]
            first = next(iter(problems or lines_said), None)
            if first:
                return f"{step}: {first.replace('problem: ', '', 1)[:300]} ({output[-1][len(counted[1]):]})"
        if output:
            return f"{step}: {output[-1][-300:]}"
    wanted = [line for line in lines if "failed to solve" in line or "ERROR" in line]
    return (wanted[-1] if wanted else (lines[-1] if lines else "no output")).strip()[-300:]


def build_image(matrix: Matrix, plan: TargetPlan, root: Path, settings: BuildSettings, force: bool = False,
                say: Say | None = None, no_cache: bool = False) -> BuildResult:
    say = as_output(say)
    if not force and local().image_exists(plan.tag):
        return BuildResult(plan.target, plan.tag, False, 0.0, None)
    extra_indexes, wheels = preflight(matrix, plan, root, settings, say)
    with machine_wide("build", plan.tag, say=say):  # the builder's tag and the canonical pass are the engine's
        if not force and local().image_exists(plan.tag):  # built by another checkout while this one waited
            return BuildResult(plan.target, plan.tag, False, 0.0, None)
        lock = lock_and_base(matrix, plan, root, say)
        try:
            return _build(matrix, plan, root, _prepare_context(matrix, plan, root, wheels, lock), extra_indexes,
                          no_cache, say)
        finally:
            shutil.rmtree(root / WHEELHOUSE, ignore_errors=True)


def _build(matrix: Matrix, plan: TargetPlan, root: Path, workdir: Path, extra_indexes: list[str], no_cache: bool,
           say: Output) -> BuildResult:
    """The build itself, from a prepared context: streamed to a log, and nothing tagged when it fails."""
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    log_path = logs / f"build-{plan.target}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    started = time.monotonic()
    # The indexes, credentials included, as a pip configuration file outside the build context, for this build only.
    with tempfile.TemporaryDirectory(prefix="servekit-secrets-") as private:
        pip_conf = Path(private) / "pip.conf"
        write_text_atomic(pip_conf, credentials.pip_config(
            credentials.with_auth(matrix.indexes["pypi"].url, "pypi"),
            [credentials.with_auth(matrix.indexes[key].url, key) for key in extra_indexes]), mode=0o600)
        with one_buildkit_solve(say=say):
            code = _stream(_command(matrix, plan, root, workdir, {"pip_conf": pip_conf}, no_cache), log_path, root,
                           say.step)
    if code != 0:
        raise EnvironmentProblem(f"build of {plan.target} failed after {time.monotonic() - started:.0f} s, nothing "
                                 f"tagged: {_failure_summary(log_path)} (full log: {log_path.relative_to(root)})")
    engine = local()
    say(f"{plan.target}: built in {time.monotonic() - started:.0f} s; making it canonical (times at "
        f"{plan.build_info['epoch']}) so that every build of {plan.tag} is one image ID")
    try:
        canonical = make_canonical(engine, provisional_tag(plan), plan.tag, epoch_seconds(plan.build_info["epoch"]),
                                   {}, root / ".cache", say=say.step)
    finally:  # made canonical or not, the builder's own image is not left tagged
        if engine.image_exists(provisional_tag(plan)):
            engine.remove_image(provisional_tag(plan))
    reused = f", {canonical.reused} of them unchanged since an earlier build" if canonical.reused else ""
    say(f"{plan.tag} is {canonical.image_id[:19]} ({canonical.layers} layers{reused}, canonical in "
        f"{canonical.seconds:.0f} s)")
    return BuildResult(plan.target, plan.tag, True, time.monotonic() - started, log_path)


def ensure_built(session: Session, target: str, say: Say | None = None, engine: Engine | None = None) -> TargetPlan:
    """The target's plan under this machine's settings, its image built first unless it exists (run, sweep,
    demo-model start here); `say` hears which image. A process engine serves from its environment: no image."""
    plan = plan_for(session, target)
    if engine is not None and not engine.serves_images:
        return plan
    say = as_output(say)
    say(f"{target} image {plan.tag}")
    build_image(session.matrix, plan, session.root, session.settings, say=say)  # preflight and base said
    return plan


def build_targets(session: Session, targets: list[str] | None = None, force: bool = False, say: Say = print,
                  no_cache: bool = False) -> list[BuildResult]:
    """`image`: each target's image (the engine's default target when none is named), content-addressed."""
    matrix = session.matrix
    names = [session.check_target(t) for t in targets or [choice.default_target(session)]]
    results = []
    for plan in plans_for(session, names):
        for name, state in plan.components.items():
            if state == "absent":
                say(f"{plan.target}: component {name} is absent ({matrix.components[name].source}/); profiles "
                    f"that need it are unavailable: {', '.join(plan.unavailable_profiles)}")
        for note in plan.notes:
            say(f"{plan.target}: {note}")
        say(f"{plan.target} on base {plan.base_name} ({plan.base}) -> {plan.tag}")
        results.append(build_image(matrix, plan, session.root, session.settings, force=force, say=say,
                                   no_cache=no_cache))
    return results
