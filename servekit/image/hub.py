"""Fetch a model repository from the Hugging Face hub (or anything that speaks its HTTP API: HF_ENDPOINT),
with the standard library alone: the file list at one commit, each file resumed where a previous try
stopped (HTTP Range), its size checked against the listing, and every safetensors shard checked to
hold all the bytes its own header declares. Progress is a plain line every few seconds.
"""

from __future__ import annotations

import http.client
import json
import os
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ENDPOINT = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
INDEX = "model.safetensors.index.json"  # written last: it names the shards, so it is the commit point
PIECE = 1 << 20
TRIES = 5  # per file; each try resumes where the last one stopped
TIMEOUT_S = 60  # between bytes


class HubError(Exception):
    """The repository cannot be fetched, or a file of it is not whole; the message says which and why."""


def _request(url: str, token: str | None, headers: dict[str, str] | None = None) -> urllib.request.Request:
    req = urllib.request.Request(url, headers=headers or {})
    if token:  # not sent on to a redirect's host (the hub's CDN)
        req.add_unredirected_header("Authorization", f"Bearer {token}")
    return req


def listing(repo: str, revision: str | None, token: str | None) -> tuple[str, dict[str, int | None]]:
    """(the commit, file name -> size) of the repository at `revision` (a commit, or main)."""
    url = f"{ENDPOINT}/api/models/{repo}/revision/{urllib.parse.quote(revision or 'main', safe='')}?blobs=true"
    try:
        with urllib.request.urlopen(_request(url, token), timeout=TIMEOUT_S) as resp:
            info = json.load(resp)
    except urllib.error.HTTPError as exc:
        raise HubError(f"{repo}@{revision or 'main'}: the hub answered HTTP {exc.code}"
                       + (" (a private or gated repository needs HF_TOKEN_FILE)" if exc.code in (401, 403) else "")) \
            from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise HubError(f"{ENDPOINT} cannot be reached ({exc}); the model is not prepared") from None
    files = {s["rfilename"]: s.get("size") for s in info.get("siblings", [])}
    if not files:
        raise HubError(f"{repo}@{revision or 'main'}: the hub lists no files")
    return info.get("sha") or revision or "main", files


def shard_problem(path: Path, name: str | None = None) -> str | None:
    """Why a safetensors file (called `name`) is not whole (its header declares more bytes than it holds), or None."""
    name = name or path.name
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as exc:
        return f"{name}: not a readable safetensors file ({exc})"
    ends = [t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"]
    wanted = 8 + length + max(ends, default=0)
    held = path.stat().st_size
    return None if held == wanted else f"{name}: holds {held} bytes, its header declares {wanted}"


def fetch_file(repo: str, commit: str, name: str, size: int | None, dest: Path, token: str | None, say) -> None:
    """dest/name, whole: resumed from dest/name.incomplete across up to TRIES tries, renamed when complete."""
    target, partial = dest / name, dest / f"{name}.incomplete"
    if target.is_file() and (size is None or target.stat().st_size == size) and not (
            name.endswith(".safetensors") and shard_problem(target)):
        return  # fetched whole by an earlier run
    partial.parent.mkdir(parents=True, exist_ok=True)
    url = f"{ENDPOINT}/{repo}/resolve/{commit}/{urllib.parse.quote(name)}"
    last_error = ""
    for _ in range(TRIES):
        have = partial.stat().st_size if partial.exists() else 0
        if size is not None and have == size:
            break
        try:
            headers = {"Range": f"bytes={have}-"} if have else {}
            with urllib.request.urlopen(_request(url, token, headers), timeout=TIMEOUT_S) as resp:
                if have and resp.status != 206:  # the server ignored the range: start the file again
                    have = 0
                _copy(resp, partial, have, size, name, say)
        except urllib.error.HTTPError as exc:
            if exc.code == 416 and size is not None and have == size:
                break
            raise HubError(f"{repo}/{name}: the hub answered HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # a dropped connection
            last_error = str(exc) or type(exc).__name__
            say(f"prepare: {name}: the transfer stopped at {partial.stat().st_size if partial.exists() else 0} "
                f"bytes ({last_error}); resuming")
            continue
        if size is None or partial.stat().st_size == size:
            break
        last_error = f"the transfer stopped at {partial.stat().st_size} of {size} bytes"
        say(f"prepare: {name}: {last_error}; resuming")
    held = partial.stat().st_size if partial.exists() else 0
    if size is not None and held != size:
        raise HubError(f"{repo}/{name}: {held} of {size} bytes after {TRIES} tries ({last_error}); run prepare "
                       "again to resume")
    if name.endswith(".safetensors") and (problem := shard_problem(partial, name)):
        partial.unlink()
        raise HubError(f"{repo}/{problem}; the file was removed, run prepare again")
    os.replace(partial, target)


def _copy(resp, partial: Path, have: int, size: int | None, name: str, say) -> None:
    started, last, done = time.monotonic(), time.monotonic(), have
    with open(partial, "r+b" if have else "wb") as out:
        out.seek(have)
        out.truncate()
        while piece := resp.read(PIECE):
            out.write(piece)
            done += len(piece)
            if time.monotonic() - last >= 5:
                rate = (done - have) / max(time.monotonic() - started, 1e-6)
                eta = f", {(size - done) / rate:.0f} s left" if size and rate else ""
                say(f"prepare: {name}: {done / 1e6:.0f}" + (f" of {size / 1e6:.0f}" if size else "")
                    + f" MB at {rate / 1e6:.1f} MB/s{eta}")
                last = time.monotonic()


def download(repo: str, revision: str | None, dest: Path, token: str | None, say=print) -> str:
    """Every file of the repository into `dest` (the index last); the commit fetched."""
    commit, files = listing(repo, revision, token)
    total = sum(s or 0 for s in files.values())
    say(f"prepare: {repo}@{commit[:12]}: {len(files)} files, {total / 1e9:.2f} GB (resumes what is there)")
    for name in sorted(files, key=lambda n: (n == INDEX, n)):
        fetch_file(repo, commit, name, files[name], dest, token, say)
    return commit
