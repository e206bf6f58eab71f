"""What a value may be where it goes: the one set of checks for every value that crosses into a file, a command, an
environment or a request, and the one bounded reader of every file handed to us.

Standard library only: the launcher inside the image uses it as the matrix loader, the command line, the record
readers and the smoke client do, so that a value is judged once, the same way, wherever it enters. Each check
returns why a value does not fit (a phrase to follow "expected"), or None; `read_text` raises Refused.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import tempfile
import unicodedata
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from .errors import UserError


class Refused(ValueError, UserError):
    """A value or file that does not fit where it goes; the message says what was expected (bad input: exit 2)."""


# --- text that becomes a line of another file or one argument of a command -------------------------------------

def control_character(text: str) -> str | None:
    """Why `text` cannot be one line of a requirements, .env, pip, Compose or YAML file: the first control character
    it holds (a line break adds a line of its own), or None."""
    for ch in text:
        if ch != " " and unicodedata.category(ch) in ("Cc", "Zl", "Zp"):
            return f"one line of text, found the control character U+{ord(ch):04X}" + (
                " (a line break)" if ch in "\n\r\x0b\x0c\x85\u2028\u2029" else "")
    return None


def printable(text: str) -> str:
    """`text` as one line a terminal shows as it is: each character that is not printable written as Python
    escapes it (a refusal that quotes a hostile name stays one line and moves no cursor)."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# PEP 508's distribution name; Debian's package name; a registry; an image reference (name[:tag][@digest]).
DIST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
DEBIAN_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]+")
REGISTRY = re.compile(r"[A-Za-z0-9.-]+(:\d+)?(/[a-z0-9._/-]+)?")  # HOST[:PORT][/NAMESPACE], where release pushes
# The distribution spec's grammar: a repository HOST[:PORT]/path of lowercase components, and a tag.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REPOSITORY = re.compile(rf"[A-Za-z0-9.-]+(?::\d+)?(?:/{_COMPONENT})+")
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
IMAGE_REF = re.compile(r"[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?")


def argv_words(text: str) -> tuple[list[str], str | None]:
    """`text` split as a shell would split it, and why it cannot be (an open quote), or None."""
    try:
        return shlex.split(text), None
    except ValueError as exc:
        return [], f"arguments as a shell splits them ({exc})"


def relative_inside(rel: str) -> str | None:
    """Why `rel` is not a relative path that stays below its base (no '..', not absolute, not empty)."""
    path = PurePosixPath(rel)
    if path.is_absolute() or ".." in path.parts or rel.strip() in ("", ".") or "\\" in rel:
        return f"a path relative to its folder that stays inside it (no '..', not absolute), found {rel!r}"
    return None


# --- numbers given on a command line or in a record -----------------------------------------------------------

def number_in(value: float, low: float | None = None, high: float | None = None) -> str | None:
    """Why `value` is not a finite number in [low, high], or None."""
    if value != value or value in (float("inf"), float("-inf")):
        return "a finite number"
    if low is not None and value < low:
        return f"at least {low:g}"
    if high is not None and value > high:
        return f"at most {high:g}"
    return None


# A switch's words, the same for every reader (the knobs, prepare's conversions, Compose's defaults, the host)
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def switch_setting(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """The environment setting `name` as on or off (`default` when unset or empty, as Compose's `${NAME:-1}` reads
    it); Refused, naming the setting and the words, when it is anything else."""
    raw = (environ.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in TRUE_WORDS | FALSE_WORDS:
        return raw in TRUE_WORDS
    raise Refused(f"{name}={environ.get(name, '')[:40]!r}: expected one of {'/'.join(sorted(TRUE_WORDS))} for on "
                  f"or {'/'.join(sorted(FALSE_WORDS))} for off (any case)")


def number_setting(environ: Mapping[str, str], name: str, default: float, low: float, high: float, unit: str = "",
                   whole: bool = False) -> float:
    """The environment setting `name` as a finite number in [low, high] (`default` when unset or empty), a whole one
    where `whole`; Refused, naming the setting, when it is anything else."""
    raw = (environ.get(name) or "").strip()
    if not raw:
        return float(default)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if problem := number_in(value, low, high) or ("a whole number" if whole and value != int(value) else None):
        raise Refused(f"{name}={raw[:40]!r}: expected {problem}{f' ({unit})' if unit else ''}")
    return value


# --- files handed to us: a key, a report, a manifest, the matrix --------------------------------------------------

class Missing(Refused):
    """The file is not there."""


def read_text(path: str | os.PathLike, max_bytes: int, follow_links: bool = True) -> str:
    """The text of the regular file at `path`: not a FIFO or a device (opened without blocking, so neither can hold
    us), at most `max_bytes`, strict UTF-8 without NUL bytes. Refused (Missing) says "PATH: what is wrong"."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise Missing(f"{path}: no such file") from None
    except OSError as exc:
        raise Refused(f"{path}: cannot be opened ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Refused(f"{path}: not a regular file")
    with os.fdopen(fd, "rb") as f:
        try:
            raw = f.read(max_bytes + 1)
        except OSError as exc:
            raise Refused(f"{path}: cannot be read ({exc.strerror})") from None
    if len(raw) > max_bytes:
        raise Refused(f"{path}: larger than {_size(max_bytes)}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refused(f"{path}: not a UTF-8 text file (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
    if "\x00" in text:
        raise Refused(f"{path}: not a text file (it holds NUL bytes)")
    return text


def write_text_atomic(path: str | os.PathLike, text: str, mode: int | None = None) -> None:
    """Replace `path` by a file holding `text`, whole or not at all: written beside it under a name of its own,
    flushed to disk, then renamed over it (a link there is replaced, never followed). Its mode is `mode`, else the
    old file's, else 0600. The one atomic writer, the host's and the image's."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # ".NAME.XXXX.tmp": a name of its own for each writer, and one that prepare's resume removes where a kill left it
    fd, staging = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        if mode is None and target.is_file() and not target.is_symlink():
            mode = target.stat().st_mode & 0o777
        if mode is not None:
            os.chmod(staging, mode)
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


SECRET_MAX_BYTES = 4096  # a key or a token is a line; a file larger than this is not one


def header_unsafe(secret: str) -> str | None:
    """Why `secret` cannot travel in an HTTP header as the client sends it and the server compares it (a bearer
    key, a token): the first character that is not visible ASCII (a byte-order mark, a zero-width space, a letter
    an encoding changes), named by its code point and never shown with the rest; or None."""
    for i, ch in enumerate(secret):
        if not "!" <= ch <= "~":
            return f"visible ASCII only, found U+{ord(ch):04X} at character {i + 1}"
    return None


def read_secret(path: str | os.PathLike, follow_links: bool = True) -> str:
    """A key or token file's one line, stripped (its text is never shown in a refusal): visible ASCII, since it
    travels in a header."""
    text = read_text(path, SECRET_MAX_BYTES, follow_links).strip()
    if problem := control_character(text) or header_unsafe(text):
        raise Refused(f"{path}: expected {problem}")
    return text
