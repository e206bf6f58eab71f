"""The launcher's knobs: names, kinds and allowed values.

Standard library only: the launcher inside the image imports this, and the matrix validates
profile knobs against it, so a typo in images.yaml fails at load rather than at boot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class Knob:
    name: str
    kind: str  # bool, enum, int, float, str
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    passthrough: bool = True  # Compose passes it from the shell to the container (compose.yaml lists it)

    def check(self, raw: str) -> str | None:
        """Return why `raw` is not a valid value of this knob, or None when it is."""
        value = raw.strip()
        if self.kind == "bool":
            if value.lower() not in TRUE_WORDS | FALSE_WORDS:
                return f"expected one of {'/'.join(sorted(TRUE_WORDS | FALSE_WORDS))} (any case)"
        elif self.kind == "enum":
            if value not in self.choices:
                return f"expected one of {', '.join(self.choices)}"
        elif self.kind in ("int", "float"):
            try:
                number = int(value) if self.kind == "int" else float(value)
            except ValueError:
                return f"expected {'an integer' if self.kind == 'int' else 'a number'}"
            if not math.isfinite(number):
                return "expected a finite number"
            if self.minimum is not None and number < self.minimum:
                return f"expected at least {self.minimum:g}"
            if self.maximum is not None and number > self.maximum:
                return f"expected at most {self.maximum:g}"
        return None


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("SPEC", "enum", "speculative decoding method", choices=("off", "mtp", "dflash2")),
    Knob("DRAFT_TOKENS", "int", "draft tokens per step for SPEC", minimum=1, maximum=32),
    Knob("CTX", "enum", "context preset: max length, KV cache dtype, attention backend",
         choices=("default", "fast", "long", "huge")),
    Knob("PREFIX_CACHE", "bool", "--enable-prefix-caching, with Mamba alignment"),
    Knob("MAX_SEQS", "int", "--max-num-seqs", minimum=1),
    Knob("MAX_LEN", "int", "--max-model-len", minimum=1),
    Knob("GPU_UTIL", "float", "--gpu-memory-utilization", minimum=0.05, maximum=1.0),
    Knob("TOOL_STRICT", "enum", "--tool-strict-level; parameter by default, since auto (upstream's default) let "
         "0.31.0 invent arguments for a tool with none",
         choices=("parameter", "auto")),
    Knob("TOOLS", "bool", "--enable-auto-tool-choice"),
    Knob("TOOL_PARSER", "str", "--tool-call-parser (qwen3_coder; hermes returns no tool_calls for it)"),
    Knob("KV_OFFLOAD_GB", "float", "--kv-offloading-size in GiB (a CPU KV tier)", minimum=0),
    Knob("LOOKUP", "bool", "VLLM_DFLASH2_LOOKUP"),
    Knob("ENABLE_THINKING", "bool", "the chat template's enable_thinking default"),
    Knob("ASYNC_SCHED", "bool", "--async-scheduling"),
    Knob("API_SERVERS", "int", "--api-server-count", minimum=1),
    Knob("PORT", "int", "the port vLLM listens on inside the container (Compose maps 8000; not passed through)",
         minimum=1, maximum=65535, passthrough=False),
    Knob("ENFORCE_EAGER", "bool", "--enforce-eager (no compiled graphs; the cpu image has no C++ compiler)"),
    Knob("DTYPE", "enum", "--dtype", choices=("auto", "bfloat16", "float16", "float32")),
    Knob("EXTRA_ARGS", "str", "extra vllm serve flags, last; a flag here wins over the same flag from a knob"),
)}
