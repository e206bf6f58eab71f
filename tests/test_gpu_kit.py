"""The GPU kit's carry (bench/gpu/pack.py): a part fits one device call beside the tree it travels with."""

from __future__ import annotations

import subprocess
import sys

from support import ROOT

sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import pack  # noqa: E402


def test_a_part_and_the_sparse_tree_fit_one_call():
    assert pack.tree_bytes() + pack.part_bytes() <= pack.CALL_BYTES


def test_what_travels_once_is_tracked_and_what_the_visit_serves():
    tracked = subprocess.run(["git", "ls-files", *pack.TRAVEL_ONCE], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for folder in pack.TRAVEL_ONCE:  # a renamed folder would travel with every part again, or not at all
        assert any(name.startswith(folder) for name in tracked), folder
    served = (ROOT / "bench" / "gpu" / "carried.sh").read_text()  # the folders visit.sh and acceptance.sh serve
    assert "MODEL=${SERVEKIT_GPU_MODEL:-$PWD/bench/gpu/qwen35-mini}" in served
    assert "bench/gpu/qwen35-mini/" in pack.TRAVEL_ONCE and "bench/gpu/qwen35-mini-dflash2/" in pack.TRAVEL_ONCE
    assert pack.SPARSE.startswith("git sparse-checkout set --no-cone '/*' ")
