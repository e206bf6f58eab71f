"""Check the series' INT4 per-token-head attention on a GPU, outside the image: non-causal means every key.

The patch `int4-kv-non-causal` passes vLLM's causal flag through its INT4 per-token-head attention kernel (DFlash
drafts attend their block both ways). vLLM needs a whole serving stack to import; the three files of the kernel need
only Triton, so they run here from a patched vllm tree, with vLLM's platform, environment and logger stood in by
what they answer on an NVIDIA GPU.

Over one paged INT4 cache (written by the same module), the check compares:
- non-causal, a block of Q queries per sequence, against causal with each query as a sequence of its own that ends
  at the sequence's last key: both see every key, so the outputs must match;
- non-causal against causal for the same block: the first queries see fewer keys causally, so they must differ;
- each against attention in float32 over the unquantized keys and values (cosine similarity, INT4's error).

    python bench/gpu/int4_non_causal.py VLLM_DIR     # VLLM_DIR: the patched `vllm` package (the image's, or
                                                     # a wheel's with docker/patches applied); exits 1 on a mismatch
"""

from __future__ import annotations

import argparse
import enum
import logging
import shutil
import sys
import tempfile
import types
from pathlib import Path

KERNEL_FILES = ("int4_per_token_head.py", "triton_unified_attention.py", "triton_attention_helpers.py")


def stage(vllm_dir: Path, into: Path) -> None:
    """A `vllm` package of the kernel's three files, and stand-ins for what they import of the rest."""
    ops = into / "vllm" / "v1" / "attention" / "ops"
    ops.mkdir(parents=True)
    for folder in (into / "vllm", into / "vllm" / "v1", ops.parent, ops):
        (folder / "__init__.py").touch()
    for name in KERNEL_FILES:
        shutil.copy(vllm_dir / "v1" / "attention" / "ops" / name, ops / name)
    (into / "vllm" / "triton_utils.py").write_text("import triton\nimport triton.language as tl\n")


def stand_ins() -> None:
    import torch

    class Platform:  # what vllm.platforms.current_platform answers on an NVIDIA GPU, for these files
        fp8_dtype = staticmethod(lambda: torch.float8_e4m3fn)
        is_cuda = staticmethod(lambda: True)
        is_rocm = is_xpu = staticmethod(lambda: False)
        has_device_capability = staticmethod(lambda capability: False)  # no hadacore op: Triton's Hadamard
        is_device_capability_family = staticmethod(lambda family: False)

    modules: dict[str, dict[str, object]] = {
        "vllm.platforms": {"current_platform": Platform()},
        "vllm.envs": {"VLLM_BATCH_INVARIANT": False},
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.v1.kv_cache_interface": {"KVQuantMode": enum.IntEnum(
            "KVQuantMode", {"NONE": 0, "FP8_PER_TENSOR": 1, "INT8_PER_TOKEN_HEAD": 2, "FP8_PER_TOKEN_HEAD": 3,
                            "INT4_PER_TOKEN_HEAD": 4, "NVFP4": 5, "TURBOQUANT_K8V4": 6})},
    }
    for name, attributes in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        sys.modules[name] = module


def reference(q, k, v, context: int, causal: bool):
    """Attention in float32 over unquantized k and v ([keys, heads, dim]) for one sequence's queries."""
    import torch
    heads = q.shape[1]
    k = k.float().repeat_interleave(heads // k.shape[1], dim=1)
    v = v.float().repeat_interleave(heads // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / q.shape[-1] ** 0.5
    if causal:
        keys = torch.arange(k.shape[0], device=q.device)
        queries = context + torch.arange(q.shape[0], device=q.device)
        scores = scores.masked_fill(keys[None, None, :] > queries[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vllm_dir", type=Path)
    args = parser.parse_args()
    staged = Path(tempfile.mkdtemp())
    stage(args.vllm_dir, staged)
    sys.path.insert(0, str(staged))
    stand_ins()
    import torch
    from vllm.v1.attention.ops.int4_per_token_head import reshape_and_cache_int4
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.kv_cache_interface import KVQuantMode

    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    seqs, context, block, heads, kv_heads, dim, block_size = 2, 100, 8, 4, 1, 256, 16  # the stand-in's shapes
    seq_len = context + block
    blocks_per_seq = -(-seq_len // block_size)
    k = torch.randn(seqs, seq_len, kv_heads, dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(seqs, block, heads, dim, device=device, dtype=dtype)
    k_cache = torch.zeros(seqs * blocks_per_seq, block_size, kv_heads, dim // 2, device=device, dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    k_scales = torch.zeros(seqs * blocks_per_seq, block_size, kv_heads, device=device, dtype=torch.float32)
    v_scales = torch.zeros_like(k_scales)
    block_table = torch.arange(seqs * blocks_per_seq, device=device, dtype=torch.int32).view(seqs, blocks_per_seq)
    slots = (block_table[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)[:, :seq_len]
    reshape_and_cache_int4(k.flatten(0, 1), v.flatten(0, 1), k_cache, v_cache, slots.flatten().long(),
                           k_scale_cache=k_scales, v_scale_cache=v_scales)

    def attend(queries, cu_seqlens_q, seq_lens, tables, causal):
        out = torch.empty_like(queries)
        unified_attention(queries, k_cache, v_cache, out, cu_seqlens_q=cu_seqlens_q,
                          max_seqlen_q=int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()), seqused_k=seq_lens,
                          max_seqlen_k=seq_len, softmax_scale=dim**-0.5, causal=causal, window_size=(-1, -1),
                          block_table=tables, softcap=0.0, q_descale=None, k_descale=None, v_descale=None,
                          kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD, k_scale_cache=k_scales,
                          v_scale_cache=v_scales)
        return out

    int32 = dict(device=device, dtype=torch.int32)
    flat = q.flatten(0, 1)
    blocks = attend(flat, torch.arange(seqs + 1, **int32) * block, torch.full((seqs,), seq_len, **int32),
                    block_table, causal=False)
    causal_blocks = attend(flat, torch.arange(seqs + 1, **int32) * block, torch.full((seqs,), seq_len, **int32),
                           block_table, causal=True)
    # every query a sequence of its own, at the sequence's last position: causal, yet it sees every key
    alone = attend(flat, torch.arange(seqs * block + 1, **int32), torch.full((seqs * block,), seq_len, **int32),
                   block_table.repeat_interleave(block, dim=0), causal=True)

    def cosine(a, b):
        return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()

    expected = torch.cat([reference(q[s], k[s], v[s], context, causal=False) for s in range(seqs)])
    expected_causal = torch.cat([reference(q[s], k[s], v[s], context, causal=True) for s in range(seqs)])
    checks = [  # (what, figure, whether it passes)
        ("non-causal against causal with one query a sequence, max abs diff", diff := (blocks - alone).abs().max(),
         diff < 2e-2),
        ("non-causal against causal for the same block, max abs diff", diff := (blocks - causal_blocks).abs().max(),
         diff > 1e-2),
        ("non-causal against float32 attention, cosine", c := cosine(blocks, expected), c > 0.98),
        ("causal against float32 causal attention, cosine", c := cosine(causal_blocks, expected_causal), c > 0.98),
    ]
    for what, figure, ok in checks:
        print(f"{'ok    ' if ok else 'FAILED'} {what}: {float(figure):.6f}")
    failed = [what for what, _, ok in checks if not ok]
    print("int4 non-causal: " + ("ok" if not failed else f"{len(failed)} of {len(checks)} failed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
