"""`fit`: the KV arithmetic against the published pools (../shared/served-model.md sections 3-4), vLLM's own words
in the full-size reports, and the command's prediction against the report it is calibrated by."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support import ROOT

from servekit.config.load import load_matrix
from servekit.config.profiles import render_profiles
from servekit.image.launcher import build_command
from servekit.image.standin import DRAFTER_FULL, FULL
from servekit.records.fit import Flags, GiB, Layout, NotPredicted, calibrations, need, predict

LAYOUT = Layout.from_config(FULL, DRAFTER_FULL)
PINNED = 5583457484  # the source's KV_MEM for its DFlash2 profiles at CTX=fast (--kv-cache-memory-bytes)
GPU = ROOT / "docs" / "gpu"


def test_the_served_layout_is_sixteen_attention_and_forty_eight_gdn_layers():
    assert (LAYOUT.attention_layers, LAYOUT.gdn_layers, LAYOUT.conv_dim, LAYOUT.ssm_elements) == (16, 48, 10240, 786432)


@pytest.mark.parametrize("flags, blocks, block, pool", [
    # the source's batch (fp8 KV, fp16 state, 150,000, no prefix caching): 285 blocks, 223,821 tokens, "1.49x"
    (Flags("fp8", 150000, 0.972, prefix_caching=False), 285, 800, 223821),
    # a 3090 on stock vLLM 0.20.2 (bf16 KV, fp32 state, 16K, MTP 1 and 3): 20,024 and 16,384 tokens
    (Flags("bfloat16", 16384, 0.9, method="mtp", drafts=1, prefix_caching=False, ssm_bytes=4), 33, 800, 20024),
    (Flags("bfloat16", 16384, 0.9, method="mtp", drafts=3, prefix_caching=False, ssm_bytes=4), 33, 800, 16384),
    # 0.31.0's batch as the source publishes it (GPU_UTIL 0.94, prefix caching on by default): 217,268
    (Flags("fp8", 150000, 0.94), 281, 800, 217268),
    # measured at full size here, 2026-12-06: default (MTP 4, bf16 KV) and batch, on an emulated 3090
    (Flags("bfloat16", 65536, 0.93, method="mtp", drafts=4), 221, 432, 85196),
    (Flags("fp8", 150000, 0.94), 275, 800, 212628),
    # alternative (DFlash2 k7, int4 KV, 160,000): the source's 226,184 on its WSL2 4090, and 286,586 measured here
    # on the emulated one (2026-12-07). The block is the target's (1056 B a token and layer); the drafter's 8 heads
    # of 128 take 1088 B, so every page is padded to the drafter's 1,696 x 1088 B, as vLLM evens them
    (Flags("int4_per_token_head", 160000, 0.95, method="dflash", drafts=7), 352, 1696, 226184),
    (Flags("int4_per_token_head", 160000, 0.95, method="dflash", drafts=7), 446, 1696, 286586),
])
def test_the_block_arithmetic_gives_each_published_and_measured_pool(flags, blocks, block, pool):
    one = need(LAYOUT, flags)
    assert one.block == block
    assert one.pool(blocks * one.block_bytes, flags.max_len) == (blocks, pool)
    assert one.pool((blocks + 1) * one.block_bytes - 1, flags.max_len) == (blocks, pool)  # a block is a block


def test_one_request_needs_what_vllm_said_it_needed_at_full_size():
    """vLLM's own refusals on an emulated 3090 (2026-12-05): 4.76 GiB for default's 65,536 tokens, 4.74 GiB for
    batch's 150,000."""
    refusals = {json.loads((GPU / run / "report.json").read_text())["checks"][0]["reason"]
                for run in ("20261205-182425-default-cuda", "20261205-183052-batch-cuda")}
    default = need(LAYOUT, Flags("bfloat16", 65536, 0.93, method="mtp", drafts=4))
    batch = need(LAYOUT, Flags("fp8", 150000, 0.94))
    for one, max_len in ((default, 65536), (batch, 150000)):
        said = f"max seq len ({max_len}), ({one.request_bytes / GiB:.2f} GiB KV cache is needed"
        assert any(said in reason for reason in refusals), (said, refusals)


def test_pages_of_different_sizes_are_evened_to_the_largest():
    """vLLM's unify_kv_cache_spec_page_size: alternative's target pages (1,696 tokens x 1056 B) and GDN states are
    padded to the drafter's 1,696 x 1088 B; a drafter whose page were twice the target's would give the target's
    attention layers blocks twice as long instead (and their pages unpadded)."""
    alternative = need(LAYOUT, Flags("int4_per_token_head", 160000, 0.95, method="dflash", drafts=7))
    assert alternative.block_bytes == alternative.group_size * 1696 * 1088
    wide = Layout.from_config(FULL, {**DRAFTER_FULL, "num_key_value_heads": 2 * DRAFTER_FULL["num_key_value_heads"]})
    bf16 = Flags("bfloat16", 65536, 0.93, kv_bytes=PINNED, method="dflash", drafts=7)
    same, doubled = need(LAYOUT, bf16), need(wide, bf16)
    assert doubled.block_bytes == 2 * same.block_bytes
    assert doubled.blocks_per_request < same.blocks_per_request  # the attention layers' blocks, twice as long


def test_a_drafter_this_arithmetic_does_not_cover_is_said_not_guessed():
    with pytest.raises(NotPredicted, match="no drafter config"):
        need(Layout.from_config(FULL), Flags("bfloat16", 65536, 0.93, kv_bytes=PINNED, method="dflash", drafts=7))
    with pytest.raises(NotPredicted, match="kvarn"):
        need(LAYOUT, Flags("kvarn_k4v2_g128", 200000, 0.93))


def test_the_dflash_drafters_window_layers_group_as_the_series_patch_groups_them():
    """The source's dflash2-k15 pool (57,344 tokens, bf16 KV, KV_MEM pinned, sync scheduling) is 57,669 tokens. In
    groups of 8 layers, the size kv-group-by-request.patch picks (vLLM's own rule takes the window's 5 and pads the
    attention layers' groups; groups of 16, the patch's first rule, pad the window to 16 and left a request 2.5% over
    the pin at full size), KV_MEM holds 354 blocks of 480 tokens, and vLLM 0.31.0's bounds hold 352 a request
    (2 attention groups of 120, 6 GDN groups of 17: align mode and 15 drafts, 1 window group of 10): 57,669 tokens."""
    k15 = need(LAYOUT, Flags("bfloat16", 57344, 0.93, kv_bytes=PINNED, method="dflash", drafts=15,
                             async_scheduling=False))
    assert (k15.block, k15.group_size, k15.groups) == (480, 8, 9)
    blocks, pool = k15.pool(PINNED, 57344)
    assert (blocks, k15.blocks_per_request, pool) == (354, 2 * 120 + 6 * 17 + 10, 57669)
    # the pages of one request: 2,816 in groups of 8, 2,896 in groups of 16 and 3,300 in vLLM's groups of 5, as the
    # thirteenth visit's log counted them
    assert k15.blocks_per_request * k15.group_size == 2816
    # DFlash2 k7 at 65,536 under async scheduling: the window holds two batches in flight, 15 blocks, and a request
    # costs 4.96 GiB in groups of 8 (5.17 in groups of 16, 5.92 in vLLM's groups of 5: the patch's header)
    k7 = need(LAYOUT, Flags("bfloat16", 65536, 0.93, kv_bytes=PINNED, method="dflash", drafts=7))
    assert (k7.block, k7.group_size, k7.blocks_per_request) == (448, 8, 2 * 147 + 6 * 9 + 15)
    assert round(k7.request_bytes / GiB, 2) == 4.96


def test_the_flags_come_from_the_launchers_own_argv():
    flags = Flags.from_argv(["--max-model-len", "65536", "--gpu-memory-utilization", "0.93", "--kv-cache-dtype",
                             "bfloat16", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 4}',
                             "--kv-cache-memory-bytes=5583457484", "--no-enable-prefix-caching"])
    assert (flags.max_len, flags.util, flags.method, flags.drafts, flags.kv_bytes, flags.prefix_caching) == (
        65536, 0.93, "mtp", 4, 5583457484, False)


def _fit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "build.py"), "fit", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_fit_predicts_each_full_size_pool_within_two_percent_and_names_what_it_cannot():
    """Each calibrating report (the newest at full size of its profile and host kind) against the prediction for the
    knobs it ran with: the pool within 2%; dflash2-k15 pins its pool; a profile never measured at size gets what one
    request needs and no pool."""
    matrix = load_matrix(ROOT / "images.yaml")
    rendered = render_profiles(matrix, "cuda")
    measured = calibrations(ROOT)
    assert {("batch", "native"), ("default", "native"), ("alternative", "wsl2"), ("default", "wsl2")} <= set(measured)
    for (profile, host), calibration in measured.items():
        report = json.loads((GPU / calibration.report / "report.json").read_text())
        argv, _ = build_command(rendered, profile, host, report["knobs"])
        card = matrix.cards[report["card"]["card"]].memory_gib
        one = predict(profile, host, argv, LAYOUT, card, calibration)
        pool = report["boot"]["kv_pool_tokens"]
        assert one.fits is True and abs(one.pool_tokens - pool) / pool < 0.02, (calibration, one.pool_tokens, pool)
    done = _fit("--profile", "dflash2-k15", "--profile", "mtp", "--host", "native", "--json")
    assert done.returncode == 0, done.stderr
    dflash2_k15, mtp = json.loads(done.stdout)
    assert dflash2_k15["pool_tokens"] == dflash2_k15["source_pool_tokens"] == 57669
    assert mtp["fits"] is None and mtp["pool_tokens"] is None and "not yet measured at size" in mtp["why"]


def test_fit_refuses_bad_input_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    for args, said in ((["--config", str(tmp_path / "config.json")], "not a Qwen3.5-family config.json"),
                       (["--card", "rtx9090"], "--card rtx9090: expected one of"),
                       (["--profile", "nope"], "--profile nope: not a profile of target")):
        done = _fit(*args)
        assert done.returncode != 0 and said in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_report_of_another_shape_calibrates_nothing_and_stops_nothing(tmp_path):
    for name, text in (("a", "[]"), ("b", '{"boot": {"budget": {"requested_gib": 21.9}}}'), ("c", "not json"),
                       ("d", '{"card": {}, "profile": "p", "boot": {"budget": {"requested_gib": 21.9, '
                             '"kv_available_gib": 6.2}}}')):
        (tmp_path / "docs/gpu" / name).mkdir(parents=True)
        (tmp_path / "docs/gpu" / name / "report.json").write_text(text)
    assert calibrations(tmp_path) == {}


def test_a_run_with_a_knob_that_changes_the_kernels_calibrates_nothing(tmp_path):
    """A batch run with INT8_ACT=emulated (a measurement aid) is newer than the shipped one's, but measured another
    configuration: the shipped run's overhead stands. GPU_UTIL moves only what vLLM is given, so it calibrates."""
    for name, knobs, available in (("20261207-1", {"GPU_UTIL": "0.95"}, 6.66), ("20261207-2", {"INT8_ACT": "emulated"},
                                                                             5.0)):
        (tmp_path / "docs/gpu" / name).mkdir(parents=True)
        (tmp_path / "docs/gpu" / name / "report.json").write_text(json.dumps({
            "card": {"card": "rtx3090"}, "profile": "batch", "host": "native", "knobs": knobs,
            "boot": {"budget": {"requested_gib": 22.38, "kv_available_gib": available}}}))
    found = calibrations(tmp_path)[("batch", "native")]
    assert (found.report, found.overhead_gib) == ("20261207-1", 15.72)
