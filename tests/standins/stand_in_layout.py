"""Inside the cpu image: the image's own stand-in writer (servekit.image.standin) held to the served checkpoint's
layout rules (../shared/served-model.md), at full size by its shapes alone and at the small scale by the files it
writes, read back through safetensors and vLLM's own weight iterator and compressed-tensors config. Prints one
JSON object of facts for the test to judge:

    python stand_in_layout.py WORK_DIR
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from servekit.image import standin


def full_size() -> dict:
    """The full layout's tensors and bytes from shapes alone (no bytes generated)."""
    t, v = standin.FULL, standin.VISION_FULL
    shapes = standin.Shapes()
    tensors = {f"{standin.LM}.embed_tokens.weight": shapes.bf16(t["vocab_size"], t["hidden_size"]),
               f"{standin.LM}.norm.weight": shapes.bf16(t["hidden_size"]),
               "lm_head.weight": shapes.bf16(t["vocab_size"], t["hidden_size"])}
    for i, kind in enumerate(standin._layer_types(t)):
        tensors.update(standin.text_layer(shapes, t, i, kind))
    tensors.update(standin.vision_tower(shapes, v))
    mtp = standin.mtp_head(shapes, t)
    config = standin.model_config(t, v)
    return {"tensors": len(tensors) + len(mtp), "packed": sum(k.endswith(".weight_packed") for k in tensors),
            "vision": sum(k.startswith("model.visual.") for k in tensors), "mtp": len(mtp),
            "bytes": standin._bytes(tensors) + standin._bytes(mtp), "mtp_bytes": standin._bytes(mtp),
            "layer_types": config["text_config"]["layer_types"], "ignore": len(config["quantization_config"]["ignore"])}


def written(folder: Path) -> dict:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files: dict[str, dict] = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / name), framework="pt") as f:
            names = f.keys()  # a safetensors handle: keys() is how it lists
            files[name] = {k: {"dtype": str(f.get_slice(k).get_dtype()), "shape": list(f.get_slice(k).get_shape())}
                           for k in names}
    tensors = {k: v for f in files.values() for k, v in f.items()}
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    read = {name: tuple(t.shape) for name, t in safetensors_weights_iterator(
        [str(folder / n) for n in files], use_tqdm_on_load=False)}
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "config.json").read_text())
    return {"files": {n: sorted(f) for n, f in files.items()}, "tensors": tensors, "index": index,
            "vllm_read": {k: list(v) for k, v in read.items()},
            "bytes_on_disk": sum((folder / n).stat().st_size for n in files),
            "vocab": tokenizer.get_vocab_size(), "decoded_last": tokenizer.decode([config["text_config"]["vocab_size"] - 1]),
            "encodes": tokenizer.encode("<|im_start|>user\nhello<|im_end|>").ids, "config": config}


TARGET_MODULES = {"lm_head": "ParallelLMHead", "model.language_model.layers.0.mlp.gate_up_proj": "MergedColumnParallelLinear",
                  "model.language_model.layers.0.linear_attn.in_proj_a": "ColumnParallelLinear",
                  "model.language_model.layers.3.self_attn.qkv_proj": "QKVParallelLinear",
                  "mtp.fc": "ColumnParallelLinear", "model.visual.blocks.0.attn.qkv": "ColumnParallelLinear"}


def drafter_modules(target_layers: int) -> dict:
    """The drafter's modules by the names vLLM's qwen3_dflash builds them with: under `model.`, its layers numbered
    after the target's."""
    first = f"model.layers.{target_layers}"
    return {"model.fc": "ReplicatedLinear", f"{first}.attention_conv.kernel_projection": "ReplicatedLinear",
            f"{first}.self_attn.qkv_proj": "QKVParallelLinear", f"{first}.mlp.gate_up_proj": "MergedColumnParallelLinear"}


def schemes(folder: Path, modules: dict) -> dict:
    """The weight bits vLLM's compressed-tensors config gives the modules named (their class names as vLLM's)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    quant = CompressedTensorsConfig.from_config(json.loads((folder / "config.json").read_text())["quantization_config"])
    quant.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    out = {}
    for name, kind in modules.items():
        scheme = quant.get_scheme_dict(type(kind, (torch.nn.Module,), {})(), layer_name=name)
        out[name] = scheme["weights"].num_bits if scheme and scheme.get("weights") is not None else None
    return out


def main(work: Path) -> None:
    facts: dict = {"full": full_size()}
    model, drafter = work / "model", work / "drafter"
    subprocess.run([sys.executable, "-m", "servekit.image.standin", "--out", str(model), "--drafter", str(drafter),
                    "--tokenizer", "/tokenizer", "--scale", "small"], check=True, stdout=subprocess.DEVNULL)
    facts["small"] = written(model)
    facts["schemes_published"] = schemes(model, TARGET_MODULES)
    with safe_open(str(drafter / "model.safetensors"), framework="pt") as f:
        names = f.keys()  # a safetensors handle: keys() is how it lists
        facts["drafter"] = {"config": json.loads((drafter / "config.json").read_text()),
                            "tensors": {k: str(f.get_slice(k).get_dtype()) for k in names}}
    target_layers = facts["small"]["config"]["text_config"]["num_hidden_layers"]
    facts["drafter"]["schemes"] = schemes(drafter, drafter_modules(target_layers))
    read = AutoConfig.from_pretrained(drafter)  # as vLLM reads it: model_type qwen3, a Qwen3Config
    facts["drafter"]["window_as_read"] = read.dflash_config.get("swa_window_size", read.sliding_window)
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    scales = [k for k in index if k.endswith(".weight_scale")]
    negative = total = 0
    for key in scales:
        with safe_open(str(model / index[key]), framework="pt") as f:
            tensor = f.get_tensor(key)
        negative, total = negative + int((tensor < 0).sum()), total + tensor.numel()
    facts["int4_scales"] = {"layers": len(scales), "negative_share": negative / total}
    groups = with_minus_8 = centre = minus_8 = codes_seen = 0
    for key in (k for k in index if k.endswith(".weight_packed")):
        with safe_open(str(model / index[key]), framework="numpy") as f:
            codes = standin.int4_codes(f.get_tensor(key))
        per_group = codes.reshape(codes.shape[0], -1, standin.GROUP)
        groups += per_group.shape[0] * per_group.shape[1]
        with_minus_8 += int((per_group == 0).any(axis=-1).sum())
        centre, minus_8 = centre + int((abs(codes - 8) <= 2).sum()), minus_8 + int((codes == 0).sum())
        codes_seen += codes.size
    facts["int4_codes"] = {"groups": groups, "groups_with_minus_8": with_minus_8,
                           "centre_share": centre / codes_seen, "minus_8_share": minus_8 / codes_seen}
    again = work / "again"
    subprocess.run([sys.executable, "-m", "servekit.image.standin", "--out", str(again), "--tokenizer", "/tokenizer",
                    "--scale", "small", "--convert"], check=True, stdout=subprocess.PIPE)
    facts["same_seed_same_bytes"] = all((model / n).read_bytes() == (again / n).read_bytes()
                                        for n in ("model-00002-of-00007.safetensors",))
    facts["schemes_converted"] = schemes(again, TARGET_MODULES)
    print(json.dumps(facts))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
