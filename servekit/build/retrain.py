"""`demo-model`: train the shipped demo model again inside the cpu image (servekit/image/demomodel.py, the image's own, is the trainer) and swap it
in for the shipped folder at once."""

from __future__ import annotations

import shutil
from pathlib import Path

from servekit.build.builder import ensure_built
from servekit.config.session import Session
from servekit.engines import local
from servekit.engines.protocol import ImageEngine
from servekit.errors import UserError
from servekit.image import demomodel, module_command
from servekit.output import Say


def regenerate(engine: ImageEngine, image: str, dest: Path, say: Say = print, steps: int = demomodel.STEPS) -> None:
    """Train the model again in `image` (through `engine`, the Docker door) for `steps` and swap it in for `dest` at
    once: a failed or interrupted run, or a model that does not do what the checks ask, leaves the shipped model as it
    was."""
    work = dest.parent / f".{dest.name}.new"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        engine.run_once(image, [*module_command("/opt/venv/bin/python", "demomodel"), "--out", "/out", "--steps",
                                str(steps)], mounts={work.resolve(): "/out"}, say=say)
        for path in work.iterdir():
            path.chmod(0o644)
        old = dest.parent / f".{dest.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if dest.exists():
            dest.rename(old)
        work.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def regenerate_shipped(session: Session, say: Say = print, steps: int = demomodel.STEPS) -> Path:
    """`demo-model`: train the generated model of the matrix again, in the image of the first target that serves
    it (built first if need be: its torch does the training), and replace the shipped folder."""
    matrix = session.matrix
    served = [(name, matrix.models[t.model]) for name, t in matrix.targets.items()
              if matrix.models[t.model].source == "generated"]
    if not served:
        raise UserError("no target of images.yaml serves a generated model (models.<name>.source: generated)")
    target, model = served[0]
    assert model.dir, "a generated model names its folder (images.yaml is refused at load otherwise)"
    plan = ensure_built(session, target, say)
    dest = session.root / model.dir
    say(f"demo-model: training in {plan.tag} for {steps} steps (about 3 per CPU second), then replacing {model.dir}/")
    regenerate(local(), plan.tag, dest, say=say, steps=steps)
    return dest
