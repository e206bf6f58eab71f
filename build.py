#!/usr/bin/env python3
"""Entry point: `python3 build.py --help`. All the work lives in the servekit package, whose packages live in the
checkout's .venv (`make venv`): run by another Python, this runs itself again with the venv's."""

import os
import sys
from pathlib import Path

VENV = Path(__file__).resolve().parent / ".venv"

if __name__ == "__main__":
    venv_python = VENV / "bin" / "python"
    # Always the venv's Python where there is one: another may import the CLI yet lack a package that a command
    # imports only when it runs.
    if venv_python.exists() and Path(sys.prefix).resolve() != VENV.resolve():
        os.execv(venv_python, [str(venv_python), *sys.argv])
    try:
        from servekit.cli import main
    except ModuleNotFoundError as exc:
        sys.exit(f"build.py: {exc.name} is not installed for {sys.executable}: run `make venv` first (it needs "
                 "Python's venv module: `apt install python3-venv` on Debian and Ubuntu), then this command again")
    sys.exit(main())
