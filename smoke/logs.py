"""The server's log: no tracebacks, no out-of-memory, no compiles during inference; knobs reached the engine."""

from __future__ import annotations

import ast
import json
import re
import shlex
from typing import Any

from servekit.image.recipe import BOOLEAN_ENV

from .core import CheckFailure, Context, NotRun, check, ensure

TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
OOM = re.compile(r"out of memory|OutOfMemoryError|No available memory for the cache blocks", re.I)
COMPILE = re.compile(r"Compiling a graph|torch\._dynamo|inductor.*compil|JIT compil|Compiling kernel", re.I)
# vLLM's JIT monitor names the kernel: "Triton kernel JIT compilation during inference: NAME."
JIT_KERNEL = re.compile(r"JIT compilation during inference: (\w+(?:\.\w+)*)")
LAUNCH = re.compile(r"launcher: profile \S+: vllm serve (.+)$")
NON_DEFAULT = re.compile(r"non-default args: (\{.*\})\s*$")


def _lines(ctx: Context) -> list[str]:
    if ctx.logs is None:
        raise NotRun("the server's log cannot be read (a remote URL): nothing to judge")
    return ctx.logs()


@check("logs")
def logs(ctx: Context) -> dict:
    lines = _lines(ctx)
    tracebacks = [line for line in lines if TRACEBACK.search(line)]
    ooms = [line for line in lines if OOM.search(line)]
    compiles = [line for line in lines[ctx.healthy_line:] if COMPILE.search(line)]
    # Every kernel the monitor named, so one visit to a GPU says all that a warm-up must cover.
    kernels = sorted({m[1] for m in map(JIT_KERNEL.search, compiles) if m})
    figures = {"lines": len(lines), "tracebacks": len(tracebacks), "out_of_memory": len(ooms),
               "compiles_during_inference": len(compiles), "kernels_compiled_during_inference": kernels}
    found = [f"{what}: {hits[0].strip()[:160]}" for what, hits in
             (("traceback", tracebacks), ("out of memory", ooms), ("compile", compiles)) if hits]
    if kernels:
        found.append(f"kernels compiled during inference: {', '.join(kernels)}")
    ensure(not tracebacks and not ooms and not compiles, "; ".join(found), **figures)
    return figures


def flag_values(argv: list[str]) -> dict[str, str | bool]:
    """vLLM's flags in `argv` by name (dashes as underscores): a flag's value, or True for a bare switch."""
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("--"):
            name, _, value = token[2:].partition("=")
            if not value and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            out[name.replace("-", "_")] = value if value else True
        i += 1
    return out


def _parsed(text: str) -> Any:
    """A flag's value as vLLM's argument parser reads it: JSON (a config, a number, null) where it parses."""
    if text == "None":
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _same(wanted: Any, got: Any) -> bool:
    """Whether the engine's parsed value is the flag's: numbers as numbers, a JSON config key by key (the engine may
    hold more keys than were given, never other values for those given)."""
    if wanted is True:
        return got is True
    wanted = _parsed(wanted)
    if isinstance(got, list) and len(got) == 1 and not isinstance(wanted, list):
        got = got[0]
    return _same_value(wanted, got)


def _same_value(wanted: Any, got: Any) -> bool:
    if isinstance(wanted, dict):
        return isinstance(got, dict) and all(k in got and _same_value(v, got[k]) for k, v in wanted.items())
    if isinstance(wanted, bool) or isinstance(got, bool):
        return wanted is got
    if isinstance(wanted, (int, float)) and isinstance(got, (int, float)):
        return float(wanted) == float(got)
    if isinstance(wanted, list) and isinstance(got, (list, tuple)):
        return len(wanted) == len(got) and all(_same_value(a, b) for a, b in zip(wanted, got, strict=True))
    return wanted == got or (isinstance(got, str) and str(wanted) == got)


ENUM_REPR = re.compile(r"<[\w.]+: ('[^']*'|-?\d+)>")
# A flag vLLM consumes before it logs its non-default arguments, so its absence there says nothing: the API server's
# count (the H200 runs: named "did not reach the engine" while in force).
NOT_ECHOED = frozenset({"api_server_count"})
# vLLM logs only the arguments that differ from its parser's defaults, so a flag passed at the pinned vLLM's default
# is in force yet absent there (the port; alternative's --prefix-cache-retention-interval 0 on the H200). Each flag a
# profile passes at vLLM's default, with that default: tests/test_cuda.py asks the pinned vLLM's parser.
AT_VLLM_DEFAULT = {"port": 8000, "prefix_cache_retention_interval": 0}
ALIASES = {"model": "model_tag"}
ENVIRONMENT = re.compile(r"launcher: profile \S+: environment (\{.*\})\s*$")
INERT = re.compile(r"launcher: profile \S+: inert (\[.*\])\s*$")  # what the image's build found nothing reads


def _engine_args(lines: list[str]) -> tuple[dict[str, str | bool], dict]:
    launch = next((m for m in map(LAUNCH.search, lines) if m), None)
    engine = next((m for m in map(NON_DEFAULT.search, lines) if m), None)
    if not launch or not engine:
        raise NotRun("the launcher's or the engine's argument line is not in the log, so what reached the engine "
                     "could not be read")
    try:  # an enum is logged as its repr (<DynamicShapesType.BACKED: 'backed'>): read it as its value
        got = ast.literal_eval(ENUM_REPR.sub(r"\1", engine[1]))
    except (ValueError, SyntaxError) as exc:
        raise CheckFailure(f"the engine's argument line cannot be read ({type(exc).__name__}): "
                           f"{engine[1][:160]}") from None
    return flag_values(shlex.split(launch[1])), got


def _flags_missing(wanted: dict[str, str | bool], got: dict) -> tuple[dict, dict, list[str]]:
    """(flag -> what the engine holds instead, flag -> the engine's value, flags it does not echo)."""
    missing, seen, not_echoed = {}, {}, []
    for name, value in wanted.items():
        if name.startswith("no_"):
            if got.get(name[3:], False) is not False:
                missing[name] = got.get(name[3:])
            continue
        key = name if name in got else ALIASES.get(name, name)
        at_default = name in AT_VLLM_DEFAULT and _same(value, AT_VLLM_DEFAULT[name])
        if key not in got and (name in NOT_ECHOED or at_default):
            not_echoed.append(name)
            continue
        seen[name] = got.get(key, "absent")
        if key not in got or not _same(value, got[key]):
            missing[name] = got.get(key, "absent")
    return missing, seen, not_echoed


def _exported(lines: list[str]) -> dict[str, str]:
    said = next((m for m in map(ENVIRONMENT.search, lines) if m), None)
    if not said:
        raise NotRun("the launcher's environment line is not in the log, so what it exported could not be compared")
    return json.loads(said[1])


def _inert(lines: list[str]) -> list[str] | None:
    """The exported variables the image's build found nothing reads, or None where the image records no readers."""
    said = next((m for m in map(INERT.search, lines) if m), None)
    return json.loads(said[1]) if said else None


def _environment_missing(exported: dict[str, str], environ: dict[str, str]) -> tuple[dict[str, str], int]:
    """(variable -> what the serving process holds instead, how many were compared) for every variable the launcher
    exported, as its log line says; a masked value (a key) is not compared. A variable vLLM reads as a boolean
    holds 1 or 0: vLLM reads anything else as off (the source's VLLM_DFLASH2_LOOKUP=true ran without lookup)."""
    missing = {}
    for name, value in exported.items():
        if value == "***":
            continue
        if environ.get(name) != value:
            missing[name] = environ.get(name, "absent")
        elif name in BOOLEAN_ENV and value not in ("0", "1"):
            missing[name] = f"{value!r}, which vLLM reads as off (it reads 1 as on)"
    return missing, sum(1 for v in exported.values() if v != "***")


@check("knobs")
def knobs(ctx: Context, live: str = "") -> dict:
    """Every flag the launcher passed appears, with its value as vLLM parses it, among the engine's logged arguments,
    and every variable the launcher exported is in the serving process's environment, as vLLM reads it; a variable
    nothing in the image reads (the build's record) is listed as inert, not counted as reached, and fails the check
    when `live` (comma-separated) names it."""
    lines = _lines(ctx)
    wanted, got = _engine_args(lines)
    if ctx.environ is None:
        raise NotRun("the serving process's environment cannot be read (a remote URL), so the exported knobs could "
                     "not be compared")
    missing, seen, not_echoed = _flags_missing(wanted, got)
    try:
        environ = ctx.environ()
    except Exception as exc:  # the engine's error (a container gone, no /proc): the comparison could not be made
        raise NotRun(f"the serving process's environment could not be read: {exc}") from None
    exported, inert = _exported(lines), _inert(lines)
    env_missing, compared = _environment_missing(exported, environ)
    must = [name.strip() for name in live.split(",") if name.strip()]
    if must and inert is None:
        raise NotRun(f"the image records no readers of its variables (built before servekit recorded them), so whether "
                     f"{', '.join(must)} is read could not be told")
    inert = inert or []
    dead = [name for name in must if name in inert or name not in exported]
    # what the engine says it runs with, per flag: a sweep's cells can be told apart by it
    figures = {"flags": len(wanted), "reached": len(wanted) - len(missing) - len(not_echoed),
               "not_echoed": not_echoed, "environment": compared, "inert": inert,
               "environment_reached": compared - len(env_missing) - len([n for n in inert if n not in env_missing]),
               "engine_values": {k: v if isinstance(v, (str, int, float, bool)) or v is None else str(v)
                                 for k, v in seen.items() if "key" not in k and "token" not in k}}
    problems = ([f"flags that did not reach the engine: {missing}"] if missing else []) + \
        ([f"environment the serving process lacks: {env_missing}"] if env_missing else []) + \
        ([f"{', '.join(dead)}, which this profile needs live, {'is' if len(dead) == 1 else 'are'} not read by anything "
          "in this image (inert) or not exported"] if dead else [])
    ensure(not problems, "; ".join(problems), **figures)
    return figures
