"""Which of the variables the launcher can export anything in the image reads: recorded at build, so that a knob
whose variables nothing reads is said to be inert rather than counted as reached.

A variable counts as read when its name stands in the serving packages (vLLM with the series and components
applied, FlashInfer, torch) as a quoted string in Python or a NUL-terminated string in a shared library: how code
names a variable it looks up. A name only in a comment or in our own launcher does not count. Standard library only.
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import re
from pathlib import Path

from .boundary import write_text_atomic

PACKAGES = ("vllm", "flashinfer", "torch")  # what the serving process runs; KVarN's files live inside vllm
RECORD_NAME = "env-readers.json"


def package_roots(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Each installed package's folder (a package this target lacks, FlashInfer on cpu, is left out)."""
    roots = {}
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec and spec.submodule_search_locations:
            roots[name] = Path(list(spec.submodule_search_locations)[0])
    return roots


def _patterns(names: list[str]) -> tuple[re.Pattern, re.Pattern]:
    alternatives = b"|".join(re.escape(n.encode()) for n in sorted(names, key=len, reverse=True))
    return (re.compile(rb"[\"'](" + alternatives + rb")[\"']"), re.compile(rb"(?<![A-Za-z0-9_])(" + alternatives
                                                                        + rb")\x00"))


def scan(roots: dict[str, Path], names: list[str]) -> dict[str, str]:
    """name -> the first file (package-relative, sorted walk) that reads it, for each of `names` that one does."""
    found: dict[str, str] = {}
    files = sorted((package, path) for package, root in roots.items() for path in root.rglob("*")
                   if path.suffix == ".py" or ".so" in path.suffixes)
    for package, path in files:
        remaining = [n for n in names if n not in found]
        if not remaining:
            break
        python, binary = _patterns(remaining)
        pattern = python if path.suffix == ".py" else binary
        try:
            with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                for match in pattern.finditer(data):
                    found.setdefault(match.group(1).decode(), f"{package}/{path.relative_to(roots[package])}")
        except (OSError, ValueError):  # an empty file cannot be mapped; an unreadable one reads nothing
            continue
    return found


def record(names: list[str], roots: dict[str, Path]) -> dict:
    """What the build writes beside the launcher: which of `names` are read, where, and which are inert."""
    read = scan(roots, names)
    return {"packages": sorted(roots), "read": dict(sorted(read.items())),
            "inert": sorted(n for n in set(names) if n not in read)}


def load(path: Path) -> dict | None:
    """The build's record, or None where there is none (an image built before it, the process engine)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("inert"), list) else None


def write(path: Path, doc: dict) -> None:
    write_text_atomic(path, json.dumps(doc, indent=2, sort_keys=True) + "\n", mode=0o644)
