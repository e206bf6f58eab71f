"""Inside the cpu image: the image's own stand-in writer (/opt/servekit/standin.py) held to the served checkpoint's
layout rules (../shared/served-model.md), at full size by its shapes alone and at the small scale by the files it
writes, read back through safetensors and vLLM's own weight iterator and compressed-tensors config; and the
emulated-card patch's logic in vLLM (its memory snapshot, platform total and FlashAttention version). Prints one
JSON object of facts for the test to judge:

    python stand_in_layout.py WORK_DIR
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

sys.path.insert(0, "/opt/servekit")
import standin  # noqa: E402

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402


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
            files[name] = {k: {"dtype": str(f.get_slice(k).get_dtype()), "shape": list(f.get_slice(k).get_shape())}
                           for k in f.keys()}
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


def schemes(folder: Path) -> dict:
    """The weight bits vLLM's compressed-tensors config gives the modules the trap concerns."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    quant = CompressedTensorsConfig.from_config(json.loads((folder / "config.json").read_text())["quantization_config"])
    quant.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    modules = {"lm_head": "ParallelLMHead", "model.language_model.layers.0.mlp.gate_up_proj": "MergedColumnParallelLinear",
               "model.language_model.layers.0.linear_attn.in_proj_a": "ColumnParallelLinear",
               "model.language_model.layers.3.self_attn.qkv_proj": "QKVParallelLinear", "mtp.fc": "ColumnParallelLinear",
               "model.visual.blocks.0.attn.qkv": "ColumnParallelLinear"}
    out = {}
    for name, kind in modules.items():
        scheme = quant.get_scheme_dict(type(kind, (torch.nn.Module,), {})(), layer_name=name)
        out[name] = scheme["weights"].num_bits if scheme and scheme.get("weights") is not None else None
    return out


def card_patch() -> dict:
    """The emulated-card patch as vLLM runs it: the memory snapshot and the platform's device total read the card's
    VLLM_DEVICE_TOTAL_MEMORY, and VLLM_FLASH_ATTN_VERSION picks the FlashAttention version, each only when set."""
    import os
    import vllm.envs as envs
    from vllm.utils import mem_utils
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))  # CUDA-only ops
    from vllm.platforms import cuda as cuda_platform
    from vllm.v1.attention.backends import fa_utils
    gib = 2**30
    accel = torch.accelerator
    saved = {n: getattr(accel, n) for n in ("memory_stats", "get_memory_info", "memory_reserved")}
    accel.memory_stats = lambda device=None: {}
    accel.get_memory_info = lambda device=None: (23 * gib + gib // 2, 139 * gib + gib * 4 // 5)  # MPS: free capped
    accel.memory_reserved = lambda device=None: 0
    mem_utils.current_platform.is_integrated_gpu = lambda index=None: False
    torch.cuda.get_device_properties = lambda device=0: types.SimpleNamespace(total_memory=139 * gib)
    sys.modules["vllm.vllm_flash_attn"] = types.ModuleType("vllm.vllm_flash_attn")
    interface = types.ModuleType("vllm.vllm_flash_attn.flash_attn_interface")
    setattr(interface, "is_fa_version_supported", lambda version: True)
    setattr(interface, "fa_version_unsupported_reason", lambda version: None)
    sys.modules["vllm.vllm_flash_attn.flash_attn_interface"] = interface
    fa_utils.current_platform = types.SimpleNamespace(is_xpu=lambda: False, is_rocm=lambda: False,
                                                      get_device_capability=lambda: types.SimpleNamespace(major=9, minor=0))
    out = {}
    for name, env in (("unset", {}), ("card", {"VLLM_DEVICE_TOTAL_MEMORY": str(round(23.56 * gib)),
                                               "VLLM_FLASH_ATTN_VERSION": "2"})):
        for key in ("VLLM_DEVICE_TOTAL_MEMORY", "VLLM_FLASH_ATTN_VERSION"):
            os.environ.pop(key, None)
        os.environ.update(env)
        if hasattr(envs, "disable_envs_cache"):
            envs.disable_envs_cache()
        snap = mem_utils.MemorySnapshot(device=torch.device("cpu"), auto_measure=False)
        snap.measure()
        out[name] = {"total": snap.total_memory, "free": snap.free_memory, "cuda_memory": snap.cuda_memory,
                     "platform_total": cuda_platform.NonNvmlCudaPlatform.get_device_total_memory(),
                     "fa_version": fa_utils.get_flash_attn_version()}
    for n, f in saved.items():
        setattr(accel, n, f)
    return out


def main(work: Path) -> None:
    facts: dict = {"full": full_size()}
    model, drafter = work / "model", work / "drafter"
    subprocess.run([sys.executable, "/opt/servekit/standin.py", "--out", str(model), "--drafter", str(drafter),
                    "--tokenizer", "/tokenizer", "--scale", "small"], check=True, stdout=subprocess.DEVNULL)
    facts["small"] = written(model)
    facts["schemes_published"] = schemes(model)
    with safe_open(str(drafter / "model.safetensors"), framework="pt") as f:
        facts["drafter"] = {"config": json.loads((drafter / "config.json").read_text()),
                            "tensors": {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}}
    again = work / "again"
    subprocess.run([sys.executable, "/opt/servekit/standin.py", "--out", str(again), "--tokenizer", "/tokenizer",
                    "--scale", "small", "--convert"], check=True, stdout=subprocess.PIPE)
    facts["same_seed_same_bytes"] = all((model / n).read_bytes() == (again / n).read_bytes()
                                        for n in ("model-00002-of-00007.safetensors",))
    facts["schemes_converted"] = schemes(again)
    facts["card_patch"] = card_patch()
    print(json.dumps(facts))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
