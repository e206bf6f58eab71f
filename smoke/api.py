"""The API itself: keyless routes and auth, the model list, greedy, sampled, streaming, and the rest."""

from __future__ import annotations

import json
from typing import Any

import requests

from .core import CheckFailure, Context, check, ensure, reasoning_of, stream_events, text_of

KEYLESS = ("/health", "/ping", "/version")
GUARDED = ("/v1/models", "/metrics", "/tokenize", "/server_info")
HELLO = [{"role": "user", "content": "Say hello."}]
RANDOM_WORDS = [{"role": "user", "content": "Continue with random words: river, cobalt,"}]
MULTIPLY = [{"role": "user", "content": "What is 17 * 23? Answer with the number only."}]


@check("health")
def health(ctx: Context) -> dict:
    keyless = {p: ctx.fetch("GET", p, keyless=True).status_code for p in KEYLESS}
    guarded = {p: ctx.fetch("GET", p, keyless=True).status_code for p in GUARDED}
    ensure(all(code == 200 for code in keyless.values()), f"a keyless route did not answer 200: {keyless}",
           keyless=keyless)
    ensure(all(code == 401 for code in guarded.values()), f"a route answered without the key: {guarded}",
           guarded=guarded)
    return {"keyless": keyless, "guarded_without_key": guarded}


@check("models")
def models(ctx: Context, expect: str = "") -> dict:
    """`expect` overrides the target's model name (a profile that serves another name)."""
    resp = ctx.fetch("GET", "/v1/models")
    resp.raise_for_status()
    served = [m["id"] for m in resp.json()["data"]]
    wanted = expect or ctx.model
    ensure(wanted in served, f"expected model {wanted!r}, the server serves {served}", served=served)
    return {"served": served}


@check("greedy")
def greedy(ctx: Context, max_tokens: int = 32) -> dict:
    answers = [ctx.answer(HELLO, temperature=0, max_tokens=max_tokens) for _ in range(2)]
    ensure(answers[0] == answers[1], f"temperature 0 gave two answers: {answers[0]!r} / {answers[1]!r}")
    return {"answer": answers[0]}


@check("sampled", bounds={"tries": (2, None)})
def sampled(ctx: Context, tries: int = 4, max_tokens: int = 24) -> dict:
    # A prompt the model has no fixed answer for, hot enough that unseeded answers differ; ignore_eos (vLLM's)
    # samples every one of the tokens, so a model sure of a short answer cannot end before sampling shows.
    hot = {"temperature": 1.5, "max_tokens": max_tokens, "ignore_eos": True}
    unseeded = {ctx.answer(RANDOM_WORDS, **hot) for _ in range(tries)}
    seeded = {ctx.answer(RANDOM_WORDS, seed=1234, **hot) for _ in range(2)}
    ensure(len(unseeded) > 1, f"{tries} unseeded sampled answers were all identical")
    ensure(len(seeded) == 1, "two answers with the same seed differ")
    return {"distinct_unseeded": len(unseeded), "tries": tries}


@check("streaming")
def streaming(ctx: Context, max_tokens: int = 16) -> dict:
    body = {"model": ctx.model, "messages": HELLO, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    resp = ctx.post("/v1/chat/completions", body)
    resp.raise_for_status()
    events = stream_events(resp.content)
    ensure(bool(events) and events[-1] == "[DONE]", "the stream did not end with [DONE]")
    try:
        chunks = [json.loads(e) for e in events[:-1]]
    except ValueError as exc:
        raise CheckFailure(f"an event of the stream is not JSON ({exc})") from None
    usage = [c["usage"] for c in chunks if c.get("usage")]
    ensure(bool(usage), "no usage chunk although include_usage was asked")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    return {"chunks": len(chunks), "completion_tokens": usage[-1]["completion_tokens"], "text": text}


@check("api", bounds={"long_prompt_tokens": (1, None), "top_logprobs": (1, 20), "stream_tokens": (6, None)})
def api(ctx: Context, long_prompt_tokens: int = 12000, top_logprobs: int = 5, min_tokens: int = 30,
        stream_tokens: int = 16) -> dict:
    """The source repository's API smoke (bench/api_smoke.py) at its sizes, each part with its own verdict (a part
    the server refuses fails alone, with the server's answer): greedy and seeded determinism, logprobs, n=2, a stop
    string that stops, json_schema, min_tokens with penalties, streaming (`stream_tokens` of the greedy answer, in
    more than one chunk: a drafter that lands more tokens a step, or a loaded machine, sends fewer, larger ones), completions with echo and prompt
    logprobs, and a prompt of over 12,000 tokens. Its two reasoning parts are the `thinking` check."""
    parts: dict[str, str] = {}
    plain: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": False}}
    greedy = ctx.answer(HELLO, temperature=0, max_tokens=32, **plain)
    measured: dict[str, int] = {}

    def same_twice(**sampling: float) -> tuple[bool, str]:
        again = [ctx.answer(HELLO, max_tokens=32, **plain, **sampling) for _ in range(2)]
        return again[0] == again[1], f"{again[0]!r} / {again[1]!r}"

    def logprobs() -> tuple[bool, str]:
        r = ctx.chat(HELLO, max_tokens=8, logprobs=True, top_logprobs=top_logprobs, temperature=0)
        content = (r["choices"][0].get("logprobs") or {}).get("content") or []
        return bool(content) and all(len(t["top_logprobs"]) == top_logprobs for t in content), str(content)[:120]

    def n2() -> tuple[bool, str]:
        r = ctx.chat(HELLO, max_tokens=8, n=2)
        return len(r["choices"]) == 2, f"{len(r['choices'])} choices"

    def json_schema() -> tuple[bool, str]:
        # A schema whose every valid document ends by itself: unconstrained, no model here would answer with it.
        schema = {"enum": ["red", "green", "blue"]}
        r = ctx.chat([{"role": "user", "content": "Pick a colour as JSON."}], max_tokens=48, temperature=0,
                     response_format={"type": "json_schema", "json_schema": {"name": "colour", "schema": schema}},
                     **plain)
        message = r["choices"][0]["message"]
        raw = text_of(message) or reasoning_of(message)  # a reasoning parser may keep a short answer as reasoning
        try:
            parsed = json.loads(raw)
        except ValueError as exc:
            return False, f"not JSON: {exc}: {raw[:80]!r}"
        return parsed in schema["enum"], repr(parsed)

    def min_tokens_part() -> tuple[bool, str]:
        r = ctx.chat(HELLO, max_tokens=min_tokens + 16, min_tokens=min_tokens, presence_penalty=0.5,
                     frequency_penalty=0.5, temperature=0)
        return r["usage"]["completion_tokens"] >= min_tokens, f"{r['usage']['completion_tokens']} tokens"

    def echo() -> tuple[bool, str]:
        resp = ctx.post("/v1/completions", {"model": ctx.model, "prompt": "The river", "max_tokens": 4, "echo": True,
                                            "logprobs": 1, "prompt_logprobs": 1, "temperature": 0})
        resp.raise_for_status()
        choice = resp.json()["choices"][0]
        ok = choice["text"].startswith("The river") and bool((choice.get("logprobs") or {}).get("tokens")) and \
            bool(choice.get("prompt_logprobs"))
        return ok, f"{choice['text']!r}, prompt_logprobs {str(choice.get('prompt_logprobs'))[:60]}"

    def long_prompt() -> tuple[bool, str]:
        r = ctx.chat([{"role": "user", "content": _text_of_tokens(ctx, long_prompt_tokens)}], max_tokens=4)
        measured["long_prompt_tokens"] = r["usage"]["prompt_tokens"]
        return r["usage"]["prompt_tokens"] > long_prompt_tokens, \
            f"{r['usage']['prompt_tokens']} tokens, not over {long_prompt_tokens}"

    for name, run in (("greedy determinism", lambda: same_twice(temperature=0)),
                      ("seeded sampling", lambda: same_twice(temperature=1.0, seed=1234)),
                      ("logprobs", logprobs), ("n=2", n2), ("stop", lambda: _stop(ctx, greedy, plain)),
                      ("json_schema", json_schema), ("min_tokens", min_tokens_part),
                      ("streaming", lambda: _streamed_chunks(ctx, greedy, stream_tokens)), ("completions echo", echo),
                      ("long prompt", long_prompt)):
        try:
            ok, detail = run()
        except requests.HTTPError as exc:
            ok, detail = False, f"HTTP {exc.response.status_code}: {exc.response.text[:200]}"
        parts[name] = "ok" if ok else f"failed: {detail}"
    failed = {k: v for k, v in parts.items() if v != "ok"}
    ensure(not failed, "; ".join(f"{k}: {v}" for k, v in failed.items()), parts=parts, **measured)
    return {"parts": parts, **measured}


def _text_of_tokens(ctx: Context, tokens: int, sample_words: int = 200) -> str:
    """Words whose templated prompt is a little over `tokens` tokens, by the server's own count (/tokenize); a word
    a token where the server cannot count."""
    def text(n: int) -> str:
        return " ".join(f"word{i % 97}" for i in range(n))
    try:
        resp = ctx.post("/tokenize", {"model": ctx.model, "prompt": text(sample_words), "add_special_tokens": False})
        resp.raise_for_status()
        per_word = resp.json()["count"] / sample_words
    except (requests.RequestException, ValueError, KeyError, TypeError):
        per_word = 1.0
    return text(int((tokens + 16) / max(per_word, 0.1)) + 1)


def _stop(ctx: Context, greedy: str, plain: dict) -> tuple[bool, str]:
    """A stop string the model will reach (a word from the middle of its own greedy answer) must end the answer
    there, and vLLM must say that string stopped it: a natural end is no proof that stop strings work."""
    words = greedy.split()
    if len(words) < 3:
        return False, f"the greedy answer {greedy!r} is too short to hold a stop string"
    stop = words[len(words) // 2]
    r = ctx.chat(HELLO, max_tokens=32, temperature=0, stop=[stop], **plain)
    choice = r["choices"][0]
    text = text_of(choice["message"])
    return stop not in text and choice["finish_reason"] == "stop" and choice.get("stop_reason") == stop, \
        f"stop {stop!r}: {text!r}, finish_reason {choice['finish_reason']}, stop_reason {choice.get('stop_reason')!r}"


def _streamed_chunks(ctx: Context, greedy: str, max_tokens: int = 16) -> tuple[bool, str]:
    """The greedy answer, streamed in pieces: its text is where the unstreamed answer begins, and it comes in more
    than one content chunk. The source asks for more than 5 chunks, but vLLM merges the tokens a reader has not yet
    taken into one chunk, so how many there are is the machine's load (4 of 16 tokens beside a loaded CPU)."""
    resp = ctx.post("/v1/chat/completions", {"model": ctx.model, "messages": HELLO, "max_tokens": max_tokens,
                                             "temperature": 0, "stream": True,
                                             "chat_template_kwargs": {"enable_thinking": False}})
    resp.raise_for_status()
    chunks = [json.loads(event) for event in stream_events(resp.content) if event != "[DONE]"]
    deltas = [c["choices"][0].get("delta") or {} for c in chunks if c.get("choices")]
    # the answer's text, or what a reasoning parser took of it (random weights never close their thinking)
    pieces = [d.get("content") or d.get("reasoning_content") or d.get("reasoning") or "" for d in deltas]
    text, pieces = "".join(pieces), [piece for piece in pieces if piece]
    begins = bool(text.strip()) and greedy.strip().startswith(text.strip())
    return begins and len(pieces) > 1, \
        f"{len(pieces)} chunks of {text[:80]!r}; the answer unstreamed begins {greedy[:80]!r}"


@check("thinking", bounds={"budget": (1, None)})
def thinking(ctx: Context, max_tokens: int = 2048, budget: int = 16) -> dict:
    """The API smoke's reasoning parts: with thinking on, 17 x 23 answers 391 and the reasoning comes apart from
    the answer; with thinking_token_budget set, the reasoning ends within the budget."""
    parts: dict[str, str] = {}
    on: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": True}, "temperature": 0}
    message = ctx.chat(MULTIPLY, max_tokens=max_tokens, **on)["choices"][0]["message"]
    answer, reasoning = text_of(message), reasoning_of(message)
    parts["thinking mode"] = "ok" if "391" in answer and reasoning.strip() else \
        f"failed: answer {answer[:80]!r}, reasoning {len(reasoning)} characters"
    message = ctx.chat(MULTIPLY, max_tokens=max_tokens, thinking_token_budget=budget, **on)["choices"][0]["message"]
    reasoning = reasoning_of(message)
    resp = ctx.post("/tokenize", {"model": ctx.model, "prompt": reasoning, "add_special_tokens": False})
    resp.raise_for_status()
    spent = resp.json()["count"]
    # the budget's closing of the reasoning may add its end marker's tokens
    parts["thinking budget"] = "ok" if reasoning.strip() and spent <= budget + 4 else \
        f"failed: {spent} reasoning tokens with a budget of {budget}"
    failed = {k: v for k, v in parts.items() if v != "ok"}
    ensure(not failed, "; ".join(f"{k}: {v}" for k, v in failed.items()), parts=parts, budget_spent=spent)
    return {"parts": parts, "budget": budget, "budget_spent": spent}
