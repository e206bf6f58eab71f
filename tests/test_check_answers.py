"""Checks against answers of the shapes a real model gives that the demo model never did (found on the H200 with the
generated hybrid model): a reasoning parser that takes the whole answer (content null), an engine argument line
holding enum reprs, a prompt budget set by the server's max_model_len. The stand-in speaks vLLM's format:
/v1/chat/completions with `reasoning_content`, /tokenize with `count` and `max_model_len`, 400 past the limit."""

from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from servekit.smoke import CHECKS, Context, run_check

MAX_MODEL_LEN = 4096


def _tokens(messages: list[dict]) -> int:
    return sum(len(str(m.get("content") or "").split()) for m in messages) * 2 + 8  # two tokens a word, a template


class ReasoningOnly(BaseHTTPRequestHandler):
    seen_prompts: list[int] = []

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            return self._send(200, {"count": _tokens(body["messages"]), "max_model_len": MAX_MODEL_LEN, "tokens": []})
        prompt = _tokens(body["messages"])
        self.seen_prompts.append(prompt)
        if prompt + body.get("max_tokens", 16) > MAX_MODEL_LEN:  # as vLLM refuses it
            return self._send(400, {"error": {"message": "maximum context length exceeded"}})
        # A thinking answer that never closes: the parser returns it all as reasoning and content null.
        rng = random.Random(body.get("seed") if body.get("temperature", 1.0) > 0 else 0)
        text = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(6))
        cached = max(0, prompt - 64) if len(body["messages"]) > 1 else 0
        self._send(200, {"choices": [{"index": 0, "finish_reason": "length", "message": {
            "role": "assistant", "content": None, "reasoning_content": text}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 6, "total_tokens": prompt + 6,
                      "prompt_tokens_details": {"cached_tokens": cached}}})

    def do_GET(self):
        if self.path != "/metrics":
            return self._send(200, {})
        data = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"  # a server without a tier
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    ReasoningOnly.seen_prompts = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), ReasoningOnly)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield Context(f"http://127.0.0.1:{httpd.server_port}", "k", "m", gpu=True)
    httpd.shutdown()
    httpd.server_close()


def test_a_check_that_breaks_says_so_at_once():
    CHECKS["broken"] = (lambda ctx: {"x": None}["y"], False)
    try:
        result = run_check("broken", Context("http://127.0.0.1:9", "k", "m"), {})
        assert result.status == "failed" and result.reason.startswith("the check itself broke: KeyError")
        assert result.seconds < 5
    finally:
        del CHECKS["broken"]


def test_answers_held_by_the_reasoning_parser_are_judged_by_their_text(server):
    sweep = {"residues": 4, "block": 16, "document_chars": 300, "max_tokens": 8}
    for name, params in (("greedy", {}), ("sampled", {}), ("prefix_cache", sweep)):
        result = run_check(name, server, params)
        assert result.status == "passed", (name, result.reason)
    assert run_check("greedy", server, {}).figures["answer"].split()[0] in ("alpha", "beta", "gamma", "delta")


def test_long_conversations_fit_the_servers_context(server):
    result = run_check("long_conversations", server, {"conversations": 2, "tokens": 60000, "min_cached_share": 0.5})
    assert result.status == "passed", result.reason
    assert max(ReasoningOnly.seen_prompts) + 16 <= MAX_MODEL_LEN < 60000
    assert max(ReasoningOnly.seen_prompts) > MAX_MODEL_LEN * 0.8  # as long as the server allows, not a token less


def test_the_knobs_check_reads_enum_reprs_in_the_engines_arguments():
    lines = ["launcher: profile default: vllm serve --model /m --max-num-seqs 8",
             'launcher: profile default: environment {"DO_NOT_TRACK": "1"}',
             "(APIServer pid=1) INFO 12-01 04:51:20 [utils.py:1] non-default args: {'model_tag': '/m', 'model': '/m', "
             "'max_num_seqs': 8, 'compilation_config': {'dynamic_shapes_config': "
             "{'type': <DynamicShapesType.BACKED: 'backed'>}}}"]
    result = run_check("knobs", Context("http://127.0.0.1:9", "k", "m", logs=lambda: lines,
                                        environ=lambda: {"DO_NOT_TRACK": "1"}), {})
    assert result.status == "passed" and result.figures["reached"] == 2, result.reason


def test_logs_names_every_kernel_the_jit_monitor_saw_compile_after_healthy():
    monitor = ("(EngineCore pid=240) WARNING 12-02 14:57:00 [jit_monitor.py:140] Triton kernel JIT compilation during "
               "inference: {}. This causes a latency spike; consider extending warmup to cover this shape/config.")
    lines = [monitor.format("_warmed_at_boot_kernel"), "INFO: Application startup complete.",
             monitor.format("_rejection_kernel"), monitor.format("_compute_local_logits_stats_kernel")]
    result = run_check("logs", Context("http://127.0.0.1:9", "k", "m", logs=lambda: lines, healthy_line=2), {})
    assert result.status == "failed"
    assert result.figures["compiles_during_inference"] == 2
    assert result.figures["kernels_compiled_during_inference"] == ["_compute_local_logits_stats_kernel",
                                                                   "_rejection_kernel"]
    assert "_compute_local_logits_stats_kernel, _rejection_kernel" in result.reason
    quiet = run_check("logs", Context("http://127.0.0.1:9", "k", "m", logs=lambda: lines[:2], healthy_line=2), {})
    assert quiet.status == "passed" and quiet.figures["kernels_compiled_during_inference"] == []
