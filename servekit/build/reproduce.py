"""`reproduce`: build a target's image again with BuildKit's cache unused and prove it is the same image ID.

The tag is a digest of the inputs; a rebuild that gives another ID means the inputs do not decide the image.
On a difference the first build keeps the tag, the rebuild is removed, and the layers and first files that
differ are named (reproducible.compare).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from servekit.build.builder import build_image
from servekit.build.plan import plan_for
from servekit.build.reproducible import compare
from servekit.config.session import Session
from servekit.engines import local
from servekit.output import Say, as_output


@dataclass
class Reproduction:
    target: str
    tag: str
    first_id: str
    second_id: str
    first_seconds: float | None  # None: the first image was already there
    second_seconds: float
    differences: list[str] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return self.first_id == self.second_id

    def as_json(self) -> dict:
        return {"target": self.target, "tag": self.tag, "same": self.same, "first_id": self.first_id,
                "second_id": self.second_id, "first_seconds": self.first_seconds,
                "second_seconds": round(self.second_seconds, 1), "differences": self.differences}


def reproduce(session: Session, target: str, say: Say | None = None) -> Reproduction:
    """The target's image (built first if it is not here), then a rebuild from nothing, compared."""
    say = as_output(say)
    plan = plan_for(session, target)
    engine = local()
    first = build_image(session.matrix, plan, session.root, session.settings, say=say)
    first_id = engine.held(plan.tag).id
    say(f"{target}: first build {first_id[:19]}; building again with the builder's cache unused")
    kept = f"{plan.tag}-first"  # the first build, held by a tag of its own while the rebuild takes the tag
    engine.name_image(plan.tag, kept)
    try:
        second = build_image(session.matrix, plan, session.root, session.settings, force=True, no_cache=True,
                             say=say)
        second_id = engine.held(plan.tag).id
        differences = [] if second_id == first_id else compare(engine, kept, plan.tag).lines()
        if second_id != first_id:  # the first build keeps the tag; the rebuild goes
            engine.name_image(kept, plan.tag)
            engine.remove_image(second_id, force=True)
    finally:
        if engine.image_exists(kept):
            engine.remove_image(kept)
    return Reproduction(target, plan.tag, first_id, second_id, first.seconds if first.built else None,
                        second.seconds, differences)
