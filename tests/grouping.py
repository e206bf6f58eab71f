"""The slow tests of each module one group of one pytest-xdist worker (`--dist loadgroup`), so that its module-wide
fixtures (a server it boots once, an image it builds) run once; a module that shares something outside itself with
another (the second engine) names a group of its own with `pytest.mark.xdist_group`. A fast test boots, builds and
holds nothing module-wide, so the fast tests go to whichever worker is free: a module of many fast tests is not one
worker's queue (`make test-fast` takes four workers).

conftest.py calls it from a `tryfirst` collection hook (before pytest-xdist reads the groups); a suite of its own
does the same (tests/test_rerun_rule.py proves the rule on one). pytest-xdist 3.8 writes the group into the node id,
which pytest 9.2 no longer reads, and every test then goes its own way (pytest-dev/pytest-xdist#1386): requirements.in
holds pytest at 9.1."""

from __future__ import annotations

import pytest


def by_module(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("xdist_group"):
            module = getattr(item, "module", None)  # a Function's; a test of another kind stays a group of its own
            item.add_marker(pytest.mark.xdist_group(module.__name__ if module else item.nodeid))
