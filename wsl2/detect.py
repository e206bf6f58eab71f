"""Is this Linux running under WSL2? Standard library only."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def wsl2_signs() -> list[str]:
    """The signs of WSL2 found here, each in words; empty off WSL2."""
    signs = []
    if "microsoft" in platform.release().lower():
        signs.append(f"kernel release {platform.release()}")
    if Path("/dev/dxg").exists():
        signs.append("/dev/dxg (the GPU paravirtualisation device)")
    if os.environ.get("WSL_DISTRO_NAME"):
        signs.append(f"WSL_DISTRO_NAME={os.environ['WSL_DISTRO_NAME']}")
    return signs


def is_wsl2() -> bool:
    return bool(wsl2_signs())
