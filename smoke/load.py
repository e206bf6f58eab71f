"""Load: the forced 64-prompt prefill step, and a burst of concurrent clients with tokens per second."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import requests
from requests import Session

from .core import Context, check, ensure


def chat_prompt(text: str) -> str:
    """A chat-formatted prompt, as the chat endpoint would render it for a Qwen-style template."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@check("forced_prefill")
def forced_prefill(ctx: Context, prompts: int = 64, max_tokens: int = 8) -> dict:
    """One /v1/completions request carrying N prompts lands N new prefills in one scheduler step:
    the step vLLM's profiling run does not budget for (the source's batch GPU_UTIL 0.95 -> 0.94)."""
    batch = [chat_prompt(f"Question {i}: name a colour and a number.") for i in range(prompts)]
    started = time.monotonic()
    resp = ctx.post("/v1/completions", {"model": ctx.model, "prompt": batch, "max_tokens": max_tokens,
                                        "temperature": 0})
    seconds = time.monotonic() - started
    ensure(resp.status_code == 200, f"HTTP {resp.status_code}: {resp.text[:200]}")
    served = len(resp.json()["choices"])
    ensure(served == prompts, f"{served} of {prompts} prompts served", served=served)
    return {"prompts": prompts, "served": served, "seconds": round(seconds, 2)}


T = TypeVar("T")

def burst_requests(send: Callable[[int, requests.Session], T], clients: int,
                   requests_total: int) -> tuple[list[T], float]:
    """Run `send(i)` for every i with `clients` at once; (results, wall seconds)."""
    local = threading.local()

    def one(i: int) -> T:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        return send(i, local.session)
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        results = list(pool.map(one, range(requests_total)))
    return results, time.monotonic() - started


@check("burst")
def burst(ctx: Context, clients: int = 64, requests: int = 128, max_tokens: int = 128) -> dict:
    def send(i: int, session: Session) -> tuple[int, int]:  # `requests` is the parameter here, not the module
        r = ctx.post("/v1/chat/completions", {"model": ctx.model, "max_tokens": max_tokens, "temperature": 0.7,
                                              "messages": [{"role": "user", "content": f"Request {i}: tell me more."}]},
                     session=session)
        return r.status_code, (r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0)
    results, seconds = burst_requests(send, clients, requests)
    ok = sum(1 for status, _ in results if status == 200)
    tokens = sum(t for _, t in results)
    figures = {"clients": clients, "requests": requests, "succeeded": ok, "completion_tokens": tokens,
               "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
               "requests_per_s": round(requests / seconds, 2)}
    ensure(ok == requests, f"{ok} of {requests} requests succeeded", **figures)
    return figures
