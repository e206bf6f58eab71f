"""Put the profile's model (and the drafters its profiles need) into the models volume, once, under a
lock; never leave a half one where the launcher would serve it.

A folder counts as complete only when it holds the marker this step writes last, naming the very
model the image asks for (the generated model's hash, or repo@revision): a newer image's model
replaces a volume's older copy. A download that stopped resumes where it stopped (hub.py, through
huggingface_hub); the marker is written after every file is there and every shard checked whole.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from . import convert, hub
from .boundary import Refused, number_setting, read_secret
from .errors import ServekitError

COMPLETE = ".servekit-complete"
LOCK_WAIT_S_DEFAULT, LOCK_WAIT_S_MOST = 600.0, 86400.0  # PREPARE_LOCK_WAIT: how long a second prepare waits


class PrepareError(ServekitError):
    """The model cannot be prepared; the message says what and how to go on."""

    def __init__(self, message: str, abandoned: bool = False) -> None:
        super().__init__(message)
        self.abandoned = abandoned  # a transfer left running: the process must not wait for its threads


def identity(model: dict) -> str:
    """Which model a folder must hold: the baked files' hash (generated), or the repository and revision."""
    if model["source"] != "generated":
        return f"{model['repo']}@{model.get('revision') or 'main'}"
    digest = hashlib.sha256()
    baked = Path(model["baked"])
    for path in sorted(p for p in baked.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(baked)).encode() + b"\0" + path.read_bytes())
    return f"sha256:{digest.hexdigest()}"


def provided(model: dict, environ: dict[str, str]) -> dict:
    """The model with the folders you already have in place of the volume's: MODEL_DIR for the model,
    DRAFTER_DIR for the DFlash2 drafter (bind-mounted, read-only is fine), else the folder the source repository's
    prepare made in a models folder mounted as the volume (MODELS_DIR), where it is whole; each is checked, never
    downloaded into."""
    out = {**model, **_yours(model, environ.get("MODEL_DIR"))}
    drafter = (model.get("drafters") or {}).get("dflash")
    if drafter:
        out["drafters"] = {**model["drafters"], "dflash": {**drafter, **_yours(drafter, environ.get("DRAFTER_DIR"))}}
    return out


def _yours(part: dict, named: str | None) -> dict:
    """The path and the provided flag of a folder you have for `part`, or nothing (the volume's own folder)."""
    if named:
        return {"path": named, "provided": True}
    if part.get("source_path") and folder_problem(Path(part["source_path"])) is None:
        return {"path": part["source_path"], "provided": True}
    return {}


def folder_problem(folder: Path) -> str | None:
    """Why a model folder is not whole (no config, a conversion a crash interrupted, a shard its index names is
    missing or short), or None."""
    if not (folder / "config.json").is_file():
        return f"{folder} has no config.json"
    if step := convert.interrupted(folder):
        return f"{folder}: its {step} conversion was interrupted; run prepare again, which finishes it"
    index = folder / hub.INDEX
    try:
        shards = hub.indexed_shards(index) if index.is_file() else sorted(p.name for p in folder.glob("*.safetensors"))
    except (OSError, ValueError, AttributeError) as exc:  # AttributeError: JSON, but not an object
        return f"{index}: not a readable index ({hub.first_line(exc)})"
    for name in shards:
        if not (folder / name).is_file():
            return f"{folder}/{name}, which the index names, is missing"
        if problem := hub.shard_problem(folder / name):
            return f"{folder}/{problem}"
    return None if shards else f"{folder} holds no safetensors shard"


def parts(model: dict) -> list[dict]:
    """The model and each of its drafters, each a folder of its own to prepare."""
    return [model] + [{"source": "huggingface", **d} for d in (model.get("drafters") or {}).values()]


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One prepare at a time per models volume; a second waits (up to PREPARE_LOCK_WAIT), then finds the work done."""
    try:
        wait_s = number_setting(os.environ, "PREPARE_LOCK_WAIT", LOCK_WAIT_S_DEFAULT, 0, LOCK_WAIT_S_MOST, "seconds")
    except Refused as exc:
        raise PrepareError(str(exc)) from None
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".prepare.lock", "w") as lock:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise PrepareError(f"another prepare held {folder} for {wait_s:.0f} s (PREPARE_LOCK_WAIT)") \
                        from None
                time.sleep(0.5)
        yield


def prepare(model: dict, say: Callable[[str], None] = print, needed: list[dict] | None = None) -> Path:
    """Each part (those `needed`, else the model and every drafter) complete in its folder; raises PrepareError
    (one line) when one cannot be."""
    try:
        convert.wanted(os.environ)  # a conversion setting that is neither on nor off ends here, before any download
    except Refused as exc:
        raise PrepareError(str(exc)) from None
    dest = Path(model["path"])
    try:
        with _locked(dest.parent):
            for part in needed if needed is not None else parts(model):
                _prepare_one(part, say)
    except PermissionError as exc:  # a read-only volume, a folder or shards of another user
        raise PrepareError(f"{exc.filename}: {exc.strerror}; prepare writes the models folder as the container's "
                           "user (SERVEKIT_UID, default 10001): give it that folder, or mount one it owns") from None
    return dest


def _prepare_one(part: dict, say: Callable[[str], None]) -> None:
    dest = Path(part["path"])
    if part.get("provided"):
        if problem := folder_problem(dest):
            raise PrepareError(f"the folder you provide is not a whole model: {problem}")
        say(f"prepare: {dest} is yours and whole; nothing to fetch")
        return
    if _marked(part):
        say(f"prepare: {dest} is complete")
        _converted(dest, part, say)
        return
    if (dest / COMPLETE).is_file():
        say(f"prepare: {dest} holds another model than this image's ({identity(part)}); replacing it")
        shutil.rmtree(dest)
    started = time.monotonic()
    if part["source"] == "generated":
        staging = dest.with_name(f".{dest.name}.new")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(part["baked"], staging)
        _mark(staging, part, started)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staging, dest)  # whole or not there
    else:
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            raise PrepareError(f"{dest} is not prepared and HF_HUB_OFFLINE=1 forbids the download of {part['repo']}")
        token_file = os.environ.get("HF_TOKEN_FILE")
        try:
            token = read_secret(token_file) if token_file and os.path.lexists(token_file) else None
        except Refused as exc:  # a FIFO, a device, two lines: said, never waited on or sent
            raise PrepareError(f"HF_TOKEN_FILE {exc}") from None
        dest.mkdir(parents=True, exist_ok=True)
        try:
            hub.download(part["repo"], part.get("revision"), dest, token or None, say=say)
        except hub.HubError as exc:
            raise PrepareError(str(exc), abandoned=isinstance(exc, hub.Stalled)) from None
        except Refused as exc:  # PREPARE_STALL_S
            raise PrepareError(str(exc)) from None
        if problem := folder_problem(dest):  # what the hub sent is held to what a folder of yours is held to
            raise PrepareError(f"{part['repo']} as the hub sent it is not a whole model: {problem}; nothing was "
                               "marked complete")
        _mark(dest, part, started)
        _converted(dest, part, say)
    say(f"prepare: {dest} ready in {time.monotonic() - started:.1f} s")


def _converted(dest: Path, part: dict, say: Callable[[str], None]) -> None:
    """The source's conversions of a fetched compressed-tensors checkpoint (convert.py), each once; a folder of
    yours is never written into."""
    if part["source"] == "huggingface" and convert.applies(dest):
        try:
            convert.convert(dest, dict(os.environ), say=say)
        except convert.ConvertError as exc:
            raise PrepareError(str(exc)) from None


def _mark(folder: Path, part: dict, started: float) -> None:
    marker = folder / f".{COMPLETE}.tmp"
    marker.write_text(json.dumps({"source": part["source"], "identity": identity(part),
                                  "seconds": round(time.monotonic() - started, 1)}) + "\n")
    os.replace(marker, folder / COMPLETE)


def is_complete(model: dict) -> bool:
    """The folder holds all of this very model (its marker names it and no conversion is half done; a folder you
    provide is checked whole)."""
    if model.get("provided"):
        return folder_problem(Path(model["path"])) is None
    return _marked(model) and convert.interrupted(Path(model["path"])) is None


def _marked(model: dict) -> bool:
    """The marker, written once every file is fetched and whole, names this very model."""
    try:
        marker = json.loads((Path(model["path"]) / COMPLETE).read_text())
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(marker, dict) and marker.get("identity") == identity(model)


if __name__ == "__main__":
    profiles = json.loads(Path(sys.argv[1]).read_text())
    prepare(profiles["model"])
