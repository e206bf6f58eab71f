"""The server's log: no tracebacks, no out-of-memory, no compiles during inference; knobs reached the engine."""

from __future__ import annotations

import ast
import re
import shlex

from . import CheckFailure, Context, Skip, check, ensure

TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
OOM = re.compile(r"out of memory|OutOfMemoryError|No available memory for the cache blocks", re.I)
COMPILE = re.compile(r"Compiling a graph|torch\._dynamo|inductor.*compil|JIT compil|Compiling kernel", re.I)
LAUNCH = re.compile(r"launcher: profile \S+: vllm serve (.+)$")
NON_DEFAULT = re.compile(r"non-default args: (\{.*\})\s*$")


def _lines(ctx: Context) -> list[str]:
    if ctx.logs is None:
        raise Skip("the server's log is not available (a remote URL)")
    return ctx.logs()


@check("logs")
def logs(ctx: Context) -> dict:
    lines = _lines(ctx)
    tracebacks = [line for line in lines if TRACEBACK.search(line)]
    ooms = [line for line in lines if OOM.search(line)]
    compiles = [line for line in lines[ctx.healthy_line:] if COMPILE.search(line)]
    figures = {"lines": len(lines), "tracebacks": len(tracebacks), "out_of_memory": len(ooms),
               "compiles_during_inference": len(compiles)}
    ensure(not tracebacks and not ooms and not compiles,
           "; ".join(f"{what}: {found[0].strip()[:160]}" for what, found in
                     (("traceback", tracebacks), ("out of memory", ooms), ("compile", compiles)) if found), **figures)
    return figures


def _flag_values(argv: list[str]) -> dict[str, str | bool]:
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


def _same(wanted, got) -> bool:
    if wanted is True:
        return got is True
    if isinstance(got, list):
        got = got[0] if len(got) == 1 else got
    try:
        return float(wanted) == float(got)
    except (TypeError, ValueError):
        return str(wanted) == str(got) or str(got).replace("'", '"').replace(" ", "") == \
            str(wanted).replace(" ", "")


ENUM_REPR = re.compile(r"<[\w.]+: ('[^']*'|-?\d+)>")


@check("knobs")
def knobs(ctx: Context) -> dict:
    """Every flag the launcher passed must appear, with its value, among the engine's logged arguments."""
    lines = _lines(ctx)
    launch = next((LAUNCH.search(line) for line in lines if LAUNCH.search(line)), None)
    engine = next((NON_DEFAULT.search(line) for line in lines if NON_DEFAULT.search(line)), None)
    if not launch or not engine:
        raise Skip("the launcher's or the engine's argument line is not in the log")
    wanted = _flag_values(shlex.split(launch[1]))
    try:  # an enum is logged as its repr (<DynamicShapesType.BACKED: 'backed'>): read it as its value
        got = ast.literal_eval(ENUM_REPR.sub(r"\1", engine[1]))
    except (ValueError, SyntaxError) as exc:
        raise CheckFailure(f"the engine's argument line cannot be read ({type(exc).__name__}): "
                           f"{engine[1][:160]}") from None
    aliases = {"model": "model_tag", "enable_prefix_caching": "enable_prefix_caching"}
    missing, seen = {}, {}
    for name, value in wanted.items():
        if name in ("host", "port") and name not in got:
            continue  # vLLM leaves its defaults out of "non-default args" (port 8000)
        key = name if name in got else aliases.get(name, name)
        if name.startswith("no_"):
            key, value = name[3:], False
            if got.get(key, False) is not False:
                missing[name] = got.get(key)
            continue
        seen[name] = got.get(key, "absent")
        if key not in got or not _same(value, got[key]):
            missing[name] = got.get(key, "absent")
    # what the engine says it runs with, per flag: a sweep's cells can be told apart by it
    figures = {"flags": len(wanted), "reached": len(wanted) - len(missing),
               "engine_values": {k: v if isinstance(v, (str, int, float, bool)) or v is None else str(v)
                                 for k, v in seen.items() if "key" not in k and "token" not in k}}
    ensure(not missing, f"flags that did not reach the engine: {missing}", **figures)
    return figures
