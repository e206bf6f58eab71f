"""Inert is not reached (#50): an image's build records which of the variables the launcher can export its packages
read; a real boot's knobs check lists a variable nothing reads as inert, not as reached; and a series patch of the
user's that adds a reader turns the knob that sets it live."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support import ROOT, docker, run_build_py, tracked_copy

pytestmark = [pytest.mark.engine, pytest.mark.network, pytest.mark.slow]

SOURCE_VARIABLES = {"VLLM_SPEC_DECODE_ATTN", "VLLM_INT4_MQ_3D", "VLLM_DFLASH2_LOOKUP"}


def test_the_cpu_images_record_says_what_its_packages_read(cpu_image):
    done = docker("run", "--rm", "--entrypoint", "cat", cpu_image, "/opt/servekit/env-readers.json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["read"]["VLLM_NO_USAGE_STATS"] == "vllm/envs.py" and "TORCHDYNAMO_DISABLE" in record["read"]
    assert set(record["inert"]) >= SOURCE_VARIABLES  # vLLM as released reads none of the source's own
    # but our series' marlin-int8-include reads batch's include rule (the cpu image carries it too)
    assert record["read"]["VLLM_MARLIN_INT8_INCLUDE_RE"] == "vllm/envs.py"  # registered there: a compile factor


def test_a_boot_lists_the_inert_as_inert_and_a_series_patch_that_reads_one_turns_it_live(tmp_path):
    """A copy whose cpu target exports two of the source's variables, and whose series ends with a patch that makes
    vLLM's environment registry read one of them; its default profile needs that one live."""
    root = tracked_copy(tmp_path / "repo")
    patches = root / "docker" / "patches"
    shutil.copy(ROOT / "tests" / "standins" / "spec-attn-reader.patch", patches)
    (patches / "series").write_text((patches / "series").read_text() + "spec-attn-reader.patch\n")
    matrix = root / "images.yaml"
    text = matrix.read_text()
    exported = '      TORCHDYNAMO_DISABLE: "1"\n'
    needed = "          long_conversations: {conversations: 2, min_cached_share: 0.5}\n"
    assert text.count(exported) == 1 and text.count(needed) == 1
    text = text.replace(exported, exported + '      VLLM_SPEC_DECODE_ATTN: "1"\n      VLLM_INT4_MQ_3D: "1"\n')
    matrix.write_text(text.replace(needed, needed + "          knobs: {live: VLLM_SPEC_DECODE_ATTN}\n"))
    done = run_build_py("run", "--target", "cpu", "--profile", "default", "--check", "knobs", "--json", cwd=root,
                        timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((Path(json.loads(done.stdout)["reports"][0]) / "report.json").read_text())
    knobs = next(c for c in report["checks"] if c["name"] == "knobs")
    assert knobs["status"] == "passed", knobs["reason"]
    assert knobs["figures"]["inert"] == ["VLLM_INT4_MQ_3D"]  # in the process's environment, read by nothing
    assert knobs["figures"]["environment_reached"] == knobs["figures"]["environment"] - 1
