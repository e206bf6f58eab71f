"""The run's one check of the machine's free disk (tests/support.py, called by conftest before anything runs): the
suite refuses to start, in one line, where the filesystem that holds the engine's images has less room than a whole
run writes, rather than a build failing half-way with "no space left on device" (seen once, beside a cuda build)."""

from __future__ import annotations

import pytest
import support

pytestmark = pytest.mark.engine


def test_a_run_without_the_room_it_writes_is_refused_in_one_line():
    said = support.disk_shortfall(need_gb=10**9)
    assert said is not None and "\n" not in said, said
    assert "GB free" in said and "`docker builder prune -f`" in said
    assert support.disk_shortfall(need_gb=0) is None
