"""The full-size stand-in of the served checkpoint (`python3 build.py stand-in`, servekit/image/standin.py) held to the
published layout (../shared/served-model.md) in the cpu image, which carries the same writer: the full size by its
shapes, the small scale by its files read back through safetensors and vLLM's own weight iterator and
compressed-tensors config."""

from __future__ import annotations

import json

import pytest
from support import ROOT, docker

pytestmark = [pytest.mark.engine, pytest.mark.network, pytest.mark.slow]

@pytest.fixture(scope="module")
def facts(cpu_image):
    script = ROOT / "tests" / "standins" / "stand_in_layout.py"
    tokenizer = ROOT / "bench" / "gpu" / "qwen35-mini"
    done = docker("run", "--rm", "-v", f"{script}:/opt/stand_in_layout.py:ro", "-v", f"{tokenizer}:/tokenizer:ro",
                  "--entrypoint", "/opt/venv/bin/python", cpu_image, "/opt/stand_in_layout.py", "/tmp/work",
                  timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_full_size_layout_is_the_published_one_to_the_tensor(facts):
    full = facts["full"]
    # 1,999 tensors of which 400 int4 linears; 333 of the vision tower, 15 of the MTP head (served-model.md §1.2, §2.2)
    assert (full["tensors"], full["packed"], full["vision"], full["mtp"]) == (1999, 400, 333, 15)
    assert 19.40e9 < full["bytes"] < 19.50e9  # the published 19.47 GB less the tokenizer's 0.02
    assert 0.84e9 < full["mtp_bytes"] < 0.86e9  # "~850 MB" of BF16 MTP
    types = full["layer_types"]
    assert len(types) == 64 and [i for i, t in enumerate(types) if t == "full_attention"] == list(range(3, 64, 4))
    assert full["ignore"] == 1 + 2 * 48 + 4 * 27 + 2  # lm_head, GDN in_proj_a/b, the vision linears, the merger


def test_the_files_are_seven_shards_lm_head_last_and_the_mtp_head_apart(facts):
    small = facts["small"]
    files = small["files"]
    assert list(files) == [f"model-{i:05d}-of-00007.safetensors" for i in range(1, 8)] + ["model_extra_tensors.safetensors"]
    assert files["model-00007-of-00007.safetensors"] == ["lm_head.weight"]
    assert files["model_extra_tensors.safetensors"] and all(k.startswith("mtp.") for k in files["model_extra_tensors.safetensors"])
    assert len(files["model_extra_tensors.safetensors"]) == 15
    index = small["index"]
    assert index["weight_map"] == {k: f for f, keys in files.items() for k in keys}
    assert set(small["vllm_read"]) == set(small["tensors"])  # vLLM's own weight iterator reads every tensor


def test_each_tensor_has_the_published_dtype_and_shape(facts):
    tensors = facts["small"]["tensors"]
    packed = [k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")]
    assert packed and not any(k.startswith(("mtp.", "model.visual.", "lm_head")) for k in packed)
    for stem in packed:
        rows, columns = [tensors[f"{stem}.weight_packed"]["shape"][0], tensors[f"{stem}.weight_packed"]["shape"][1] * 8]
        assert tensors[f"{stem}.weight_packed"]["dtype"] == "I32"
        assert tensors[f"{stem}.weight_scale"] == {"dtype": "F16", "shape": [rows, columns // 128]}
        assert tensors[f"{stem}.weight_shape"] == {"dtype": "I64", "shape": [2]}
        assert f"{stem}.weight" not in tensors and f"{stem}.weight_zero_point" not in tensors
    bf16 = [k for k in tensors if k.endswith((".weight", ".bias", "A_log", "dt_bias"))]
    assert all(tensors[k]["dtype"] == "BF16" for k in bf16)
    for name in ("lm_head.weight", "model.language_model.embed_tokens.weight", "mtp.fc.weight",
                 "model.language_model.layers.0.linear_attn.in_proj_a.weight",
                 "model.language_model.layers.0.linear_attn.conv1d.weight", "model.visual.blocks.0.attn.qkv.weight"):
        assert name in bf16, name
    config = facts["small"]["config"]
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert tensors["lm_head.weight"]["shape"] == [config["text_config"]["vocab_size"], config["text_config"]["hidden_size"]]


def test_vllm_reads_the_published_trap_and_the_conversions_mend_it(facts):
    published, converted = facts["schemes_published"], facts["schemes_converted"]
    assert published["mtp.fc"] == 4 and published["lm_head"] is None  # BF16 MTP taken for int4: the source's trap
    assert published["model.language_model.layers.0.mlp.gate_up_proj"] == 4
    assert published["model.language_model.layers.0.linear_attn.in_proj_a"] is None
    assert published["model.visual.blocks.0.attn.qkv"] is None
    assert converted["mtp.fc"] == 8 and converted["lm_head"] == 8
    assert facts["same_seed_same_bytes"]


def test_the_tokenizer_is_real_and_decodes_every_id_the_model_can_emit(facts):
    small = facts["small"]
    assert small["vocab"] == small["config"]["text_config"]["vocab_size"]
    assert small["decoded_last"].strip()
    assert small["encodes"][0] == 1 and small["encodes"][-1] == 2  # <|im_start|> ... <|im_end|>: the BPE unchanged


def test_the_drafter_is_a_w4a16_dflash2_drafter_fed_by_five_target_layers(facts):
    drafter = facts["drafter"]
    config = drafter["config"]
    assert config["architectures"] == ["DFlash2DraftModel"] and config["quantization_config"]["format"] == "pack-quantized"
    assert drafter["tensors"]["layers.0.mlp.gate_proj.weight_packed"] == "I32"
    assert drafter["tensors"]["fc.weight"] == "BF16"
    assert drafter["tensors"]["layers.0.attention_conv.kernel_projection.weight_packed"] == "I32"
    assert "embed_tokens.weight" not in drafter["tensors"]  # shared with the target, as the published requant


def test_vllm_quantizes_the_drafters_modules_as_its_files_hold_them(facts):
    """vLLM builds the drafter under `model.`, its layers numbered after the target's, and matches the ignore list
    against those names: the BF16 fc must be ignored by that name, the packed linears (the convolutions' kernel
    projections among them) not. A full-size boot died on each mismatch in turn (docs/gpu/log.md)."""
    schemes = facts["drafter"]["schemes"]
    assert schemes.pop("model.fc") is None
    assert set(schemes.values()) == {4}, schemes


def test_the_drafters_window_survives_the_config_vllm_reads(facts):
    """vLLM reads the drafter's config as a Qwen3Config, which drops a top-level `sliding_window` unless
    `use_sliding_window` is set; DFlash takes `dflash_config.swa_window_size` first (a full-size boot without it:
    'DFlash sliding attention requires a window size')."""
    assert facts["drafter"]["window_as_read"] == 2048


def test_the_drafter_has_the_served_window_layers_and_the_scales_autorounds_signs(facts):
    """What the memory patches and the W4A8 path depend on: the DFlash2 drafter's layers are sliding-window
    attention of window 2048, as served (vLLM groups their KV apart: kv-group-by-request.patch), and the int4 scales
    are of either sign, about half negative, as AutoRound's."""
    config = facts["drafter"]["config"]
    assert config["layer_types"] == ["sliding_attention"] * config["num_hidden_layers"]
    assert config["sliding_window"] == 2048
    scales = facts["int4_scales"]
    assert scales["layers"] > 0 and 0.45 < scales["negative_share"] < 0.55, scales


def test_the_int4_codes_have_autorounds_shape_each_groups_largest_at_minus_8(facts):
    """What marlin-int8-signed-scales' fold gives back one step off is -8 under a negative scale: AutoRound puts each
    group's largest weight there (it divides by that weight's magnitude over 8 and folds its sign into the scale), so
    every group has one, and the rest crowd the centre. Uniform random codes (the stand-in before) gave -8 to one
    weight in 16, eight times AutoRound's share."""
    codes = facts["int4_codes"]
    assert codes["groups"] > 0 and codes["groups_with_minus_8"] == codes["groups"], codes
    assert codes["centre_share"] > 0.5, codes  # within two codes of the centre; uniform codes: 5 of 16
    assert codes["minus_8_share"] < 1 / 64, codes  # about one a group of 128
