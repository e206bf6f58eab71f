"""vLLM's memory budget read from a boot's log (servekit/records/budget.py): from the real lines of the full-size
reports and boot logs in docs/gpu, from the lines the series' memory-budget-info patch makes vLLM write, and shown in
report.md beside the source's figures. The cpu image's lines are read by a real run (tests/test_run.py)."""

from __future__ import annotations

import json

from support import ROOT

from servekit.config.matrix import SourceBudget
from servekit.records.budget import NAMES, read_budget
from servekit.records.models import RunReport
from servekit.records.report import render_markdown

GPU = ROOT / "docs" / "gpu"


def _last_lines(run: str) -> list[str]:
    return json.loads((GPU / run / "report.json").read_text())["checks"][0]["figures"]["last_lines"]


def test_a_full_size_boot_refused_for_its_kv_says_what_it_had_needed_and_what_would_fit():
    """The 27B's layout on an emulated 3090: default at 0.93 and batch at 0.94, both refused at the KV check."""
    assert read_budget(_last_lines("20261205-182425-default-cuda")) == {
        "util": 0.93, "kv_available_gib": 2.83, "kv_needed_gib": 4.76, "max_len_fits": 34992}
    assert read_budget(_last_lines("20261205-183052-batch-cuda")) == {
        "util": 0.94, "kv_available_gib": 3.53, "kv_needed_gib": 4.74, "max_len_fits": 109600}


def test_a_whole_boot_log_gives_weights_block_size_kv_and_the_pool():
    lines = (GPU / "20261203-105645-alternative-cuda-boot.log").read_text().splitlines()
    assert read_budget(lines) == {"util": 0.95, "weights_gib": 0.11, "kv_available_gib": 132.18, "block_size": 576,
                                  "kv_pool_tokens": 260568357, "max_concurrency": 1017.85}


def _patched_lines() -> list[str]:
    """The lines vLLM writes with the series, made from the patch's own format strings and vLLM's profile result
    (its __repr__ in 0.31.0), so a change to either shows here."""
    patch = (ROOT / "docker" / "patches" / "memory-budget-info.patch").read_text()
    assert '+        logger.info(\n             "Initial free memory: %s GiB; Requested memory: %f (util), %s GiB",' in patch
    assert '+        logger.info("%s", profile_result)' in patch
    requested = f"Initial free memory: 23.28 GiB; Requested memory: {0.93:f} (util), 21.91 GiB"
    profile = ("Memory profiling takes 41.20 seconds. Total non KV cache memory: 17.20GiB; torch peak memory increase: "
               "1.96GiB; total consumed (from mem_get_info): 16.10GiB; weights memory: 14.26GiB.")
    prefix = "(EngineCore pid=96) INFO 12-06 10:00:00 [gpu_worker.py:680] "
    return [prefix + requested, prefix + profile, prefix + "Estimated CUDA graph memory: 0.52 GiB total",
            prefix + "Available KV cache memory: 4.19 GiB",
            prefix + "GPU KV cache size: 217,268 tokens, Maximum concurrency for 150,000 tokens per request: 1.45x",
            prefix + "Graph capturing finished in 12 secs, took 0.11 GiB",  # the real capture's own line: not read
            prefix + "CUDA graph pool memory: 0.11 GiB (actual), 0.52 GiB (estimated), difference: 0.41 GiB (78.8%)."]


def test_the_patched_info_lines_give_the_whole_budget():
    budget = read_budget(_patched_lines())
    assert budget == {"total_gib": 23.56, "free_at_start_gib": 23.28, "util": 0.93, "requested_gib": 21.91,
                      "weights_gib": 14.26, "activation_peak_gib": 1.96, "non_torch_gib": 0.98, "non_kv_gib": 17.2,
                      "cudagraph_gib": 0.52, "kv_available_gib": 4.19, "kv_pool_tokens": 217268,
                      "max_concurrency": 1.45, "cudagraph_captured_gib": 0.11}
    assert list(budget) == [name for name in NAMES if name in budget]  # in the order a boot computes them


def _logged_formats(patch: str, opening: str) -> list[str]:
    """Each format string the patch adds that starts with `opening`, its adjacent literals joined as Python joins
    them."""
    added = [line[1:].strip() for line in patch.splitlines() if line.startswith("+")]
    formats = []
    for i, line in enumerate(added):
        if line.startswith(f'"{opening}'):
            parts = []
            for literal in added[i:]:
                if not literal.startswith('"'):
                    break
                parts.append(literal.rstrip(",")[1:-1])
            formats.append("".join(parts))
    return formats


def test_each_runner_logs_the_graphs_first_use_term_in_the_line_the_reader_reads():
    patch = (ROOT / "docker" / "patches" / "cudagraph-memory-from-allocator.patch").read_text()
    v1_estimate, = _logged_formats(patch, "Estimated CUDA graph memory")
    v2_profile, = _logged_formats(patch, "Profiled the CUDA graphs")
    for line in (v1_estimate % (0.14, 22, 0.02, 0.27), v2_profile % (31, 0.14, 0.02, 0.27)):
        budget = read_budget(["INFO 12-07 10:00:00 [gpu_model_runner.py:6700] " + line])
        assert (budget["cudagraph_first_use_gib"], budget["cudagraph_profile_driver_gib"]) == (0.02, 0.27)
    real_captures = _logged_formats(patch, "Graph capturing finished")  # V1's and V2's, the same line
    assert len(real_captures) == 2 and len(set(real_captures)) == 1
    assert read_budget([real_captures[0] % (4, 0.13, 0.15)]) == {"cudagraph_captured_driver_gib": 0.15}


def test_the_weights_processing_peak_is_read_from_the_line_the_patch_adds():
    """The spike to the card's size as loading ends: the allocated and the reserved peak, and the step that
    allocated most, read from the memory-budget-info patch's own format string and shown in report.md."""
    patch = (ROOT / "docker" / "patches" / "memory-budget-info.patch").read_text()
    processed, = _logged_formats(patch, "Weights processed")
    line = processed % (21.93, 22.87, 15.02, "model.layers.3.mlp.gate_up_proj", 0.41)
    budget = read_budget(["(EngineCore pid=176) INFO 12-07 16:36:46 [utils.py:212] " + line])
    assert budget == {"weights_processing_peak_allocated_gib": 21.93, "weights_processing_peak_reserved_gib": 22.87,
                      "weights_processing_largest_step": "model.layers.3.mlp.gate_up_proj",
                      "weights_processing_largest_step_gib": 0.41}
    base = {"run_id": "r", "created": "2026-12-06T00:00:00+00:00", "profile": "batch", "target": "cuda",
            "host": "native", "url": "http://127.0.0.1:18000", "image": {"tag": "vllm-serve:x"}, "pins": {}}
    shown = render_markdown(RunReport.model_validate({**base, "boot": {"budget": budget}}))
    assert "| the module whose processing step allocated most | model.layers.3.mlp.gate_up_proj |" in shown
    assert "| that processing's peak reserved, the allocator's cached blocks included | 22.87 GiB |" in shown


def test_report_md_shows_the_budget_beside_the_source_figures_and_says_when_the_log_had_none():
    base = {"run_id": "r", "created": "2026-12-06T00:00:00+00:00", "profile": "batch", "target": "cuda",
            "host": "native", "url": "http://127.0.0.1:18000", "image": {"tag": "vllm-serve:x"}, "pins": {}}
    source = {"source": "the source's README", "util": 0.94, "weights_gib": 14.26, "kv_pool_tokens": 217268}
    shown = render_markdown(RunReport.model_validate({**base, "boot": {"budget": read_budget(_patched_lines())},
                                                      "source_budget": source}))
    assert "| vLLM's memory budget | this run | the source's |" in shown
    assert "| the weights, as loaded | 14.26 GiB | 14.26 GiB |" in shown
    assert "| the KV pool (tokens) | 217,268 | 217,268 |" in shown
    assert "| the profile run's activation peak (torch) | 1.96 GiB |  |" in shown
    assert "The source's figures: the source's README." in shown
    none = render_markdown(RunReport.model_validate(base))
    assert "vLLM's memory budget: not in the log" in none and "| vLLM's memory budget |" not in none


def test_the_source_figures_are_budget_figures_and_each_host_is_one_the_matrix_has():
    figures = set(SourceBudget.model_fields) - {"source"}
    assert figures <= set(NAMES), figures - set(NAMES)
    from servekit.config.load import load_matrix
    matrix = load_matrix(ROOT / "images.yaml")
    named = {(p, h) for p, profile in matrix.profiles.items() for h in profile.source_budget}
    assert ("batch", "native") in named and all(h in matrix.hosts for _, h in named)


def test_a_figure_in_the_log_is_read_whatever_the_line_around_it():
    noisy = ["\rLoading safetensors checkpoint shards: 100%|| 7/7 Model loading took 15.43 GiB memory and 61.2 s",
             "garbage", "Available KV cache memory: not-a-number GiB"]
    assert read_budget(noisy) == {"weights_gib": 15.43}


def test_the_compile_cache_is_cold_where_vllm_compiled_and_warm_where_it_loaded():
    """Cold from a real boot log of the H200 visits; warm from vLLM 0.31.0's own line (compilation/backends.py),
    as a second boot of one image and profile writes it."""
    from servekit.records.budget import compile_cache
    cold = (GPU / "20261203-105645-alternative-cuda-boot.log").read_text().splitlines()
    assert (compile_cache(cold) or "").startswith("cold: compiled now (")
    warm = ["(EngineCore pid=83) INFO 12-06 10:00:00 [backends.py:290] Directly load the compiled graph(s) for "
            "compile range (1, 2048) from the cache, took 2.114 s"]
    assert compile_cache(warm) == "warm: loaded from the cache"
    # the AOT path (compilation/decorators.py), which the second full-size boot of default took (2026-12-06)
    aot = ["(EngineCore pid=96) INFO 12-06 06:14:58 [decorators.py:316] Directly load AOT compilation from path "
           "/cache/vllm/torch_compile_cache/torch_aot_compile/fc8c30fec0/rank_0_0/model"]
    assert compile_cache(aot) == "warm: loaded from the cache"
    assert (compile_cache(warm + cold) or "").startswith("partly warm")
    assert compile_cache(["Available KV cache memory: 2.83 GiB"]) is None
