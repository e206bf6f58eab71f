"""The launcher's knobs: names, kinds and allowed values.

Standard library only: the launcher inside the image imports this, and the matrix validates
profile knobs against it, so a typo in images.yaml fails at load rather than at boot.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass

from .boundary import FALSE_WORDS, TRUE_WORDS, control_character

# vllm serve's flags that carry a secret. EXTRA_ARGS may not hold them: the key travels in API_KEY_FILE (or
# VLLM_API_KEY), the token in HF_TOKEN_FILE, never on a command line that a process list, the server's log, `ps`
# and the run's report show. Where a value is shown anyway (a refusal that names it), masked() hides them.
SECRET_FLAGS = ("--api-key", "--hf-token")
_SECRET_FLAG = re.compile(r"(?<!\S)(" + "|".join(SECRET_FLAGS) + r")(?=[=\s]|$)")
_SECRET_VALUE = re.compile(r"(?<!\S)(" + "|".join(SECRET_FLAGS) + r")(=|\s+)(\"[^\"]*\"?|'[^']*'?|\S+)")


# Where vLLM listens is HOST and PORT (servekit watches the server there, Compose publishes it): EXTRA_ARGS may not
# move it behind their back.
LISTEN_FLAGS = ("--host", "--port")
_LISTEN_FLAG = re.compile(r"(?<!\S)(" + "|".join(LISTEN_FLAGS) + r")(?=[=\s]|$)")
WILDCARDS = ("0.0.0.0", "::")


def watched_problem(name: str, value: str) -> str | None:
    """Why a knob set for a boot of servekit's own (images.yaml, --knob) would move the server away from where
    servekit watches it (a container's published port reaches only a wildcard; the port is --port's), or None."""
    if name == "PORT":
        return ("expected no PORT here: servekit publishes the server and watches it on --port (default serve.port); "
                "the PORT of your shell or compose/.env is read there too")
    if name == "HOST" and value.strip() not in WILDCARDS:
        return (f"expected a wildcard address ({' or '.join(WILDCARDS)}): servekit reaches the server through the "
                "address it publishes (BIND), which reaches only a server that listens on every address")
    return None


def masked(text: str) -> str:
    """`text` (EXTRA_ARGS, a command line) with each secret flag's value shown as ***."""
    return _SECRET_VALUE.sub(lambda m: f"{m.group(1)}{m.group(2)}***", text)




@dataclass(frozen=True)
class Knob:
    name: str
    kind: str  # bool, enum, int, float, str, address
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    passthrough: bool = True  # Compose passes it from the shell to the container (compose.yaml lists it)
    # What the knob set empty (`KNOB=`) means. None: unset, the default applies (the source's `${KNOB:-default}`);
    # a value: that value (the source's `${KNOB-default}`, where set-but-empty drops the flag).
    empty: str | None = None

    def check(self, raw: str) -> str | None:
        """Return why `raw` is not a valid value of this knob, or None when it is."""
        try:
            self.normalize(raw)
        except ValueError as exc:
            return str(exc)
        return None

    def normalize(self, raw: str) -> str:
        """The value in the one form every reader takes (vLLM reads a boolean variable as on only when it is `1`):
        a boolean as 1 or 0 whatever its spelling, a number as Python writes it, text stripped. ValueError says
        why `raw` is not a value of this knob."""
        value = raw.strip()
        if value == "" and self.empty is not None:
            value = self.empty
        problem = self._problem(value)
        if problem:
            raise ValueError(problem)
        if self.kind == "bool":
            return "1" if value.lower() in TRUE_WORDS else "0"
        if self.kind == "int":
            return str(int(value))
        if self.kind == "float":
            number = float(value)
            return str(int(number)) if number.is_integer() and "." not in value and "e" not in value.lower() \
                else repr(number)
        return value

    def _problem(self, value: str) -> str | None:
        if problem := control_character(value):  # it becomes a line of compose/.env and an argument of vllm serve
            return f"expected {problem}"
        if self.name == "EXTRA_ARGS" and (secret := _SECRET_FLAG.search(value)):
            return (f"expected no {secret.group(1)}: a secret travels in its file (API_KEY_FILE, HF_TOKEN_FILE) or "
                    "VLLM_API_KEY, never on a command line that ps, the log and the report show")
        if self.name == "EXTRA_ARGS" and (listen := _LISTEN_FLAG.search(value)):
            return (f"expected no {listen.group(1)}: where vLLM listens is HOST and PORT, which Compose publishes and "
                    "servekit watches")
        if self.kind == "address":
            try:
                ipaddress.ip_address(value)
            except ValueError:
                return "expected an IP address to listen on, e.g. 0.0.0.0"
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
            if isinstance(number, int) and abs(number) >= 2**63:  # no flag of vLLM's takes it (nor does a float)
                return "expected an integer below 2**63"
            if not math.isfinite(number):
                return "expected a finite number"
            if self.minimum is not None and number < self.minimum:
                return f"expected at least {self.minimum:g}"
            if self.maximum is not None and number > self.maximum:
                return f"expected at most {self.maximum:g}"
        return None


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("MODE", "enum", "which of the source's launchers the profile is: single (start_qwen.sh), batch, "
         "alternative (alternative.sh), or plain (only what the knobs ask: the cpu target)",
         choices=("single", "batch", "alternative", "plain")),
    Knob("SPEC", "enum", "speculative decoding: mtp (the checkpoint's own head), dflash2 (the DFlash2 drafter, "
         "method dflash), off", choices=("off", "mtp", "dflash2")),
    Knob("DRAFT_TOKENS", "int", "draft tokens per step (default by SPEC and CTX: mtp 4 fast, 3 long and huge; "
         "dflash2 7)", minimum=1, maximum=32),
    Knob("DRAFT_SAMPLE", "enum", "draft_sample_method of the speculative config (probabilistic: greedy drafts cut "
         "DFlash2's acceptance from 3.23 to 2.66 tokens a step)", choices=("probabilistic", "greedy")),
    Knob("CTX", "enum", "single-user context preset: attention backend, KV dtype, block size, max length, draft "
         "count", choices=("fast", "long", "huge")),
    Knob("KV", "enum", "batch's KV cache: fp8, kvarn (KVarN pool) or int4pth (int4 per token and head)",
         choices=("fp8", "kvarn", "int4pth")),
    Knob("KV_MEM", "int", "--kv-cache-memory in bytes where the recipe pins it (dflash2); 0 or empty sizes from "
         "GPU_UTIL", minimum=0, empty="0"),
    Knob("PREFIX_RETENTION", "str", "--prefix-cache-retention-interval (default by profile: None, 0 on "
         "alternative, 13056/14592 at CTX=huge with dflash2 k7/k15)"),
    Knob("CUDAGRAPH_MODE", "enum", "cudagraph_mode of the compilation config (PIECEWISE at CTX=huge without "
         "dflash2)", choices=("PIECEWISE", "FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "NONE")),
    Knob("SPEC_ATTN", "bool", "VLLM_SPEC_DECODE_ATTN with mtp"),
    Knob("INT8_ACT", "enum", "int8 activations in Marlin (VLLM_MARLIN_INPUT_DTYPE; batch's default); emulated: the "
         "16-bit kernel over the int8 path's weights and inputs rounded as int8 ones are (VLLM_MARLIN_INT8_EMULATE), "
         "the reference W4A8 is measured against", choices=("int8", "off", "emulated")),
    Knob("INT4_MQ_3D", "bool", "VLLM_INT4_MQ_3D on alternative"),
    Knob("VISION", "bool", "serve images too (drops --language-model-only)"),
    Knob("SSE_KEEP_ALIVE", "int", "--sse-keep-alive-interval in seconds on the single-user launcher; 0 or empty "
         "drops it", minimum=0, empty="0"),
    Knob("PREFIX_CACHE", "bool", "--enable-prefix-caching, with Mamba alignment"),
    Knob("MAX_SEQS", "int", "--max-num-seqs", minimum=1),
    Knob("MAX_LEN", "int", "--max-model-len", minimum=1),
    Knob("GPU_UTIL", "float", "--gpu-memory-utilization", minimum=0.05, maximum=1.0),
    Knob("TOOL_STRICT", "enum", "--tool-strict-level; parameter by default, since auto (upstream's default) let "
         "0.31.0 invent arguments for a tool with none",
         choices=("parameter", "auto")),
    Knob("TOOLS", "bool", "--enable-auto-tool-choice, --tool-call-parser and --tool-strict-level; 0 drops all three "
         "(alternative.sh keeps its tool flags whatever TOOLS says)"),
    Knob("TOOL_PARSER", "str", "--tool-call-parser (qwen3_coder; hermes returns no tool_calls for it)"),
    Knob("KV_OFFLOAD_GB", "float", "--kv-offloading-size in GiB (a CPU KV tier)", minimum=0),
    Knob("LOOKUP", "bool", "VLLM_DFLASH2_LOOKUP"),
    Knob("ENABLE_THINKING", "bool", "the chat template's enable_thinking default"),
    Knob("ASYNC_SCHED", "bool", "--async-scheduling"),
    Knob("API_SERVERS", "int", "--api-server-count", minimum=1),
    Knob("PORT", "int", "the port clients reach, as in the source's launchers and Compose file: Compose publishes it "
         "(inside, vLLM listens on 8000), the process engine listens on it; default serve.port (18020); servekit's "
         "commands take it from --port, the shell or compose/.env, never from images.yaml or --knob",
         minimum=1, maximum=65535, passthrough=False),
    Knob("HOST", "address", "the address vLLM listens on, the source's HOST: 0.0.0.0 inside a container (what other "
         "machines reach is BIND, the published address); the process engine listens on serve.bind unless set; in "
         "images.yaml and --knob only a wildcard (0.0.0.0, ::), which BIND always reaches",
         passthrough=False),
    Knob("ENFORCE_EAGER", "bool", "--enforce-eager (no compiled graphs; the cpu image has no C++ compiler)"),
    Knob("DTYPE", "enum", "--dtype", choices=("auto", "bfloat16", "float16", "float32")),
    Knob("EXTRA_ARGS", "str", "extra vllm serve flags, last; a flag here wins over the same flag from a knob"),
)}


@dataclass(frozen=True)
class SourceName:
    """A name the source repository's users set (its launchers, its Compose file, its key file), and what it is here."""
    there: str  # what the source's launchers or Compose file did with it
    here: str  # what it does here
    renamed_to: str | None = None  # the name to use here: the launcher refuses the old one, naming this


# Same name, same meaning: every knob above that the source's launchers read (docs/profiles.md lists them with
# SOURCE_NAMES, which holds the rest: what servekit reads outside the launcher, renamed names, and names not read).
SAME_AS_SOURCE = ("SPEC", "DRAFT_TOKENS", "DRAFT_SAMPLE", "CTX", "KV", "KV_MEM", "PREFIX_RETENTION", "CUDAGRAPH_MODE",
                  "SPEC_ATTN", "INT8_ACT", "INT4_MQ_3D", "VISION", "SSE_KEEP_ALIVE", "PREFIX_CACHE", "MAX_SEQS",
                  "MAX_LEN", "GPU_UTIL", "TOOL_STRICT", "TOOLS", "TOOL_PARSER", "KV_OFFLOAD_GB", "LOOKUP",
                  "ASYNC_SCHED", "PORT", "HOST", "EXTRA_ARGS")

SOURCE_NAMES: dict[str, SourceName] = {
    "BIND": SourceName("the address Compose publishes the port on (default 127.0.0.1)",
                       "the same, in the shell or compose/.env; default serve.bind"),
    "GPU_COUNT": SourceName("how many GPUs Compose gives the server (default 1)", "the same (default 1)"),
    "MODELS_DIR": SourceName("the folder Compose bind-mounts at /app/models (default ./models)",
                             "the same, in the shell or compose/.env, in place of the models volume (unset: the "
                             "volume); a whole model or drafter folder the source's prepare left there (under the "
                             "name images.yaml's source_folder gives) is served where it is, never fetched again or "
                             "written into; a relative path is taken from compose/, and prepare writes there as "
                             "SERVEKIT_UID"),
    "VLLM_API_KEY": SourceName("the API key; an exported one wins over api_key.txt",
                               "the same, in the shell or compose/.env: Compose hands it to the container, whose "
                               "launcher takes it first; `image`/`up` also write it to compose/secrets/api_key"),
    "api_key.txt": SourceName("the key file at the repository's root",
                              "read when VLLM_API_KEY is unset; its key goes to compose/secrets/api_key"),
    "PRINT_ARGV": SourceName("print the argv and exit", "the same (the key masked), plus the environment"),
    "DFLASH_TOKENS": SourceName("draft tokens per step for dflash2", "renamed", renamed_to="DRAFT_TOKENS"),
    "DFLASH_MAX_LEN": SourceName("max length for dflash2, over MAX_LEN", "renamed", renamed_to="MAX_LEN"),
    "DRAFT_METHOD": SourceName("dflash, or dspark for the DSpark drafter", "renamed (SPEC=dflash2 is method dflash; "
                               "DSpark is not served here)", renamed_to="SPEC"),
    "CUDA_VISIBLE_DEVICES": SourceName("which GPUs the solo service sees", "not read: no solo service here; give "
                                       "the container its GPUs with GPU_COUNT"),
    "PREFILL_ATTN": SourceName("VLLM_PREFILL_ATTN", "not read here"),
    "EMBED_UVA": SourceName("VLLM_EMBED_UVA=1", "not read here"),
    "VLLM_OFFLOAD_KEEP_SHM": SourceName("keep the CPU tier's shared memory between runs", "not read here"),
}
RENAMED = {name: n.renamed_to for name, n in SOURCE_NAMES.items() if n.renamed_to}

