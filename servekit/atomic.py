"""Write a file so that a reader sees the old content or the new, never a half-written one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text(path: Path, text: str, mode: int | None = None) -> None:
    """Replace `path` by a new file (a link there is replaced, never followed) with `mode`, else the old file's
    mode, else 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        if mode is None and path.is_file() and not path.is_symlink():
            mode = path.stat().st_mode & 0o777
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
