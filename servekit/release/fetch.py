"""`pull`: a target's released image from the registry instead of a build, with its progress.

What is pulled is the immutable tag `release` pushes for this build's content digest, so it is the image this
checkout would build (builds reproduce: the same image ID); it is then tagged as the build's own tag, so `up`,
`run` and a plain `docker compose up PROFILE` in compose/ use it as they would a build. `--moving` takes the newest
release of the pinned vLLM instead (its moving tag: a checkout a commit away from a release has no release of its
own), said to be another build, and kept under the registry's name, which compose/.env then names.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from servekit.build.plan import plan_for
from servekit.config.session import Session
from servekit.engines import local
from servekit.engines.registry import LayerBars, PushProgress, TransientRegistryError
from servekit.errors import CheckFailed, EnvironmentProblem
from servekit.output import Say, as_output
from servekit.release.naming import release_tags, released_reference


@dataclass
class Pulled:
    target: str
    reference: str
    tag: str
    image_id: str
    seconds: float


def pull_release(session: Session, target: str, given_registry: str | None = None, say: Say | None = None, moving: bool = False) -> Pulled:
    """This checkout's release of `target`, tagged as its build would be; with `moving`, the release's moving tag of
    the pinned vLLM instead (the newest release, another build than this checkout's), kept under its own name."""
    say = as_output(say)
    plan = plan_for(session, target)
    reference = released_reference(session.matrix, plan, given_registry, session.root)
    repository, _, exact = reference.rpartition(":")
    newest = release_tags(session.matrix, plan)[1]
    engine = local()
    engine.check()
    door = engine.registries(timeout=1800)
    started = time.monotonic()
    tag = newest if moving else exact
    try:
        if door.digest(repository, tag) is None:
            offer = newest if not moving and door.digest(repository, newest) else None
            raise CheckFailed(_not_there(repository, tag, offer, plan.tag, target))
        if moving:
            say(f"{target}: {repository}:{newest} is the newest release of vLLM {session.matrix.vllm}, not this "
                f"checkout's build ({plan.tag}): its image, its patches and its reports are the release's")
        say(f"{target}: pulling {repository}:{tag}")
        shown = LayerBars(tag) if sys.stderr.isatty() else PushProgress(
            tag, lambda text, live: say(text), False, verb="pull")  # a log: a line every few seconds
        with shown:
            image_id = door.pull(repository, tag, progress=shown)
    except TransientRegistryError as exc:
        raise EnvironmentProblem(f"pulling {repository}:{tag} failed: {exc}") from None
    say(shown.line())
    if not moving:  # the very image this checkout builds: it goes by the build's tag
        door.tag(image_id, *plan.tag.rpartition(":")[::2])
    return Pulled(target, f"{repository}:{tag}", f"{repository}:{tag}" if moving else plan.tag, image_id,
                  time.monotonic() - started)


def _not_there(repository: str, tag: str, moving: str | None, build: str, target: str) -> str:
    offer = (f"; the registry has {repository}:{moving}, the newest release of this vLLM (another build, not this "
             f"checkout's digest): `python3 build.py pull --moving` takes it") if moving else ""
    return (f"{repository}:{tag} is not in the registry: this build ({build}) was not released there{offer}; or build "
            f"it here with `python3 build.py image --target {target}`, or name the registry it was released to with "
            "--registry (SERVEKIT_REGISTRY in the shell or compose/.env)")
