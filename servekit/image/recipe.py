"""What `vllm serve` is told, per launcher mode: the source's three launchers (single-user, batch,
alternative.sh) as tables, plus `plain` (no GPU recipe: the cpu target). Standard library only.

Read a mode top to bottom: its defaults, then the row its SPEC and CTX (or KV) pick, then the
rules that depend on the draft count. Every value here is the source's (../shared/source-recipe.md,
sections 2 and 3); where the source is silent the choice is said in docs/profiles.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .errors import UserError

# What every target's server runs with: no usage statistics leave the machine (the source's image sets both).
PRIVACY_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
# The variables this recipe sets that vLLM (or FlashInfer) reads as booleans, on only when `1`: each is written as 1
# or 0 from a knob already normalized (knobs.py), never from the user's spelling.
BOOLEAN_ENV = frozenset({"FLASHINFER_DISABLE_VERSION_CHECK", "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_SPEC_DECODE_ATTN",
                         "VLLM_DFLASH2_LOOKUP", "VLLM_DFLASH2_LOOKUP_ADAPTIVE", "VLLM_WSL2_ENABLE_PIN_MEMORY",
                         "VLLM_INT4_MQ_3D", *PRIVACY_ENV})
# Mode defaults: each is overridden by a knob of the same name set in images.yaml or the environment.
MODES: dict[str, dict[str, str]] = {
    "single": {"SPEC": "mtp", "CTX": "fast", "GPU_UTIL": "0.93", "DRAFT_SAMPLE": "probabilistic", "TOOLS": "1",
               "SSE_KEEP_ALIVE": "30", "INT8_ACT": "off"},
    "batch": {"SPEC": "off", "KV": "fp8", "MAX_SEQS": "64", "TOOLS": "1", "INT8_ACT": "int8"},
    "alternative": {"SPEC": "dflash2", "GPU_UTIL": "0.95", "MAX_LEN": "256000", "MAX_SEQS": "1",
                    "DRAFT_SAMPLE": "probabilistic", "PREFIX_CACHE": "1", "ENABLE_THINKING": "0", "INT8_ACT": "off"},
    "plain": {"SPEC": "off"},
}

# single-user: (SPEC, CTX) -> attention backend, KV dtype, block size, max length (and with more than 7 drafts),
# max sequences (and with more than 7), draft tokens, --kv-cache-memory bytes, environment, and the CUDA-graph
# capture size where the source fixes it (MTP: 32); elsewhere min(64, sequences x (drafts + 1)).
SINGLE: dict[tuple[str, str], dict[str, Any]] = {
    ("mtp", "fast"): dict(attention="FLASH_ATTN", kv="bfloat16", max_len=65536, seqs=8, drafts=4, cudagraphs=32),
    ("mtp", "long"): dict(kv="fp8", max_len=150000, seqs=8, drafts=3, cudagraphs=32),
    ("mtp", "huge"): dict(kv="kvarn_k4v2_g128", block=128, max_len=200000, seqs=8, drafts=3, cudagraphs=32,
                          env={"KVARN_POOL_MEM_FRAC": "0.15"}, cudagraph_mode="PIECEWISE"),
    ("dflash2", "fast"): dict(attention="FLASH_ATTN", kv="bfloat16", max_len=65536, max_len_many=57344, seqs=8,
                              seqs_many=4, drafts=7, kv_memory=5583457484),
    ("dflash2", "long"): dict(attention="TRITON_ATTN", kv="int8_per_token_head", max_len=131072, seqs=4, drafts=7,
                              kv_memory=5583457484),
    ("dflash2", "huge"): dict(kv="kvarn_k4v2_g128", block=128, max_len=245760, max_len_many=221184, seqs=2, drafts=7,
                              kv_memory=5261334938, env={"VLLM_SPEC_DECODE_ATTN": "0", "KVARN_POOL_MEM_FRAC": "0.15"}),
}
SINGLE.update({("off", ctx): {k: v for k, v in row.items() if k != "drafts"} for (spec, ctx), row in SINGLE.items()
               if spec == "mtp"})

# batch: KV -> KV dtype, attention backend, block size, max length and GPU_UTIL (a host's own defaults per KV come
# from images.yaml, hosts.<h>.batch, over these).
BATCH: dict[str, dict[str, Any]] = {
    "fp8": dict(kv="fp8", max_len=150000, util="0.94"),
    "kvarn": dict(kv="kvarn_k4v2_g128", block=128, max_len=262144, util="0.93", env={"KVARN_POOL_MEM_FRAC": "0.25"}),
    "int4pth": dict(kv="int4_per_token_head", attention="TRITON_ATTN", max_len=262144, util="0.93"),
}

# alternative.sh: int4 per-token-head KV on Triton attention, DFlash2 with k7.
ALTERNATIVE: dict[str, Any] = dict(attention="TRITON_ATTN", kv="int4_per_token_head", drafts=7)

# --prefix-cache-retention-interval for CTX=huge with DFlash2, by draft count; any other speculating profile: None.
RETENTION_HUGE_DFLASH = {7: "13056", 15: "14592"}
# Flags a profile sets that EXTRA_ARGS may shadow; the launcher warns when it does (resolve_config.sh's list).
WATCHED = ("--port", "--host", "--max-model-len", "--max-num-seqs", "--gpu-memory-utilization", "--kv-cache-dtype",
           "--attention-backend", "--served-model-name", "--api-server-count", "--block-size",
           "--mamba-ssm-cache-dtype", "--tool-strict-level")
CUSTOM_OPS = ["+rms_norm", "+silu_and_mul"]
VISION_ARGS = ["--limit-mm-per-prompt", json.dumps({"image": {"count": 1}}),
               "--mm-processor-kwargs", json.dumps({"size": {"shortest_edge": 65536, "longest_edge": 2097152}})]


class RecipeError(UserError):
    """A combination the source's launchers refuse (resolve_config.sh), said in one line."""


def _on(value: str | None) -> bool:
    """A boolean knob, already normalized to 1 or 0 by the launcher (knobs.py)."""
    return value == "1"


def _bit(value: str | None, default: bool) -> str:
    """A boolean knob as the variable vLLM reads: 1 or 0."""
    return "1" if (default if value is None else _on(value)) else "0"


@dataclass(frozen=True)
class Sizing:
    """What a mode's row and the knobs give a profile: its table row, draft tokens, sequences, GPU_UTIL, max length
    and the CUDA-graph capture size."""
    row: dict[str, Any]
    drafts: int
    seqs: int
    util: str
    max_len: str
    cudagraphs: int


def _batch_sizing(k: dict[str, str], spec: str, batch_defaults: dict[str, dict[str, str]] | None) -> Sizing:
    if spec != "off":
        raise RecipeError(f"SPEC={spec}: batch serves without speculation (SPEC=off)")
    row = BATCH[k["KV"]]
    on_host = (batch_defaults or {}).get(k["KV"], {})
    return Sizing(row, 0, int(k["MAX_SEQS"]), k.get("GPU_UTIL") or on_host.get("GPU_UTIL") or row["util"],
                  k.get("MAX_LEN") or on_host.get("MAX_LEN") or str(row["max_len"]), 64)


def _alternative_sizing(k: dict[str, str], spec: str) -> Sizing:
    if spec not in ("dflash2", "off"):
        raise RecipeError(f"SPEC={spec}: alternative.sh speculates with dflash2 or not at all (off)")
    drafts = int(k.get("DRAFT_TOKENS", ALTERNATIVE["drafts"])) if spec != "off" else 0
    seqs = int(k["MAX_SEQS"])
    return Sizing(ALTERNATIVE, drafts, seqs, k["GPU_UTIL"], k["MAX_LEN"], min(64, seqs * 8))


def _single_sizing(k: dict[str, str], spec: str) -> Sizing:
    if k.get("CTX") not in ("fast", "long", "huge"):
        raise RecipeError(f"CTX={k.get('CTX')!r}: the single-user launcher takes fast, long or huge")
    row = SINGLE[(spec, k["CTX"])]
    drafts = int(k.get("DRAFT_TOKENS", row.get("drafts", 0))) if spec != "off" else 0
    many = drafts > 7
    seqs = int(k.get("MAX_SEQS") or row["seqs_many" if many and "seqs_many" in row else "seqs"])
    max_len = k.get("MAX_LEN") or str(row["max_len_many" if many and "max_len_many" in row else "max_len"])
    return Sizing(row, drafts, seqs, k["GPU_UTIL"], max_len, row.get("cudagraphs") or min(64, seqs * (drafts + 1)))


def _speculation(k: dict[str, str], mode: str, spec: str, host: str, drafts: int, model: dict,
                 env: dict[str, str]) -> list[str]:
    """The speculative config's flag, its environment added to `env`."""
    if spec == "off":
        return []
    sample = k["DRAFT_SAMPLE"]
    if spec == "mtp":
        config = {"method": "mtp", "num_speculative_tokens": drafts, "draft_sample_method": sample}
        env.setdefault("VLLM_SPEC_DECODE_ATTN", _bit(k.get("SPEC_ATTN"), True))
    else:
        config = {"method": "dflash", "model": model["drafters"]["dflash"]["path"], "num_speculative_tokens": drafts,
                  "draft_sample_method": sample}
        env["VLLM_DFLASH2_LOOKUP"] = _bit(k.get("LOOKUP"), True)
        if mode == "single":
            env["VLLM_SPEC_DECODE_ATTN_QMAX"] = str(drafts + 1)
        if host == "wsl2":
            env["VLLM_WSL2_ENABLE_PIN_MEMORY"] = "1"  # else "UVA is not available" under WSL2
    return ["--speculative-config", json.dumps(config)]


def _prefix_caching(k: dict[str, str], mode: str, spec: str, drafts: int, env: dict[str, str]) -> list[str]:
    if not _on(k.get("PREFIX_CACHE")):
        return []
    args = ["--enable-prefix-caching", "--mamba-cache-mode", "align"]
    if k.get("CTX") == "huge" and mode == "single":
        args += ["--prefix-match-unit", "128"]
    if spec != "off":
        args += ["--prefix-cache-retention-interval", _retention(k, mode, spec, drafts)]
    if mode == "single" and k.get("CTX") == "huge" and drafts > 7 and spec == "dflash2":
        env["VLLM_DFLASH2_LOOKUP_ADAPTIVE"] = "0"
    return args


def command(k: dict[str, str], host: str, model: dict, batch_defaults: dict[str, dict[str, str]] | None = None
            ) -> tuple[list[str], dict[str, str]]:
    """(flags after --model/--host/--port, environment) for knobs `k` (mode defaults under them) on `host`, whose
    batch defaults per KV (images.yaml's hosts.<h>.batch) are `batch_defaults`."""
    mode = k.get("MODE", "plain")
    k = {**MODES[mode], **k}
    if mode == "plain":
        if k.get("SPEC", "off") != "off":  # it would be taken and nothing passed: a speculator the user never gets
            raise RecipeError(f"SPEC={k['SPEC']}: MODE=plain serves without speculation; set SPEC=off, or a MODE "
                              "whose recipe drafts (single, alternative)")
        return _plain(k), {}
    spec = k["SPEC"]
    if spec == "dflash2" and not model.get("drafters", {}).get("dflash"):
        raise RecipeError("SPEC=dflash2 needs the DFlash2 drafter, and the model names none (images.yaml "
                          "models.<name>.drafters.dflash)")
    size = (_batch_sizing(k, spec, batch_defaults) if mode == "batch" else
            _alternative_sizing(k, spec) if mode == "alternative" else _single_sizing(k, spec))
    if k.get("DTYPE") == "float16" and spec != "off":
        raise RecipeError("DTYPE=float16 with a speculator: the source's launcher refuses it")
    row, drafts = size.row, size.drafts
    # Expandable segments: off beside a CPU KV tier, which vLLM 0.31 refuses with them (the allocator may remap the
    # KV cache's addresses under the copy engine); a host that needs them off (WSL2) says so in images.yaml's env.
    expandable = "KV_OFFLOAD_GB" not in k
    env = {"FLASHINFER_DISABLE_VERSION_CHECK": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:{expandable}", **row.get("env", {})}
    async_default = not (drafts > 7 and _on(k.get("LOOKUP", "1")) and spec == "dflash2")
    args = ["--gpu-memory-utilization", size.util, "--max-model-len", size.max_len, "--max-num-seqs", str(size.seqs),
            "--api-server-count", k.get("API_SERVERS", "1")]
    args += VISION_ARGS if _on(k.get("VISION")) else ["--language-model-only"]
    args += ["--attention-backend", row["attention"]] if row.get("attention") else []
    args += ["--kv-cache-dtype", row["kv"]] + (["--block-size", str(row["block"])] if row.get("block") else [])
    if mode == "single" and row.get("kv_memory") and k.get("KV_MEM") != "0":
        # The source writes --kv-cache-memory=, a prefix argparse expands; the full name survives a new flag
        # that shares the prefix.
        args.append(f"--kv-cache-memory-bytes={k.get('KV_MEM') or row['kv_memory']}")
    args += ["--mamba-ssm-cache-dtype", "float16"]
    args.append("--async-scheduling" if _on(k.get("ASYNC_SCHED", "1" if async_default else "0"))
                else "--no-async-scheduling")
    args += ["--max-num-batched-tokens", "2048"]
    args += _speculation(k, mode, spec, host, drafts, model, env)
    compilation: dict = {"max_cudagraph_capture_size": size.cudagraphs, "custom_ops": CUSTOM_OPS}
    mode_of_graphs = k.get("CUDAGRAPH_MODE") or (row.get("cudagraph_mode") if spec != "dflash2" else None)
    if mode_of_graphs:
        compilation["cudagraph_mode"] = mode_of_graphs
    args += ["--compilation-config", json.dumps(compilation), "--reasoning-parser", "qwen3",
             "--enable-prompt-tokens-details"]
    if mode == "alternative" or _on(k.get("TOOLS")):  # alternative.sh passes its tool flags whatever TOOLS says
        args += _tool_flags(k)
    if mode == "single" and k.get("SSE_KEEP_ALIVE", "0") != "0":
        args += ["--sse-keep-alive-interval", k["SSE_KEEP_ALIVE"]]
    if "ENABLE_THINKING" in k:
        args += ["--default-chat-template-kwargs", json.dumps({"enable_thinking": _on(k["ENABLE_THINKING"])})]
    args += _prefix_caching(k, mode, spec, drafts, env)
    if mode == "alternative":
        env["VLLM_INT4_MQ_3D"] = _bit(k.get("INT4_MQ_3D"), True)
    if k.get("INT8_ACT") in ("int8", "emulated"):
        env["VLLM_MARLIN_INPUT_DTYPE"] = "int8"
        env["VLLM_MARLIN_INT8_INCLUDE_RE"] = "mlp" if mode == "batch" else "mlp|linear_attn|self_attn"
    if k.get("INT8_ACT") == "emulated":
        env["VLLM_MARLIN_INT8_EMULATE"] = "1"
    if _on(k.get("VISION")):
        env["VLLM_VISION_CPU_OFFLOAD_GB"] = "1"
    return args, env


# The knobs that add, drop or change a flag or a variable beyond what a mode's rows choose (every_flag and
# every_variable run each on every row).
FLAG_VARIANTS: list[dict[str, str]] = [
    {}, {"VISION": "1"}, {"PREFIX_CACHE": "1"}, {"PREFIX_CACHE": "0"}, {"ASYNC_SCHED": "0"}, {"ASYNC_SCHED": "1"},
    {"TOOLS": "0"}, {"ENFORCE_EAGER": "1"}, {"DTYPE": "auto"}, {"ENABLE_THINKING": "1"}, {"CUDAGRAPH_MODE": "FULL"},
    {"MAX_LEN": "1024", "MAX_SEQS": "1", "GPU_UTIL": "0.5", "API_SERVERS": "1"}, {"KV_OFFLOAD_GB": "1"},
    {"SSE_KEEP_ALIVE": "0"}, {"KV_MEM": "0"}, {"DRAFT_TOKENS": "15"}, {"INT8_ACT": "int8"}, {"INT8_ACT": "emulated"},
    {"DRAFT_TOKENS": "15", "PREFIX_CACHE": "1"}]


def _every_command() -> Iterator[tuple[list[str], dict]]:
    """(argv, environment) of `command` over each mode's rows (SPEC, CTX, KV) with each knob of FLAG_VARIANTS on both
    hosts."""
    model = {"drafters": {"dflash": {"path": "/drafter"}}}
    for mode in MODES:
        for spec in ("off", "mtp", "dflash2"):
            for ctx in ("fast", "long", "huge"):
                for kv in BATCH:
                    for variant in FLAG_VARIANTS:
                        for host in ("native", "wsl2"):
                            try:
                                yield command({"MODE": mode, "SPEC": spec, "CTX": ctx, "KV": kv, **variant}, host,
                                              model)
                            except RecipeError:
                                continue


def every_flag() -> list[str]:
    """Every flag `command` can emit: the image's verify asks the pinned `vllm serve` for each."""
    return sorted({a.split("=", 1)[0] for args, _ in _every_command() for a in args if a.startswith("--")})


def every_variable() -> list[str]:
    """Every environment variable `command` can set, and the privacy pair every target's server runs with: the
    image's build records which of them its packages read."""
    return sorted({name for _, env in _every_command() for name in env} | set(PRIVACY_ENV))


def _tool_flags(k: dict[str, str]) -> list[str]:
    """The three tool flags, which TOOLS=0 drops together (the source's launchers)."""
    return ["--enable-auto-tool-choice", "--tool-call-parser", k.get("TOOL_PARSER", "qwen3_coder"),
            "--tool-strict-level", k.get("TOOL_STRICT", "parameter")]


def _retention(k: dict[str, str], mode: str, spec: str, drafts: int) -> str:
    if k.get("PREFIX_RETENTION"):
        return k["PREFIX_RETENTION"]
    if mode == "alternative":
        return "None" if k.get("KV_OFFLOAD_GB") else "0"
    if spec == "dflash2" and k.get("CTX") == "huge":
        return RETENTION_HUGE_DFLASH.get(drafts, "None")
    return "None"


def _plain(k: dict[str, str]) -> list[str]:
    """No GPU recipe: only what the knobs ask (the cpu target)."""
    args = ["--enable-prompt-tokens-details"]
    for knob, flag in (("MAX_LEN", "--max-model-len"), ("MAX_SEQS", "--max-num-seqs"),
                       ("GPU_UTIL", "--gpu-memory-utilization"), ("API_SERVERS", "--api-server-count"),
                       ("DTYPE", "--dtype")):
        if knob in k:
            args += [flag, k[knob]]
    if "PREFIX_CACHE" in k:
        args.append("--enable-prefix-caching" if _on(k["PREFIX_CACHE"]) else "--no-enable-prefix-caching")
    if _on(k.get("TOOLS", "1")):
        args += _tool_flags(k)
    if "ENABLE_THINKING" in k:
        args += ["--default-chat-template-kwargs", json.dumps({"enable_thinking": _on(k["ENABLE_THINKING"])})]
    if _on(k.get("ASYNC_SCHED", "0")):
        args.append("--async-scheduling")
    if _on(k.get("ENFORCE_EAGER", "0")):
        args.append("--enforce-eager")
    return args
