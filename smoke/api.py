"""The API itself: keyless routes and auth, the model list, greedy, sampled, streaming, and the rest."""

from __future__ import annotations

import json


from . import Context, check, ensure, text_of

KEYLESS = ("/health", "/ping", "/version")
GUARDED = ("/v1/models", "/metrics", "/tokenize", "/server_info")
HELLO = [{"role": "user", "content": "Say hello."}]


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
    prompt = [{"role": "user", "content": "Continue with random words: river, cobalt,"}]
    hot = {"temperature": 1.5, "max_tokens": max_tokens, "ignore_eos": True}
    unseeded = {ctx.answer(prompt, **hot) for _ in range(tries)}
    seeded = {ctx.answer(prompt, seed=1234, **hot) for _ in range(2)}
    ensure(len(unseeded) > 1, f"{tries} unseeded sampled answers were all identical")
    ensure(len(seeded) == 1, "two answers with the same seed differ")
    return {"distinct_unseeded": len(unseeded), "tries": tries}


@check("streaming")
def streaming(ctx: Context, max_tokens: int = 16) -> dict:
    body = {"model": ctx.model, "messages": HELLO, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    resp = ctx.post("/v1/chat/completions", body)
    resp.raise_for_status()
    events = [line[len(b"data: "):].decode() for line in resp.content.splitlines() if line.startswith(b"data: ")]
    ensure(bool(events) and events[-1] == "[DONE]", "the stream did not end with [DONE]")
    chunks = [json.loads(e) for e in events[:-1]]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    ensure(bool(usage), "no usage chunk although include_usage was asked")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    return {"chunks": len(chunks), "completion_tokens": usage[-1]["completion_tokens"], "text": text}


@check("api")
def api(ctx: Context, long_prompt_words: int = 1200) -> dict:
    """The rest of the source repository's API smoke, each part a sub-check with its own verdict."""
    parts: dict[str, str] = {}

    def part(name: str, ok: bool, detail: str = "") -> None:
        parts[name] = "ok" if ok else f"failed: {detail}"

    r = ctx.chat(HELLO, max_tokens=8, logprobs=True, top_logprobs=2, temperature=0)
    content = r["choices"][0]["logprobs"]["content"]
    part("logprobs", bool(content) and all(len(t["top_logprobs"]) == 2 for t in content), str(content)[:120])
    r = ctx.chat(HELLO, max_tokens=8, n=2)
    part("n=2", len(r["choices"]) == 2, f"{len(r['choices'])} choices")
    r = ctx.chat(HELLO, max_tokens=32, temperature=0, stop=["demo"])
    text = text_of(r["choices"][0]["message"])
    part("stop", "demo" not in text and r["choices"][0]["finish_reason"] == "stop", repr(text))
    # A schema whose every valid document ends by itself: unconstrained, no model here would answer with it.
    schema = {"enum": ["red", "green", "blue"]}
    r = ctx.chat([{"role": "user", "content": "Pick a colour as JSON."}], max_tokens=48, temperature=0,
                 response_format={"type": "json_schema", "json_schema": {"name": "colour", "schema": schema}})
    try:
        parsed = json.loads(text_of(r["choices"][0]["message"]))
        part("json_schema", parsed in schema["enum"], repr(parsed))
    except ValueError as exc:
        part("json_schema", False, f"not JSON: {exc}")
    r = ctx.chat(HELLO, max_tokens=24, min_tokens=12, presence_penalty=0.5, frequency_penalty=0.5, temperature=0)
    part("min_tokens", r["usage"]["completion_tokens"] >= 12, f"{r['usage']['completion_tokens']} tokens")
    resp = ctx.post("/v1/completions", {"model": ctx.model, "prompt": "The river", "max_tokens": 4, "echo": True,
                                        "logprobs": 1, "temperature": 0})
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    part("completions echo", choice["text"].startswith("The river") and bool(choice["logprobs"]["tokens"]),
         repr(choice["text"]))
    long_text = " ".join(f"word{i % 97}" for i in range(long_prompt_words))
    r = ctx.chat([{"role": "user", "content": long_text}], max_tokens=4)
    part("long prompt", r["usage"]["prompt_tokens"] > long_prompt_words // 2, f"{r['usage']['prompt_tokens']} tokens")
    failed = {k: v for k, v in parts.items() if v != "ok"}
    ensure(not failed, "; ".join(f"{k}: {v}" for k, v in failed.items()), parts=parts)
    return {"parts": parts}
