"""The code that runs inside the image: launcher, knobs, model prepare, series apply, component
install, the hub client, the launch recipe and the in-image verify. Each module loads with the
standard library alone (a test enforces it): the series and the components are applied by the
base's own Python before any wheel is there, and the host imports the knob table without the
serving stack. Only inside a function may one use a package the target's own lock installs (prepare's
huggingface_hub). This package is what the Dockerfile copies to /opt/servekit/servekit/image, what .dockerignore
admits and what the image's digest covers; the image runs its modules as `python -m servekit.image.NAME`, as the host
imports them.
"""

import os
from collections.abc import Mapping
from pathlib import Path

CODE_DIR = Path(__file__).resolve().parent  # this package: servekit/image here, /opt/servekit/servekit/image there
# The folder that holds the servekit folder: in the image /opt/servekit, on PYTHONPATH, where the build also stages
# what the code reads (profiles.json, build-info.json, the series, the lock's slices, the SBOM).
PACKAGE_ROOT = CODE_DIR.parent.parent


def module_command(python: str, module: str) -> list[str]:
    """The command that runs this package's `module` (launcher, series, ...) under `python`."""
    return [python, "-m", f"{__name__}.{module}"]


def module_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with PACKAGE_ROOT first on PYTHONPATH: an interpreter that has not installed servekit (the process
    engine's vLLM environment) finds this package there."""
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": str(PACKAGE_ROOT) + (os.pathsep + path if path else "")}
