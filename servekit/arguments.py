"""The command line's value types: each refuses a bad value in one line, through argparse, before any work starts
(the value checks themselves are the boundary's, as for the matrix and the launcher)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from packaging.version import InvalidVersion, Version

from servekit.image.boundary import REGISTRY, control_character, number_in

N = TypeVar("N", int, float)


def _number(kind: Callable[[str], N], text: str, low: float | None, high: float | None, what: str) -> N:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, found {text!r}") from None
    if problem := number_in(value, low, high):
        raise argparse.ArgumentTypeError(f"expected {what} ({problem}), found {text!r}")
    return value


def port(text: str) -> int:
    return _number(int, text, 1, 65535, "a TCP port")


def count(text: str) -> int:
    """How many of something (boots a cell): at least 1, so that no command does nothing and passes."""
    return _number(int, text, 1, 1_000_000, "a whole number")


def seed(text: str) -> int:
    """A random seed as numpy takes one (a 32-bit unsigned number)."""
    return _number(int, text, 0, 2**32 - 1, "a seed from 0 to 4294967295")


def lines(text: str) -> int:
    return _number(int, text, 0, 10_000_000, "a number of lines")


def seconds(text: str) -> float:
    """A duration: more than nothing, less than a day (every wait has a deadline, and a reachable one)."""
    value = _number(float, text, 0, 86_400, "seconds")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected seconds (more than 0), found {text!r}")
    return value


def interval(text: str) -> float:
    """A sampling interval: at least a millisecond (a zero would spin), at most a minute."""
    return _number(float, text, 0.001, 60, "seconds between samples")


def share(text: str) -> float:
    """A relative difference: 0.10 is 10 %."""
    return _number(float, text, 0, 100, "a relative difference such as 0.10")


def http_url(text: str) -> str:
    """A server's base URL: http(s)://HOST[:PORT][/PATH], one line, no query."""
    if problem := control_character(text):
        raise argparse.ArgumentTypeError(f"expected {problem}")
    parts = urlsplit(text)
    try:
        parts.port  # noqa: B018  (it raises on a port that is no number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected http(s)://HOST[:PORT], found {text!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment \
            or parts.username or parts.password:
        raise argparse.ArgumentTypeError(f"expected http(s)://HOST[:PORT][/PATH] (no credentials, no query), found "
                                         f"{text!r}")
    return text


def folder(text: str) -> Path:
    """A folder to write into: it may not exist yet, but it may not be a file."""
    path = Path(text)
    if problem := control_character(text):
        raise argparse.ArgumentTypeError(f"expected {problem}")
    try:
        if path.exists() and not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a file; expected a folder to write into")
    except OSError as exc:  # a name longer than the file system takes, a folder we may not look into
        raise argparse.ArgumentTypeError(f"{text[:80]!r}: {exc.strerror}; expected a folder to write into") from None
    return path


def kube_version(text: str) -> str:
    """A Kubernetes minor version whose schemas the validator holds (it validates offline)."""
    from kubernetes_validate.utils import (  # the Kubernetes schemas, loaded only by `render k8s` and --kube-version
        all_versions,
        major_minor,
    )
    known = sorted({major_minor(v) for v in all_versions()}, key=lambda v: tuple(map(int, v.split("."))))
    if text not in known:
        raise argparse.ArgumentTypeError(f"expected a Kubernetes minor version whose schemas are here, {known[0]} to "
                                         f"{known[-1]}, found {text!r}")
    return text


def registry(text: str) -> str:
    """Where `release` pushes: HOST[:PORT][/NAMESPACE], as release.registry in images.yaml."""
    if not REGISTRY.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected HOST[:PORT][/NAMESPACE] such as 127.0.0.1:5000/serve, found "
                                         f"{text!r}")
    return text


def version(text: str) -> str:
    """A release version as the index spells it (PEP 440, normalized: 0.32.0, 0.32.0rc1), never a path or a word."""
    try:
        normal = str(Version(text))
    except InvalidVersion:
        raise argparse.ArgumentTypeError(f"expected a version such as 0.32.0, found {text!r}") from None
    if normal != text:
        raise argparse.ArgumentTypeError(f"expected the version as the index spells it, {normal}, found {text!r}")
    return text


ACCEPTED_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")  # a name or Class.method


def accepted(text: str) -> tuple[str, str]:
    """`port --accept NAME=REASON`: a name port reports (an identifier, or Class.method) and a one-line reason, as
    one line of the series' port-accept file."""
    name, sep, reason = (part.strip() for part in text.partition("="))
    if not sep or not ACCEPTED_NAME.fullmatch(name) or not reason:
        raise argparse.ArgumentTypeError(f"expected NAME=REASON, NAME an identifier or Class.method, e.g. "
                                         f"old_name='only in a docstring', found {text[:80]!r}")
    if problem := control_character(reason):
        raise argparse.ArgumentTypeError(f"expected a reason that is {problem}")
    return name, reason
