"""Inside the cpu image (torch, safetensors, compressed-tensors and vLLM of its lock): a scaled-down checkpoint of
the served layout (../shared/served-model.md: Qwen3_5ForConditionalGeneration, W4A16 pack-quantized linears, BF16
embeddings, lm_head, GDN in_proj_a/b, norms, a vision tower and the MTP head in model_extra_tensors.safetensors,
lm_head in the last shard, the published ignore list without the MTP linears), put through the image's own
conversions (servekit.image.convert) three ways, and the facts of each printed as JSON for the test to judge:

    python served_layout.py WORK_DIR
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONVERT = ["-m", "servekit.image.convert"]  # the image's package, on its PYTHONPATH
# The served text model's shape, scaled down (hidden 5120 -> 256, vocab 248320 -> 8192, 64 layers -> 4)
TEXT: dict[str, Any] = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
            head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=8192, full_attention_interval=4,
            mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, attn_output_gate=True,
            model_type="qwen3_5_text", dtype="bfloat16", rms_norm_eps=1e-6, tie_word_embeddings=False)
VISION: dict[str, Any] = dict(model_type="qwen3_5", depth=1, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3,
              patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64,
              out_hidden_size=256, deepstack_visual_indexes=[])


def _bf16(*shape) -> torch.Tensor:
    return (torch.randn(*shape) * 0.08).to(torch.bfloat16)


def _int4_linear(name: str, rows: int, columns: int) -> dict[str, torch.Tensor]:
    """A W4A16 linear as the checkpoint stores it: int32 packed along the input, fp16 scales per 128, the shape."""
    return {f"{name}.weight_packed": torch.randint(-2**31, 2**31 - 1, (rows, columns // 8), dtype=torch.int32),
            f"{name}.weight_scale": (torch.rand(rows, columns // 128) * 1e-3 + 5e-4).to(torch.float16),
            f"{name}.weight_shape": torch.tensor([rows, columns], dtype=torch.int64)}


def write(folder: Path) -> None:
    torch.manual_seed(0)
    t = TEXT
    h, inter, vocab = t["hidden_size"], t["intermediate_size"], t["vocab_size"]
    kd, vd = t["linear_num_key_heads"] * t["linear_key_head_dim"], t["linear_num_value_heads"] * t["linear_value_head_dim"]
    heads, kv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    types = ["full_attention" if (i + 1) % t["full_attention_interval"] == 0 else "linear_attention"
             for i in range(t["num_hidden_layers"])]
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    ignore = ["lm_head"]
    lm = "model.language_model"
    shards[0][f"{lm}.embed_tokens.weight"] = _bf16(vocab, h)
    for i, kind in enumerate(types):
        shard, p = shards[0 if i < len(types) // 2 else 1], f"{lm}.layers.{i}"
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            shard.update(_int4_linear(f"{a}.in_proj_qkv", 2 * kd + vd, h))
            shard.update(_int4_linear(f"{a}.in_proj_z", vd, h))
            shard.update(_int4_linear(f"{a}.out_proj", h, vd))
            shard.update({f"{a}.in_proj_b.weight": _bf16(t["linear_num_value_heads"], h),
                          f"{a}.in_proj_a.weight": _bf16(t["linear_num_value_heads"], h),
                          f"{a}.conv1d.weight": _bf16(2 * kd + vd, 1, t["linear_conv_kernel_dim"]),
                          f"{a}.A_log": torch.zeros(t["linear_num_value_heads"], dtype=torch.bfloat16),
                          f"{a}.dt_bias": torch.ones(t["linear_num_value_heads"], dtype=torch.bfloat16),
                          f"{a}.norm.weight": torch.ones(t["linear_value_head_dim"], dtype=torch.bfloat16)})
            ignore += [f"{a}.in_proj_a", f"{a}.in_proj_b"]
        else:
            a = f"{p}.self_attn"
            shard.update(_int4_linear(f"{a}.q_proj", 2 * heads * hd, h))
            shard.update(_int4_linear(f"{a}.k_proj", kv * hd, h))
            shard.update(_int4_linear(f"{a}.v_proj", kv * hd, h))
            shard.update(_int4_linear(f"{a}.o_proj", h, heads * hd))
            shard.update({f"{a}.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
                          f"{a}.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16)})
        for proj, rows, columns in (("gate_proj", inter, h), ("up_proj", inter, h), ("down_proj", h, inter)):
            shard.update(_int4_linear(f"{p}.mlp.{proj}", rows, columns))
        shard.update({f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                      f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    v, vh = VISION, VISION["hidden_size"]
    for i in range(v["depth"]):
        b = f"model.visual.blocks.{i}"
        for name, rows, columns in (("attn.qkv", 3 * vh, vh), ("attn.proj", vh, vh),
                                    ("mlp.linear_fc1", v["intermediate_size"], vh),
                                    ("mlp.linear_fc2", vh, v["intermediate_size"])):
            shards[1].update({f"{b}.{name}.weight": _bf16(rows, columns), f"{b}.{name}.bias": _bf16(rows)})
            ignore.append(f"{b}.{name}")
        for norm in ("norm1", "norm2"):
            shards[1].update({f"{b}.{norm}.weight": torch.ones(vh, dtype=torch.bfloat16),
                              f"{b}.{norm}.bias": torch.zeros(vh, dtype=torch.bfloat16)})
    merged = vh * v["spatial_merge_size"] ** 2
    shards[1].update({"model.visual.patch_embed.proj.weight": _bf16(vh, 3, 2, 16, 16),
                      "model.visual.patch_embed.proj.bias": _bf16(vh),
                      "model.visual.pos_embed.weight": _bf16(v["num_position_embeddings"], vh),
                      "model.visual.merger.norm.weight": torch.ones(vh, dtype=torch.bfloat16),
                      "model.visual.merger.norm.bias": torch.zeros(vh, dtype=torch.bfloat16),
                      "model.visual.merger.linear_fc1.weight": _bf16(merged, merged),
                      "model.visual.merger.linear_fc1.bias": _bf16(merged),
                      "model.visual.merger.linear_fc2.weight": _bf16(h, merged),
                      "model.visual.merger.linear_fc2.bias": _bf16(h)})
    ignore += ["model.visual.merger.linear_fc1", "model.visual.merger.linear_fc2"]
    shards[1].update({f"{lm}.norm.weight": torch.ones(h, dtype=torch.bfloat16), "lm_head.weight": _bf16(vocab, h)})
    mtp = {"mtp.fc.weight": _bf16(h, 2 * h), **{f"mtp.{n}.weight": torch.ones(h, dtype=torch.bfloat16)
                                                for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                                          "layers.0.input_layernorm", "layers.0.post_attention_layernorm")},
           "mtp.layers.0.self_attn.q_proj.weight": _bf16(2 * heads * hd, h),
           "mtp.layers.0.self_attn.k_proj.weight": _bf16(kv * hd, h),
           "mtp.layers.0.self_attn.v_proj.weight": _bf16(kv * hd, h),
           "mtp.layers.0.self_attn.o_proj.weight": _bf16(h, heads * hd),
           "mtp.layers.0.self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
           "mtp.layers.0.self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
           "mtp.layers.0.mlp.gate_proj.weight": _bf16(inter, h), "mtp.layers.0.mlp.up_proj.weight": _bf16(inter, h),
           "mtp.layers.0.mlp.down_proj.weight": _bf16(h, inter)}
    folder.mkdir(parents=True)
    weight_map = {}
    files = {f"model-{i + 1:05d}-of-00002.safetensors": s for i, s in enumerate(shards)}
    files["model_extra_tensors.safetensors"] = mtp
    for name, tensors in files.items():
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128, "dynamic": False,
               "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
              "text_config": {**TEXT, "layer_types": types}, "vision_config": VISION,
              "quantization_config": {
                  "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                  "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": weights,
                                                "input_activations": None, "output_activations": None}},
                  "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {}, "version": "0.17.0"}}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def _run(folder: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *CONVERT, str(folder)], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600)


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _tensor(folder: Path, key: str) -> torch.Tensor:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(folder / index[key]), framework="pt") as shard:
        return shard.get_tensor(key)


def _original(folder: Path, key: str) -> torch.Tensor:
    """A tensor as published: from the backup of the shard the published index named."""
    index = json.loads((folder / "model.safetensors.index.json.bak-quant").read_text())["weight_map"]
    with safe_open(str(folder / f"{index[key]}.bak"), framework="pt") as shard:
        return shard.get_tensor(key)


def _dequantized(folder: Path, stem: str) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    shape = torch.Size(_tensor(folder, f"{stem}.weight_shape").tolist())
    q = unpack_from_int32(_tensor(folder, f"{stem}.weight_packed"), 8, shape)
    scale = _tensor(folder, f"{stem}.weight_scale").float()
    return q.float() * scale.repeat_interleave(shape[1] // scale.shape[1], dim=1)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _schemes(folder: Path) -> dict[str, int | None]:
    """The weight bits vLLM's own compressed-tensors config gives each module (None: left unquantized), by its
    module class, as vLLM names the served model's modules."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    quant = CompressedTensorsConfig.from_config(json.loads((folder / "config.json").read_text())["quantization_config"])
    quant.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    modules = {"lm_head": "ParallelLMHead", "model.language_model.embed_tokens": "VocabParallelEmbedding",
               "model.language_model.layers.0.mlp.gate_up_proj": "MergedColumnParallelLinear",
               "model.language_model.layers.0.linear_attn.in_proj_a": "ColumnParallelLinear",
               "mtp.fc": "ColumnParallelLinear", "mtp.layers.0.self_attn.qkv_proj": "QKVParallelLinear",
               "mtp.layers.0.mlp.down_proj": "RowParallelLinear", "model.visual.blocks.0.attn.qkv": "ColumnParallelLinear"}
    out = {}
    for name, kind in modules.items():
        scheme = quant.get_scheme_dict(type(kind, (torch.nn.Module,), {})(), layer_name=name)
        out[name] = scheme["weights"].num_bits if scheme and scheme.get("weights") is not None else None
    return out


# When a kill lands after the step's journal: at once (the shards' links being made), while the shard is read and
# quantized, and (under a loaded machine, or later in the step) while the new shard is written.
KILL_AFTER_S = {"kill": 0.0, "kill-reading": 0.3, "kill-writing": 1.5}
# The worst moment to die: every shard of the step rewritten and the config written, the index (the commit point)
# not yet; the process ends as a SIGKILL ends it, no handler run.
DIE_BEFORE_THE_INDEX = """
import os, sys
from pathlib import Path
from servekit.image import convert
write = convert._write_json
convert._write_json = lambda path, doc: os._exit(137) if path.name == convert.INDEX else write(path, doc)
convert.convert(Path(sys.argv[1]), {})
"""


def _vllm_takes(folder: Path) -> dict:
    """The converted tensors through vLLM's own methods on this CPU: the quantized embedding's parameters loaded by
    their own weight loaders and looked up as its kernel computes (in torch: its kernel is Triton's), and what vLLM
    says of an int8 lm_head here."""
    import socket

    from compressed_tensors.quantization import QuantizationArgs
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_embedding import (
        CompressedTensorsEmbeddingWNA16Int,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 import (
        CompressedTensorsWNA16,
    )
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    vocab, hidden = TEXT["vocab_size"], TEXT["hidden_size"]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        stem = "model.language_model.embed_tokens"
        method = CompressedTensorsEmbeddingWNA16Int(QuantizationArgs(num_bits=8, type="int", symmetric=True,
                                                                     strategy="group", group_size=128))
        layer = torch.nn.Module()
        method.create_weights(layer, hidden, [vocab], hidden, vocab, torch.bfloat16,
                              weight_loader=default_weight_loader)
        for part in ("packed", "scale", "shape"):
            param = getattr(layer, f"weight_{part}")
            param.weight_loader(param, _tensor(folder, f"{stem}.weight_{part}"))
        ids = torch.randint(0, vocab, (256,))
        packed = layer.weight_packed[ids]
        columns = torch.arange(hidden)
        q = ((packed[:, columns // 4] >> ((columns % 4) * 8)) & 0xFF) - 128  # the kernel's own unpacking
        rows = q.float() * layer.weight_scale[ids].float().repeat_interleave(128, dim=1)
        lookup = _relative(rows, _original(folder, f"{stem}.weight").float()[ids])
        built = _as_qwen35_builds_it(folder)
        try:
            CompressedTensorsWNA16(strategy="group", num_bits=8, group_size=128, symmetric=True).create_weights(
                torch.nn.Module(), output_size=vocab, input_size=hidden, output_partition_sizes=[vocab],
                input_size_per_partition=hidden, params_dtype=torch.bfloat16, weight_loader=default_weight_loader)
            lm_head = "created"
        except ValueError as exc:
            lm_head = str(exc)
    return {"embedding_lookup": lookup, "lm_head_on_cpu": lm_head, "qwen35_embeddings": built}


def _as_qwen35_builds_it(folder: Path) -> dict:
    """The embedding each of vLLM's Qwen3.5 modules (the model, the MTP module) builds, with the converted folder's
    quantization config: its quantization method, and whether the checkpoint's int8 triplet loads into it through its
    own weight loaders (qwen35-quantized-embedding.patch; as released, both are built without the config)."""
    from types import SimpleNamespace

    from transformers import AutoConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    # The vision tower's image processor wants torchvision, which the cpu image's lock leaves out; the text model
    # and its embeddings need none of it.
    processor = types.ModuleType("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    setattr(processor, "__getattr__", lambda name: type(name, (), {}))  # noqa: B010 (mypy: a module's method)
    sys.modules.setdefault(processor.__name__, processor)
    from vllm.model_executor.models import qwen3_5, qwen3_5_mtp

    class Built(Exception):
        pass

    def record(*args, **kwargs):
        raise Built(args, kwargs)

    quant = CompressedTensorsConfig.from_config(json.loads((folder / "config.json").read_text())["quantization_config"])
    text = AutoConfig.from_pretrained(folder).get_text_config()
    config = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=text, hf_config=text), quant_config=quant,
                             parallel_config=SimpleNamespace(eplb_config=SimpleNamespace(num_redundant_experts=0)))
    out = {}
    for name, module, cls, prefix in (("model", qwen3_5, qwen3_5.Qwen3_5Model, "language_model.model"),
                                      ("mtp", qwen3_5_mtp, qwen3_5_mtp.Qwen3_5MultiTokenPredictor, "mtp")):
        real, module.VocabParallelEmbedding = module.VocabParallelEmbedding, record
        try:
            cls(vllm_config=config, prefix=prefix)
        except Built as built:
            args, kwargs = built.args
        finally:
            module.VocabParallelEmbedding = real
        embedding = real(*args, **kwargs)
        loaded = {}
        for part in ("packed", "scale", "shape"):
            param = getattr(embedding, f"weight_{part}", None)
            if param is not None:
                given = _tensor(folder, f"model.language_model.embed_tokens.weight_{part}")
                param.weight_loader(param, given)
                loaded[part] = bool(torch.equal(param.data, given.to(param.dtype)))
        out[name] = {"prefix": kwargs.get("prefix"), "method": type(embedding.quant_method).__name__,
                     "loaded": loaded}
    return out


def _interrupted(folder: Path, how: str) -> dict:
    """The conversion killed mid-step (`how`: SIGKILL a given time after its journal is there, or dying right before
    its index is written), what the folder says then, and the plain run after it."""
    if how.startswith("kill"):
        proc = subprocess.Popen([sys.executable, *CONVERT, str(folder)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not (folder / ".servekit-convert.json").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(KILL_AFTER_S[how])
        proc.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=60)
    else:
        rc = subprocess.run([sys.executable, "-c", DIE_BEFORE_THE_INDEX, str(folder)], timeout=600).returncode
    from servekit.image.prepare import folder_problem
    problem = folder_problem(folder)
    again = _run(folder)
    return {"rc": rc, "problem_after_kill": problem, "resumed_rc": again.returncode,
            "resumed_said": again.stderr + again.stdout, "problem_after_resume": folder_problem(folder)}


def _through_prepare(folder: Path) -> dict:
    """The launcher's `prepare` on a fetched folder (its marker written, as a finished download leaves it): the
    conversions follow the download."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    (folder / ".servekit-complete").write_text(json.dumps({"source": "huggingface", "identity": f"org/m@{commit}"}))
    profiles = folder.parent / "profiles.json"
    profiles.write_text(json.dumps({"model": {"source": "huggingface", "repo": "org/m", "revision": commit,
                                              "path": str(folder), "served_name": "m", "drafters": {}},
                                    "profiles": {}, "hosts": {}}))
    done = subprocess.run([sys.executable, "-m", "servekit.image.launcher", "prepare"], capture_output=True, text=True,
                          env={**os.environ, "SERVEKIT_PROFILES": str(profiles), "HF_HUB_OFFLINE": "1"}, timeout=600)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    return {"rc": done.returncode, "said": done.stdout + done.stderr,
            "converted": sorted(k for k in index if k.endswith(".weight_packed")  # the int4 layers' aside
                                and not k.startswith("model.language_model.layers."))}


def main(work: Path) -> None:
    published = work / "published"
    write(published)
    facts: dict = {"published": {"schemes": _schemes(published)}}
    runs = {"all": {}, "lm_head_only": {"QUANT_EMBED": "false", "QUANT_MTP": " Off"}}  # any switch word
    for name, env in runs.items():
        folder = work / name
        shutil.copytree(published, folder)
        done = _run(folder, **env)
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        config = json.loads((folder / "config.json").read_text())["quantization_config"]
        before = _hashes(folder)
        again = _run(folder, **env)
        facts[name] = {"rc": done.returncode, "said": done.stdout + done.stderr, "keys": sorted(index),
                       "groups": config["config_groups"], "ignore": config["ignore"], "schemes": _schemes(folder),
                       "dtypes": {k: str(_tensor(folder, k).dtype) for k in index
                                  if k.startswith(("lm_head.", "mtp.fc.", "model.language_model.embed_tokens."))},
                       "shapes": {k: list(_tensor(folder, k).shape) for k in index if k.startswith("lm_head.")},
                       "again_rc": again.returncode, "again_said": again.stdout + again.stderr,
                       "unchanged_by_again": _hashes(folder) == before}
    all_ = work / "all"
    hidden = torch.randn(64, TEXT["hidden_size"])
    errors = {}
    for stem in ("lm_head", "model.language_model.embed_tokens", "mtp.fc", "mtp.layers.0.mlp.down_proj"):
        original = _original(all_, f"{stem}.weight").float()
        errors[stem] = _relative(_dequantized(all_, stem), original)
    lm_head = _original(all_, "lm_head.weight").float()
    logits, converted = hidden @ lm_head.T, hidden @ _dequantized(all_, "lm_head").T
    facts["numbers"] = {"round_trip": errors, "logits": _relative(converted, logits),
                        "same_top1": float((converted.argmax(-1) == logits.argmax(-1)).float().mean())}
    facts["vllm"] = _vllm_takes(all_)
    shutil.copytree(published, work / "via-prepare")
    facts["through_prepare"] = _through_prepare(work / "via-prepare")
    for how in (*KILL_AFTER_S, "before_the_index"):
        folder = work / f"interrupted-{how}"
        shutil.copytree(published, folder)
        facts[f"interrupted_{how}"] = _interrupted(folder, how)
        mine, theirs = _hashes(folder), _hashes(all_)
        facts[f"interrupted_{how}"]["differing_from_uninterrupted"] = sorted(
            set(mine) ^ set(theirs) | {name for name in mine if name in theirs and mine[name] != theirs[name]})
    print(json.dumps(facts))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
