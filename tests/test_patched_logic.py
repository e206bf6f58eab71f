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
    assert unset["total"] == gpu_total and unset["platform_total"] == 139 * GiB and unset["fa_version"] == 3 and unset["autotune"]
    assert card["total"] == CARD and card["platform_total"] == CARD and card["fa_version"] == 2 and not card["autotune"]
    assert card["free"] == min(23 * GiB + GiB // 2, CARD) and card["cuda_memory"] == CARD - card["free"]
    # On the Hopper GPU vLLM takes FlashInfer's GDN prefill; the card (a 3090, a 4090) runs FLA's; an additional
    # config that names one still wins.
    assert unset["gdn_prefill"] == "flashinfer" and card["gdn_prefill"] == "triton"
    assert unset["gdn_prefill_configured"] == card["gdn_prefill_configured"] == "flashinfer"
    # Beside an FP8 KV cache, vLLM quantizes FlashInfer's prefill query to FP8 on Hopper (its FA3 kernel); the card
    # keeps the model's dtype (FA2).
    assert unset["flashinfer_prefill_query"] == "float8_e4m3fn" and card["flashinfer_prefill_query"] == "bfloat16"


def test_marlin_int8_activations_keep_to_the_layers_the_include_expression_names(facts):
    """Batch's int8 activations (INT8_ACT=int8) with VLLM_MARLIN_INT8_INCLUDE_RE=mlp, as the source exports them: the
    MLP takes int8, the attention and the int8 lm_head keep 16-bit activations (W8A8 is what Marlin refused). The
    single launcher's rule matches the MTP head's MLP too, which keeps 16-bit activations all the same; and each rule
    is a factor of the compile cache's key, so a boot under another rule never replays this one's graphs."""
    marlin = facts["marlin_include"]
    unset, mlp, single = marlin["unset"], marlin["mlp"], marlin["single"]
    assert set(unset.values()) == {"torch.int8"}  # as released: every layer
    assert {layer for layer, dtype in mlp.items() if dtype == "torch.int8"} == {
        "model.language_model.layers.0.mlp.gate_up_proj"}
    assert {layer for layer, dtype in single.items() if dtype == "torch.int8"} == {
        "model.language_model.layers.0.mlp.gate_up_proj", "model.language_model.layers.3.self_attn.qkv_proj",
        "model.language_model.layers.0.linear_attn.in_proj_qkvz"}
    assert single["mtp.layers.0.mlp.gate_up_proj"] == single["mtp.fc"] == single["lm_head"] == "None"
    factors = marlin["compile_factor"]
    assert factors["mlp"] != factors["single"] and None not in (factors["mlp"], factors["single"]), factors


def test_a_cold_boot_measures_a_warm_forward_and_a_pinned_pool_sits_on_an_emptied_cache(facts):
    """profile-warm-peak.patch: the profile forward runs once (under the allocator's split limit) before vLLM opens
    the window that measures the activation peak, so a cold compile's scratch is not charged to the KV cache;
    VLLM_PROFILE_WARMUP=0 measures the first forward, as released. kv-bytes-release-scratch.patch: with a pinned
    pool (KV_MEM), what the forward left cached is given back before the pool is allocated."""
    order = facts["profile_order"]
    assert order["profiled"] == ["split limit", "forward", "measured window"], order
    assert order["profiled_warmup_off"] == ["measured window"], order
    assert order["pinned"] == ["forward", "cache emptied"], order


def test_the_dflash2_drafters_window_layers_no_longer_pad_the_full_attention_groups(facts):
    """kv-group-by-request.patch: with the drafter's 5 window layers, groups of 8 (the window padded by 3, 9 groups)
    rather than 5 (the full attention padded, 15 groups): one request of 65,536 tokens takes 2,984 pages rather than
    3,565, 16% less (groups of 16 would take 3,104, but a size that makes no more groups than the released rule and
    costs fewer pages wins); without a drafter (MTP) the grouping is as released, and VLLM_KV_GROUP_BY_REQUEST=0
    groups as released."""
    groups = facts["kv_groups"]
    assert groups["dflash2_released"] == {"group_size": 5, "groups": 15, "pages_per_request": 3565}, groups
    assert groups["dflash2"] == {"group_size": 8, "groups": 9, "pages_per_request": 2984}, groups
    assert groups["mtp"] == groups["mtp_released"] == {"group_size": 17, "groups": 4, "pages_per_request": 17 * 152 + 3 * 17 * 9}


def test_no_gdn_spec_decode_kernel_indexes_before_its_row_when_nothing_was_accepted(facts):
    """gdn-spec-accepted-bounds.patch: each GDN spec-decode kernel's accepted-count index (`num_accepted - 1`) is
    bounded below at 0, so a step that accepted nothing (structured output rejecting every draft) reads no state
    slot before its request's row (upstream #50021). Read from the installed kernels' source: Triton's kernels do not
    run in the cpu image."""
    sites = facts["gdn_accepted_bounds"]
    assert sites and all(sites.values()), sites  # each file has such an index
    assert all(all(bounded) for bounded in sites.values()), sites


def test_marlin_int8_activations_hold_the_checkpoints_weights_whatever_the_sign_of_their_scales(facts):
    """marlin-int8-signed-scales.patch: with int8 activations Marlin reads each group scale as an unsigned int16, so
    released, a negative scale (about half of AutoRound's) comes out hundreds of quantization steps off. Patched, the
    kernel holds the checkpoint's weights to the int16 scale's rounding (1/4096 of the largest), but for -8 under a
    negative scale, which four bits can only give back as +7: one step."""
    signed = facts["signed_scales"]
    assert 0.3 < signed["negative_scales"] / signed["groups"] < 0.7 and signed["clamped"] > 0, signed
    assert signed["worst_unclamped_error_in_steps"] < 0.01, signed
    assert signed["worst_error_in_steps"] <= 1.01, signed


def test_the_profile_run_sends_the_gdn_prefill_kernels_the_largest_step_the_scheduler_can_form(facts):
    """gdn-profile-worst-prefill.patch: in a forward of the profile run's size without attention metadata, each GDN
    layer sends its prefill kernels max_num_seqs sequences in max_num_batched_tokens tokens split for the most chunks
    (batch: 64 in 2,048, 95 chunks), with an initial state per sequence in the cache's dtype; a smaller forward (a
    compile warm-up) and VLLM_GDN_PROFILE_WORST_PREFILL=0 (as released) send nothing."""
    worst = facts["gdn_worst_prefill"]
    budget = worst["budget"]
    [step] = worst["profile"]
    assert len(step["cu_seqlens"]) == budget["seqs"] + 1 and step["cu_seqlens"][-1] == budget["tokens"]
    assert step["q"][1] == budget["tokens"] and step["initial_state"][0] == budget["seqs"]
    assert step["state_dtype"] == "torch.float16"  # the SSM cache's dtype (batch's --mamba-ssm-cache-dtype float16)
    assert step["chunks"] == worst["most_chunks"] == 95
    assert worst["smaller"] == [] and worst["off"] == []


def test_the_int8_emulation_keeps_16_bit_kernels_and_rounds_the_inputs_int8_activations_would_take(facts):
    """marlin-int8-emulated.patch (INT8_ACT=emulated): beside batch's int8 activations, VLLM_MARLIN_INT8_EMULATE=1
    keeps the 16-bit kernel for the layers the include rule gives int8, marks them as Marlin prepares them, holds
    in them the weights the int8 kernel would (negative group scales folded into the codes: what the fold costs is
    the int8 path's, not the kernel's), and hands a marked layer's kernel its input rounded as the int8 path rounds
    it, per token; the attention and the lm_head get theirs as given. Unset, the MLP takes int8 as before and nothing is rounded twice.
    The variable is one of the compile cache's factors."""
    emulated = facts["int8_emulated"]
    assert emulated["rounding_changes_the_input"] and emulated["rounded_as_the_int8_path"]
    mlp, attention = "model.language_model.layers.0.mlp.down_proj", "model.language_model.layers.3.self_attn.o_proj"
    head = "lm_head"
    on, off = emulated["emulated"]["layers"], emulated["int8"]["layers"]
    assert on[mlp] == {"input_dtype": "torch.int8", "kept_16_bit": True, "marked": True, "input_as_given": False,
                       "input_as_int8_rounds_it": True, "signs_folded": True}
    for layer in (attention, head):
        assert on[layer] == {"input_dtype": "None", "kept_16_bit": False, "marked": False, "input_as_given": True,
                             "input_as_int8_rounds_it": False, "signs_folded": False}, layer
    assert off[mlp]["input_dtype"] == "torch.int8" and not any(f["kept_16_bit"] or f["marked"] for f in off.values())
    assert emulated["emulated"]["compile_factor"] != emulated["int8"]["compile_factor"]


def test_two_requests_in_flight_keep_their_heads_in_the_cpu_tier(facts):
    """offload-rank-running-tail-first.patch: two requests store 40 chunks each, four at a time in turn, into a CPU
    tier of 60, then finish. Released (and with VLLM_KV_OFFLOAD_RANK_RUNNING=0), the tier evicts in the order chunks
    were stored, heads first, and neither request finds a single leading chunk again (the source's 0% and 0% turn-2
    reuse); patched, each running request's chunks are ranked tail first as it stores, and both find most of their
    prefix, the two runs together most of what the tier holds."""
    ranking = facts["tier_ranking"]
    assert ranking["released"] == {"leading_chunks": {"a": 0, "b": 0}, "refused_stores": 0}, ranking
    patched = ranking["patched"]
    assert patched["refused_stores"] == 0 and all(run >= ranking["chunks"] // 2 for run in
                                                  patched["leading_chunks"].values()), ranking
    assert sum(patched["leading_chunks"].values()) >= 0.8 * ranking["capacity"], ranking
