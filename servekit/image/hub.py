"""Fetch a model repository from the Hugging Face hub (or anything that speaks its HTTP API: HF_ENDPOINT)
through huggingface_hub, the client the image's lock already installs: one commit, each file resumed where
a dropped transfer stopped, its size checked, HF_TOKEN / HF_ENDPOINT / HF_HUB_OFFLINE honoured, the layout
of a `local_dir` download users know. What is ours: the commit resolved first (every file from that one
commit), and every safetensors shard checked to hold all the bytes its own header declares (a repository
can hold a truncated shard; the client checks only that it got what the server sent). Nothing the hub says is
taken on trust: the commit it names must be a commit id, a header or index of another shape is named as such, and
a hub that stops answering or trickles is abandoned once too few bytes arrive in PREPARE_STALL_S.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .boundary import number_setting, read_text
from .errors import ServekitError

T = TypeVar("T")
INDEX = "model.safetensors.index.json"  # names the shards; a folder you provide is judged by it
COMMIT = re.compile(r"[0-9a-f]{40}")
WORKERS = 4  # files fetched at once
MAX_HEADER_BYTES = 100_000_000  # safetensors' own cap on a header
STALL_BYTES = 1 << 20  # a download that gains less than this in PREPARE_STALL_S seconds is abandoned
STALL_S_DEFAULT, STALL_S_MOST = 300.0, 86400.0
POLL_S = 2.0
PROGRESS_S_DEFAULT = 10.0  # how often a download says how far it is (PREPARE_PROGRESS_S)


class HubError(ServekitError):
    """The repository cannot be fetched, or a file of it is not whole; the message says which and why."""


class Stalled(HubError):
    """A transfer that gained too little in PREPARE_STALL_S, abandoned: it is left running (its threads hold the
    process until it ends)."""


def shard_problem(path: Path, name: str | None = None) -> str | None:
    """Why a safetensors file (called `name`) is not whole (its header declares more bytes than it holds, or is no
    safetensors header), or None."""
    name = name or path.name
    try:
        held = path.stat().st_size
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(MAX_HEADER_BYTES, held - 8):
                return f"{name}: its header claims {length} bytes, more than " + (
                    "safetensors allows" if length > MAX_HEADER_BYTES else f"the file's {held}")
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as exc:
        return f"{name}: not a readable safetensors file ({exc})"
    ends = _data_ends(header)
    if ends is None:
        return f"{name}: its header is not a safetensors header (a table of tensors, each with two data offsets)"
    wanted = 8 + length + max(ends, default=0)
    return None if held == wanted else f"{name}: holds {held} bytes, its header declares {wanted}"


def _data_ends(header: Any) -> list[int] | None:
    """Where each tensor's data ends, or None when the header is not a table of tensors with [start, end] offsets."""
    if not isinstance(header, dict):
        return None
    ends = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1]):
            return None
        ends.append(offsets[1])
    return ends


def indexed_shards(index: Path) -> list[str]:
    """The shard files an index names, each a plain file name in the index's folder; ValueError when it is not an
    index (JSON with a weight_map of tensor names to such file names)."""
    weight_map = json.loads(read_text(index, MAX_HEADER_BYTES)).get("weight_map")  # Refused: a ValueError
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError("no weight_map of tensor names to shard files")
    shards = sorted(set(weight_map.values()))
    for name in shards:
        if problem := shard_name_problem(name):
            raise ValueError(problem)
    return shards


def shard_name_problem(name: str) -> str | None:
    """Why `name` is not a plain .safetensors file name beside its index (a path elsewhere, '..'), or None."""
    if "/" in name or "\\" in name or name in ("", ".", "..") or not name.endswith(".safetensors"):
        return f"it names {name[:80]!r}, not a .safetensors file beside it"
    return None


def download(repo: str, revision: str | None, dest: Path, token: str | None, say: Callable[[str], None] = print) -> str:
    """Every file of the repository into `dest`, resuming what an earlier run left; the commit fetched."""
    import httpx
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub import errors as hf
    from huggingface_hub.hf_api import RepoFile

    wanted = revision or "main"
    stall_s = number_setting(os.environ, "PREPARE_STALL_S", STALL_S_DEFAULT, 1, STALL_S_MOST, "seconds")

    progress = Progress(repo, dest, say, number_setting(os.environ, "PREPARE_PROGRESS_S", PROGRESS_S_DEFAULT, 0.5,
                                                        STALL_S_MOST, "seconds"))

    def answer(what: str, call: Callable[[], Any]) -> Any:
        """An API answer as the client reads it; JSON of another shape (a list for the model's information, an entry
        without its fields, nesting past the parser) is refused, never a traceback."""
        try:
            return call()
        except (TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise HubError(f"{repo}@{wanted}: the hub's {what} is not of the shape its API gives "
                           f"({type(exc).__name__}: {first_line(exc)[:120]}); nothing was fetched") from None

    def fetch() -> str:
        # A branch or tag is resolved once, so that every file comes from the same commit.
        commit = wanted if COMMIT.fullmatch(wanted) else answer(
            "model information", lambda: HfApi().model_info(repo, revision=wanted, token=token).sha)
        if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
            raise HubError(f"{repo}@{wanted}: the hub named {str(commit)[:60]!r} as its commit, which is no commit id "
                           "(40 hex digits); nothing was fetched")
        sizes = answer("file tree", lambda: {f.path: f.size for f in HfApi().list_repo_tree(
            repo, revision=commit, recursive=True, token=token) if isinstance(f, RepoFile)})
        if not all(isinstance(p, str) and isinstance(n, int) for p, n in sizes.items()):
            raise HubError(f"{repo}@{wanted}: the hub's file tree names a file without a name or a size; nothing was "
                           "fetched")
        progress.expect(sizes)
        say(f"prepare: {repo}@{commit[:12]}: {progress.expected_line()}; fetching (resumes what is there)")
        snapshot_download(repo, revision=commit, local_dir=dest, token=token, max_workers=WORKERS)
        return commit

    try:
        commit = _watched(fetch, dest, stall_s, f"{repo}: {constants.ENDPOINT}", progress)
    except hf.GatedRepoError:
        raise HubError(f"{repo} is gated: accept its terms on the hub and give a token (HF_TOKEN_FILE)") from None
    except hf.RepositoryNotFoundError:
        raise HubError(f"{repo}: the hub has no such repository, or it is private (give a token: HF_TOKEN_FILE)") \
            from None
    except hf.RevisionNotFoundError:
        raise HubError(f"{repo} has no revision {wanted!r}") from None
    except hf.HfHubHTTPError as exc:
        code = exc.response.status_code if exc.response is not None else "?"
        raise HubError(f"{repo}@{wanted}: the hub answered HTTP {code}") from None
    except (httpx.ConnectError, httpx.TimeoutException) as exc:
        raise HubError(f"{constants.ENDPOINT} cannot be reached ({first_line(exc)}); {repo} is not prepared") \
            from None
    except (httpx.HTTPError, OSError, ValueError) as exc:  # dropped past the client's retries, short, unwritable
        raise HubError(f"{repo}@{wanted}: {type(exc).__name__}: {first_line(exc)}; run prepare again to resume") \
            from None
    for path in sorted(dest.rglob("*.safetensors")):
        if ".cache" not in path.relative_to(dest).parts and (problem := shard_problem(path, path.name)):
            path.unlink()  # the next run fetches it again
            raise HubError(f"{repo}/{problem}; the file was removed, run prepare again")
    say(progress.done_line())
    return commit


class Progress:
    """How far a download is, said every `every_s`: bytes under the folder (partial files included) of the
    repository's total, the rate since the last line, and how many of its files are whole."""

    def __init__(self, repo: str, dest: Path, say: Callable[[str], None], every_s: float) -> None:
        self.repo, self.dest, self.say, self.every_s = repo, dest, say, every_s
        self.sizes: dict[str, int] = {}
        self.started = time.monotonic()
        self.first = _bytes_under(dest)  # what an earlier run left: not this run's rate
        self.last_at, self.last_bytes = self.started, self.first

    def expect(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes

    def expected_line(self) -> str:
        return f"{len(self.sizes)} files, {sum(self.sizes.values()) / 1e9:.2f} GB"

    def whole_files(self) -> int:
        whole = 0
        for name, size in self.sizes.items():
            with contextlib.suppress(OSError):  # not there yet
                whole += (self.dest / name).stat().st_size == size
        return whole

    def tick(self, held: int) -> None:
        now = time.monotonic()
        if not self.sizes or now - self.last_at < self.every_s:
            return
        rate = (held - self.last_bytes) / (now - self.last_at)
        total = sum(self.sizes.values())
        self.say(f"prepare: {self.repo}: {held / 1e9:.2f} of {total / 1e9:.2f} GB, {rate / 1e6:.1f} MB/s, "
                 f"{self.whole_files()} of {len(self.sizes)} files")
        self.last_at, self.last_bytes = now, held

    def done_line(self) -> str:
        took = time.monotonic() - self.started
        fetched = max(0, sum(self.sizes.values()) - self.first)
        return (f"prepare: {self.repo}: downloaded {fetched / 1e9:.2f} GB in {took:.1f} s "
                f"({fetched / 1e6 / max(took, 1e-3):.1f} MB/s), {self.whole_files()} of {len(self.sizes)} files whole")


def _watched(work: Callable[[], T], dest: Path, stall_s: float, what: str, progress: Progress | None = None) -> T:
    """work()'s result, or its exception; Stalled when the bytes under `dest` (the client's partial files included)
    grow by less than STALL_BYTES in stall_s: a read timeout cannot catch a server that sends a byte at a time.
    `progress` hears the bytes at each look."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = work()
        except BaseException as exc:  # handed to the caller's thread, which says it
            box["error"] = exc

    worker = threading.Thread(target=run, daemon=True, name="hub-download")
    worker.start()
    held, since = _bytes_under(dest), time.monotonic()
    while worker.is_alive():
        worker.join(min(POLL_S, stall_s, progress.every_s if progress else POLL_S))
        now = _bytes_under(dest)
        if progress:
            progress.tick(now)
        if now >= held + STALL_BYTES:
            held, since = now, time.monotonic()
        elif worker.is_alive() and time.monotonic() - since > stall_s:
            raise Stalled(f"{what} sent less than {STALL_BYTES >> 20} MiB in {stall_s:.0f} s (PREPARE_STALL_S): it "
                          "has stopped answering or trickles; what arrived is kept, run prepare again to resume")
    if "error" in box:
        raise box["error"]
    return box["result"]


def _bytes_under(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # renamed or removed by the client as we counted
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]
