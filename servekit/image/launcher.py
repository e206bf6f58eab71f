"""The launcher inside the image: knobs (environment variables) to a `vllm serve` command line.

Standard library only. Reads the profiles that the build rendered out of images.yaml, merges
the environment over the profile's knobs, refuses a bad value before vLLM starts, and execs
vLLM. `PRINT_ARGV=1` prints the final command line (the key masked) and exits.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

try:
    from .knobs import FALSE_WORDS, KNOBS, TRUE_WORDS
except ImportError:  # run as a script inside the image, beside knobs.py
    from knobs import FALSE_WORDS, KNOBS, TRUE_WORDS  # type: ignore[no-redef]

MIN_KEY_CHARS = 16  # a shorter key (an empty file above all) is no key: the host regenerates one this short or shorter
PROFILES_FILE = Path(os.environ.get("SERVEKIT_PROFILES", Path(__file__).resolve().parent / "profiles.json"))
VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
CTX_PRESETS = {  # CTX -> (max length, KV cache dtype)
    "default": (None, None), "fast": (32768, None), "long": (131072, "fp8"), "huge": (262144, "fp8"),
}
SPEC_METHODS = {"mtp": ("mtp", 4), "dflash2": ("dflash2", 7)}
# Every flag this launcher can emit; the image's verify step checks each against `vllm serve --help`.
FLAGS = ("--model", "--served-model-name", "--host", "--port", "--max-model-len", "--max-num-seqs",
         "--gpu-memory-utilization", "--kv-cache-dtype", "--enable-prefix-caching", "--no-enable-prefix-caching",
         "--speculative-config", "--tool-strict-level", "--enable-auto-tool-choice", "--tool-call-parser",
         "--kv-offloading-size", "--default-chat-template-kwargs", "--async-scheduling", "--api-server-count",
         "--enforce-eager", "--dtype", "--enable-prompt-tokens-details")


class KnobError(Exception):
    pass


def truthy(name: str, value: str) -> bool:
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise KnobError(f"{name}={value!r}: expected one of {'/'.join(sorted(TRUE_WORDS | FALSE_WORDS))} (any case)")


def merged_knobs(profile_knobs: dict[str, str], environ: dict[str, str]) -> dict[str, str]:
    knobs = dict(profile_knobs)
    # An empty variable is unset: `KNOB=` in a compose file or shell must not override a default.
    knobs.update({k: v for k, v in environ.items() if k in KNOBS and v != ""})
    for name, value in knobs.items():
        problem = KNOBS[name].check(value)
        if problem:
            raise KnobError(f"{name}={value!r}: {problem}")
    return knobs


def _flag_name(token: str) -> str:
    return token.split("=", 1)[0]


def build_command(profiles: dict, profile: str, host: str, environ: dict[str, str]) -> tuple[list[str], dict]:
    """(argv, extra environment) for `vllm serve`."""
    if profile not in profiles["profiles"]:
        raise KnobError(f"PROFILE={profile!r}: expected one of {', '.join(profiles['profiles'])}")
    if host not in profiles["hosts"]:
        raise KnobError(f"HOST={host!r}: expected one of {', '.join(profiles['hosts'])}")
    k = merged_knobs(profiles["profiles"][profile][host], environ)
    model = profiles["model"]
    env = {**profiles.get("env", {}), **profiles["hosts"][host]["env"]}
    args = ["--model", model["path"], "--served-model-name", model["served_name"], "--host", "0.0.0.0",
            "--port", k.get("PORT", "8000"), "--enable-prompt-tokens-details"]
    max_len, kv_dtype = CTX_PRESETS[k.get("CTX", "default")]
    if "MAX_LEN" in k:
        max_len = int(k["MAX_LEN"])
    if max_len:
        args += ["--max-model-len", str(max_len)]
    if kv_dtype:
        args += ["--kv-cache-dtype", kv_dtype]
    if "MAX_SEQS" in k:
        args += ["--max-num-seqs", k["MAX_SEQS"]]
    if "GPU_UTIL" in k:
        args += ["--gpu-memory-utilization", k["GPU_UTIL"]]
    if "PREFIX_CACHE" in k:
        args.append("--enable-prefix-caching" if truthy("PREFIX_CACHE", k["PREFIX_CACHE"])
                    else "--no-enable-prefix-caching")
    spec = k.get("SPEC", "off")
    if spec != "off":
        method, default_k = SPEC_METHODS[spec]
        drafts = int(k.get("DRAFT_TOKENS", default_k))
        args += ["--speculative-config", json.dumps({"method": method, "num_speculative_tokens": drafts})]
        if spec == "dflash2" and host == "wsl2":
            env["VLLM_WSL2_ENABLE_PIN_MEMORY"] = "1"  # else "UVA is not available" under WSL2
    if "LOOKUP" in k:
        env["VLLM_DFLASH2_LOOKUP"] = "1" if truthy("LOOKUP", k["LOOKUP"]) else "0"
    args += ["--tool-strict-level", k.get("TOOL_STRICT", "parameter")]
    if truthy("TOOLS", k.get("TOOLS", "1")):
        args += ["--enable-auto-tool-choice", "--tool-call-parser", k.get("TOOL_PARSER", "qwen3_coder")]
    if "KV_OFFLOAD_GB" in k:
        args += ["--kv-offloading-size", k["KV_OFFLOAD_GB"]]
    if "ENABLE_THINKING" in k:
        thinking = truthy("ENABLE_THINKING", k["ENABLE_THINKING"])
        args += ["--default-chat-template-kwargs", json.dumps({"enable_thinking": thinking})]
    if truthy("ASYNC_SCHED", k.get("ASYNC_SCHED", "0")):
        args.append("--async-scheduling")
    if "API_SERVERS" in k:
        args += ["--api-server-count", k["API_SERVERS"]]
    if truthy("ENFORCE_EAGER", k.get("ENFORCE_EAGER", "0")):
        args.append("--enforce-eager")
    if "DTYPE" in k:
        args += ["--dtype", k["DTYPE"]]
    extra = shlex.split(k.get("EXTRA_ARGS", ""))
    return _extra_wins(args, extra), env


def _extra_wins(args: list[str], extra: list[str]) -> list[str]:
    """Drop from `args` each flag (and its value) that EXTRA_ARGS sets again, then append EXTRA_ARGS."""
    overridden = {_flag_name(t) for t in extra if t.startswith("--")}
    out, i = [], 0
    while i < len(args):
        token = args[i]
        takes_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        if _flag_name(token) in overridden:
            i += 2 if takes_value and "=" not in token else 1
            continue
        out.append(token)
        i += 1
    return out + extra


def read_key(key_file: str | None) -> tuple[str | None, str]:
    """(the key, "") or (None, why there is none): unset, unreadable, empty or too short."""
    if not key_file:
        return None, "no API key: API_KEY_FILE is not set"
    try:
        key = Path(key_file).read_text().strip()
    except OSError as exc:
        return None, f"no API key: {key_file} cannot be read ({exc.strerror})"
    if len(key) < MIN_KEY_CHARS:
        return None, f"no API key: {key_file} holds {len(key)} characters"
    return key, ""


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else "serve"
    if command == "flags":
        print("\n".join(FLAGS))
        return 0
    if command not in ("serve", "prepare"):
        print(f"launcher: unknown command {command!r}; expected serve [PROFILE], prepare or flags", file=sys.stderr)
        return 2
    profiles = json.loads(PROFILES_FILE.read_text())
    try:
        from .prepare import is_complete, prepare
    except ImportError:  # run as a script inside the image, beside prepare.py
        from prepare import is_complete, prepare  # type: ignore[no-redef]
    if command == "prepare":
        prepare(profiles["model"], say=lambda line: print(line, file=sys.stderr, flush=True))
        return 0
    profile = argv[2] if len(argv) > 2 else os.environ.get("PROFILE", "default")
    try:
        args, env = build_command(profiles, profile, os.environ.get("HOST", "native"), dict(os.environ))
    except KnobError as exc:
        print(f"launcher: refusing to start: {exc}", file=sys.stderr)
        return 2
    key, problem = read_key(os.environ.get("API_KEY_FILE"))
    if key:  # the key travels in the environment, never on the command line or in a log
        env["VLLM_API_KEY"] = key
    elif profile in profiles.get("without_key", []):
        print(f"launcher: profile {profile} serves WITHOUT an API key (images.yaml says auth: none)", file=sys.stderr)
    else:  # vLLM adds its auth only for a non-empty key: without one it would serve an open API
        print(f"launcher: refusing to start: {problem}; mount a key file of at least {MIN_KEY_CHARS} characters "
              "and set API_KEY_FILE to it (compose/ does), or give the profile auth: none in images.yaml",
              file=sys.stderr)
        return 2
    if not is_complete(profiles["model"]) and os.environ.get("PRINT_ARGV") != "1":
        print(f"launcher: refusing to start: the model in {profiles['model']['path']} is missing or incomplete; "
              "run the prepare step first (docker compose runs it before every profile)", file=sys.stderr)
        return 2
    if os.environ.get("PRINT_ARGV") == "1":
        print(shlex.join(VLLM[2:] + args))
        for name in sorted(env):
            print(f"{name}={'***' if 'KEY' in name or 'TOKEN' in name else env[name]}")
        return 0
    os.environ.update(env)
    print(f"launcher: profile {profile}: vllm serve {shlex.join(args)}", file=sys.stderr, flush=True)
    os.execv(VLLM[0], VLLM + args)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
