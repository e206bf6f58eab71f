"""Tool calls: a forced call on a tool with no parameters returns exactly {}; auto calls are well formed."""

from __future__ import annotations

import json

from . import Context, check, ensure

NO_PARAMS_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Get the current time.",
                                                   "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What time is it?"}]


@check("tool_required", bounds={"max_runaway": (0, None)})
def tool_required(ctx: Context, seeds: int = 20, max_tokens: int = 2048, max_runaway: int = 2) -> dict:
    """N seeds; each must return one call with arguments exactly {}. A call that keeps decoding after
    a correct {} until max_tokens (the source saw 2 of 20) is counted, and allowed up to max_runaway."""
    empty = runaway = 0
    wrong: list[str] = []
    for seed in range(seeds):
        r = ctx.chat(ASK, tools=[NO_PARAMS_TOOL], tool_choice="required", seed=seed, max_tokens=max_tokens)
        choice = r["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        args = [c["function"]["arguments"] for c in calls]
        if len(calls) == 1 and json.loads(args[0] or "null") == {}:
            empty += 1
        else:
            wrong.append(f"seed {seed}: {args}")
        if choice["finish_reason"] == "length":
            runaway += 1
    figures = {"seeds": seeds, "empty_arguments": empty, "runaway_to_max_tokens": runaway}
    ensure(empty == seeds, f"{empty} of {seeds} seeds returned exactly {{}}; {'; '.join(wrong[:3])}", **figures)
    ensure(runaway <= max_runaway, f"{runaway} of {seeds} forced calls kept decoding to max_tokens "
           f"(allowed {max_runaway})", **figures)
    return figures


@check("tool_auto")
def tool_auto(ctx: Context, max_tokens: int = 256, thinking: str = "on,off") -> dict:
    """tool_choice=auto must give a well-formed call with thinking on and off (`thinking` picks which)."""
    outcome = {}
    for on in [mode.strip() == "on" for mode in thinking.split(",")]:
        r = ctx.chat(ASK, tools=[NO_PARAMS_TOOL], tool_choice="auto", max_tokens=max_tokens, temperature=0,
                     chat_template_kwargs={"enable_thinking": on})
        calls = r["choices"][0]["message"].get("tool_calls") or []
        ok = len(calls) >= 1 and all(c["function"]["name"] == "get_time" and
                                     isinstance(json.loads(c["function"]["arguments"] or "{}"), dict) for c in calls)
        outcome["thinking on" if on else "thinking off"] = "call" if ok else f"no well-formed call: {calls}"
    bad = {k: v for k, v in outcome.items() if v != "call"}
    ensure(not bad, "; ".join(f"{k}: {v}" for k, v in bad.items()), outcome=outcome)
    return {"outcome": outcome}
