"""A small model of the served family for the GPU acceptance: Qwen3.5's hybrid text architecture (Gated
DeltaNet layers with a full-attention layer every fourth, as the 27B has) with an MTP head, random weights.

The checks that need trained weights cannot pass on it; everything else runs for real: SPEC=mtp drafting
from the checkpoint's own head, prefix caching in Mamba align mode, bf16 and fp8 KV, CUDA graphs, the
GDN prefill step. The tokenizer and chat template are the demo model's (docker/demo-model). Deterministic:
the same seed gives the same files.

    python bench/gpu/make_hybrid_model.py OUT_DIR        # in an environment with torch and transformers
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

DEMO = Path(__file__).resolve().parents[2] / "docker" / "demo-model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=256, linear_num_key_heads=4, linear_num_value_heads=8,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
             max_position_embeddings=262144, tie_word_embeddings=False)


def make(out: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    demo = json.loads((DEMO / "config.json").read_text())
    tokens = {k: demo[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    config = Qwen3_5TextConfig(**tokens, layer_types=["linear_attention"] * 3 + ["full_attention"]
                               * 1 + ["linear_attention"] * 3 + ["full_attention"], **SHAPE)
    model = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    weights = load_file(out / "model.safetensors")
    full = next(i for i, kind in enumerate(config.layer_types) if kind == "full_attention")
    prefix = next(k for k in weights if k.endswith(f"layers.{full}.input_layernorm.weight")).split("layers.")[0]
    # The MTP head as Qwen3.5 checkpoints carry it: one full-attention decoder layer fed by fc([embed; hidden]).
    mtp = {f"mtp.layers.0.{k.split(f'layers.{full}.', 1)[1]}": v.clone() for k, v in weights.items()
           if k.startswith(f"{prefix}layers.{full}.")}
    hidden = config.hidden_size
    mtp["mtp.fc.weight"] = (torch.randn(hidden, 2 * hidden) * 0.02).to(torch.bfloat16)
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        mtp[f"mtp.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    save_file({**weights, **mtp}, out / "model.safetensors", metadata={"format": "pt"})
    config_json = json.loads((out / "config.json").read_text())
    config_json.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy2(DEMO / name, out / name)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    made = make(Path(sys.argv[1]))
    size = sum(p.stat().st_size for p in made.iterdir())
    print(f"{made}: {size / 1e6:.0f} MB, {json.loads((made / 'config.json').read_text())['architectures']}")
