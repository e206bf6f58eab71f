"""Full locks: every package an image installs, each at one version with the hashes of its files, for the
target's Python and platform; and the host tool's own. Made from the pins by uv (`python3 build.py lock`),
committed, installed with hash checking, covered by the image's content digest, checked by `verify`.

A target has one lock per Python its bases carry (docker/locks/<target>-py<python>.txt); the host tool's
requirements.lock is made from requirements.in for every Python and platform the tool runs on.
Each lock's first lines record a digest of what it was made from, so a lock older than its pins is named.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from packaging.utils import canonicalize_name

from servekit.build.index import IndexUnreachable, release_exists
from servekit.config.matrix import Matrix
from servekit.config.session import Session
from servekit.config.settings import ENV_WHEELS
from servekit.credentials import auth, with_auth
from servekit.errors import EnvironmentProblem, UserError
from servekit.image.boundary import write_text_atomic
from servekit.output import Say
from servekit.trust import ca_bundle

LOCK_DIR = "docker/locks"
HOST_PINS, HOST_LOCK = "requirements.in", "requirements.lock"
# The platform an image's wheels are chosen for: torch's Linux wheels need glibc 2.28, and every base is newer.
PLATFORM = "x86_64-manylinux_2_28"
HOST_PYTHON = "3.11"  # the oldest Python the host tool supports (pyproject's requires-python)
INPUTS = "# servekit-lock-inputs: "
LEFT_OUT = "# left out: "
PACKAGE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
RESOLVE_TIMEOUT_S = 900
KEPT_UV_ENV = ("UV_CACHE_DIR", "UV_NATIVE_TLS", "UV_HTTP_TIMEOUT")  # the user's; any other UV_* could change the result


@dataclass
class Lock:
    inputs: str | None  # the digest of what it was made from
    left_out: dict[str, str]  # distribution -> why it is not in the lock
    packages: dict[str, str]  # normalized name -> version (a marker-split name keeps its first)
    text: str


@dataclass
class LockPlan:
    """One lock to make: the requirements uv is given, the indexes and folders of wheels it may read."""
    target: str
    python: str
    path: str
    requirements: list[str]
    indexes: list[str] = field(default_factory=list)  # URLs beyond PyPI, credentials included
    find_links: list[Path] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)


def lock_file(target: str, python: str) -> str:
    return f"{LOCK_DIR}/{target}-py{python}.txt"


def image_locks(matrix: Matrix, targets: list[str] | None = None) -> list[tuple[str, str]]:
    """(target, python) of every lock the matrix needs: one per Python among each target's bases."""
    return [(t, py) for t in targets or list(matrix.targets)
            for py in sorted({matrix.bases[b].python for b in matrix.targets[t].bases})]


def _digest(doc: object) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def inputs_digest(matrix: Matrix, target: str, python: str) -> str:
    """What a target's lock is made from: its pins, what it leaves out, Python and platform. Not the indexes: a
    mirror serving the same files satisfies the lock's hashes."""
    return _digest({"pins": matrix.target_pins(target), "exclude": sorted(matrix.targets[target].exclude),
                    "python": python, "platform": PLATFORM})


def host_inputs_digest(root: Path) -> str:
    return _digest({"pins": (root / HOST_PINS).read_text(), "python": HOST_PYTHON})


def read(path: Path) -> Lock:
    text = path.read_text()
    inputs: str | None = None
    left_out: dict[str, str] = {}
    packages: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith(INPUTS):
            inputs = line[len(INPUTS):].strip()
        elif line.startswith(LEFT_OUT):
            name, _, why = line[len(LEFT_OUT):].partition(" ")
            left_out[name.split("==")[0]] = why.strip(" ()")
        elif found := PACKAGE.match(line):
            packages.setdefault(canonicalize_name(found[1]), found[2])
    return Lock(inputs, left_out, packages, text)


def _current(matrix: Matrix, root: Path, target: str, python: str) -> tuple[Lock | None, str | None]:
    """The target's lock when it is there and made from today's pins; else what is wrong with it, in one line."""
    rel = lock_file(target, python)
    command = f"`python3 build.py lock --target {target}`"
    if not (root / rel).is_file():
        return None, f"{rel}: missing; make it with {command}"
    lock = read(root / rel)
    if lock.inputs != inputs_digest(matrix, target, python):
        return None, (f"{rel}: stale: made from other pins or exclusions than images.yaml names now; make it again "
                      f"with {command}")
    return lock, None


def problems(matrix: Matrix, root: Path) -> tuple[list[str], list[str]]:
    """(problems, notes) of every lock against what it is made from; no network."""
    out: list[str] = []
    notes: list[str] = []
    for target, python in image_locks(matrix):
        lock, problem = _current(matrix, root, target, python)
        if lock is None:
            out.append(str(problem))
            continue
        rel = lock_file(target, python)
        for dist, version in matrix.target_pins(target).items():
            if dist in lock.left_out:
                notes.append(f"{rel}: {dist}=={version} left out ({lock.left_out[dist]}); a build needs --without "
                             f"{matrix.pin_key(target, dist)} until the lock is made where its index answers")
            elif lock.packages.get(canonicalize_name(dist)) != version:
                out.append(f"{rel}: {dist} is {lock.packages.get(canonicalize_name(dist), 'absent')}, the pin is {version} "
                           f"(edited by hand?); make it again with `python3 build.py lock --target {target}`")
    if not (root / HOST_LOCK).is_file():
        out.append(f"{HOST_LOCK}: missing; make it with `python3 build.py lock --host-tool`")
    elif read(root / HOST_LOCK).inputs != host_inputs_digest(root):
        out.append(f"{HOST_LOCK}: stale against {HOST_PINS}; make it again with `python3 build.py lock --host-tool`")
    return out, notes


def installable(lock: Lock, leave_out: set[str]) -> str:
    """The lock's text less the entries (a package line, its hash lines and comments) of `leave_out` names."""
    dropped = {canonicalize_name(n) for n in leave_out}
    kept, skipping = [], False
    for line in lock.text.splitlines():
        found = PACKAGE.match(line)
        if found:
            skipping = canonicalize_name(found[1]) in dropped
            if skipping:
                kept.append(f"# left out by --without: {found[1]}=={found[2]}")
                continue
        elif skipping and line.startswith((" ", "\t")):
            continue
        else:
            skipping = False
        kept.append(line)
    return "\n".join(kept) + "\n"


# The image installs its lock in slices, one layer each, ordered by how often they change: torch and everything
# it depends on (the CUDA libraries, Triton) change with torch; the rest (vLLM, FlashInfer and what they need)
# with a vLLM bump. The Dockerfile installs requirements-<slice>.txt in this order.
LAYERS = ("torch", "serving")
ROOT_OF_FIRST_LAYER = "torch"


def layers(text: str) -> dict[str, str]:
    """An installable lock (for_build's text) as its LAYERS: each a requirements file of package and hash lines
    only, so that a slice's text changes only when a package of that slice does (the lock's header and its `via`
    notes change with every pin). A package is in the torch slice when torch needs it, by the lock's `via` notes."""
    entries: dict[str, list[str]] = {}
    needed_by: dict[str, set[str]] = {}
    current, in_via = "", False
    for line in text.splitlines():
        if found := PACKAGE.match(line):
            current, in_via = canonicalize_name(found[1]), False
            entries.setdefault(current, []).append(line)
            needed_by.setdefault(current, set())
        elif current and line.lstrip().startswith("--hash"):
            entries[current].append(line)
        elif current and (note := line.strip()).startswith("# via"):
            rest = note.removeprefix("# via").strip()
            needed_by[current].update({canonicalize_name(rest)} if rest else set())
            in_via = not rest
        elif current and in_via and line.strip().startswith("#   "):
            needed_by[current].add(canonicalize_name(line.strip().removeprefix("#").strip()))
        elif not line.startswith((" ", "\t")):
            current, in_via = "", False
    first = {ROOT_OF_FIRST_LAYER}
    while grown := {name for name, users in needed_by.items() if name not in first and users & first}:
        first |= grown
    out = {}
    for layer in LAYERS:
        chosen = [lines for name, lines in entries.items() if (name in first) == (layer == ROOT_OF_FIRST_LAYER)]
        out[layer] = "".join("\n".join(lines).rstrip(" \\") + "\n" for lines in chosen)
    return out


def for_build(matrix: Matrix, root: Path, target: str, python: str, omitted: set[str]) -> str:
    """What the image installs: the target's lock less the pins this build leaves out. Refuses a lock that is
    missing, stale, or lacks a pin the build installs."""
    lock, problem = _current(matrix, root, target, python)
    if lock is None:
        raise UserError(str(problem))
    rel, command = lock_file(target, python), f"`python3 build.py lock --target {target}`"
    leave_out = set()
    for dist in matrix.target_pins(target):
        pin = matrix.pin_key(target, dist)
        if pin in omitted:
            leave_out.add(dist)
        elif dist in lock.left_out:
            raise UserError(f"{rel}: {dist} is not in the lock ({lock.left_out[dist]}); make it again with {command} "
                            f"where that index can be reached, or build --without {pin}")
    return installable(lock, leave_out)


# ---------------------------------------------------------------------------------------------
# making locks


def plan_lock(matrix: Matrix, target: str, python: str, wheel_dirs: list[Path]) -> LockPlan:
    """Which indexes and folders of wheels the lock of `target` reads. An index that cannot be reached is stood in
    for by a folder holding the pinned wheel, else its pin is left out (when the matrix allows), else refused."""
    plan = LockPlan(target, python, lock_file(target, python), [])
    for dist, version in matrix.target_pins(target).items():
        pin = matrix.pin_key(target, dist)
        key = matrix.index_key_of(target, pin)
        url = matrix.indexes[key].url
        plan.requirements.append(f"{dist}=={version}")
        if key == "pypi":
            continue
        folders = [d for d in wheel_dirs if any(d.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))]
        try:
            release_exists(dist, version, url, auth(key))
            plan.indexes.append(with_auth(url, key))
            continue
        except IndexUnreachable:
            pass
        if folders:
            plan.find_links += [f for f in folders if f not in plan.find_links]
        elif pin in matrix.may_omit:
            plan.requirements.pop()
            plan.left_out[dist] = f"{url} could not be reached when this lock was made"
        else:
            raise EnvironmentProblem(f"index {url} (for {dist}=={version}) cannot be reached from here and no folder "
                                     f"of wheels holds it; name one with --wheels ({ENV_WHEELS})")
    return plan


def uv_env(pypi: str, extra: list[str]) -> dict[str, str]:
    """uv's environment: the indexes (credentials stay out of the command line and the lock) and our CA bundle."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_") or k in KEPT_UV_ENV}
    env.update(UV_DEFAULT_INDEX=pypi, UV_INDEX=" ".join(extra), UV_NO_PROGRESS="1")
    bundle = ca_bundle()
    if bundle:
        env["SSL_CERT_FILE"] = str(bundle)
    return env


def run_uv(args: list[str], requirements: list[str], env: dict[str, str], what: str) -> str:
    """`uv pip compile` over requirements given on stdin (so the lock names no file of ours); its output."""
    import uv  # the resolver: only `lock` and `bump` need it
    cmd = [uv.find_uv_bin(), "pip", "compile", "--no-config", "-", "--generate-hashes", "--no-header", *args]
    try:
        done = subprocess.run(cmd, input="\n".join(requirements) + "\n", capture_output=True, text=True, env=env,
                              timeout=RESOLVE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise EnvironmentProblem(f"{what}: uv did not finish within {RESOLVE_TIMEOUT_S} s") from None
    if done.returncode != 0:
        said = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        reason = " ".join(said[-4:])[-600:] or "no output"
        if re.search(r"failed to fetch|dns error|connect|timed out", reason, re.I):
            raise EnvironmentProblem(f"{what}: an index could not be reached: {reason}")
        raise UserError(f"{what}: the pins do not resolve: {reason}")
    return done.stdout


def _header(lines: list[str], inputs: str, left_out: dict[str, str]) -> str:
    head = [*(f"# {line}" for line in lines), f"{INPUTS}{inputs}"]
    head += [f"{LEFT_OUT}{dist} ({why})" for dist, why in left_out.items()]
    return "\n".join(head) + "\n"


def make_image_lock(matrix: Matrix, root: Path, target: str, python: str, wheel_dirs: list[Path], say: Say) -> Path:
    plan = plan_lock(matrix, target, python, wheel_dirs)
    args = ["--python-version", python, "--python-platform", PLATFORM]
    args += [x for d in plan.find_links for x in ("--find-links", str(d))]
    args += [x for name in matrix.targets[target].exclude for x in ("--no-emit-package", name)]
    started = time.monotonic()
    say(f"lock: resolving the {target} target's {len(plan.requirements)} pins for Python {python} on {PLATFORM} (uv)")
    body = run_uv(args, plan.requirements, uv_env(with_auth(matrix.indexes["pypi"].url, "pypi"), plan.indexes),
                  f"lock of {target} for Python {python}")
    header = _header([f"The {target} target's whole package set for Python {python} on {PLATFORM}: every file "
                      "hash-checked when the image installs it.",
                      f"Made by `python3 build.py lock --target {target}` (uv) from images.yaml's pins; do not edit."],
                     inputs_digest(matrix, target, python), plan.left_out)
    path = root / plan.path
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, header + body, mode=0o644)
    for dist, why in plan.left_out.items():
        say(f"lock: {plan.path}: {dist} left out: {why}")
    say(f"lock: {plan.path}: {len(read(path).packages)} packages in {time.monotonic() - started:.0f} s")
    return path


def make_host_lock(matrix: Matrix, root: Path, say: Say) -> Path:
    """requirements.lock from requirements.in, for every Python from HOST_PYTHON up and every platform."""
    pins = [line.split("#")[0].strip() for line in (root / HOST_PINS).read_text().splitlines()]
    started = time.monotonic()
    say(f"lock: resolving the host tool's {len([p for p in pins if p])} pins ({HOST_PINS}) for Python "
        f"{HOST_PYTHON} and later, every platform (uv)")
    body = run_uv(["--universal", "--python-version", HOST_PYTHON], [p for p in pins if p],
                  uv_env(with_auth(matrix.indexes["pypi"].url, "pypi"), []), "host lock")
    header = _header(["The host tool's whole package set, every file hash-checked: `make venv` installs exactly this.",
                      f"Made by `python3 build.py lock --host-tool` (uv) from {HOST_PINS}; do not edit."],
                     host_inputs_digest(root), {})
    write_text_atomic(root / HOST_LOCK, header + body, mode=0o644)
    say(f"lock: {HOST_LOCK}: {len(read(root / HOST_LOCK).packages)} packages in {time.monotonic() - started:.0f} s")
    return root / HOST_LOCK


def make_locks(session: Session, targets: list[str] | None = None, host: bool = True, images: bool = True,
               say: Say = print) -> list[Path]:
    """`lock`: the named targets' locks (all when none is named) and the host's."""
    written = []
    if images:
        for target, python in image_locks(session.matrix, targets):
            written.append(make_image_lock(session.matrix, session.root, target, python,
                                           session.settings.wheel_dirs, say))
    if host:
        written.append(make_host_lock(session.matrix, session.root, say))
    return written
