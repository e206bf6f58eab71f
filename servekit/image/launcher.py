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
from collections.abc import Callable, Mapping
from pathlib import Path

from . import PACKAGE_ROOT, readers, recipe
from .boundary import Refused, argv_words, control_character, header_unsafe, read_secret, read_text
from .errors import UserError
from .knobs import KNOBS, RENAMED, masked

CONTAINER_PORT = 8000  # where vLLM listens inside the container: the Dockerfile and Compose use it (a test ties them)
HOST_KIND_ENV = "SERVEKIT_HOST"  # which host of images.yaml this is (native, wsl2); HOST is the source's bind address
MIN_KEY_CHARS = 16  # a shorter key (an empty file above all) is no key: the host regenerates one this short or shorter
PROFILES_MAX_BYTES = 4 << 20
PROFILES_FILE = Path(os.environ.get("SERVEKIT_PROFILES", PACKAGE_ROOT / "profiles.json"))
# What the build found its packages read (readers.py); absent where there was no such build (the process engine)
# The kernel's release: WSL2's names Microsoft ("5.15.167.4-microsoft-standard-WSL2"), and a container under Docker
# Desktop runs on that kernel. SERVEKIT_OSRELEASE reads another file (a test's).
KERNEL_RELEASE_FILE = Path(os.environ.get("SERVEKIT_OSRELEASE", "/proc/sys/kernel/osrelease"))
READERS_FILE = Path(os.environ.get("SERVEKIT_ENV_READERS", PACKAGE_ROOT / readers.RECORD_NAME))
VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
# The flags the launcher itself adds around the recipe's.
OWN_FLAGS = ("--model", "--served-model-name", "--host", "--port")


def flags() -> list[str]:
    """Every flag this launcher can emit, derived from the recipe's tables: the image's verify step checks each
    against `vllm serve --help`."""
    return [*OWN_FLAGS, TIER_FLAG, *(f for f in recipe.every_flag() if f not in OWN_FLAGS and f != TIER_FLAG)]


class KnobError(UserError):
    pass


def merged_knobs(profile_knobs: dict[str, str], environ: Mapping[str, str],
                 host_kinds: tuple[str, ...] = ()) -> dict[str, str]:
    """The profile's knobs under the environment's, each in its one normalized form (knobs.py): whatever spelling a
    user chose, the recipe sees 1/0, plain numbers and stripped text. A HOST that names one of `host_kinds` (the
    hosts of images.yaml) is refused, naming SERVEKIT_HOST."""
    for old, new in RENAMED.items():  # the source's name for a knob: refused, naming the one to set
        if environ.get(old):
            raise KnobError(f"{old}={environ[old]!r} is the source repository's name; set {new} instead")
    if environ.get("HOST", "").strip() in host_kinds:  # the host kind under the source's name of the bind address
        raise KnobError(f"HOST={environ['HOST']!r} is the address vLLM listens on (the source's HOST); the host "
                        f"kind is {HOST_KIND_ENV}={environ['HOST'].strip()}")
    knobs = dict(profile_knobs)
    # An empty variable is unset (`KNOB=` in a compose file or shell must not override a default), but where the
    # source gives empty a meaning of its own (knobs.py: Knob.empty).
    knobs.update({k: v for k, v in environ.items() if k in KNOBS and (v != "" or KNOBS[k].empty is not None)})
    out = {}
    for name, value in knobs.items():
        try:
            out[name] = KNOBS[name].normalize(value)
        except ValueError as exc:
            raise KnobError(f"{name}={masked(value)!r}: {exc}") from None
    return out


def _flag_name(token: str) -> str:
    return token.split("=", 1)[0]


# Flags of EXTRA_ARGS whose companion settings (environment, sizes, backends) only a knob brings: refused on the
# source's recipes with the knob to use. A CPU tier (--kv-offloading-size) is taken as KV_OFFLOAD_GB instead.
NEEDS_A_KNOB = {
    "--speculative-config": "set SPEC, DRAFT_TOKENS and DRAFT_SAMPLE instead: the drafter's environment "
                            "(VLLM_DFLASH2_LOOKUP, VLLM_SPEC_DECODE_ATTN...) and the CUDA-graph sizes come with them",
    "--kv-cache-dtype": "set CTX (single-user) or KV (batch) instead: the attention backend, the block size and the "
                        "KVarN pool's environment come with them",
}
TIER_FLAG = "--kv-offloading-size"


def _extra_args(k: dict[str, str]) -> list[str]:
    """EXTRA_ARGS as tokens, its CPU tier folded into KV_OFFLOAD_GB (so the tier's environment and retention rules
    apply, as the source's `EXTRA_ARGS="--kv-offloading-size 8"` needs) and the flags that need a knob refused."""
    extra, problem = argv_words(k.get("EXTRA_ARGS", ""))
    if problem:
        raise KnobError(f"EXTRA_ARGS={masked(k['EXTRA_ARGS'])!r}: expected {problem}")
    rest, i = [], 0
    while i < len(extra):
        token, name = extra[i], _flag_name(extra[i])
        if name in NEEDS_A_KNOB and k.get("MODE", "plain") != "plain":
            raise KnobError(f"EXTRA_ARGS sets {name}: {NEEDS_A_KNOB[name]}")
        if name == TIER_FLAG:
            value = token.partition("=")[2] if "=" in token else (extra[i + 1] if i + 1 < len(extra) else "")
            i += 1 if "=" in token else 2
            try:
                k["KV_OFFLOAD_GB"] = KNOBS["KV_OFFLOAD_GB"].normalize(value)
            except ValueError as exc:
                raise KnobError(f"EXTRA_ARGS {TIER_FLAG} {value!r}: {exc}") from None
            continue
        rest.append(token)
        i += 1
    return rest


def build_command(profiles: dict, profile: str, host: str, environ: dict[str, str],
                  warn: Callable[[str], None] | None = None) -> tuple[list[str], dict]:
    """(argv, extra environment) for `vllm serve`: the profile's knobs under the environment's, through the
    recipe of its MODE (recipe.py), then KV_OFFLOAD_GB and EXTRA_ARGS, which win. `warn` hears of each flag of
    the profile's that EXTRA_ARGS shadows."""
    if profile not in profiles["profiles"]:
        raise KnobError(f"PROFILE={profile!r}: expected one of {', '.join(profiles['profiles'])}")
    if host not in profiles["hosts"]:
        raise KnobError(f"SERVEKIT_HOST={host!r}: expected one of {', '.join(profiles['hosts'])}")
    k = merged_knobs(profiles["profiles"][profile][host], environ, profiles["hosts"])
    extra_args = _extra_args(k)
    model = profiles["model"]
    try:
        flags, recipe_env = recipe.command(k, host, model, profiles["hosts"][host].get("batch"))
    except recipe.RecipeError as exc:
        raise KnobError(str(exc)) from None
    env = {**recipe.PRIVACY_ENV, **recipe_env, **profiles.get("env", {}), **profiles["hosts"][host]["env"]}
    args = ["--model", model["path"], "--served-model-name", model["served_name"], "--host",
            k.get("HOST", "0.0.0.0"), "--port", k.get("PORT", str(CONTAINER_PORT)), *flags]
    extra = ([TIER_FLAG, k["KV_OFFLOAD_GB"]] if "KV_OFFLOAD_GB" in k else []) + extra_args
    _refuse_abbreviations(extra_args, {_flag_name(t) for t in args if t.startswith("--")})
    if warn:
        mine = {_flag_name(t) for t in args}
        for flag in sorted({_flag_name(t) for t in extra if t.startswith("--")} & mine & set(recipe.WATCHED)):
            warn(f"EXTRA_ARGS sets {flag}, which the profile sets too; EXTRA_ARGS wins")
    return _extra_wins(args, extra), env


def _refuse_abbreviations(extra: list[str], profiles_flags: set[str]) -> None:
    """vLLM's parser takes an unambiguous prefix of a flag for the flag: EXTRA_ARGS `--kv-cache-dtyp` would set what
    a knob or the profile owns past the checks above, which match flags by their full names."""
    owned = profiles_flags | set(NEEDS_A_KNOB) | {TIER_FLAG}
    for token in extra:
        name = _flag_name(token)
        if token.startswith("--") and name not in owned and (full := sorted(f for f in owned if f.startswith(name))):
            raise KnobError(f"EXTRA_ARGS {name}: vLLM would read it as {full[0]}, which "
                            + ("a knob sets" if full[0] in NEEDS_A_KNOB or full[0] == TIER_FLAG else "the profile sets")
                            + "; spell the flag out")


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


def given_key(environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The key as the source's launchers take it: an exported VLLM_API_KEY wins, else API_KEY_FILE's (read_key)."""
    exported = environ.get("VLLM_API_KEY", "").strip()
    if not exported:
        return read_key(environ.get("API_KEY_FILE"))
    if len(exported) < MIN_KEY_CHARS or control_character(exported):
        return None, f"no API key: VLLM_API_KEY holds {len(exported)} characters, not one line of {MIN_KEY_CHARS} or more"
    if unsafe := header_unsafe(exported):  # a client would send another key than the server compares: every call a 401
        return None, f"no API key: VLLM_API_KEY is no key an HTTP header carries: expected {unsafe}"
    return exported, ""


def read_key(key_file: str | None) -> tuple[str | None, str]:
    """(the key, "") or (None, why there is none): unset, unreadable, empty or too short."""
    if not key_file:
        return None, "no API key: API_KEY_FILE is not set"
    try:
        key = read_secret(key_file)
    except Refused as exc:  # missing, a FIFO or a device (never waited on), too large, not one line of text
        return None, f"no API key: {exc}"
    if len(key) < MIN_KEY_CHARS:
        return None, f"no API key: {key_file} holds {len(key)} characters"
    return key, ""


def served_parts(model: dict, argv: list[str]) -> list[dict]:
    """What a launch serves from disk: the model, and the drafter its --speculative-config names, if any."""
    from .prepare import parts  # prepare's conversions load only where a launch prepares
    spec = json.loads(argv[argv.index("--speculative-config") + 1]) if "--speculative-config" in argv else {}
    return [model] + [p for p in parts(model)[1:] if spec.get("model") == p["path"]]


def _prepared(step: Callable[[], object], error: type[Exception]) -> int:
    try:
        step()
    except error as exc:
        abandoned = getattr(exc, "abandoned", False)  # a stalled transfer: its progress bar is mid-line
        print(f"{chr(10) if abandoned else ''}prepare: error: {exc}", file=sys.stderr, flush=True)
        if abandoned:  # its threads would hold a normal exit until the server lets go
            os._exit(1)
        return 1
    return 0


def read_profiles(path: Path) -> dict:
    """The rendered profiles the image bakes (or SERVEKIT_PROFILES names); Refused in one line when they are not."""
    try:
        profiles = json.loads(read_text(path, PROFILES_MAX_BYTES))
    except ValueError as exc:  # Refused is one
        raise Refused(str(exc) if isinstance(exc, Refused) else f"{path}: not JSON ({exc})") from None
    if not isinstance(profiles, dict) or not isinstance(profiles.get("model"), dict) or \
            not isinstance(profiles.get("profiles"), dict):
        raise Refused(f"{path}: not the rendered profiles (an object with a model and its profiles)")
    return profiles


def say_inert(profile: str, env: dict[str, str]) -> None:
    """Which of the variables this launch exports nothing in the image reads (the build's record), once: a knob that
    sets only those does nothing here, and the knobs check does not count them as reached."""
    record = readers.load(READERS_FILE)
    if record is None:
        return
    inert = sorted(name for name in env if name in record["inert"])
    print(f"launcher: profile {profile}: inert {json.dumps(inert)}", file=sys.stderr, flush=True)
    if inert:
        print(f"launcher: note: nothing in this image reads {', '.join(inert)}: the knobs that set them do nothing "
              "here (the shipped series carries no reader of them; a series of yours may: docs/profiles.md)",
              file=sys.stderr, flush=True)


def int8_activation_problem(env: dict[str, str], model_dir: Path, record: dict | None) -> str | None:
    """Why this launch would die in vLLM's Marlin (measured at full size on a GPU, 2026-12-05: "W8A8 is not
    supported by marlin kernel"), or None: int8 activations asked for (INT8_ACT=int8), nothing here reading the
    variable that limits them to some layers (the build's record), and a model whose lm_head is int8 (prepare's
    QUANT_LM_HEAD), which Marlin cannot run with int8 activations."""
    limit = "VLLM_MARLIN_INT8_INCLUDE_RE"
    if env.get("VLLM_MARLIN_INPUT_DTYPE") != "int8" or record is None or limit not in record["inert"]:
        return None
    try:
        groups = json.loads(read_text(model_dir / "config.json", PROFILES_MAX_BYTES))["quantization_config"][
            "config_groups"]
        int8_head = any(g["weights"]["num_bits"] == 8 and any("lm_head" in t for t in g["targets"])
                        for g in groups.values())
    except (ValueError, KeyError, TypeError, AttributeError):  # no config or no groups: nothing int8 to meet
        return None
    return (f"INT8_ACT=int8 gives every Marlin layer int8 activations here (nothing in this image reads {limit}, "
            "which keeps them to the MLP in the source), and this model's lm_head is int8, which Marlin cannot run "
            "with int8 activations: set INT8_ACT=off, or QUANT_LM_HEAD=0 on a fresh prepare") if int8_head else None


def host_kind(environ: Mapping[str, str], kernel_release: str) -> tuple[str, str]:
    """(the host's kind, why): SERVEKIT_HOST when set; else the source's launchers' rule, wsl2 where the kernel's
    release names Microsoft or WSL_DISTRO_NAME is set, native otherwise."""
    if given := environ.get(HOST_KIND_ENV, "").strip():
        return given, f"{HOST_KIND_ENV}={given}"
    if "microsoft" in kernel_release.lower():
        return "wsl2", f"the kernel is WSL2's ({kernel_release.strip()[:80]})"
    if environ.get("WSL_DISTRO_NAME"):
        return "wsl2", "WSL_DISTRO_NAME is set"
    return "native", "the kernel is not WSL2's"


def _kernel_release() -> str:
    try:
        return KERNEL_RELEASE_FILE.read_text(errors="replace")[:256]
    except OSError:  # not Linux, or /proc not mounted: nothing says WSL2
        return ""


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else "serve"
    if command == "flags":
        print("\n".join(flags()))
        return 0
    if command not in ("serve", "prepare"):
        print(f"launcher: unknown command {command!r}; expected serve [PROFILE], prepare [PROFILE] or flags",
              file=sys.stderr)
        return 2
    try:
        profiles = read_profiles(PROFILES_FILE)
    except Refused as exc:
        print(f"launcher: refusing to start: {exc} (SERVEKIT_PROFILES names the file; the image bakes it)",
              file=sys.stderr)
        return 2
    from .prepare import PrepareError, is_complete, prepare, provided  # as above
    profiles["model"] = provided(profiles["model"], dict(os.environ))
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if command == "prepare" and len(argv) < 3:  # Compose's prepare service: the model and every drafter
        return _prepared(lambda: prepare(profiles["model"], say=say), PrepareError)
    profile = argv[2] if len(argv) > 2 else os.environ.get("PROFILE", "default")
    try:
        host, why = host_kind(os.environ, _kernel_release())
        if host == "wsl2" and not os.environ.get(HOST_KIND_ENV):  # said: it changes the defaults
            say(f"launcher: the wsl2 host's defaults: {why} (SERVEKIT_HOST=native overrides)")
        args, env = build_command(profiles, profile, host, dict(os.environ),
                                  warn=lambda line: print(f"launcher: warning: {line}", file=sys.stderr))
    except KnobError as exc:
        print(f"launcher: refusing to start: {exc}", file=sys.stderr)
        return 2
    needed = served_parts(profiles["model"], args)
    if command == "prepare":  # `prepare PROFILE`: what that profile serves (the process engine), no more
        return _prepared(lambda: prepare(profiles["model"], say=say, needed=needed), PrepareError)
    key, problem = given_key(os.environ)
    if key:  # the key travels in the environment, never on the command line or in a log
        env["VLLM_API_KEY"] = key
    elif profile in profiles.get("without_key", []):
        print(f"launcher: profile {profile} serves WITHOUT an API key (images.yaml says auth: none)", file=sys.stderr)
    elif os.environ.get("PRINT_ARGV") == "1":  # prints, serves nothing: the source's PRINT_ARGV needs no key either
        print(f"launcher: {problem}; serve would refuse to start without one", file=sys.stderr)
    else:  # vLLM adds its auth only for a non-empty key: without one it would serve an open API
        print(f"launcher: refusing to start: {problem}; set VLLM_API_KEY (compose/.env), or mount a key file of at "
              f"least {MIN_KEY_CHARS} characters and set API_KEY_FILE to it (`build.py up` does), or give the "
              "profile auth: none in images.yaml",
              file=sys.stderr)
        return 2
    missing = [p for p in needed if not is_complete(p)]
    if missing and os.environ.get("PRINT_ARGV") != "1":
        what = "the model" if missing[0] is profiles["model"] else "the drafter this profile needs"
        print(f"launcher: refusing to start: {what} in {missing[0]['path']} is missing or incomplete; "
              "run the prepare step first (docker compose runs it before every profile)", file=sys.stderr)
        return 2
    if not missing and (clash := int8_activation_problem(env, Path(needed[0]["path"]), readers.load(READERS_FILE))):
        print(f"launcher: refusing to start: {clash}", file=sys.stderr)
        return 2
    shown = {name: "***" if "KEY" in name or "TOKEN" in name else env[name] for name in sorted(env)}
    if os.environ.get("PRINT_ARGV") == "1":
        say_inert(profile, env)
        print(masked(shlex.join(["vllm", "serve", *args])))  # what `-m vllm.entrypoints.cli.main serve` is
        print("\n".join(f"{name}={value}" for name, value in shown.items()))
        return 0
    os.environ.update(env)
    # These lines are what the knobs check compares with what the engine parsed and the process holds.
    print(f"launcher: profile {profile}: vllm serve {masked(shlex.join(args))}", file=sys.stderr, flush=True)
    print(f"launcher: profile {profile}: environment {json.dumps(shown)}", file=sys.stderr, flush=True)
    say_inert(profile, env)
    os.execv(VLLM[0], VLLM + args)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
