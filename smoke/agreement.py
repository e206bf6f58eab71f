"""What the model makes of a fixed text, token by token: the figures by which `compare` holds two boots of one
checkpoint to each other (batch's int8 activations against 16-bit ones, say)."""

from __future__ import annotations

import math
import statistics

from .cache import document
from .core import CheckFailure, Context, check, ensure

# Plain prose, before the numbered lines: the same text on every run and for every model. Written for this check.
PROSE = (
    "The ferry left the harbour an hour before dawn, when the water was still dark and the gulls had not yet "
    "woken. On the lower deck a man sorted letters into canvas sacks, one for each island, reading the names "
    "under a lamp that swung with the swell. He had done this for twenty years and knew most of the names by "
    "heart: the baker on the second island who wrote to her sister every week, the lighthouse keeper who "
    "ordered seeds in spring and complained about them in autumn, the schoolteacher whose parcels were always "
    "books. By the time the first island rose out of the mist, the sacks were tied and stacked by the ramp, "
    "and he went up to the rail to watch the light come over the hills.\n\n"
)


def text(chars: int) -> str:
    """The check's prompt: the prose, then the residue sweep's numbered lines up to `chars` characters."""
    return PROSE + document(chars - len(PROSE))


@check("prompt_logprobs", bounds={"chars": (len(PROSE), 200_000)})
def prompt_logprobs(ctx: Context, chars: int = 3000) -> dict:
    """Each prompt token's logprob and the model's own first choice there (vLLM's prompt_logprobs), all finite."""
    prompt = text(chars)
    tokenized = ctx.post("/tokenize", {"model": ctx.model, "prompt": prompt})
    tokenized.raise_for_status()
    ids = tokenized.json()["tokens"]
    resp = ctx.post("/v1/completions", {"model": ctx.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                         "prompt_logprobs": 1})
    resp.raise_for_status()
    positions = resp.json()["choices"][0].get("prompt_logprobs") or []
    ensure(len(positions) == len(ids), f"{len(positions)} prompt logprobs for a prompt of {len(ids)} tokens")
    logprobs, top1 = [], []
    for token, entry in zip(ids[1:], positions[1:], strict=True):  # the first token has nothing before it to be predicted from
        if not isinstance(entry, dict) or str(token) not in entry:
            raise CheckFailure(f"prompt logprobs without the prompt's own token {token}: {str(entry)[:120]}")
        logprobs.append(float(entry[str(token)]["logprob"]))
        top1.append(int(min(entry, key=lambda t: entry[t].get("rank") or math.inf)))
    bad = [i for i, v in enumerate(logprobs) if not math.isfinite(v)]
    ensure(not bad and bool(logprobs), f"{len(bad)} of {len(logprobs)} prompt logprobs are not finite numbers "
           f"(first at token {bad[0] + 1 if bad else 0})", tokens=len(logprobs))
    return {"tokens": len(logprobs), "mean_logprob": round(statistics.fmean(logprobs), 4),
            "logprobs": [round(v, 4) for v in logprobs], "top1": top1}


# Two boots of one checkpoint agree when their logprobs along the text correlate at least this well (Pearson): a
# kernel's rounding (int8 activations against 16-bit ones) moves each token's logprob by a small part of how much
# logprobs vary along a text, and a wrong weight or a wrong scale by as much as they vary.
AGREEMENT_FLOOR = 0.95


def agreement(first: dict, second: dict) -> dict | None:
    """How two prompt_logprobs checks' figures agree: Pearson r of the logprobs, the share of tokens whose first
    choice is the same, the mean absolute difference, and whether r reaches the floor; None where either has no
    figures of the same text (another length) or the logprobs do not vary."""
    a, b = first.get("logprobs"), second.get("logprobs")
    if not (isinstance(a, list) and isinstance(b, list)) or len(a) != len(b) or len(a) < 2:
        return None
    try:
        r = statistics.correlation(a, b)
    except statistics.StatisticsError:  # constant input: no spread to correlate
        return None
    top_a, top_b = first.get("top1") or [], second.get("top1") or []
    same = sum(x == y for x, y in zip(top_a, top_b, strict=True)) if len(top_a) == len(top_b) == len(a) else 0
    return {"tokens": len(a), "pearson_r": round(r, 4), "top1_same": round(same / len(a), 4),
            "mean_abs_difference": round(statistics.fmean(abs(x - y) for x, y in zip(a, b, strict=True)), 4),
            "floor": AGREEMENT_FLOOR, "agrees": r >= AGREEMENT_FLOOR}
