"""Prefix caching: long conversations in flight at once reusing their prefix on turn 2, and the same answer cold
and warm."""

from __future__ import annotations

import hashlib
import statistics
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from .core import CheckFailure, Context, NotRun, check, ensure, text_of

# The prefix cache's counters, and a CPU KV tier's bytes moved (vLLM's offloading connector): store is GPU to
# CPU, load is CPU to GPU.
METRIC = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:kv_offload_store_bytes_total",
          "vllm:kv_offload_load_bytes_total")


def _conversation(seed: int, words: int) -> list[dict]:
    # Distinct long documents, so the two conversations share nothing but the template.
    text = " ".join(f"c{seed}w{(i * 7 + seed) % 89}" for i in range(words))
    return [{"role": "user", "content": f"Document {seed}:\n{text}\nSummarise it."}]


def _words_for(ctx: Context, tokens: int, max_tokens: int, sample_words: int = 300) -> int:
    """Words a conversation needs for a prompt of about `tokens` tokens, its second turn still inside the server's
    max_model_len: measured with the server's /tokenize (vLLM's answers the count and the limit), else about three
    tokens a word (what the served model's vocabulary gives)."""
    try:
        resp = ctx.post("/tokenize", {"model": ctx.model, "messages": _conversation(0, sample_words)})
        resp.raise_for_status()
        body = resp.json()
        per_word, limit = body["count"] / sample_words, body.get("max_model_len")
    except (requests.RequestException, ValueError, KeyError, TypeError, ZeroDivisionError):
        return max(16, tokens // 3)
    budget = min(tokens, limit - 2 * max_tokens - 128) if limit else tokens
    return max(16, int(budget / per_word))


@check("long_conversations", bounds={"conversations": (1, 4), "min_cached_share": (0.01, 1.0)})
def long_conversations(ctx: Context, conversations: int = 2, tokens: int = 60000, min_cached_share: float = 0.9,
                       max_tokens: int = 16, tier: bool = False) -> dict:
    """`conversations` long conversations at once (as that many users), each asked a second turn: every turn 2 must
    find at least `min_cached_share` of its prompt in the prefix cache. The source measured, per profile, what the
    pool holds: one ~60K conversation reuses 97-99% at CTX=fast and 94.5% at CTX=huge, where two at once reuse
    nothing by design; alternative.sh reuses 93.5% for two at once. With `tier`, the server must have a CPU KV tier,
    and a tier that stored bytes but read none back while turn 2 fell short is named as the source's regression."""
    words = _words_for(ctx, tokens, max_tokens)
    convs = [_conversation(seed, words) for seed in range(1, conversations + 1)]
    before = ctx.metric_totals(METRIC)
    with ThreadPoolExecutor(conversations) as pool:  # all in flight at once, as that many users would be
        turn1 = list(pool.map(lambda m: ctx.chat(m, temperature=0, max_tokens=max_tokens), convs))
        turn2_msgs = [m + [{"role": "assistant", "content": text_of(r["choices"][0]["message"])},
                           {"role": "user", "content": "And in one word?"}] for m, r in zip(convs, turn1, strict=True)]
        turn2 = list(pool.map(lambda m: ctx.chat(m, temperature=0, max_tokens=max_tokens), turn2_msgs))
    after = ctx.metric_totals(METRIC)
    per = []
    for r in turn2:
        details = r["usage"].get("prompt_tokens_details") or {}
        cached, prompt = details.get("cached_tokens") or 0, r["usage"]["prompt_tokens"]
        per.append({"prompt_tokens": prompt, "cached_tokens": cached, "share": round(cached / prompt, 4)})
    moved = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    queries, hits = moved.get("vllm:prefix_cache_queries_total", 0), moved.get("vllm:prefix_cache_hits_total", 0)
    figures = {"turn2": per, "turn2_min_cached_share": min(p["share"] for p in per),
               "counter_queries": queries, "counter_hits": hits,
               "counter_hit_share": round(hits / queries, 4) if queries else None}
    has_tier = "vllm:kv_offload_store_bytes_total" in after
    if has_tier:
        figures.update(offload_gpu_to_cpu_bytes=moved["vllm:kv_offload_store_bytes_total"],
                       offload_cpu_to_gpu_bytes=moved.get("vllm:kv_offload_load_bytes_total", 0))
    elif tier:
        raise CheckFailure("the profile serves with a CPU KV tier, and the server has no tier counters "
                           "(vllm:kv_offload_*_bytes_total) on /metrics: no tier is in use", **figures)
    low = [p for p in per if p["share"] < min_cached_share]
    if low and has_tier and figures["offload_gpu_to_cpu_bytes"] > 0 and figures["offload_cpu_to_gpu_bytes"] == 0:
        raise CheckFailure(f"the CPU tier stored {figures['offload_gpu_to_cpu_bytes'] / 1e9:.2f} GB and read 0 bytes "
                           f"back while turn 2 reused {', '.join(str(p['share']) for p in per)}: the tier stores but "
                           "never serves (the source's regression from upstream #51787; the source carries upstream's "
                           "open PR #61050 for it, which this image's series does not yet)", **figures)
    ensure(not low, f"turn-2 cached share {', '.join(str(p['share']) for p in per)} below {min_cached_share}",
           **figures)
    return figures


def _block_size(ctx: Context) -> int | None:
    """The prefix cache's block from the engine's own /metrics (vllm:cache_config_info), as residue_sweep.py reads
    it."""
    found = [s.labels.get("block_size", "") for s in ctx.metrics() if s.name == "vllm:cache_config_info"]
    return int(found[0]) if found and found[0].isdigit() else None


def document(chars: int) -> str:
    """Numbered lines of plain words, the same on every run: the text the model is asked to copy."""
    words = ["river", "stone", "cobalt", "lantern", "meadow", "harbour", "signal", "copper", "willow", "orbit"]
    lines: list[str] = []
    size = 0
    while size < chars:
        i = len(lines)
        lines.append(f"{i + 1:04d} " + " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(8)))
        size += len(lines[-1]) + 1
    return "\n".join(lines)[:chars]


def copy_request(document_chars: int, lines: int) -> tuple[str, str]:
    """The residue sweep's request before its padding, and the verbatim copy it asks for."""
    text = document(document_chars)
    return (f"Document:\n{text}\n\nReproduce the first {lines} lines of the document verbatim, nothing else.",
            "\n".join(text.splitlines()[:lines]))


def _coverage(answer: str, expected: str) -> float:
    """How much of the answer copies the document verbatim from its start: the common prefix's share of what could
    have matched."""
    answer, expected = answer.strip(), expected.strip()
    reach = min(len(answer), len(expected))
    if not reach:
        return 0.0
    same = next((i for i in range(reach) if answer[i] != expected[i]), reach)
    return same / reach


def _residue_prompts(ctx: Context, base: str, residues: int, block: int, thinking_off: dict) -> list[tuple[int, int, list]]:
    """(residue, prompt tokens, messages) for `residues` prompts that differ only in their padding, one pad more
    each (one ' x' is one token in the served family's vocabularies), until every residue of the block that
    `residues` can cover is covered; the templated length is the server's own count (/tokenize)."""
    wanted = min(residues, block)
    found: list[tuple[int, int, list]] = []
    seen: set[int] = set()
    for pad in range(4 * residues):
        if len(found) >= residues and len(seen) >= wanted:
            break
        messages = [{"role": "user", "content": base + " x" * pad}]
        resp = ctx.post("/tokenize", {"model": ctx.model, "messages": messages, **thinking_off})
        resp.raise_for_status()
        count = resp.json()["count"]
        if count % block in seen and len(found) >= residues:
            continue
        seen.add(count % block)
        found.append((count % block, count, messages))
    if len(seen) < wanted:
        raise NotRun(f"{4 * residues} paddings reached {len(seen)} of the block's {wanted} residues: this tokenizer "
                     "does not step one token a pad")
    return found


@check("prefix_cache", bounds={"residues": (1, 1024), "max_broken": (0, None), "block": (0, None),
                               "min_coverage_share": (0.0, 1.0)}, deadline_factor=3)  # 256 answers of 300 tokens
def prefix_cache(ctx: Context, residues: int = 128, block: int = 0, document_chars: int = 72000, lines: int = 60,
                 max_tokens: int = 300, max_broken: int = 0, one_hash: bool = True,
                 min_coverage_share: float = 0.5) -> dict:
    """The source's residue sweep (bench/residue_sweep.py): one long document to copy verbatim, padded one token at
    a time so the templated prompts cover every residue of the cache's block (`block`, else the engine's own),
    each sent twice at temperature 0 with thinking off: the first arms the prefix cache, the second is a full
    self-hit and is judged. A residue is broken when its self-hit answers otherwise than its first send, or copies
    less than `min_coverage_share` of what the other residues copy (their median); `one_hash` asks every answer
    to hash the same, as the served checkpoint's 256 did."""
    block = block or _block_size(ctx) or 0
    if not block:
        raise NotRun("the cache's block size is neither in the check's parameters (block) nor on /metrics "
                     "(vllm:cache_config_info): residues cannot be swept")
    base, expected = copy_request(document_chars, lines)
    thinking_off = {"chat_template_kwargs": {"enable_thinking": False}}
    rows: list[dict[str, Any]] = []
    for residue, tokens, messages in _residue_prompts(ctx, base, residues, block, thinking_off):
        cold, warm = (ctx.answer(messages, temperature=0, max_tokens=max_tokens, **thinking_off) for _ in range(2))
        rows.append({"residue": residue, "prompt_tokens": tokens, "cold": hashlib.sha1(cold.encode()).hexdigest()[:12],
                     "warm": hashlib.sha1(warm.encode()).hexdigest()[:12], "coverage": round(_coverage(warm, expected), 4)})
    median = statistics.median(r["coverage"] for r in rows)
    for row in rows:
        row["broken"] = row["cold"] != row["warm"] or (median > 0 and row["coverage"] < min_coverage_share * median)
    broken = [r for r in rows if r["broken"]]
    hashes = {r["cold"] for r in rows} | {r["warm"] for r in rows}
    figures = {"block": block, "prompts": len(rows), "residues_covered": len({r["residue"] for r in rows}),
               "prompt_tokens": [min(r["prompt_tokens"] for r in rows), max(r["prompt_tokens"] for r in rows)],
               "broken": len(broken), "broken_residues": [r["residue"] for r in broken][:16],
               "distinct_hashes": len(hashes), "median_coverage": round(median, 4)}
    ensure(len(broken) <= max_broken, f"{len(broken)} broken of {len(rows)} residues (allowed {max_broken}): residues "
           + ", ".join(f"{r['residue']} ({'self-hit differs' if r['cold'] != r['warm'] else 'coverage ' + str(r['coverage'])})"
                       for r in broken[:6]), **figures)
    ensure(not one_hash or len(hashes) == 1, f"{len(hashes)} distinct answers over {2 * len(rows)}, where every one "
           "should hash the same", **figures)
    return figures
