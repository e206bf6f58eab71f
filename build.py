#!/usr/bin/env python3
"""Entry point: `python build.py --help`. All the work lives in the servekit package."""

import sys

from servekit.cli import main

if __name__ == "__main__":
    sys.exit(main())
