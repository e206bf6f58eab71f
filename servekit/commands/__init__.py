"""The commands, group by group: each module registers its commands' parsers and holds what each prints; `cli.py`
parses and dispatches to them."""

from __future__ import annotations

from servekit.commands import checking, images, machine, matrix, releasing, serving

GROUPS = (matrix, images, serving, checking, releasing, machine)
