"""The cuda profiles' argv and environment, flag by flag, as the source's launchers emit them
(../shared/source-recipe.md, sections 2 and 3); docs/profiles.md says where the source was silent."""

from __future__ import annotations

import json
import shlex

import pytest
from support import ROOT

from servekit.config.load import load_matrix
from servekit.config.profiles import render_profiles
from servekit.image.launcher import KnobError, build_command

CUDA = render_profiles(load_matrix(ROOT / "images.yaml"), "cuda")
HEAD = "--model /app/models/qwen38-27b --served-model-name qwen3.8-27b --host 0.0.0.0 --port 8000"
COMMON = "--mamba-ssm-cache-dtype float16"
TAIL = "--reasoning-parser qwen3 --enable-prompt-tokens-details --enable-auto-tool-choice --tool-call-parser " \
       "qwen3_coder --tool-strict-level parameter"
OPS = '"custom_ops": ["+rms_norm", "+silu_and_mul"]'
DRAFTER = "/app/models/qwen38-27b-dflash"
BASE_ENV = {"FLASHINFER_DISABLE_VERSION_CHECK": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1"}


def _mtp(k: int) -> str:
    return shlex.quote(json.dumps({"method": "mtp", "num_speculative_tokens": k, "draft_sample_method": "probabilistic"}))


def _dflash(k: int) -> str:
    return shlex.quote(json.dumps({"method": "dflash", "model": DRAFTER, "num_speculative_tokens": k,
                                   "draft_sample_method": "probabilistic"}))


def _graphs(size: int) -> str:
    return shlex.quote(f'{{"max_cudagraph_capture_size": {size}, {OPS}}}')


SINGLE_FAST_MTP = (f"--gpu-memory-utilization 0.93 --max-model-len 65536 --max-num-seqs 8 --api-server-count 1 "
                   f"--language-model-only --attention-backend FLASH_ATTN --kv-cache-dtype bfloat16 {COMMON} "
                   f"--async-scheduling --max-num-batched-tokens 2048 --speculative-config {_mtp(4)} "
                   f"--compilation-config {_graphs(32)} {TAIL} --sse-keep-alive-interval 30")

# (profile, host) -> (flags after the head, environment beyond the base and PYTORCH_CUDA_ALLOC_CONF)
EXPECTED = {
    ("default", "native"): (SINGLE_FAST_MTP, {"VLLM_SPEC_DECODE_ATTN": "1"}),
    ("mtp", "native"): (SINGLE_FAST_MTP, {"VLLM_SPEC_DECODE_ATTN": "1"}),
    ("mtp-long", "native"): (
        f"--gpu-memory-utilization 0.93 --max-model-len 150000 --max-num-seqs 8 --api-server-count 1 "
        f"--language-model-only --kv-cache-dtype fp8 {COMMON} --async-scheduling --max-num-batched-tokens 2048 "
        f"--speculative-config {_mtp(3)} --compilation-config {_graphs(32)} {TAIL} --sse-keep-alive-interval 30",
        {"VLLM_SPEC_DECODE_ATTN": "1"}),
    ("batch", "native"): (
        f"--gpu-memory-utilization 0.94 --max-model-len 150000 --max-num-seqs 64 --api-server-count 1 "
        f"--language-model-only --kv-cache-dtype fp8 {COMMON} --async-scheduling --max-num-batched-tokens 2048 "
        f"--compilation-config {_graphs(64)} {TAIL}",
        {"VLLM_MARLIN_INPUT_DTYPE": "int8", "VLLM_MARLIN_INT8_INCLUDE_RE": "mlp"}),
    ("batch", "wsl2"): (
        f"--gpu-memory-utilization 0.91 --max-model-len 150000 --max-num-seqs 64 --api-server-count 1 "
        f"--language-model-only --kv-cache-dtype fp8 {COMMON} --async-scheduling --max-num-batched-tokens 2048 "
        f"--compilation-config {_graphs(64)} {TAIL}",
        {"VLLM_MARLIN_INPUT_DTYPE": "int8", "VLLM_MARLIN_INT8_INCLUDE_RE": "mlp"}),
    ("alternative", "native"): (
        f"--gpu-memory-utilization 0.95 --max-model-len 256000 --max-num-seqs 1 --api-server-count 1 "
        f"--language-model-only --attention-backend TRITON_ATTN --kv-cache-dtype int4_per_token_head {COMMON} "
        f"--async-scheduling --max-num-batched-tokens 2048 --speculative-config {_dflash(7)} "
        f"--compilation-config {_graphs(8)} {TAIL} "
        """--default-chat-template-kwargs '{"enable_thinking": false}' """
        "--enable-prefix-caching --mamba-cache-mode align --prefix-cache-retention-interval 0",
        {"VLLM_DFLASH2_LOOKUP": "1", "VLLM_INT4_MQ_3D": "1"}),
    ("alternative-tier", "native"): (  # an 8 GB CPU tier: dense retention for the tier to serve from
        f"--gpu-memory-utilization 0.95 --max-model-len 256000 --max-num-seqs 1 --api-server-count 1 "
        f"--language-model-only --attention-backend TRITON_ATTN --kv-cache-dtype int4_per_token_head {COMMON} "
        f"--async-scheduling --max-num-batched-tokens 2048 --speculative-config {_dflash(7)} "
        f"--compilation-config {_graphs(8)} {TAIL} "
        """--default-chat-template-kwargs '{"enable_thinking": false}' """
        "--enable-prefix-caching --mamba-cache-mode align --prefix-cache-retention-interval None "
        "--kv-offloading-size 8",
        {"VLLM_DFLASH2_LOOKUP": "1", "VLLM_INT4_MQ_3D": "1"}),
    ("alternative", "wsl2"): (  # the pin document's WSL2 row: MAX_SEQS=4 MAX_LEN=160000
        f"--gpu-memory-utilization 0.95 --max-model-len 160000 --max-num-seqs 4 --api-server-count 1 "
        f"--language-model-only --attention-backend TRITON_ATTN --kv-cache-dtype int4_per_token_head {COMMON} "
        f"--async-scheduling --max-num-batched-tokens 2048 --speculative-config {_dflash(7)} "
        f"--compilation-config {_graphs(32)} {TAIL} "
        """--default-chat-template-kwargs '{"enable_thinking": false}' """
        "--enable-prefix-caching --mamba-cache-mode align --prefix-cache-retention-interval 0",
        {"VLLM_DFLASH2_LOOKUP": "1", "VLLM_INT4_MQ_3D": "1", "VLLM_WSL2_ENABLE_PIN_MEMORY": "1"}),
    ("dflash2", "native"): (
        f"--gpu-memory-utilization 0.93 --max-model-len 65536 --max-num-seqs 8 --api-server-count 1 "
        f"--language-model-only --attention-backend FLASH_ATTN --kv-cache-dtype bfloat16 "
        f"--kv-cache-memory-bytes=5583457484 {COMMON} --async-scheduling --max-num-batched-tokens 2048 "
        f"--speculative-config {_dflash(7)} --compilation-config {_graphs(64)} {TAIL} --sse-keep-alive-interval 30",
        {"VLLM_DFLASH2_LOOKUP": "1", "VLLM_SPEC_DECODE_ATTN_QMAX": "8"}),
    ("dflash2-k15", "wsl2"): (  # k>7: 57344 and 4 sequences; lookup on makes scheduling synchronous
        f"--gpu-memory-utilization 0.93 --max-model-len 57344 --max-num-seqs 4 --api-server-count 1 "
        f"--language-model-only --attention-backend FLASH_ATTN --kv-cache-dtype bfloat16 "
        f"--kv-cache-memory-bytes=5583457484 {COMMON} --no-async-scheduling --max-num-batched-tokens 2048 "
        f"--speculative-config {_dflash(15)} --compilation-config {_graphs(64)} {TAIL} --sse-keep-alive-interval 30",
        {"VLLM_DFLASH2_LOOKUP": "1", "VLLM_SPEC_DECODE_ATTN_QMAX": "16", "VLLM_WSL2_ENABLE_PIN_MEMORY": "1"}),
    ("huge", "native"): (
        f"--gpu-memory-utilization 0.93 --max-model-len 245760 --max-num-seqs 2 --api-server-count 1 "
        f"--language-model-only --kv-cache-dtype kvarn_k4v2_g128 --block-size 128 --kv-cache-memory-bytes=5261334938 "
        f"{COMMON} --async-scheduling --max-num-batched-tokens 2048 --speculative-config {_dflash(7)} "
        f"--compilation-config {_graphs(16)} {TAIL} --sse-keep-alive-interval 30 "
        "--enable-prefix-caching --mamba-cache-mode align --prefix-match-unit 128 "
        "--prefix-cache-retention-interval 13056",
        {"VLLM_SPEC_DECODE_ATTN": "0", "KVARN_POOL_MEM_FRAC": "0.15", "VLLM_DFLASH2_LOOKUP": "1",
         "VLLM_SPEC_DECODE_ATTN_QMAX": "8"}),
}


@pytest.mark.parametrize("profile,host", list(EXPECTED), ids=[f"{p}-{h}" for p, h in EXPECTED])
def test_each_profile_emits_the_source_launchers_argv_and_environment(profile, host):
    flags, extra_env = EXPECTED[(profile, host)]
    argv, env = build_command(CUDA, profile, host, {})
    assert shlex.join(argv) == f"{HEAD} {flags}"
    off = host == "wsl2" or "--kv-offloading-size" in argv  # vLLM 0.31 refuses expandable segments beside a tier
    alloc = {"PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:{'False' if off else 'True'}"}
    assert env == {**BASE_ENV, **alloc, **extra_env}


def test_every_cuda_profile_and_host_is_in_the_table():
    """A new profile or host is proven against the source before it ships: the table must name it."""
    known = {p for p, _ in EXPECTED}
    assert set(CUDA["profiles"]) <= known, set(CUDA["profiles"]) - known
    for profile in CUDA["profiles"]:
        for host in CUDA["hosts"]:
            build_command(CUDA, profile, host, {})  # every combination resolves


@pytest.mark.parametrize("environ,says", [
    ({"SPEC": "mtp", "MODE": "batch"}, "batch serves without speculation"),
    ({"SPEC": "mtp", "MODE": "alternative"}, "alternative.sh speculates with dflash2"),
    ({"DTYPE": "float16"}, "DTYPE=float16 with a speculator"),
    ({"CTX": "enormous"}, "CTX='enormous'"),
    ({"KV": "int2"}, "KV='int2'"),
])
def test_combinations_the_source_refuses_are_refused(environ, says):
    with pytest.raises(KnobError, match=says.replace("(", r"\(")):
        build_command(CUDA, "default", "native", environ)


def test_dflash2_without_a_drafter_is_refused():
    no_drafter = {**CUDA, "model": {**CUDA["model"], "drafters": {}}}
    with pytest.raises(KnobError, match="needs the DFlash2 drafter"):
        build_command(no_drafter, "alternative", "native", {})


def test_extra_args_win_and_a_shadowed_flag_is_said():
    said: list[str] = []
    argv, _ = build_command(CUDA, "batch", "native", {"EXTRA_ARGS": "--max-num-seqs 32 --enforce-eager"},
                            warn=said.append)
    assert argv.count("--max-num-seqs") == 1 and argv[-3:] == ["--max-num-seqs", "32", "--enforce-eager"]
    assert said == ["EXTRA_ARGS sets --max-num-seqs, which the profile sets too; EXTRA_ARGS wins"]


def test_a_cpu_tier_goes_first_in_extra_args_and_alternative_retention_becomes_none():
    argv, _ = build_command(CUDA, "alternative", "native", {"KV_OFFLOAD_GB": "16", "EXTRA_ARGS": "--enforce-eager"})
    assert argv[-3:] == ["--kv-offloading-size", "16", "--enforce-eager"]
    assert argv[argv.index("--prefix-cache-retention-interval") + 1] == "None"
