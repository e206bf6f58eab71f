"""sweep: every cell booted N times, the table with its spread column, failures recorded, nothing left running."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import project_containers, run_build_py, work_dir

from servekit.serve.sweep import Cell, sizing_advice, spread_versus_gap

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _latest_sweep() -> tuple[dict, Path]:
    folders = sorted((work_dir() / "reports").glob("*-sweep-*"))
    return json.loads((folders[-1] / "report.json").read_text()), folders[-1]


def test_two_values_two_boots_each_give_the_table_with_the_spread_column():
    """Buys a sweep on real boots: two values, two boots each, the table and the spread column that says whether a
    difference is more than noise."""
    result = run_build_py("sweep", "default", "--target", "cpu", "--knob", "MAX_SEQS=4,16", "--boots", "2",
                          "--checks", "burst,knobs", timeout=3000)
    assert result.returncode == 0, result.stderr[-3000:]
    doc, folder = _latest_sweep()
    assert [c["knobs"] for c in doc["cells"]] == [{"MAX_SEQS": "4"}, {"MAX_SEQS": "16"}]
    assert all(len(c["boots"]) == 2 and all(b["survived"] for b in c["boots"]) for c in doc["cells"])
    # the knob really reached the engine on every boot
    assert all(b["checks"]["knobs"]["status"] == "passed" for c in doc["cells"] for b in c["boots"])
    header, rows = doc["table"]["header"], doc["table"]["rows"]
    assert header[7].startswith("spread < gap to next (tokens_per_s)")
    assert rows[0][1] == "2/2 survive" and rows[0][7].startswith(("yes", "no"))
    assert rows[0][8] == "no speculation in this profile or target"
    assert {p.name for p in folder.iterdir()} == {"report.json", "report.md", "sweep.png"}  # and nothing else
    assert "MAX_SEQS=4" in result.stdout and "2/2 survive" in result.stdout
    assert project_containers() == []


def test_a_value_vllm_refuses_is_a_failed_cell_and_the_rest_completes():
    """Buys a sweep's failure handling on real boots: a value vLLM refuses is a failed cell with its reason, and the
    other cells still run."""
    result = run_build_py("sweep", "default", "--target", "cpu", "--knob", "MAX_LEN=1024,100000", "--boots", "1",
                          "--checks", "health", timeout=3000)
    assert result.returncode == 0, result.stderr[-3000:]
    doc, _ = _latest_sweep()
    ok, refused = doc["cells"]
    assert ok["boots"][0]["survived"] and ok["boots"][0]["checks"]["health"]["status"] == "passed"
    assert not refused["boots"][0]["survived"]
    assert "max_model_len (100000)" in refused["boots"][0]["reason"]
    assert doc["table"]["rows"][1][1] == "failed, 1/1"
    assert project_containers() == []


def _cell(value: str, tps: list[float], margins: list[int | None] | None = None) -> Cell:
    boots = [{"tokens_per_s": t, "time_to_healthy_s": 30.0, "survived": True, "kind": "survived",
              "gpu_margin_bytes": (margins or [None] * len(tps))[i], "kv_pool_tokens": 1000, "traffic_rise_bytes": None, "spilled": None,
              "tokens_per_step": None} for i, t in enumerate(tps)]
    return Cell({"GPU_UTIL": value}, boots)


def test_spread_column_says_which_gaps_are_claims():
    claims = spread_versus_gap([_cell("0.94", [1000, 1010]), _cell("0.95", [1200, 1205]),
                                _cell("0.96", [1190, 1260])], "tokens_per_s")
    assert claims[0].startswith("yes") and claims[1].startswith("no") and claims[2] == ""


def test_sizing_advice_takes_the_largest_value_with_margin_on_every_boot():
    mib = 2**20
    cells = [_cell("0.94", [1, 1], [174 * mib, 180 * mib]), _cell("0.945", [1, 1], [54 * mib, 60 * mib]),
             _cell("0.95", [1, 1], [150 * mib, 20 * mib])]
    advice = sizing_advice(cells, "GPU_UTIL", 100 * mib, "0.94")
    assert advice is not None and advice.startswith("recommended GPU_UTIL default: 0.94 ") and "current default: 0.94" in advice


def test_a_dtype_sweep_boots_each_cell_with_its_own_dtype():
    """The knob reaches the engine per cell: its "non-default args" line names the cell's dtype, or vLLM refused
    the cell with its own reason; never the same dtype twice."""
    result = run_build_py("sweep", "default", "--target", "cpu", "--knob", "DTYPE=float32,bfloat16", "--boots", "1",
                          "--checks", "knobs", timeout=3000)
    assert result.returncode == 0, result.stderr[-3000:]
    doc, _ = _latest_sweep()
    seen = []
    for cell in doc["cells"]:
        boot = cell["boots"][0]
        if boot["survived"]:
            knobs = boot["checks"]["knobs"]
            assert knobs["status"] == "passed", knobs
            seen.append(knobs["figures"]["engine_values"]["dtype"])
        else:  # vLLM's own words, not a boot that never started
            assert any(word in boot["reason"].lower() for word in ("dtype", "bfloat16", "bf16")), boot
            seen.append(None)
    assert seen[0] == "float32" and seen[1] in ("bfloat16", None)
    assert project_containers() == []
