"""Speculative decoding: tokens per step (accepted draft tokens per drafting step, plus the one the
target model always adds) at temperature 0 and at the default temperature, from vLLM's counters,
each against its floor (the profile's, from the source's acceptance for the served checkpoint)."""

from __future__ import annotations

from typing import Any

from .core import Context, NotRun, check, ensure

DRAFTS, ACCEPTED = "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"
COUNTER = (DRAFTS, ACCEPTED)
PROMPT = [{"role": "user", "content": "Copy this exactly: the quick brown fox jumps over the lazy dog, twice."}]


def tokens_per_step(before: dict[str, float], after: dict[str, float]) -> float | None:
    """1 + accepted / drafts between two readings of the counters (bench/harness.py's formula); None without drafts."""
    drafts = after.get(DRAFTS, 0.0) - before.get(DRAFTS, 0.0)
    accepted = after.get(ACCEPTED, 0.0) - before.get(ACCEPTED, 0.0)
    return 1.0 + accepted / drafts if drafts > 0 else None


def _measure(ctx: Context, requests_n: int, max_tokens: int, **sampling: Any) -> float:
    before = ctx.metric_totals(COUNTER)
    for _ in range(requests_n):
        ctx.chat(PROMPT, max_tokens=max_tokens, **sampling)
    measured = tokens_per_step(before, ctx.metric_totals(COUNTER))
    ensure(measured is not None, "the server has spec-decode counters but drafted nothing for these requests")
    return round(measured, 3)  # type: ignore[arg-type]


@check("spec_decode", bounds={"min_greedy": (1.0, None), "min_sampled": (1.0, None)})
def spec_decode(ctx: Context, requests: int = 8, max_tokens: int = 256, min_greedy: float = 1.5,
                min_sampled: float = 1.5) -> dict:
    """Tokens per step at temperature 0 (greedy) and at the server's default temperature (sampled), each at least
    its floor: 1.0 means no draft token was ever accepted, which a working drafter never gives."""
    if DRAFTS not in ctx.metric_totals(COUNTER):
        raise NotRun("the server has no spec-decode counters on /metrics: it does not speculate, so tokens per step "
                     "could not be measured")
    figures = {"greedy": _measure(ctx, requests, max_tokens, temperature=0), "sampled": _measure(ctx, requests, max_tokens),
               "min_greedy": min_greedy, "min_sampled": min_sampled}
    low = [f"{name} {figures[name]} below its floor {floor}" for name, floor in
           (("greedy", min_greedy), ("sampled", min_sampled)) if figures[name] < floor]
    ensure(not low, f"tokens per step: {'; '.join(low)}", **figures)
    return figures
