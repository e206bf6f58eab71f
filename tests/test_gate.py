"""An honest gate: a check passes, fails or did not run (never a pass for what was not measured), and each check
judges what the source's acceptance judged. Against a stand-in that speaks vLLM's format (/v1/chat/completions,
/v1/completions, /tokenize with `count`, /metrics in Prometheus' text), recording what it was sent."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from support import LAUNCHER, ROOT

from servekit.config.load import load_matrix
from servekit.config.profiles import render_profiles
from servekit.image.knobs import FALSE_WORDS, KNOBS, TRUE_WORDS
from servekit.image.launcher import KnobError, build_command
from servekit.image.recipe import BOOLEAN_ENV, PRIVACY_ENV
from servekit.serve.checks import console_line, not_required_results, smoke
from servekit.smoke import Context, Result, all_passed, run_check

MATRIX = load_matrix(ROOT / "images.yaml")
CUDA, CPU = render_profiles(MATRIX, "cuda"), render_profiles(MATRIX, "cpu")


class VllmLike(BaseHTTPRequestHandler):
    """What a test sets: `metrics` (the exposition text, or a function giving it at each read), `answer(body) ->
    (message, finish_reason, extra)`; what it sees: `sent` (every chat body)."""
    metrics: Any = ""
    stream: bytes | None = None  # a streamed answer's body, as sent
    sent: list[dict] = []
    answer: Any = None

    def _send(self, code: int, body: dict | str) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        metrics = VllmLike.metrics
        self._send(200, metrics() if callable(metrics) else metrics) if self.path == "/metrics" else self._send(200, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":  # a word a token, the template four more
            text = " ".join(m["content"] for m in body["messages"]) if "messages" in body else body["prompt"]
            return self._send(200, {"count": len(text.split()) + 4, "max_model_len": 65536, "tokens": []})
        if self.path == "/v1/completions":
            return self._send(200, {"choices": [{"index": 0, "text": body["prompt"] + " flows", "finish_reason": "length",
                                                 "logprobs": {"tokens": ["The", " river", " flows"]},
                                                 "prompt_logprobs": [None, {"1": {"logprob": -1.0}}]}],
                                    "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}})
        self.sent.append(body)
        if body.get("stream") and VllmLike.stream is not None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(VllmLike.stream)))
            self.end_headers()
            return self.wfile.write(VllmLike.stream)
        message, finish, extra = type(self).answer(body)
        prompt = sum(len(str(m.get("content") or "").split()) for m in body.get("messages", [])) + 4
        self._send(200, {"choices": [{"index": 0, "finish_reason": finish, "message": {"role": "assistant", **message},
                                      **extra}],
                         "usage": {"prompt_tokens": prompt, "completion_tokens": 8, "total_tokens": prompt + 8}})

    def log_message(self, *args):
        pass


@pytest.fixture
def standin():
    VllmLike.sent, VllmLike.metrics, VllmLike.stream = [], "", None
    VllmLike.answer = staticmethod(lambda body: ({"content": "Hello there, friend."}, "stop", {}))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), VllmLike)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield Context(f"http://127.0.0.1:{httpd.server_port}", "k", "m", check_deadline_s=60)
    httpd.shutdown()
    httpd.server_close()


def _sse(*events: str, newline: bytes = b"\n") -> bytes:
    return b"".join(e.encode().replace(b"\n", newline) + newline * 2 for e in events)


def test_a_stream_is_read_as_server_sent_events_however_the_server_frames_them(standin):
    """What the format allows and a line-prefix reader misses: CRLF line ends, a comment, `data:` without its
    space, one event's JSON over two data lines. Without [DONE] the same stream fails."""
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    first = json.dumps({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})
    events = (": keep-alive", f"data:{first}",
              'data: {"choices": [{"index": 0,\ndata:  "delta": {"content": "lo"}}]}',
              "data: " + json.dumps({"choices": [], "usage": usage}))
    VllmLike.stream = _sse(*events, "data: [DONE]", newline=b"\r\n")
    passed = run_check("streaming", standin, {})
    assert passed.status == "passed", passed.reason
    assert passed.figures["text"] == "Hello" and passed.figures["chunks"] == 3
    VllmLike.stream = _sse(*events)
    cut = run_check("streaming", standin, {})
    assert cut.status == "failed" and cut.reason == "the stream did not end with [DONE]"


# --- three outcomes, one rule ------------------------------------------------------------------------

def test_no_spec_decode_counters_and_an_unreadable_log_fail_the_gate_as_not_run(standin):
    results = smoke(standin, {"spec_decode": {}, "logs": {}, "knobs": {}})
    assert [(r.name, r.status) for r in results] == [("spec_decode", "not_run"), ("logs", "not_run"),
                                                     ("knobs", "not_run")]
    assert "no spec-decode counters" in results[0].reason and "cannot be read" in results[1].reason
    assert not all_passed(r.status for r in results)


def test_a_check_the_matrix_does_not_require_is_listed_with_why_and_does_not_gate():
    extra = not_required_results(MATRIX, "default", "cpu")
    assert {r.name: r.status for r in extra} == {"spec_decode": "not_required", "thinking": "not_required"}
    assert all(r.reason for r in extra)
    assert all_passed([r.status for r in extra] + ["passed"])
    assert not all_passed(["passed", "not_run"])
    assert not_required_results(MATRIX, "default", "cpu", only=["spec_decode"])[0].name == "thinking"


def test_an_old_report_that_skipped_a_check_no_longer_gates():
    from servekit.records.models import RunReport
    report = RunReport.model_validate({
        "run_id": "r", "url": "http://127.0.0.1:1", "created": "2026-11-29T00:00:00+00:00", "profile": "default",
        "target": "cpu", "host": "native", "image": {"tag": "x"}, "pins": {}, "passed": True,
        "boot": {}, "memory": {}, "checks": [{"name": "knobs", "status": "skipped", "reason": "no log"}]})
    assert report.checks[0].status == "not_run" and report.passed and not report.gate_passes


def test_the_console_prints_a_failures_whole_first_line():
    reason = "x" * 400 + "\nsecond line"
    line = console_line(Result("api", "failed", reason, seconds=1.0))
    assert line.endswith("x" * 400) and "second line" not in line and line.startswith("failed ")


def test_the_markdown_report_holds_the_whole_reason_and_says_not_run():
    from servekit.records.models import RunReport
    from servekit.records.report import render_markdown
    reason = "the check could not measure " + "y" * 300
    report = RunReport.model_validate({
        "run_id": "r", "url": "http://127.0.0.1:1", "created": "2026-11-29T00:00:00+00:00", "profile": "default",
        "target": "cpu", "host": "native", "image": {"tag": "x"}, "pins": {}, "passed": False,
        "boot": {}, "memory": {}, "checks": [{"name": "knobs", "status": "not_run", "reason": reason},
                                             {"name": "thinking", "status": "not_required", "reason": "no parser"}]})
    text = render_markdown(report)
    assert f"| knobs | **not run** |  | {reason} |" in text and "| thinking | not required |" in text


# --- the residue sweep ---------------------------------------------------------------------------------

def _block_metrics(block: int) -> str:
    return ("# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{block}",cache_dtype="auto",enable_prefix_caching="True"}} 1.0\n')


def test_the_residue_sweep_sends_128_distinct_prompts_twice_over_every_residue(standin):
    VllmLike.metrics = _block_metrics(128)
    result = run_check("prefix_cache", standin, {"document_chars": 2000, "max_tokens": 8})
    assert result.status == "passed", result.reason
    prompts = [b["messages"][0]["content"] for b in VllmLike.sent]
    assert len(prompts) == 256 and len(set(prompts)) == 128
    assert all(prompts.count(p) == 2 for p in set(prompts))  # the arming send, then the self-hit
    assert {len(p.split()) % 128 for p in set(prompts)} == set(range(128))  # every residue of the block (4 is fixed)
    assert all(b["temperature"] == 0 and b["chat_template_kwargs"] == {"enable_thinking": False} for b in VllmLike.sent)
    assert result.figures["block"] == 128 and result.figures["residues_covered"] == 128
    assert result.figures["distinct_hashes"] == 1


def test_a_self_hit_that_answers_otherwise_is_a_broken_residue(standin):
    VllmLike.metrics = _block_metrics(16)
    seen: dict[str, int] = {}

    def answer(body):
        text = body["messages"][0]["content"]
        seen[text] = seen.get(text, 0) + 1
        broken = seen[text] == 2 and (len(text.split()) + 4) % 16 == 7  # the self-hit at residue 7 is corrupt
        return {"content": "0001 river" if not broken else "garbage"}, "stop", {}
    VllmLike.answer = staticmethod(answer)
    result = run_check("prefix_cache", standin, {"residues": 16, "document_chars": 500, "max_tokens": 8})
    assert result.status == "failed" and result.figures["broken_residues"] == [7], result.reason
    assert "1 broken of 16" in result.reason and "self-hit differs" in result.reason


def test_the_sweep_cannot_run_without_a_block_size(standin):
    result = run_check("prefix_cache", standin, {"document_chars": 500})
    assert result.status == "not_run" and "block" in result.reason


# --- tokens per step, tool calls, the API smoke ----------------------------------------------------------

def test_tokens_per_step_below_the_floor_fails(standin):
    drafts = iter(range(0, 10_000, 50))

    # each reading: 50 more drafts, none accepted (1.0 token a step)
    VllmLike.metrics = lambda: (f"vllm:spec_decode_num_drafts_total {next(drafts)}.0\n"
                                "vllm:spec_decode_num_accepted_tokens_total 0.0\n")
    result = run_check("spec_decode", standin, {"requests": 1, "min_greedy": 1.5, "min_sampled": 1.2})
    assert result.status == "failed" and result.figures["greedy"] == 1.0
    assert "greedy 1.0 below its floor 1.5" in result.reason


def _call(arguments: str, content: str | None = None) -> dict:
    return {"content": content, "tool_calls": [{"id": "c", "type": "function",
                                                "function": {"name": "get_time", "arguments": arguments}}]}


def test_a_complete_call_then_whitespace_to_max_tokens_is_a_runaway_and_a_cut_call_is_wrong(standin):
    VllmLike.answer = staticmethod(lambda body: (_call("{}", "\n \n"), "length" if body["seed"] < 3 else "tool_calls",
                                                 {}))
    result = run_check("tool_required", standin, {"seeds": 5, "max_runaway": 2})
    assert result.status == "failed" and result.figures["whitespace_runaways"] == 3, result.reason
    assert result.figures["empty_arguments"] == 5 and "decoded whitespace until max_tokens" in result.reason
    VllmLike.answer = staticmethod(lambda body: (_call('{"ho'), "length", {}))
    result = run_check("tool_required", standin, {"seeds": 2})
    assert result.status == "failed" and "cut off by max_tokens" in result.reason
    assert result.figures["whitespace_runaways"] == 0


def test_a_stop_string_must_stop_the_answer_not_a_natural_end(standin):
    result = run_check("api", standin, {"long_prompt_tokens": 50})
    assert result.status == "failed"
    assert result.figures["parts"]["stop"].startswith("failed: stop 'there,'")  # it ended naturally: no stop_reason
    VllmLike.answer = staticmethod(lambda body: (
        ({"content": "Hello "}, "stop", {"stop_reason": body["stop"][0]}) if body.get("stop") else
        ({"content": "Hello there, friend."}, "stop", {})))
    result = run_check("api", standin, {"long_prompt_tokens": 50})
    assert result.figures["parts"]["stop"] == "ok"


def test_json_schema_takes_the_answer_a_reasoning_parser_kept(standin):
    VllmLike.answer = staticmethod(lambda body: (({"content": None, "reasoning_content": '"green"'}, "stop", {})
                                                 if body.get("response_format") else ({"content": "a b c"}, "stop", {})))
    result = run_check("api", standin, {"long_prompt_tokens": 50})
    assert result.figures["parts"]["json_schema"] == "ok"


# --- the CPU tier's regression -----------------------------------------------------------------------

def test_a_tier_that_stores_and_never_serves_is_named_as_the_regression(standin):
    stored = iter(range(0, 100 * 10**9, 5 * 10**9))  # each reading: 5 GB more stored, nothing read back
    VllmLike.metrics = lambda: (f"vllm:kv_offload_store_bytes_total {next(stored)}.0\n"
                                "vllm:kv_offload_load_bytes_total 0.0\nvllm:prefix_cache_queries_total 100.0\n")
    result = run_check("long_conversations", standin, {"conversations": 2, "tokens": 300, "tier": True})
    assert result.status == "failed" and "stores but never serves" in result.reason
    VllmLike.metrics = ""
    result = run_check("long_conversations", standin, {"conversations": 2, "tokens": 300, "tier": True})
    assert result.status == "failed" and "no tier is in use" in result.reason


# --- knobs reach vLLM as vLLM reads them ----------------------------------------------------------------

BOOL_KNOBS = [name for name, knob in KNOBS.items() if knob.kind == "bool"]


@pytest.mark.parametrize("name", BOOL_KNOBS)
def test_every_boolean_knob_reaches_vllm_as_one_or_zero_whatever_its_spelling(name):
    for profiles, profile in ((CUDA, "default"), (CUDA, "alternative"), (CUDA, "dflash2"), (CPU, "default")):
        for words, canonical in ((TRUE_WORDS, "1"), (FALSE_WORDS, "0")):
            expected = build_command(profiles, profile, "native", {name: canonical})
            for word in words:
                for spelling in (word, word.upper(), f" {word.title()} "):
                    assert build_command(profiles, profile, "native", {name: spelling}) == expected, (name, spelling)
            argv, env = expected
            assert all(env[v] in ("0", "1") for v in env if v in BOOLEAN_ENV), env


def test_lookup_true_runs_with_lookup():
    """The source's bug: VLLM_DFLASH2_LOOKUP=true ran without lookup, since vLLM reads anything but 1 as off."""
    _, env = build_command(CUDA, "dflash2", "native", {"LOOKUP": "true"})
    assert env["VLLM_DFLASH2_LOOKUP"] == "1"
    _, env = build_command(CUDA, "default", "native", {"SPEC_ATTN": "yes"})
    assert env["VLLM_SPEC_DECODE_ATTN"] == "1"
    _, env = build_command(CUDA, "alternative", "native", {"INT4_MQ_3D": "off"})
    assert env["VLLM_INT4_MQ_3D"] == "0"


def test_the_sources_extra_args_tier_gets_the_tiers_settings():
    by_knob = build_command(CUDA, "alternative", "native", {"KV_OFFLOAD_GB": "8"})
    for extra in ("--kv-offloading-size 8", "--kv-offloading-size=8"):
        argv, env = build_command(CUDA, "alternative", "native", {"EXTRA_ARGS": extra})
        assert (argv, env) == by_knob
    argv, env = by_knob
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"  # vLLM 0.31 refuses them beside a tier
    assert argv[argv.index("--prefix-cache-retention-interval") + 1] == "None"  # dense retention beside a tier
    assert argv.count("--kv-offloading-size") == 1


@pytest.mark.parametrize("extra, knob", [("--speculative-config '{\"method\": \"mtp\"}'", "SPEC"),
                                         ("--kv-cache-dtype=fp8", "CTX")])
def test_extra_args_that_set_what_a_knob_sets_are_refused_with_the_knob(extra, knob):
    with pytest.raises(KnobError, match=knob):
        build_command(CUDA, "default", "native", {"EXTRA_ARGS": extra})
    assert build_command(CPU, "default", "native", {"EXTRA_ARGS": extra})  # the plain recipe has no companions


def test_extra_args_that_do_not_split_are_refused_in_one_line():
    with pytest.raises(KnobError, match="arguments as a shell splits them"):
        build_command(CUDA, "default", "native", {"EXTRA_ARGS": "--served-model-name 'unclosed"})


def _knob_lines(argv: list[str], env: dict[str, str]) -> list[str]:
    return [f"launcher: profile default: vllm serve {shlex.join(argv)}",
            f"launcher: profile default: environment {json.dumps(env)}",
            "(APIServer pid=1) INFO [utils.py:1] non-default args: {'model_tag': '/m', 'max_num_seqs': 8, "
            "'speculative_config': {'method': 'mtp', 'num_speculative_tokens': 4, 'draft_sample_method': "
            "'probabilistic'}, 'gpu_memory_utilization': 0.93}"]


def test_the_knobs_check_compares_parsed_flags_and_the_processs_environment():
    argv = ["--model", "/m", "--max-num-seqs", "8", "--api-server-count", "1", "--gpu-memory-utilization", "0.93",
            "--speculative-config", '{"method":"mtp","num_speculative_tokens":4}']
    env = {"VLLM_DFLASH2_LOOKUP": "1", "DO_NOT_TRACK": "1", "VLLM_API_KEY": "***"}
    ok = Context("http://127.0.0.1:9", "k", "m", logs=lambda: _knob_lines(argv, env),
                 environ=lambda: {"VLLM_DFLASH2_LOOKUP": "1", "DO_NOT_TRACK": "1", "VLLM_API_KEY": "the real key"})
    result = run_check("knobs", ok, {})
    assert result.status == "passed", result.reason
    assert result.figures["not_echoed"] == ["api_server_count"] and result.figures["environment_reached"] == 2
    assert "the real key" not in json.dumps(result.figures)
    wrong = Context("http://127.0.0.1:9", "k", "m", logs=lambda: _knob_lines(argv, {"VLLM_DFLASH2_LOOKUP": "true"}),
                    environ=lambda: {"VLLM_DFLASH2_LOOKUP": "true"})
    result = run_check("knobs", wrong, {})
    assert result.status == "failed" and "which vLLM reads as off" in result.reason
    lost = Context("http://127.0.0.1:9", "k", "m", logs=lambda: _knob_lines(argv, env), environ=lambda: {})
    result = run_check("knobs", lost, {})
    assert result.status == "failed" and "VLLM_DFLASH2_LOOKUP" in result.reason
    other = [line.replace("'num_speculative_tokens': 4", "'num_speculative_tokens': 3") for line in _knob_lines(argv, env)]
    result = run_check("knobs", Context("http://127.0.0.1:9", "k", "m", logs=lambda: other, environ=lambda: {
        "VLLM_DFLASH2_LOOKUP": "1", "DO_NOT_TRACK": "1"}), {})
    assert result.status == "failed" and "speculative_config" in result.reason


def test_a_variable_nothing_in_the_image_reads_is_inert_not_reached_and_fails_where_the_profile_needs_it_live():
    """The launcher's inert line (the build's record of readers): VLLM_DFLASH2_LOOKUP is in the process's
    environment, yet nothing reads it, so it is listed as inert and not counted; `live` naming it fails the check,
    naming it; an image with no record cannot tell, and says so."""
    argv = ["--model", "/m", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.93",
            "--speculative-config", '{"method":"mtp","num_speculative_tokens":4}']
    env = {"VLLM_DFLASH2_LOOKUP": "1", "DO_NOT_TRACK": "1"}
    lines = _knob_lines(argv, env) + ['launcher: profile default: inert ["VLLM_DFLASH2_LOOKUP"]']
    ctx = Context("http://127.0.0.1:9", "k", "m", logs=lambda: lines, environ=lambda: dict(env))
    result = run_check("knobs", ctx, {})
    assert result.status == "passed", result.reason
    assert result.figures["inert"] == ["VLLM_DFLASH2_LOOKUP"] and result.figures["environment_reached"] == 1
    needed = run_check("knobs", ctx, {"live": "VLLM_DFLASH2_LOOKUP"})
    assert needed.status == "failed" and "VLLM_DFLASH2_LOOKUP, which this profile needs live" in needed.reason
    assert run_check("knobs", ctx, {"live": "DO_NOT_TRACK"}).status == "passed"
    unrecorded = Context("http://127.0.0.1:9", "k", "m", logs=lambda: _knob_lines(argv, env), environ=lambda: env)
    assert run_check("knobs", unrecorded, {}).figures["environment_reached"] == 2
    assert run_check("knobs", unrecorded, {"live": "DO_NOT_TRACK"}).status == "not_run"


def test_the_launcher_says_which_exported_variables_are_inert_once(tmp_path):
    record = tmp_path / "env-readers.json"
    record.write_text(json.dumps({"packages": ["vllm"], "read": {"DO_NOT_TRACK": "vllm/envs.py"},
                                  "inert": ["VLLM_INT4_MQ_3D", "VLLM_DFLASH2_LOOKUP", "UNUSED_HERE"]}))
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps(CUDA))
    env = {"SERVEKIT_PROFILES": str(profiles), "SERVEKIT_ENV_READERS": str(record), "PRINT_ARGV": "1",
           "PATH": "/usr/bin:/bin"}
    done = subprocess.run([*LAUNCHER, "serve", "alternative"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert 'launcher: profile alternative: inert ["VLLM_DFLASH2_LOOKUP", "VLLM_INT4_MQ_3D"]' in done.stderr
    assert done.stderr.count("nothing in this image reads VLLM_DFLASH2_LOOKUP, VLLM_INT4_MQ_3D") == 1
    done = subprocess.run([*LAUNCHER, "serve", "alternative"],
                          env={k: v for k, v in env.items() if k != "SERVEKIT_ENV_READERS"}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "inert" not in done.stderr  # no record here (a checkout): no claim either way


def test_the_build_finds_a_variable_read_as_code_names_it_and_not_in_a_comment(tmp_path):
    from servekit.image.readers import record
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "envs.py").write_text('x = os.environ.get("VLLM_READ_IN_PYTHON", "0")\n# VLLM_ONLY_IN_A_COMMENT\n')
    (package / "sub" / "_C.so").write_bytes(b"\x7fELF\x00junk\x00VLLM_READ_IN_A_LIBRARY\x00more")
    (package / "sub" / "empty.py").write_text("")
    doc = record(["VLLM_READ_IN_PYTHON", "VLLM_READ_IN_A_LIBRARY", "VLLM_ONLY_IN_A_COMMENT", "NOWHERE"],
                 {"pkg": package})
    assert doc["read"] == {"VLLM_READ_IN_A_LIBRARY": "pkg/sub/_C.so", "VLLM_READ_IN_PYTHON": "pkg/envs.py"}
    assert doc["inert"] == ["NOWHERE", "VLLM_ONLY_IN_A_COMMENT"]


def test_the_build_asks_about_every_variable_a_profile_can_export():
    from servekit.image.recipe import every_variable
    asked = set(every_variable()) | set(CUDA["env"]) | {n for h in CUDA["hosts"].values() for n in h["env"]}
    for profile in CUDA["profiles"]:
        for host in CUDA["hosts"]:
            for knobs in ({}, {"INT8_ACT": "int8", "VISION": "1", "KV_OFFLOAD_GB": "4"}):
                _, env = build_command(CUDA, profile, host, knobs)
                assert set(env) <= asked, (profile, host, set(env) - asked)


@pytest.mark.parametrize("retention, status", [("0", "passed"), ("5", "failed")])
def test_a_flag_vllm_leaves_out_of_its_log_passes_only_at_vllms_default(retention, status):
    """vLLM logs only non-default arguments: a flag absent there reached the engine only if it holds the default."""
    argv = ["--model", "/m", "--max-num-seqs", "8", "--port", "8000", "--prefix-cache-retention-interval", retention]
    env = {"DO_NOT_TRACK": "1"}
    result = run_check("knobs", Context("http://127.0.0.1:9", "k", "m", logs=lambda: _knob_lines(argv, env),
                                        environ=lambda: env), {})
    assert result.status == status, result.reason
    if status == "passed":
        assert result.figures["not_echoed"] == ["port", "prefix_cache_retention_interval"]
    else:
        assert "'prefix_cache_retention_interval': 'absent'" in result.reason


# --- privacy --------------------------------------------------------------------------------------------

def test_no_usage_statistics_leave_any_target():
    assert PRIVACY_ENV == {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    for profiles in (CUDA, CPU):
        for profile in profiles["profiles"]:
            _, env = build_command(profiles, profile, "native", {})
            assert PRIVACY_ENV.items() <= env.items(), profile
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    runtime_env = re.search(r"^ENV HOME=/cache \\\n((?:    .*\n)+)", dockerfile, re.M)
    assert runtime_env and all(f"    {k}={v} \\" in runtime_env[1] for k, v in PRIVACY_ENV.items())

