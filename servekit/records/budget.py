"""The memory budget vLLM computed at boot, read from its log: what the card holds, what vLLM asked for, and where it
went (weights, the profiled activation peak, memory outside torch, the CUDA-graph estimate) before what was left
became the KV pool, and what the graphs took when captured after it. The series' memory-budget-info patch logs at INFO the figures vLLM 0.31.0 logs at DEBUG only;
the cpu target's worker logs its own one line. A failed boot's log gives what it got to.

Each figure is vLLM's own, as it printed it (GiB to two decimals); `non_torch_gib` is the one derived here: the
profile's non-KV memory less its activation peak and the weights, which is how vLLM adds them up."""

from __future__ import annotations

import re
from collections.abc import Iterable

# (figure, what it is) in the order a boot computes them: the report's table rows.
FIELDS = (
    ("total_gib", "the device's memory, as vLLM sized from it (the card's, or the CPU node's)"),
    ("free_at_start_gib", "free when vLLM started"),
    ("util", "GPU_UTIL (--gpu-memory-utilization)"),
    ("requested_gib", "what vLLM may use: total x util"),
    ("weights_gib", "the weights, as loaded"),
    ("weights_processing_peak_allocated_gib", "the allocator's peak while the weights were processed for their kernels"),
    ("weights_processing_peak_reserved_gib", "that processing's peak reserved, the allocator's cached blocks included"),
    ("weights_processing_largest_step", "the module whose processing step allocated most"),
    ("weights_processing_largest_step_gib", "what that step allocated above what was allocated before it"),
    ("activation_peak_gib", "the profile run's activation peak (torch)"),
    ("non_torch_gib", "memory outside torch (CUDA context, NCCL, ...)"),
    ("non_kv_gib", "everything but the KV cache, as profiled"),
    ("cudagraph_gib", "the CUDA graphs, estimated"),
    ("cudagraph_first_use_gib", "of that, what each graph size's first forward left allocated"),
    ("cudagraph_profile_driver_gib", "the profile's capture, by the driver's free memory"),
    ("kv_available_gib", "left for the KV cache"),
    ("kv_needed_gib", "needed for one request of max-model-len (a boot refused for it)"),
    ("max_len_fits", "the longest max-model-len that memory fits (vLLM's estimate)"),
    ("block_size", "attention block size (tokens)"),
    ("kv_pool_tokens", "the KV pool (tokens)"),
    ("max_concurrency", "requests of max-model-len at once"),
    ("cudagraph_captured_gib", "the CUDA graphs, as captured after the pool"),
    ("cudagraph_captured_driver_gib", "that capture, by the driver's free memory"),
)
NAMES = tuple(name for name, _ in FIELDS)

_NUMBER = r"([\d.]+)"
# Each line vLLM 0.31.0 writes (with the series), and the figures its groups are, in order.
_LINES: tuple[tuple[re.Pattern, tuple[str, ...]], ...] = tuple((re.compile(pattern), names) for pattern, names in (
    (rf"Weights processed: the allocator's peak {_NUMBER} GiB allocated, {_NUMBER} GiB reserved \([\d.]+ GiB reserved "
     rf"after\); the largest step (\S+), {_NUMBER} GiB above",
     ("weights_processing_peak_allocated_gib", "weights_processing_peak_reserved_gib", "weights_processing_largest_step",
      "weights_processing_largest_step_gib")),
    (rf"Model loading took {_NUMBER} GiB memory", ("weights_gib",)),
    (rf"Initial free memory: {_NUMBER} GiB; Requested memory: {_NUMBER} \(util\), {_NUMBER} GiB",
     ("free_at_start_gib", "util", "requested_gib")),
    (rf"Total non KV cache memory: {_NUMBER}GiB; torch peak memory increase: {_NUMBER}GiB; .*weights memory: "
     rf"{_NUMBER}GiB", ("non_kv_gib", "activation_peak_gib", "weights_gib")),
    (rf"Estimated CUDA graph memory: {_NUMBER} GiB total", ("cudagraph_gib",)),
    # the profile's warm pass, the V1 runner's estimate line or the V2 runner's own line for its profile
    (rf"{_NUMBER} GiB of it left allocated by each size's first forward", ("cudagraph_first_use_gib",)),
    (rf"\(the capture by the driver's free memory: {_NUMBER} GiB\)", ("cudagraph_profile_driver_gib",)),
    (rf"Graph capturing finished in [\d.]+ secs, took [\d.]+ GiB \(the driver's free memory: {_NUMBER} GiB\)",
     ("cudagraph_captured_driver_gib",)),
    # after the capture, the worker's line beside its estimate: the v2 model runner's profile logs no "Estimated"
    # line of its own
    (rf"CUDA graph pool memory: {_NUMBER} GiB \(actual\), {_NUMBER} GiB \(estimated\)",
     ("cudagraph_captured_gib", "cudagraph_gib")),
    (rf"The current --gpu-memory-utilization={_NUMBER} is equivalent", ("util",)),
    (rf"Available KV cache memory: {_NUMBER} GiB", ("kv_available_gib",)),
    # --kv-cache-memory-bytes (KV_MEM): no profile of the budget, the reserve as given
    (rf"Initial free memory {_NUMBER} GiB, reserved {_NUMBER} GiB memory for KV Cache",
     ("free_at_start_gib", "kv_available_gib")),
    (r"Setting attention block size to (\d+) tokens", ("block_size",)),
    # the refusal rounds what is available coarser than the line above it: that one's figure stands
    (rf"\({_NUMBER} GiB KV cache is needed, which is larger than the available KV cache memory \([\d.]+ GiB\)\. "
     r"Based on the available memory, the estimated maximum model length is (\d+)", ("kv_needed_gib", "max_len_fits")),
    (r"KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x",
     ("kv_pool_tokens", "max_concurrency")),
    # the cpu worker's one line: the KV cache it set aside of the node's memory (and what the rest took), or was told
    (rf"Explicitly set \({_NUMBER}/{_NUMBER}\) GiB for KV cache on node \d+", ("kv_available_gib", "total_gib")),
    (rf"Auto set \({_NUMBER}/{_NUMBER}\) GiB for KV cache on node \d+, with {_NUMBER} GiB requested memory for the "
     rf"worker\. {_NUMBER} GiB memory was consumed by non-kv usages",
     ("kv_available_gib", "total_gib", "requested_gib", "non_kv_gib")),
))
_WHOLE = {"block_size", "kv_pool_tokens", "max_len_fits"}
_TEXT = {"weights_processing_largest_step"}


def _figure(name: str, text: str) -> float | int | str:
    if name in _TEXT:
        return text
    return int(text.replace(",", "")) if name in _WHOLE else float(text)


def read_budget(lines: Iterable[str]) -> dict[str, float | int | str]:
    """The budget's figures that `lines` (a boot's log) hold, by FIELDS' names; a figure logged twice (a restart
    inside the boot) is its last."""
    found: dict[str, float | int | str] = {}
    for line in lines:
        for pattern, names in _LINES:
            match = pattern.search(line)
            if match:
                for name, text in zip(names, match.groups(), strict=True):
                    found[name] = _figure(name, text)
    if "total_gib" not in found and found.get("util") and "requested_gib" in found:
        found["total_gib"] = round(float(found["requested_gib"]) / float(found["util"]), 2)
    if {"non_kv_gib", "activation_peak_gib", "weights_gib"} <= found.keys():
        found["non_torch_gib"] = round(float(found["non_kv_gib"]) - float(found["activation_peak_gib"])
                                       - float(found["weights_gib"]), 2)
    return {name: found[name] for name in NAMES if name in found}


# A warm boot's line: the graphs of one compile range from Inductor's cache (compilation/backends.py), or the whole
# AOT-compiled model from vLLM's cache folder (compilation/decorators.py, the path 0.31.0 takes on a GPU)
_LOADED = re.compile(r"Directly load (the compiled graph\(s\) for compile range .* from the cache|AOT compilation from path)")
_COMPILED = re.compile(r"Compiling a graph for compile range .* takes ([\d.]+) s")


def compile_cache(lines: Iterable[str]) -> str | None:
    """Whether the boot found torch.compile's graphs in the cache volume (warm) or compiled them now (cold), by vLLM's
    own lines: the profiled activation peak, and so the KV pool, differ between the two (a cold compile's scratch is
    charged to the budget). None where the log says neither (a target that does not compile, a boot that ended
    first)."""
    loaded = any(_LOADED.search(line) for line in lines)
    compiled = [float(m[1]) for line in lines if (m := _COMPILED.search(line))]
    if compiled:
        took = f"compiled now ({sum(compiled):.1f} s)"
        return f"cold: {took}" if not loaded else f"partly warm: some graphs loaded, others {took}"
    return "warm: loaded from the cache" if loaded else None
