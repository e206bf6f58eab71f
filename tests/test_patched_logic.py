"""The logic our series patches change, as the cpu image's patched vLLM runs it (tests/standins/patched_logic.py):
each behaves as released with its variables unset, and as the patch says with them set, so each test fails on an
image without the patch."""

from __future__ import annotations

import json

import pytest

from support import ROOT, docker

pytestmark = [pytest.mark.engine, pytest.mark.network, pytest.mark.slow]

GiB = 2**30
CARD = round(23.56 * GiB)


@pytest.fixture(scope="module")
def facts(cpu_image):
    script = ROOT / "tests" / "standins" / "patched_logic.py"
    done = docker("run", "--rm", "-v", f"{script}:/opt/patched_logic.py:ro", "--entrypoint", "/opt/venv/bin/python",
                  cpu_image, "/opt/patched_logic.py", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_emulated_card_patch_sizes_vllm_from_the_card_only_when_asked(facts):
    unset, card = facts["card_patch"]["unset"], facts["card_patch"]["card"]
    gpu_total = 139 * GiB + GiB * 4 // 5
    # As released: the GPU's total, so GPU_UTIL x 139.8 GiB against the 23.5 GiB MPS leaves free.
    assert unset["total"] == gpu_total and unset["platform_total"] == 139 * GiB and unset["fa_version"] == 3
    assert card["total"] == CARD and card["platform_total"] == CARD and card["fa_version"] == 2
    assert card["free"] == min(23 * GiB + GiB // 2, CARD) and card["cuda_memory"] == CARD - card["free"]


def test_marlin_int8_activations_keep_to_the_layers_the_include_expression_names(facts):
    """Batch's int8 activations (INT8_ACT=int8) with VLLM_MARLIN_INT8_INCLUDE_RE=mlp, as the source exports them: the
    MLP takes int8, the attention and the int8 lm_head keep 16-bit activations (W8A8 is what Marlin refused)."""
    unset, mlp = facts["marlin_include"]["unset"], facts["marlin_include"]["mlp"]
    assert set(unset.values()) == {"torch.int8"}  # as released: every layer
    assert mlp == {"model.language_model.layers.0.mlp.gate_up_proj": "torch.int8",
                   "model.language_model.layers.3.self_attn.qkv_proj": "None", "lm_head": "None"}
