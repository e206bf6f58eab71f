"""Inside the image: the served checkpoint's exact architecture and file layout with random weights (seeded), and a
DFlash2 drafter of the served size, for sizing the profiles where the hub cannot be reached.

    python -m servekit.image.standin --out DIR --tokenizer DIR [--seed N] [--scale full|small] [--drafter DIR]

The layout is dbirks/Qwen3.8-27B-W4A16-AutoRound's as ../shared/served-model.md gathers it: Qwen3_5ForConditional-
Generation, W4A16 compressed-tensors pack-quantized linears (int32 weight_packed, fp16 weight_scale per 128 inputs,
int64 weight_shape; symmetric, no zero point), BF16 where the checkpoint keeps BF16 (embeddings, lm_head, the vision
tower, the MTP head, the GDN in_proj_a/b, convolutions, norms), 7 shards with lm_head in the last, the MTP head in
model_extra_tensors.safetensors, the index, and the ignore list as published (the MTP linears missing from it). The
tokenizer is the stand-in's real BPE (the one `--tokenizer` names) with its vocabulary filled to the model's 248,320
ids, so that any id the random weights pick decodes. `--scale small` writes the same layout at a few MB (the tests').
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import convert, hub
from .boundary import write_text_atomic

SHARDS = 7
EXTRA = "model_extra_tensors.safetensors"
GROUP = convert.GROUP  # compressed-tensors' group of the published int4 linears, as of prepare's int8 ones
Array = Any  # a numpy array; numpy is imported where it is used (the image's code loads with the standard library)
LM = "model.language_model"
FULL: dict = dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                  num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320,
                  full_attention_interval=4)
VISION_FULL: dict = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=5120,
                         num_position_embeddings=2304, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                         in_channels=3)
# The same layout at a few MB: every rule of the full one (group 128, the 3:1 layer pattern, the shards) holds.
SMALL: dict = dict(FULL, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=8192)
VISION_SMALL: dict = dict(VISION_FULL, depth=2, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=256,
                          num_position_embeddings=64)
# The DFlash2 drafter: hidden states of five target layers into Qwen3 layers with grouped convolutions (vLLM's
# qwen3_dflash2). Its published W4A16 requant is about 1.2 GB and the BF16 original 3.85 GB; five layers of the
# target's width land there ([I]: the layer count and taps are not published; chosen to match the sizes).
# Its layers are sliding-window attention, window 2048, as served (the source's KV arithmetic confirms both on the
# published pools, served-model.md 3.8); causality is left to vLLM's rule for such layers ([I]: not published).
DRAFTER_FULL: dict = dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=5, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, target_layer_ids=[1, 16, 31, 46, 61],
                          sliding_window=2048)
DRAFTER_SMALL: dict = dict(DRAFTER_FULL, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, target_layer_ids=[1, 3])


def _int4_code_table() -> bytes:
    """256 entries, one per random byte: the int4 code (the value plus 8) of a weight of a group of normal weights
    under AutoRound's symmetric rounding, each code as many entries as its share of 256. AutoRound divides a group by
    its largest magnitude over 8, the sign of that weight folded into the scale, so the largest weight is -8 (placed
    apart, in Weights.int4) and the rest crowd the centre: 128 normal weights span about 2.7 standard deviations to
    their largest, so one code is 2.7 / 8 of a deviation wide ([I]: AutoRound's tuning of each group's range and
    rounding moves these shares a little; the checkpoint's are not published)."""
    import math
    deviation = 8 / 2.7  # in codes

    def below(x: float) -> float:
        return 0.5 * (1 + math.erf(x / (deviation * math.sqrt(2))))

    shares = [0.0] + [below(v + 0.5) - below(v - 0.5) for v in range(-7, 8)]  # -8 is the largest's alone
    shares[1], shares[-1] = below(-6.5), below(-6.5)  # the tails, clamped to +-7 (within the largest's magnitude)
    counts = [round(256 * share) for share in shares]
    counts[8] += 256 - sum(counts)  # the centre (value 0) takes what rounding the shares left
    return bytes(code for code, count in enumerate(counts) for _ in range(count))


@functools.cache  # made once, at the first int4 linear
def _int4_pair_table() -> Array:
    """65,536 entries, one per random 16-bit number: a byte of two codes drawn from _int4_code_table, the low byte's
    in the low four bits (the order compressed-tensors packs in). One lookup a byte: a flat lookup into 64 KiB is
    what keeps the full size's 25 billion codes to seconds."""
    import numpy as np
    table = np.frombuffer(_int4_code_table(), dtype=np.uint8)
    pairs = np.arange(1 << 16)
    return (table[pairs & 0xFF] | (table[pairs >> 8] << 4)).astype(np.uint8)


class Weights:
    """Seeded random tensors as numpy arrays: BF16 as uint16 bit patterns of magnitude 2^-7..2^-5 with a random sign
    (random bits, no float pass: gigabytes in seconds), int4 codes as AutoRound's rounding shapes them (a table
    lookup per two random bytes), fp16 scales near 1e-3."""

    def __init__(self, seed: int, part: int) -> None:
        import numpy as np
        self.rng = np.random.default_rng([seed, part])

    def bf16(self, *shape: int) -> Array:
        import numpy as np
        bits = self.rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
        return (bits & 0x807F) | (((bits >> 7) & 1) + 120).astype(np.uint16) << 7

    @staticmethod
    def ones(n: int) -> Array:
        import numpy as np
        return np.full(n, 0x3F80, dtype=np.uint16)  # 1.0 in BF16

    @staticmethod
    def zeros(n: int) -> Array:
        import numpy as np
        return np.zeros(n, dtype=np.uint16)

    def int4(self, name: str, rows: int, columns: int) -> dict[str, Array]:
        """A W4A16 linear as compressed-tensors packs it: eight int4 per int32 along the input, a scale per 128 of
        either sign, half negative, as AutoRound's are (it folds the sign of a group's largest weight into its scale;
        a path that assumes positive scales, such as a W4A8 requant, must meet them). The codes are AutoRound's
        shape: bell-shaped about the centre, and each group's largest weight at -8, one a group at a random place
        (under a negative scale that is the group's largest positive weight, which a sign fold must give back)."""
        import numpy as np
        two_codes = _int4_pair_table()[np.frombuffer(self.rng.bytes(rows * columns), dtype=np.uint16)]
        two_codes = two_codes.reshape(rows, columns // 2)
        groups = columns // GROUP
        largest = self.rng.integers(0, GROUP, size=(rows, groups)) + np.arange(groups) * GROUP
        # -8 (code 0) for the group's largest magnitude: its byte keeps the other code's four bits
        two_codes[np.arange(rows)[:, None], largest // 2] &= np.where(largest % 2 == 0, 0xF0, 0x0F).astype(np.uint8)
        packed = two_codes.view(np.int32)  # eight codes to an int32, the first in the lowest bits (int4_codes reads)
        magnitude = self.rng.random((rows, columns // GROUP), dtype=np.float32) * 1e-3 + 5e-4
        sign = np.where(self.rng.random((rows, columns // GROUP)) < 0.5, -1.0, 1.0).astype(np.float32)
        scale = (magnitude * sign).astype(np.float16)
        return {f"{name}.weight_packed": packed, f"{name}.weight_scale": scale,
                f"{name}.weight_shape": np.array([rows, columns], dtype=np.int64)}


def int4_codes(packed: Array) -> Array:
    """The codes (0..15, the value plus 8) of a packed int4 linear, [rows, columns / 8] int32 as Weights.int4 and
    compressed-tensors write it: [rows, columns]."""
    import numpy as np
    return np.stack([(packed >> (4 * nibble)) & 0xF for nibble in range(8)], axis=-1).reshape(packed.shape[0], -1)


def _layer_types(t: dict) -> list[str]:
    return ["full_attention" if (i + 1) % t["full_attention_interval"] == 0 else "linear_attention"
            for i in range(t["num_hidden_layers"])]


def text_layer(w: Weights, t: dict, i: int, kind: str) -> dict[str, Array]:
    h, inter, p = t["hidden_size"], t["intermediate_size"], f"{LM}.layers.{i}."
    out: dict[str, Array] = {}
    if kind == "linear_attention":
        kd = t["linear_num_key_heads"] * t["linear_key_head_dim"]
        vd = t["linear_num_value_heads"] * t["linear_value_head_dim"]
        heads = t["linear_num_value_heads"]
        a = p + "linear_attn."
        out.update(w.int4(a + "in_proj_qkv", 2 * kd + vd, h))
        out.update(w.int4(a + "in_proj_z", vd, h))
        out[a + "in_proj_b.weight"] = w.bf16(heads, h)
        out[a + "in_proj_a.weight"] = w.bf16(heads, h)
        out[a + "conv1d.weight"] = w.bf16(2 * kd + vd, 1, t["linear_conv_kernel_dim"])
        out[a + "A_log"] = w.zeros(heads)
        out[a + "dt_bias"] = w.zeros(heads)
        out[a + "norm.weight"] = w.ones(t["linear_value_head_dim"])
        out.update(w.int4(a + "out_proj", h, vd))
    else:
        q, kv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
        a = p + "self_attn."
        out.update(w.int4(a + "q_proj", 2 * q * hd, h))  # the query and its output gate (attn_output_gate)
        out.update(w.int4(a + "k_proj", kv * hd, h))
        out.update(w.int4(a + "v_proj", kv * hd, h))
        out.update(w.int4(a + "o_proj", h, q * hd))
        out[a + "q_norm.weight"] = w.ones(hd)
        out[a + "k_norm.weight"] = w.ones(hd)
    out.update(w.int4(p + "mlp.gate_proj", inter, h))
    out.update(w.int4(p + "mlp.up_proj", inter, h))
    out.update(w.int4(p + "mlp.down_proj", h, inter))
    out[p + "input_layernorm.weight"] = w.ones(h)
    out[p + "post_attention_layernorm.weight"] = w.ones(h)
    return out


def vision_tower(w: Weights, v: dict) -> dict[str, Array]:
    h, inter, merged = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
    out: dict[str, Array] = {}
    for i in range(v["depth"]):
        b = f"model.visual.blocks.{i}."
        for norm in ("norm1", "norm2"):
            out[b + f"{norm}.weight"], out[b + f"{norm}.bias"] = w.ones(h), w.zeros(h)
        for name, rows, columns in (("attn.qkv", 3 * h, h), ("attn.proj", h, h), ("mlp.linear_fc1", inter, h),
                                    ("mlp.linear_fc2", h, inter)):
            out[b + f"{name}.weight"], out[b + f"{name}.bias"] = w.bf16(rows, columns), w.zeros(rows)
    out["model.visual.patch_embed.proj.weight"] = w.bf16(h, v["in_channels"], v["temporal_patch_size"],
                                                         v["patch_size"], v["patch_size"])
    out["model.visual.patch_embed.proj.bias"] = w.zeros(h)
    out["model.visual.pos_embed.weight"] = w.bf16(v["num_position_embeddings"], h)
    out["model.visual.merger.norm.weight"], out["model.visual.merger.norm.bias"] = w.ones(h), w.zeros(h)
    for name, rows, columns in (("linear_fc1", merged, merged), ("linear_fc2", v["out_hidden_size"], merged)):
        out[f"model.visual.merger.{name}.weight"] = w.bf16(rows, columns)
        out[f"model.visual.merger.{name}.bias"] = w.zeros(rows)
    return out


def mtp_head(w: Weights, t: dict) -> dict[str, Array]:
    """The MTP head in BF16 (15 tensors): it reuses the model's embeddings and lm_head."""
    h, inter, q, kv, hd = (t["hidden_size"], t["intermediate_size"], t["num_attention_heads"],
                           t["num_key_value_heads"], t["head_dim"])
    p = "mtp.layers.0."
    return {"mtp.fc.weight": w.bf16(h, 2 * h), "mtp.norm.weight": w.ones(h),
            "mtp.pre_fc_norm_embedding.weight": w.ones(h), "mtp.pre_fc_norm_hidden.weight": w.ones(h),
            p + "input_layernorm.weight": w.ones(h), p + "post_attention_layernorm.weight": w.ones(h),
            p + "self_attn.q_proj.weight": w.bf16(2 * q * hd, h), p + "self_attn.k_proj.weight": w.bf16(kv * hd, h),
            p + "self_attn.v_proj.weight": w.bf16(kv * hd, h), p + "self_attn.o_proj.weight": w.bf16(h, q * hd),
            p + "self_attn.q_norm.weight": w.ones(hd), p + "self_attn.k_norm.weight": w.ones(hd),
            p + "mlp.gate_proj.weight": w.bf16(inter, h), p + "mlp.up_proj.weight": w.bf16(inter, h),
            p + "mlp.down_proj.weight": w.bf16(h, inter)}


def _bytes(tensors: dict[str, Array]) -> int:
    return sum(a.nbytes for a in tensors.values())


def _save(tensors: dict[str, Array], path: Path) -> None:
    """One safetensors file, BF16 where the array holds BF16 bit patterns (uint16), written under a temporary name
    and renamed: a killed writer leaves no file that looks whole."""
    import warnings

    import numpy as np
    import torch
    from safetensors.torch import save_file
    warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # save_file only reads them
    as_torch = {k: torch.from_numpy(np.ascontiguousarray(a)).view(torch.bfloat16) if a.dtype == np.uint16
                else torch.from_numpy(np.ascontiguousarray(a)) for k, a in tensors.items()}
    part = path.with_name(path.name + ".part")
    save_file(as_torch, str(part), metadata={"format": "pt"})
    os.chmod(part, 0o644)  # the image's user (10001) reads what root wrote
    os.replace(part, path)


def quantization_config(t: dict, v: dict) -> dict:
    ignore = ["lm_head"]
    ignore += [f"{LM}.layers.{i}.linear_attn.in_proj_{ab}" for i, kind in enumerate(_layer_types(t))
               if kind == "linear_attention" for ab in ("a", "b")]
    ignore += [f"model.visual.blocks.{i}.{name}" for i in range(v["depth"])
               for name in ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    ignore += ["model.visual.merger.linear_fc1", "model.visual.merger.linear_fc2"]
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
               "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
               "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": weights,
                                          "input_activations": None, "output_activations": None}},
            "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None, "sparsity_config": {},
            "transform_config": {}, "version": "0.17.0"}


def model_config(t: dict, v: dict) -> dict:
    text = {"model_type": "qwen3_5_text", "dtype": "bfloat16", **t, "attn_output_gate": True,
            "output_gate_type": "swish", "layer_types": _layer_types(t), "mamba_ssm_dtype": "float32",
            "mlp_only_layers": [], "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
            "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
            "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "partial_rotary_factor": 0.25,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
            "tie_word_embeddings": False, "eos_token_id": 248044, "bos_token_id": None, "pad_token_id": None}
    vision = {"model_type": "qwen3_5", **v, "hidden_act": "gelu_pytorch_tanh", "deepstack_visual_indexes": [],
              "initializer_range": 0.02}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
            "vision_end_token_id": 248054, "tie_word_embeddings": False, "language_model_only": False,
            "transformers_version": "5.8.0", "text_config": text, "vision_config": vision,
            "quantization_config": quantization_config(t, v)}


def write_tokenizer(source: Path, out: Path, vocab_size: int) -> None:
    """The stand-in's tokenizer with its BPE vocabulary filled to `vocab_size` ids: the added ids are plain tokens
    that no merge reaches, so encoding is unchanged and every id the model can emit decodes."""
    doc = json.loads((source / "tokenizer.json").read_text())
    vocab: dict[str, int] = doc["model"]["vocab"]
    taken = set(vocab) | {a["content"] for a in doc.get("added_tokens", [])}
    used = set(vocab.values()) | {a["id"] for a in doc.get("added_tokens", [])}
    n = 0
    for token_id in range(vocab_size):
        if token_id in used:
            continue
        while (name := f"Ġrnd{n:x}") in taken:
            n += 1
        vocab[name], n = token_id, n + 1
    (out / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            (out / name).write_text((source / name).read_text())


def _zeros(shape: tuple, dtype: Any) -> Array:
    """An array of `shape` that takes no memory: what a tensor's size is, without generating it."""
    import numpy as np
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=shape, strides=(0,) * len(shape))


class Shapes(Weights):
    """Weights' shapes and dtypes without their bytes: the shards' sizes, known before anything is generated."""

    def __init__(self) -> None:
        pass

    def bf16(self, *shape: int) -> Array:
        import numpy as np
        return _zeros(shape, np.uint16)

    def int4(self, name: str, rows: int, columns: int) -> dict[str, Array]:
        import numpy as np
        return {f"{name}.weight_packed": _zeros((rows, columns // 8), np.int32),
                f"{name}.weight_scale": _zeros((rows, columns // GROUP), np.float16),
                f"{name}.weight_shape": _zeros((2,), np.int64)}


def write_model(out: Path, tokenizer: Path, seed: int, t: dict, v: dict, say: Callable[[str], None] = print) -> dict:
    """The checkpoint into `out`, one part at a time (a layer, the vision tower), into 7 shards of about equal size
    with lm_head alone in the last, as published; what was written (tensors, bytes, seconds)."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    def layer(i: int, kind: str) -> Callable[[Weights], dict[str, Array]]:
        return lambda w: text_layer(w, t, i, kind)
    parts: list[Callable[[Weights], dict[str, Array]]] = [
        lambda w: {f"{LM}.embed_tokens.weight": w.bf16(t["vocab_size"], t["hidden_size"])},
        *(layer(i, kind) for i, kind in enumerate(_layer_types(t))),
        lambda w: {f"{LM}.norm.weight": w.ones(t["hidden_size"])}, lambda w: vision_tower(w, v)]
    per_shard = sum(_bytes(make(Shapes())) for make in parts) / (SHARDS - 1)
    weight_map: dict[str, str] = {}
    written = [0]

    def save(tensors: dict[str, Array], name: str) -> None:
        _save(tensors, out / name)
        weight_map.update({k: name for k in tensors})
        written[0] += _bytes(tensors)
        say(f"standin: {name}: {len(tensors)} tensors, {_bytes(tensors) / 1e9:.2f} GB")

    shard: dict[str, Array] = {}
    shard_no, before = 1, 0  # the shard being filled; the bytes of the shards already written
    for n, make in enumerate(parts):
        shard.update(make(Weights(seed, n + 1)))
        left_parts, left_shards = len(parts) - n - 1, SHARDS - 1 - shard_no
        full = before + _bytes(shard) >= per_shard * shard_no
        if n == len(parts) - 1 or (left_shards > 0 and (full or left_parts == left_shards)):
            before += _bytes(shard)
            save(shard, f"model-{shard_no:05d}-of-{SHARDS:05d}.safetensors")
            shard, shard_no = {}, shard_no + 1
    if shard_no != SHARDS:
        raise SystemExit(f"standin: the layout filled {shard_no - 1} shards before lm_head, not {SHARDS - 1}")
    save({"lm_head.weight": Weights(seed, 0).bf16(t["vocab_size"], t["hidden_size"])},
         f"model-{SHARDS:05d}-of-{SHARDS:05d}.safetensors")
    save(mtp_head(Weights(seed, len(parts) + 1), t), EXTRA)
    index = {"metadata": {"total_size": written[0]}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / hub.INDEX, index)
    _write_json(out / "config.json", model_config(t, v))
    _write_json(out / "generation_config.json", {"bos_token_id": None, "eos_token_id": [248046, 248044],
                                                 "pad_token_id": 248044, "do_sample": True, "temperature": 1.0,
                                                 "top_p": 0.95, "top_k": 20, "transformers_version": "5.8.0"})
    # Qwen3-VL's image processor settings (patch 16, merge 2, mean and std 0.5): [I], not published for Qwen3.8
    _write_json(out / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": v["patch_size"],
        "temporal_patch_size": v["temporal_patch_size"], "merge_size": v["spatial_merge_size"],
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]})
    write_tokenizer(tokenizer, out, t["vocab_size"])
    for path in out.iterdir():
        os.chmod(path, 0o644)
    return {"folder": str(out), "tensors": len(weight_map), "bytes": written[0],
            "seconds": round(time.monotonic() - started, 1)}


def write_drafter(out: Path, seed: int, t: dict, d: dict, say: Callable[[str], None] = print) -> dict:
    """A DFlash2 drafter for the model of text config `t`, of the served size: the linears of its layers W4A16 (as
    the published requant; AutoRound quantizes every linear of a block, the convolutions' kernel projections too),
    the rest BF16; it shares the target's embeddings and lm_head (vLLM's drafters do). The window is in
    `dflash_config.swa_window_size`: a Qwen3 config drops its top-level `sliding_window` unless `use_sliding_window`."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    w = Weights(seed, 20_000)
    h, hd, inter, heads, kv = (d["hidden_size"], d["head_dim"], d["intermediate_size"], d["num_attention_heads"],
                               d["num_key_value_heads"])
    taps, groups, rank = 4, h // 64, 16
    tensors = {"fc.weight": w.bf16(h, len(d["target_layer_ids"]) * t["hidden_size"]),
               "hidden_norm.weight": w.ones(h), "norm.weight": w.ones(h),
               "candidate_selector.predecessor_codebook": w.bf16(t["vocab_size"], rank),
               "candidate_selector.successor_codebook": w.bf16(t["vocab_size"], rank),
               "candidate_selector.hidden_projection.weight": w.bf16(rank, h)}
    for i in range(d["num_hidden_layers"]):
        p = f"layers.{i}."
        for name, rows, columns in (("self_attn.q_proj", heads * hd, h), ("self_attn.k_proj", kv * hd, h),
                                    ("self_attn.v_proj", kv * hd, h), ("self_attn.o_proj", h, heads * hd),
                                    ("mlp.gate_proj", inter, h), ("mlp.up_proj", inter, h),
                                    ("mlp.down_proj", h, inter)):
            tensors.update(w.int4(p + name, rows, columns))
        tensors.update({p + "self_attn.q_norm.weight": w.ones(hd), p + "self_attn.k_norm.weight": w.ones(hd),
                        p + "input_layernorm.weight": w.ones(h), p + "post_attention_layernorm.weight": w.ones(h)})
        for conv in ("attention_conv", "mlp_conv"):
            tensors[p + f"{conv}.base_kernel"] = w.bf16(2, taps, h)
            tensors.update(w.int4(p + f"{conv}.kernel_projection", 2 * taps * groups, h))
    _save(tensors, out / "model.safetensors")
    quant = quantization_config(dict(t, num_hidden_layers=0), dict(VISION_SMALL, depth=0))
    # vLLM matches the ignore list against its own module names, and builds the drafter under `model.` (its layers
    # numbered after the target's): a checkpoint's `fc` would leave vLLM expecting fc packed ([I]: the published list
    # is not known; this one is what loads).
    quant["ignore"] = ["model.fc", "model.candidate_selector.hidden_projection"]
    config = {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3",
              **{k: d[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim")},
              "layer_types": ["sliding_attention"] * d["num_hidden_layers"], "sliding_window": d["sliding_window"],
              "vocab_size": t["vocab_size"], "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
              "hidden_act": "silu", "attention_bias": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0}, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "target_hidden_size": t["hidden_size"], "quantization_config": quant,
              "dflash_config": {"target_layer_ids": d["target_layer_ids"], "swa_window_size": d["sliding_window"],
                                "conv_kernel_size": taps,
                                "conv_group_size": 64, "selector_rank": rank, "selector_top_k": 8,
                                "use_aux_hidden_state": True, "mask_token_id": 248044}}
    _write_json(out / "config.json", config)
    for path in out.iterdir():
        os.chmod(path, 0o644)
    say(f"standin: drafter: {len(tensors)} tensors, {_bytes(tensors) / 1e9:.2f} GB")
    return {"folder": str(out), "tensors": len(tensors), "bytes": _bytes(tensors),
            "seconds": round(time.monotonic() - started, 1)}


def converted(folder: Path) -> dict:
    """prepare's conversions (int8 lm_head, embeddings and MTP; the BF16 MTP ignored) on the written checkpoint, as
    prepare runs them on a download: the seconds they take and the bytes of weights they free."""
    def weights() -> int:  # the shards the index names, as they are on disk (backups beside them not counted)
        return sum((folder / name).stat().st_size for name in hub.indexed_shards(folder / hub.INDEX))
    before, started = weights(), time.monotonic()
    convert.convert(folder, dict(os.environ))
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o644)
    after = weights()
    return {"seconds": round(time.monotonic() - started, 1), "bytes_before": before, "bytes_after": after,
            "freed_bytes": before - after}


def _write_json(path: Path, doc: dict) -> None:
    write_text_atomic(path, json.dumps(doc, indent=2) + "\n", mode=0o644)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servekit.image.standin", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the model's folder (made)")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a folder with tokenizer.json")
    parser.add_argument("--drafter", type=Path, help="also write a DFlash2 drafter into this folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", choices=("full", "small"), default="full")
    parser.add_argument("--convert", action="store_true", help="then run prepare's conversions on it (convert.py), "
                        "timed, with the bytes they free")
    args = parser.parse_args(argv)
    full = args.scale == "full"
    t, v, d = (FULL, VISION_FULL, DRAFTER_FULL) if full else (SMALL, VISION_SMALL, DRAFTER_SMALL)
    if not (args.tokenizer / "tokenizer.json").is_file():
        print(f"standin: error: {args.tokenizer}/tokenizer.json is missing", file=sys.stderr)
        return 2
    done = {"model": write_model(args.out, args.tokenizer, args.seed, t, v)}
    if args.drafter:
        done["drafter"] = write_drafter(args.drafter, args.seed, t, d)
    if args.convert:
        done["converted"] = converted(args.out)
    print(json.dumps(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
