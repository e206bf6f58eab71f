"""docs/profiles.md says of each knob in SAME_AS_SOURCE "the same as here": each row is held here against what the
source's launchers do with it (../shared/source-recipe.md, section 3), through the launcher's own build_command, so
a knob that means something else here fails its row (#48)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from support import ROOT

from servekit.config.load import load_matrix
from servekit.config.profiles import render_profiles
from servekit.image.knobs import SAME_AS_SOURCE
from servekit.image.launcher import KnobError, build_command

CUDA = render_profiles(load_matrix(ROOT / "images.yaml"), "cuda")


@dataclass(frozen=True)
class Row:
    """The source's behaviour for one knob value on one profile: argv runs that must appear in order, flags that
    must not appear, and what the speculative config, compilation config and environment must hold."""
    profile: str
    set_to: dict[str, str]
    has: tuple[tuple[str, ...], ...] = ()
    lacks: tuple[str, ...] = ()
    spec: dict = field(default_factory=dict)
    compilation: dict = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    last: str | None = None


ROWS: dict[str, list[Row]] = {
    "SPEC": [Row("default", {"SPEC": "off"}, lacks=("--speculative-config",))],
    "DRAFT_TOKENS": [Row("default", {"DRAFT_TOKENS": "2"}, spec={"num_speculative_tokens": 2})],
    "DRAFT_SAMPLE": [Row("dflash2", {"DRAFT_SAMPLE": "greedy"}, spec={"draft_sample_method": "greedy"})],
    # CTX=long: fp8 KV on FlashInfer, 150000, k3
    "CTX": [Row("default", {"CTX": "long"}, has=(("--kv-cache-dtype", "fp8"), ("--max-model-len", "150000")),
                lacks=("--attention-backend",), spec={"num_speculative_tokens": 3})],
    # KV=kvarn: the KVarN dtype, block 128, 262144, GPU_UTIL 0.93 natively, a pool fraction of 0.25
    "KV": [Row("batch", {"KV": "kvarn"}, has=(("--kv-cache-dtype", "kvarn_k4v2_g128"), ("--block-size", "128"),
                                            ("--max-model-len", "262144"), ("--gpu-memory-utilization", "0.93")),
               env={"KVARN_POOL_MEM_FRAC": "0.25"})],
    # --kv-cache-memory= on the DFlash2 rows; `KV_MEM=` (empty) falls back to sizing from GPU_UTIL
    "KV_MEM": [Row("dflash2", {"KV_MEM": "4000000000"}, has=(("--kv-cache-memory-bytes=4000000000",),)),
               Row("dflash2", {"KV_MEM": ""}, lacks=("--kv-cache-memory-bytes",)),
               Row("dflash2", {"KV_MEM": "0"}, lacks=("--kv-cache-memory-bytes",))],
    "PREFIX_RETENTION": [Row("alternative", {"PREFIX_RETENTION": "512"},
                             has=(("--prefix-cache-retention-interval", "512"),))],
    "CUDAGRAPH_MODE": [Row("default", {"CUDAGRAPH_MODE": "FULL"}, compilation={"cudagraph_mode": "FULL"})],
    "SPEC_ATTN": [Row("default", {"SPEC_ATTN": "0"}, env={"VLLM_SPEC_DECODE_ATTN": "0"})],
    # single-user: int8 activations in mlp, linear_attn and self_attn; batch (its default): mlp only
    "INT8_ACT": [Row("default", {"INT8_ACT": "int8"}, env={"VLLM_MARLIN_INPUT_DTYPE": "int8",
                                                           "VLLM_MARLIN_INT8_INCLUDE_RE": "mlp|linear_attn|self_attn"}),
                 Row("batch", {}, env={"VLLM_MARLIN_INPUT_DTYPE": "int8", "VLLM_MARLIN_INT8_INCLUDE_RE": "mlp"}),
                 Row("batch", {"INT8_ACT": "emulated"}, env={"VLLM_MARLIN_INPUT_DTYPE": "int8",
                                                             "VLLM_MARLIN_INT8_INCLUDE_RE": "mlp",
                                                             "VLLM_MARLIN_INT8_EMULATE": "1"})],
    "INT4_MQ_3D": [Row("alternative", {"INT4_MQ_3D": "0"}, env={"VLLM_INT4_MQ_3D": "0"})],
    "VISION": [Row("default", {"VISION": "1"}, has=(("--limit-mm-per-prompt", '{"image": {"count": 1}}'),),
                   lacks=("--language-model-only",), env={"VLLM_VISION_CPU_OFFLOAD_GB": "1"})],
    # `SSE_KEEP_ALIVE=` (empty) drops the keep-alive flag
    "SSE_KEEP_ALIVE": [Row("default", {"SSE_KEEP_ALIVE": "15"}, has=(("--sse-keep-alive-interval", "15"),)),
                       Row("default", {"SSE_KEEP_ALIVE": ""}, lacks=("--sse-keep-alive-interval",))],
    "PREFIX_CACHE": [Row("default", {"PREFIX_CACHE": "1"},
                         has=(("--enable-prefix-caching", "--mamba-cache-mode", "align"),)),
                     Row("default", {"PREFIX_CACHE": "0"}, lacks=("--enable-prefix-caching", "--mamba-cache-mode"))],
    "MAX_SEQS": [Row("batch", {"MAX_SEQS": "32"}, has=(("--max-num-seqs", "32"),))],
    "MAX_LEN": [Row("default", {"MAX_LEN": "32768"}, has=(("--max-model-len", "32768"),))],
    "GPU_UTIL": [Row("batch", {"GPU_UTIL": "0.9"}, has=(("--gpu-memory-utilization", "0.9"),))],
    "TOOL_STRICT": [Row("batch", {"TOOL_STRICT": "auto"}, has=(("--tool-strict-level", "auto"),))],
    # TOOLS=0 drops all three tool flags; alternative.sh passes them whatever TOOLS says
    "TOOLS": [Row("default", {"TOOLS": "0"},
                  lacks=("--enable-auto-tool-choice", "--tool-call-parser", "--tool-strict-level")),
              Row("batch", {"TOOLS": "0"},
                  lacks=("--enable-auto-tool-choice", "--tool-call-parser", "--tool-strict-level")),
              Row("alternative", {"TOOLS": "0"}, has=(("--enable-auto-tool-choice", "--tool-call-parser",
                                                        "qwen3_coder", "--tool-strict-level", "parameter"),))],
    "TOOL_PARSER": [Row("batch", {"TOOL_PARSER": "hermes"}, has=(("--tool-call-parser", "hermes"),))],
    # a tier on alternative.sh: dense retention (None) for the tier to serve from, expandable segments off
    "KV_OFFLOAD_GB": [Row("alternative", {"KV_OFFLOAD_GB": "8"},
                          has=(("--kv-offloading-size", "8"), ("--prefix-cache-retention-interval", "None")),
                          env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})],
    "LOOKUP": [Row("dflash2", {"LOOKUP": "0"}, env={"VLLM_DFLASH2_LOOKUP": "0"})],
    "ASYNC_SCHED": [Row("default", {"ASYNC_SCHED": "0"}, has=(("--no-async-scheduling",),),
                        lacks=("--async-scheduling",))],
    "PORT": [Row("default", {"PORT": "18021"}, has=(("--port", "18021"),))],
    "HOST": [Row("default", {"HOST": "127.0.0.1"}, has=(("--host", "127.0.0.1"),))],
    # EXTRA_ARGS goes last, so it overrides earlier flags
    "EXTRA_ARGS": [Row("default", {"EXTRA_ARGS": "--max-model-len 1000"}, has=(("--max-model-len", "1000"),),
                       last="1000")],
}


def test_every_knob_the_table_calls_the_same_has_a_row_here():
    assert sorted(ROWS) == sorted(SAME_AS_SOURCE)


def _runs_in(argv: list[str], run: tuple[str, ...]) -> bool:
    return any(tuple(argv[i:i + len(run)]) == run for i in range(len(argv) - len(run) + 1))


def _json_after(argv: list[str], flag: str) -> dict:
    return json.loads(argv[argv.index(flag) + 1]) if flag in argv else {}


@pytest.mark.parametrize("knob, row", [(knob, row) for knob, rows in ROWS.items() for row in rows],
                         ids=lambda value: value if isinstance(value, str) else "")
def test_the_knob_does_here_what_it_did_in_the_source(knob, row):
    argv, env = build_command(CUDA, row.profile, "native", dict(row.set_to))
    names = [token.split("=", 1)[0] for token in argv]
    for run in row.has:
        assert _runs_in(argv, run), f"{knob}: expected {' '.join(run)} in {' '.join(argv)}"
    for flag in row.lacks:
        assert flag not in names, f"{knob}: expected no {flag} in {' '.join(argv)}"
    spec = _json_after(argv, "--speculative-config")
    assert {k: spec.get(k) for k in row.spec} == row.spec
    compilation = _json_after(argv, "--compilation-config")
    assert {k: compilation.get(k) for k in row.compilation} == row.compilation
    assert {k: env.get(k) for k in row.env} == row.env
    if row.last is not None:
        assert argv[-1] == row.last


def test_host_naming_a_host_kind_is_refused_naming_servekit_host():
    """The source's HOST is vLLM's bind address; a user who writes HOST=wsl2 means the host kind."""
    with pytest.raises(KnobError, match="HOST='wsl2' is the address vLLM listens on .*SERVEKIT_HOST=wsl2"):
        build_command(CUDA, "alternative", "native", {"HOST": "wsl2"})


def test_alternative_tier_on_wsl2_runs_the_sources_tier_run():
    """The source's tier run (WSL2 4090): alternative.sh at SPEC=dflash2 PREFIX_CACHE=1 MAX_SEQS=4 MAX_LEN=160000
    with an 8 GB tier, so that two ~60K conversations are in flight at once."""
    argv, env = build_command(CUDA, "alternative-tier", "wsl2", {})
    for run in (("--max-num-seqs", "4"), ("--max-model-len", "160000"), ("--kv-offloading-size", "8"),
                ("--enable-prefix-caching", "--mamba-cache-mode", "align", "--prefix-cache-retention-interval",
                 "None")):
        assert _runs_in(argv, run), run
    assert _json_after(argv, "--speculative-config")["method"] == "dflash"
