"""`stand-in`: the served checkpoint's exact layout with random weights, written on this machine by the image's own
code (servekit/image/standin.py), so that a GPU host without the hub serves the product's memory at full size."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from servekit.build.plan import plan_for
from servekit.config.session import Session
from servekit.engines import choice, local
from servekit.errors import UserError
from servekit.image import module_command
from servekit.output import Say

CONTAINER_OUT = "/out"
CONTAINER_TOKENIZER = "/tokenizer"


def default_out(session: Session, target: str | None = None) -> Path:
    """Where the matrix's full-size stand-in of the target's model lives (models.<name>.dir's folder), so that
    MODEL_DIR naming it is recognised and judged as that stand-in (its not_required checks)."""
    matrix = session.matrix
    model = matrix.targets[session.check_target(target or next(n for n, t in matrix.targets.items() if t.gpu))].model
    found = matrix.stand_in_proving(model, "size")
    if found is None:
        raise UserError("stand-in: images.yaml names no full-size stand-in (proves: [size]) of the model; pass --out")
    return session.root / Path(found).parent


@contextmanager
def _out_folder(out: Path) -> Iterator[None]:
    """--out in a folder that cannot hold it (/proc, read-only, a name too long) in one line. Only the file system's
    calls go in here: an engine's connection error is an OSError too, and is no fault of --out."""
    try:
        yield
    except OSError as exc:
        raise UserError(f"stand-in: --out {str(out)[:80]}: {exc.strerror}; name a folder you can write") from None


def write_stand_in(session: Session, out: Path, drafter: bool, seed: int, scale: str, target: str | None = None,
                   convert: bool = True, say: Say = print) -> tuple[Path, Path | None]:
    """The model into out/<its source folder> (and its DFlash2 drafter beside it), through `target`'s image, then
    (`convert`) prepare's conversions on it, timed. (model folder, drafter folder)."""
    matrix = session.matrix
    engine = local()  # the image runs on this machine, where the folder is
    target = choice.target(session, target, engine)
    served = matrix.models[matrix.targets[target].model]
    # the tokenizer of a trained stand-in of the same model (a real BPE with the chat's special tokens)
    tokenizer = matrix.stand_in_proving(matrix.targets[target].model, "function")
    if not served.source_folder or tokenizer is None:
        raise UserError(f"stand-in: target {target}'s model has no source_folder or no stand-in with a tokenizer "
                        "(images.yaml models)")
    dflash = served.drafters.get("dflash")
    drafter_folder = dflash.source_folder if drafter and dflash else None
    model_dir = out / served.source_folder
    with _out_folder(out):
        if out.exists() and not out.is_dir():
            raise UserError(f"stand-in: --out {out} is not a folder")
        for folder in (model_dir, out / drafter_folder if drafter_folder else None):
            if folder and folder.exists() and any(folder.iterdir()):
                raise UserError(f"stand-in: {folder} is not empty; remove it or name another --out")
    engine.check()
    image = plan_for(session, target).tag
    if not engine.image_exists(image):
        raise UserError(f"stand-in: {image} is not here; run `python3 build.py image --target {target}` first")
    with _out_folder(out):  # made only once the image is there: a refused run leaves nothing behind
        out.mkdir(parents=True, exist_ok=True)
    command = [*module_command("/opt/venv/bin/python", "standin"), "--out", f"{CONTAINER_OUT}/{served.source_folder}",
               "--tokenizer", CONTAINER_TOKENIZER, "--seed", str(seed), "--scale", scale]
    if drafter_folder:
        command += ["--drafter", f"{CONTAINER_OUT}/{drafter_folder}"]
    if convert:
        command.append("--convert")
    say(f"stand-in: writing {model_dir}" + (f" and {out / drafter_folder}" if drafter_folder else "")
        + f" ({scale} size, seed {seed}) in {image}")
    engine.run_once(image, command, {out.resolve(): CONTAINER_OUT, (session.root / tokenizer).resolve():
                                     CONTAINER_TOKENIZER}, say=say)
    return model_dir, out / drafter_folder if drafter_folder else None
