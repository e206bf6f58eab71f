"""Tool calls: a forced call on a tool with no parameters returns exactly {}; auto calls are well formed."""

from __future__ import annotations

import json
from typing import Any

from .core import Context, check, ensure

NO_PARAMS_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Get the current time.",
                                                   "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What time is it?"}]


@check("tool_required", bounds={"max_runaway": (0, None)})
def tool_required(ctx: Context, seeds: int = 20, max_tokens: int = 2048, max_runaway: int = 2) -> dict:
    """N seeds; each must return one call with arguments exactly {}. The source's runaway, a call that is complete
    ({} and its closing tag decoded) and then decodes whitespace until max_tokens (2 of 20 seeds on 0.31.0 batch),
    is counted as such and allowed up to max_runaway; a call cut off by max_tokens before it was complete, or text
    decoded after it, is no runaway but a wrong answer."""
    empty = runaway = 0
    wrong: list[str] = []
    for seed in range(seeds):
        r = ctx.chat(ASK, tools=[NO_PARAMS_TOOL], tool_choice="required", seed=seed, max_tokens=max_tokens)
        choice = r["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        args = [c["function"]["arguments"] for c in calls]
        complete = len(calls) == 1 and _json(args[0]) == {}
        trailing = (choice["message"].get("content") or "").strip()
        if complete and not trailing:
            empty += 1
            runaway += choice["finish_reason"] == "length"  # a whitespace runaway: complete, then blanks to the end
        elif complete:
            wrong.append(f"seed {seed}: text after the call: {trailing[:60]!r}")
        else:
            cut = " (cut off by max_tokens)" if choice["finish_reason"] == "length" else ""
            wrong.append(f"seed {seed}: {args}{cut}")
    figures = {"seeds": seeds, "empty_arguments": empty, "whitespace_runaways": runaway}
    ensure(not wrong, f"{seeds - len(wrong)} of {seeds} seeds returned exactly {{}}; {'; '.join(wrong[:3])}",
           **figures)
    ensure(runaway <= max_runaway, f"{runaway} of {seeds} forced calls were complete and then decoded whitespace "
           f"until max_tokens (allowed {max_runaway})", **figures)
    return figures


def _json(text: str | None) -> Any:
    try:
        return json.loads(text or "null")
    except ValueError:
        return None


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
