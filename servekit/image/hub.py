"""Fetch a model repository from the Hugging Face hub (or anything that speaks its HTTP API: HF_ENDPOINT)
through huggingface_hub, the client the image's lock already installs: one commit, each file resumed where
a dropped transfer stopped, its size checked, HF_TOKEN / HF_ENDPOINT / HF_HUB_OFFLINE honoured, the layout
of a `local_dir` download users know. What is ours: the commit resolved first (every file from that one
commit), and every safetensors shard checked to hold all the bytes its own header declares (a repository
can hold a truncated shard; the client checks only that it got what the server sent).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

INDEX = "model.safetensors.index.json"  # names the shards; a folder you provide is judged by it
COMMIT = re.compile(r"[0-9a-f]{40}")
WORKERS = 4  # files fetched at once


class HubError(Exception):
    """The repository cannot be fetched, or a file of it is not whole; the message says which and why."""


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


def download(repo: str, revision: str | None, dest: Path, token: str | None, say=print) -> str:
    """Every file of the repository into `dest`, resuming what an earlier run left; the commit fetched."""
    import httpx
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub import errors as hf

    wanted = revision or "main"
    try:
        # A branch or tag is resolved once, so that every file comes from the same commit.
        commit = wanted if COMMIT.fullmatch(wanted) else HfApi().model_info(repo, revision=wanted, token=token).sha
        if not commit:
            raise HubError(f"{repo}@{wanted}: the hub named no commit for it")
        say(f"prepare: {repo}@{commit[:12]}: fetching (resumes what is there)")
        snapshot_download(repo, revision=commit, local_dir=dest, token=token, max_workers=WORKERS)
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
        raise HubError(f"{constants.ENDPOINT} cannot be reached ({_first_line(exc)}); {repo} is not prepared") \
            from None
    except (httpx.HTTPError, OSError, ValueError) as exc:  # dropped past the client's retries, short, unwritable
        raise HubError(f"{repo}@{wanted}: {type(exc).__name__}: {_first_line(exc)}; run prepare again to resume") \
            from None
    for path in sorted(dest.rglob("*.safetensors")):
        if ".cache" not in path.relative_to(dest).parts and (problem := shard_problem(path, path.name)):
            path.unlink()  # the next run fetches it again
            raise HubError(f"{repo}/{problem}; the file was removed, run prepare again")
    return commit


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]
