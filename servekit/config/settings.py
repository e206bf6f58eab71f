"""Per-machine build settings: which base, which pins or patches to leave out, which folders of wheels to offer.

None of them is a fact of the product, so none lives in images.yaml: each comes from a global flag,
else from the environment. The base and what is left out change what an image holds, so they
are part of its digest; a folder of wheels offers only exact pinned versions, so it is not. A patch
of the series is left out to measure what it does (the image as released vLLM behaves without it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from servekit.config.matrix import Matrix
from servekit.errors import UserError
from servekit.image.series import read_series

ENV_BASE = "SERVEKIT_BASE"
ENV_WITHOUT = "SERVEKIT_WITHOUT"
ENV_WHEELS = "SERVEKIT_WHEELS"


@dataclass(frozen=True)
class BuildSettings:
    base: str | None = None
    without: tuple[str, ...] = ()
    wheels: tuple[str, ...] | None = None  # None: the find-links folders pip is configured with

    @classmethod
    def resolve(cls, matrix: Matrix, base: str | None = None, without: list[str] | None = None,
                wheels: str | None = None, series_dir: Path | None = None) -> BuildSettings:
        """Each setting as given (command-line flags), else from the environment; checked against the matrix and
        the patches of the series in `series_dir`."""
        base = base or os.environ.get(ENV_BASE) or None
        without_text = without or [os.environ.get(ENV_WITHOUT, "")]
        omitted = tuple(sorted({w.strip() for text in without_text for w in text.split(",") if w.strip()}))
        wheels_text = wheels or os.environ.get(ENV_WHEELS)
        folders = tuple(w for w in wheels_text.split(os.pathsep) if w) if wheels_text else None
        settings = cls(base, omitted, folders)
        settings.check(matrix, series_dir)
        return settings

    def check(self, matrix: Matrix, series_dir: Path | None = None) -> None:
        if self.base is not None:
            if self.base not in matrix.bases:
                raise UserError(f"--base {self.base} ({ENV_BASE}): no such base; expected one of "
                                f"{', '.join(matrix.bases)}")
            if not any(self.base in t.bases for t in matrix.targets.values()):
                raise UserError(f"--base {self.base}: no target lists it in its bases; add it to a target's "
                                "bases in images.yaml")
        for name in self.without:
            if name not in matrix.may_omit and not (series_dir and (series_dir / f"{name}.patch").is_file()):
                allowed = ", ".join(matrix.may_omit) or "none"
                raise UserError(f"--without {name} ({ENV_WITHOUT}): neither a pin listed under may_omit in images.yaml "
                                f"({allowed}) nor a patch of the series ({matrix.series.dir}/series, named without "
                                ".patch)")
        if self.without and series_dir and (series_dir / "series").is_file():
            self._check_requirements(series_dir)
        for folder in self.wheels or ():
            if not Path(folder).is_dir():
                raise UserError(f"--wheels {folder} ({ENV_WHEELS}): not a folder; name a folder of .whl files or "
                                "unset it")

    def _check_requirements(self, series_dir: Path) -> None:
        """A patch kept that calls code of one left out would build an image that fails where it runs."""
        for patch in read_series(series_dir):
            if self.leaves_out_patch(patch.name):
                continue
            if missing := [needed for needed in patch.requires if self.leaves_out_patch(needed)]:
                both = ",".join(sorted({*self.without, patch.name.removesuffix(".patch")}))
                raise UserError(f"--without {', '.join(m.removesuffix('.patch') for m in missing)} ({ENV_WITHOUT}): "
                                f"{patch.name} requires it (its Requires: trailer); leave that out too: "
                                f"--without {both}")

    def base_for(self, matrix: Matrix, target: str) -> str:
        """The base `target` builds on: the one asked for where the target lists it, else its first."""
        bases = matrix.targets[target].bases
        return self.base if self.base in bases else bases[0]

    def omitted(self, matrix: Matrix, target: str) -> list[str]:
        """The pins of `target` this build leaves out."""
        return [name for name in matrix.targets[target].packages if name in self.without]

    def leaves_out_patch(self, patch_file: str) -> bool:
        """Whether this build leaves out the series' patch `patch_file` (NAME.patch)."""
        return patch_file.removesuffix(".patch") in self.without

    @cached_property
    def wheel_dirs(self) -> list[Path]:
        """The folders of wheels offered to the build: those named, else pip's own find-links that exist."""
        if self.wheels is not None:
            return [Path(w) for w in self.wheels]
        return [p for p in _pip_find_links() if p.is_dir()]


def _pip_find_links() -> list[Path]:
    """`find-links` from this machine's pip configuration (files and PIP_FIND_LINKS), local folders only."""
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    found: list[Path] = []
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.rsplit(".", 1)[-1] != "find-links":
            continue
        for item in value.strip().strip("'\"").split():
            item = item.removeprefix("file://")
            if item.startswith("/") and Path(item) not in found:
                found.append(Path(item))
    return found
