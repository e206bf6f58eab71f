"""Speculative decoding: tokens per step (accepted draft tokens per drafting step, plus the one the
target model always adds) at temperature 0 and at the default temperature, from vLLM's counters."""

from __future__ import annotations

import re

from . import Context, Skip, check, ensure

COUNTER = re.compile(r"^(vllm:spec_decode_num_(?:accepted_tokens|drafts)_total)\{[^}]*\} ([0-9.e+]+)$", re.M)
PROMPT = [{"role": "user", "content": "Copy this exactly: the quick brown fox jumps over the lazy dog, twice."}]


def _tokens_per_step(ctx: Context, requests_n: int, max_tokens: int, **sampling) -> float:
    before = ctx.metric_totals(COUNTER)
    for _ in range(requests_n):
        ctx.chat(PROMPT, max_tokens=max_tokens, **sampling)
    after = ctx.metric_totals(COUNTER)
    drafts = after["vllm:spec_decode_num_drafts_total"] - before["vllm:spec_decode_num_drafts_total"]
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - before["vllm:spec_decode_num_accepted_tokens_total"]
    ensure(drafts > 0, "the server speculates but drafted nothing for these requests")
    return 1.0 + accepted / drafts


@check("spec_decode")
def spec_decode(ctx: Context, requests: int = 8, max_tokens: int = 256) -> dict:
    if "vllm:spec_decode_num_drafts_total" not in ctx.metric_totals(COUNTER):
        raise Skip("the server does not speculate (no spec-decode counters on /metrics)")
    return {"greedy": round(_tokens_per_step(ctx, requests, max_tokens, temperature=0), 3),
            "sampled": round(_tokens_per_step(ctx, requests, max_tokens), 3)}
