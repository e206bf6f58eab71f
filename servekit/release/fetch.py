"""`pull`: a target's released image from the registry instead of a build, with its progress.

What is pulled is the immutable tag `release` pushes for this build's content digest, so it is the image this
checkout would build (builds reproduce: the same image ID); it is then tagged as the build's own tag, so `up`,
`run` and a plain `docker compose up PROFILE` in compose/ use it as they would a build.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from servekit.engines.docker import local
from servekit.errors import CheckFailed, EnvironmentProblem
from servekit.output import as_output
from servekit.release import registry
from servekit.release.publish import released_reference


@dataclass
class Pulled:
    target: str
    reference: str
    tag: str
    image_id: str
    seconds: float


def pull_release(session, target: str, given_registry: str | None = None, say=None) -> Pulled:
    say = as_output(say)
    plan = session.plan(target)
    reference = released_reference(session.matrix, plan, given_registry, session.root)
    repository, _, tag = reference.rpartition(":")
    engine = local()
    engine.check()
    client = engine.sdk(timeout=1800)
    started = time.monotonic()
    try:
        if registry.digest(client, repository, tag) is None:
            raise CheckFailed(f"{reference} is not in the registry: this build ({plan.tag}) was not released there; "
                              f"build it here with `python build.py image --target {target}`, or name the registry "
                              "it was released to with --registry (SERVEKIT_REGISTRY in the shell or compose/.env)")
        say(f"{target}: pulling {reference}")
        shown = registry.PushProgress(tag, lambda text, live: say.step(text) if live else say(text),
                                      sys.stderr.isatty(), verb="pull")
        registry.pull(client, repository, tag, progress=shown)
    except registry.TransientRegistryError as exc:
        raise EnvironmentProblem(f"pulling {reference} failed: {exc}") from None
    say(shown.line())
    image = client.images.get(reference)
    image.tag(*plan.tag.rpartition(":")[::2])
    return Pulled(target, reference, plan.tag, image.id, time.monotonic() - started)
