"""Put the profile's model into the models volume, once, under a lock; never leave a half one.

A model folder counts as complete only when it holds the marker this step writes last, naming the
very model the image asks for (the generated model's hash, or repo@revision): a newer image's model
replaces a volume's older copy. A download that stopped half way has no marker: the next run
resumes it (huggingface_hub keeps what it fetched) and only then writes the marker. Runs inside
the image; standard library plus huggingface_hub, which the image has.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

COMPLETE = ".servekit-complete"


def identity(model: dict) -> str:
    """Which model a folder must hold: the baked files' hash (generated), or the repository and revision."""
    if model["source"] != "generated":
        return f"{model['repo']}@{model.get('revision') or 'main'}"
    digest = hashlib.sha256()
    baked = Path(model["baked"])
    for path in sorted(p for p in baked.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(baked)).encode() + b"\0" + path.read_bytes())
    return f"sha256:{digest.hexdigest()}"


def prepare(model: dict, say=print) -> Path:
    dest = Path(model["path"])
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two prepares at once: the second waits, then finds it complete
        if is_complete(model):
            say(f"prepare: {dest} is complete")
            return dest
        if (dest / COMPLETE).is_file():
            say(f"prepare: {dest} holds another model than this image's ({identity(model)}); replacing it")
            (dest / COMPLETE).unlink()
        started = time.monotonic()
        if model["source"] == "generated":
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(model["baked"], dest)
        else:
            from huggingface_hub import snapshot_download
            token_file = os.environ.get("HF_TOKEN_FILE")
            token = Path(token_file).read_text().strip() if token_file and Path(token_file).is_file() else None
            say(f"prepare: downloading {model['repo']} into {dest} (resumes a partial download)")
            snapshot_download(model["repo"], revision=model.get("revision"), local_dir=dest, token=token or None)
        (dest / COMPLETE).write_text(json.dumps({"source": model["source"], "identity": identity(model),
                                                 "seconds": round(time.monotonic() - started, 1)}) + "\n")
        say(f"prepare: {dest} ready in {time.monotonic() - started:.1f} s")
        return dest


def is_complete(model: dict) -> bool:
    """The folder holds all of this very model (its marker names it)."""
    try:
        marker = json.loads((Path(model["path"]) / COMPLETE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("identity") == identity(model)


if __name__ == "__main__":
    profiles = json.loads(Path(sys.argv[1]).read_text())
    prepare(profiles["model"])
