"""Read a release's declared requirements from a package index, without downloading the wheel.

The simple index (PEP 691 JSON) lists the files. Where the index serves the metadata file
(PEP 658) it is fetched; otherwise the wheel's METADATA is read out of the zip with HTTP range
requests (a few hundred KB of a 300 MB wheel). Results are cached on disk, so `verify` runs
offline once it has run online. An index's answer is checked before use (its listing's shape, a file name that is a
name and no path, the wheel's sha256 against the listing), and each exchange has a deadline for the whole of it: a
read timeout alone lets an index that trickles a byte at a time hold us for ever.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urljoin

import requests
from packaging.utils import canonicalize_name

from servekit.errors import EnvironmentProblem, UserError
from servekit.image.boundary import write_text_atomic
from servekit.image.components import file_sha256
from servekit.trust import requests_verify

TIMEOUT = 30  # one read
EXCHANGE_DEADLINE_S = 180.0  # a listing and a METADATA, all their reads
WHEEL_DEADLINE_S, WHEEL_MIN_RATE = 120.0, 256 << 10  # a wheel: this long plus its size at this many bytes a second
JSON_ACCEPT = "application/vnd.pypi.simple.v1+json"
WHEEL_NAME = re.compile(r"[A-Za-z0-9_.+!-]+\.whl")  # a file name, never a path


class IndexUnreachable(EnvironmentProblem):
    """The index could not be asked, or answered nonsense; the caller checks what it can offline."""


class NotOnIndex(UserError):
    """The index answered, and it does not have that release."""


T = TypeVar("T")


def within(seconds: float, what: str, index_url: str, call: Callable[[], T]) -> T:
    """call()'s result, or its exception (requests' own as IndexUnreachable), within `seconds` for the whole of it;
    IndexUnreachable past them. The call runs in a daemon thread: a read stuck on a trickling server cannot be
    interrupted, but it no longer holds the command, which ends with the error."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = call()
        except requests.RequestException as exc:
            box["error"] = IndexUnreachable(f"{index_url} could not be reached ({type(exc).__name__})")
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=run, daemon=True, name="index")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise IndexUnreachable(f"{what} took more than {seconds:.0f} s: the index is too slow or trickles")
    if "error" in box:
        raise box["error"]
    return box["result"]


@dataclass(frozen=True)
class Metadata:
    name: str
    version: str
    requires_dist: tuple[str, ...]
    requires_python: str | None


class _RangeFile(io.RawIOBase):
    """A read-only, seekable file over HTTP range requests: enough for zipfile."""

    def __init__(self, session: requests.Session, url: str) -> None:
        self.session, self.url, self.pos = session, url, 0
        head = session.head(url, allow_redirects=True, timeout=TIMEOUT, verify=requests_verify())
        head.raise_for_status()
        self.size = int(head.headers["Content-Length"])
        self.url = head.url

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def readinto(self, buffer: Any) -> int:
        if self.pos >= self.size:
            return 0
        end = min(self.pos + len(buffer), self.size) - 1
        resp = self.session.get(self.url, headers={"Range": f"bytes={self.pos}-{end}"}, timeout=TIMEOUT,
                                verify=requests_verify())
        resp.raise_for_status()
        data = resp.content
        if resp.status_code != 206:  # the server ignored the range: take our slice of the whole
            data = data[self.pos:end + 1]
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _pick_wheel(files: list[dict], name: str, version: str, platform: str) -> dict | None:
    prefix = f"{canonicalize_name(name).replace('-', '_')}-{version}-"
    wheels = [f for f in files if f["filename"].lower().startswith(prefix.lower()) and f["filename"].endswith(".whl")
              and not f.get("yanked")]
    # Prefer the wheel for the platform asked for; any wheel of the release declares the same requirements
    # apart from markers, which the caller evaluates.
    wheels.sort(key=lambda f: (platform not in f["filename"], "none-any" not in f["filename"]))
    return wheels[0] if wheels else None


def _parse(text: str) -> Metadata:
    headers = HeaderParser().parsestr(text)
    return Metadata(headers["Name"], headers["Version"], tuple(headers.get_all("Requires-Dist") or ()),
                    headers.get("Requires-Python"))


def _listing(get: Callable[..., requests.Response], name: str, index_url: str, auth: tuple[str, str] | None = None) -> requests.Response | None:
    """The index's listing of project `name` (PEP 691 asked for), or None when it has no such project;
    IndexUnreachable for any other answer than those two."""
    listing = get(f"{index_url.rstrip('/')}/{canonicalize_name(name)}/", headers={"Accept": JSON_ACCEPT}, timeout=TIMEOUT,
                  verify=requests_verify(), auth=auth)
    if listing.status_code == 404:
        return None
    if listing.status_code != 200:
        raise IndexUnreachable(f"{index_url} answered HTTP {listing.status_code} for {name}")
    return listing


def _no_listing(index_url: str, name: str, exc: Exception) -> IndexUnreachable:
    return IndexUnreachable(f"{index_url} answered for {name} with no PEP 691 listing ({str(exc)[:120]})")


def _wheel_entry(session: requests.Session, name: str, version: str, index_url: str, platform: str) -> dict:
    """The index's entry (PEP 691) for the wheel of `name==version` that suits the platform, its url absolute;
    IndexUnreachable when the answer is not a PEP 691 listing."""
    listing = _listing(session.get, name, index_url)
    if listing is None:
        raise NotOnIndex(f"{name} is not on {index_url}")
    if "json" not in listing.headers.get("Content-Type", ""):
        raise IndexUnreachable(f"{index_url} does not answer in PEP 691 JSON (it sent "
                               f"{listing.headers.get('Content-Type') or 'no Content-Type'})")
    try:
        files = listing.json()["files"]
        problems = [problem for f in files if (problem := _entry_problem(f))]
    except (ValueError, KeyError, TypeError) as exc:
        raise _no_listing(index_url, name, exc) from None
    if problems:
        raise _no_listing(index_url, name, ValueError(problems[0]))
    wheel = _pick_wheel(files, name, version, platform)
    if wheel is None:
        raise NotOnIndex(f"{index_url} has no wheel of {name}=={version}")
    return {**wheel, "url": urljoin(listing.url, wheel["url"])}  # PEP 691 lets a url be relative to the listing


def _entry_problem(entry: object) -> str | None:
    """Why a listing's file entry cannot be used (its name must be a file name: it becomes one here), or None."""
    if not isinstance(entry, dict) or not isinstance(entry.get("filename"), str) or \
            not isinstance(entry.get("url"), str) or not isinstance(entry.get("hashes", {}), dict):
        return "a file entry without a filename, url and hashes"
    if entry["filename"].endswith(".whl") and not WHEEL_NAME.fullmatch(entry["filename"]):
        return f"a wheel named {entry['filename'][:80]!r}, which is no file name"
    return None


def fetch_metadata(name: str, version: str, index_url: str, cache_dir: Path,
                   platform: str = "x86_64") -> Metadata:
    """The METADATA of `name==version` as the index serves it; cached under cache_dir (written whole, and checked
    against its own digest when read: a damaged copy is fetched again, never believed)."""
    cached = cache_dir / f"{canonicalize_name(name)}-{version}.metadata.json"
    text = _cached_metadata(cached, name, version)
    if text is not None:
        return _parse(text)
    text = within(EXCHANGE_DEADLINE_S, f"{index_url}: the METADATA of {name} {version}", index_url,
                  lambda: _read_metadata(name, version, index_url, platform))
    parsed = _parse(text)
    if canonicalize_name(parsed.name or "") != canonicalize_name(name) or parsed.version != version:
        raise IndexUnreachable(f"{index_url} served metadata of {parsed.name} {parsed.version} for {name} {version}")
    write_text_atomic(cached, json.dumps({"name": name, "version": version, "sha256": hashlib.sha256(text.encode()).hexdigest(),
                                   "metadata": text}) + "\n")
    return parsed


def _read_metadata(name: str, version: str, index_url: str, platform: str) -> str:
    session = requests.Session()
    try:
        wheel = _wheel_entry(session, name, version, index_url, platform)
        if wheel.get("core-metadata") or wheel.get("data-dist-info-metadata"):
            meta = session.get(wheel["url"] + ".metadata", timeout=TIMEOUT, verify=requests_verify())
            meta.raise_for_status()
            return meta.text
        with zipfile.ZipFile(io.BufferedReader(_RangeFile(session, wheel["url"]), 1 << 16)) as whl:
            member = next((n for n in whl.namelist() if n.endswith(".dist-info/METADATA")), None)
            if member is None:
                raise IndexUnreachable(f"{index_url}: the wheel of {name} {version} holds no METADATA")
            return whl.read(member).decode("utf-8")
    except (zipfile.BadZipFile, UnicodeDecodeError, ValueError, KeyError) as exc:
        raise IndexUnreachable(f"{index_url} served no readable wheel of {name} {version} ({str(exc)[:120]})") \
            from None


def _cached_metadata(path: Path, name: str, version: str) -> str | None:
    try:
        doc = json.loads(path.read_text())
        text = doc["metadata"]
        whole = hashlib.sha256(text.encode()).hexdigest() == doc["sha256"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return text if whole and doc.get("name") == name and doc.get("version") == version else None


def release_exists(name: str, version: str, index_url: str, auth: tuple[str, str] | None = None) -> bool:
    """Whether the index lists any file of that release; raises IndexUnreachable."""
    return within(EXCHANGE_DEADLINE_S, f"{index_url}: the listing of {name}", index_url,
                  lambda: _lists_release(name, version, index_url, auth))


def _lists_release(name: str, version: str, index_url: str, auth: tuple[str, str] | None) -> bool:
    listing = _listing(requests.get, name, index_url, auth)
    if listing is None:
        return False
    if "json" in listing.headers.get("Content-Type", ""):
        try:
            data = listing.json()
            if "versions" in data:  # PEP 700
                return version in data["versions"]
            return _names_release((f.get("filename", "") for f in data.get("files", [])), name, version)
        except (ValueError, TypeError, AttributeError) as exc:
            raise _no_listing(index_url, name, exc) from None
    # An HTML-only index (PEP 503): look for a file of that release among the links' texts and targets.
    return _names_release(re.findall(r"[^\s\"'<>/=]+\.(?:whl|tar\.gz|zip)", unquote(listing.text)), name, version)


def _names_release(filenames: Iterable[str], name: str, version: str) -> bool:
    """Whether a file name is of `name` at exactly `version` (a local label such as +cpu included)."""
    # File names spell the project with `_` or `-`; with every `-` made `_`, one pattern finds both.
    stem = re.escape(canonicalize_name(name).replace("-", "_"))
    wanted = re.compile(rf"(?i){stem}_{re.escape(version)}[_.]")
    return any(wanted.match(f.replace("-", "_")) for f in filenames)


def download_wheel(name: str, version: str, index_url: str, dest: Path, platform: str = "x86_64") -> Path:
    """The wheel of `name==version` for the platform, downloaded once into `dest` and checked against the sha256
    its listing names."""
    session = requests.Session()
    wheel = within(EXCHANGE_DEADLINE_S, f"{index_url}: the listing of {name}", index_url,
                   lambda: _wheel_entry(session, name, version, index_url, platform))
    path = dest / wheel["filename"]
    sha256 = (wheel.get("hashes") or {}).get("sha256")
    if path.is_file() and (file_sha256(path) == sha256 if sha256 else path.stat().st_size == wheel.get("size")):
        return path
    dest.mkdir(parents=True, exist_ok=True)
    given = wheel.get("size")
    size = given if isinstance(given, int) else 0
    # A partial file of this download's own: two processes fetching one wheel (two test workers, two commands)
    # must not write, check or rename each other's (one renamed it away while the other read it: FileNotFoundError).
    fd, name = tempfile.mkstemp(dir=dest, prefix=f".{wheel['filename']}.", suffix=".part")
    os.close(fd)
    partial = Path(name)
    try:
        within(WHEEL_DEADLINE_S + size / WHEEL_MIN_RATE, f"{index_url}: {wheel['filename']}", index_url,
               lambda: _fetch(session, wheel["url"], partial))
        if sha256 and file_sha256(partial) != sha256:
            raise IndexUnreachable(f"{index_url} served a {wheel['filename']} whose sha256 is not the one its "
                                   "listing names; removed, not used")
        os.replace(partial, path)  # only a whole, checked file gets the wheel's name (atomically, whoever is last)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _fetch(session: requests.Session, url: str, out_path: Path) -> None:
    with session.get(url, stream=True, timeout=TIMEOUT, verify=requests_verify()) as resp:
        resp.raise_for_status()
        with open(out_path, "wb") as out:
            for chunk in resp.iter_content(1 << 20):
                out.write(chunk)


