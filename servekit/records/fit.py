"""`fit`: which profiles fit a card, from the checkpoint's config.json, the profile's flags and the overheads the
full-size reports measured, before 20 GB is downloaded.

The KV arithmetic is vLLM 0.31.0's for this hybrid model (../shared/served-model.md section 3, which reproduces the
source's published pools): the attention page per token and layer from the KV dtype, the GDN state per layer and
sequence (the conv rows grow with the drafts), the block size that makes one attention page hold a GDN state, a
request holding cdiv(MAX_LEN, block) attention blocks plus 1 + drafts (+1 with prefix caching) blocks per GDN group
and, beside a DFlash drafter, its sliding-window layers' window less one and every token in flight; every page
evened to the largest (with int4 KV the drafter's per-head scales, for twice the heads, make its page the largest,
and the rest are padded to it); the kinds' layers grouped as the series' kv-group-by-request picks (the smaller kind's count for Qwen3.5 alone: the MTP layer
makes 17, with padding), a block id costing one page per layer of a group. What vLLM keeps for itself (weights,
activation peak, memory outside torch, CUDA graphs) does not come out of one constant (served-model.md 3.10): it is
taken per profile from its newest full-size report's budget, as requested less available, and a profile without
one gets no pool, only what one request needs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from servekit.config.matrix import Matrix
from servekit.config.profiles import render_profiles
from servekit.image.launcher import build_command
from servekit.image.standin import DRAFTER_FULL, FULL
from servekit.records.report import report_files
from servekit.smoke.logs import flag_values

GiB = 2**30
ALIGN = 16  # the attention backends' kernel alignment of the hybrid block size
# bytes per token and layer per KV head and head dimension, by --kv-cache-dtype: (per element, per head)
KV_BYTES = {"auto": (2, 0), "bfloat16": (2, 0), "float16": (2, 0), "fp8": (1, 0), "fp8_e4m3": (1, 0),
            "int4_per_token_head": (0.5, 4), "int8_per_token_head": (1, 4)}  # the per-token-head dtypes: fp32 scales


@dataclass(frozen=True)
class Drafter:
    """What the KV arithmetic needs of a DFlash drafter's config: its sliding-window attention layers."""
    window_layers: int
    window: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: dict) -> Drafter:
        window = (config.get("dflash_config") or {}).get("swa_window_size") or config["sliding_window"]
        return cls(window_layers=config["num_hidden_layers"], window=window, kv_heads=config["num_key_value_heads"],
                   head_dim=config["head_dim"])


@dataclass(frozen=True)
class Layout:
    """What the KV arithmetic needs of a Qwen3.5-family text config (and of the DFlash drafter served beside it)."""
    attention_layers: int
    gdn_layers: int
    kv_heads: int
    head_dim: int
    conv_dim: int
    conv_rows: int  # the conv kernel less one
    ssm_elements: int
    drafter: Drafter | None = None

    @classmethod
    def from_config(cls, config: dict, drafter: dict | None = None) -> Layout:
        t = config.get("text_config", config)
        types = t.get("layer_types") or ["full_attention" if (i + 1) % t["full_attention_interval"] == 0
                                          else "linear_attention" for i in range(t["num_hidden_layers"])]
        key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
        return cls(attention_layers=types.count("full_attention"), gdn_layers=types.count("linear_attention"),
                   kv_heads=t["num_key_value_heads"], head_dim=t["head_dim"],
                   conv_dim=2 * key_dim + t["linear_num_value_heads"] * t["linear_value_head_dim"],
                   conv_rows=t["linear_conv_kernel_dim"] - 1,
                   ssm_elements=t["linear_num_value_heads"] * t["linear_key_head_dim"] * t["linear_value_head_dim"],
                   drafter=Drafter.from_config(drafter) if drafter else None)


@dataclass(frozen=True)
class Flags:
    """The profile's flags that size the pool, as the launcher passes them."""
    kv_dtype: str
    max_len: int
    util: float
    block: int | None = None
    kv_bytes: int | None = None  # --kv-cache-memory-bytes: a pinned pool
    method: str | None = None  # the speculative method
    drafts: int = 0
    prefix_caching: bool = True
    ssm_bytes: int = 2  # --mamba-ssm-cache-dtype float16 (the launcher's); float32 takes 4
    async_scheduling: bool = True  # two batches in flight: a sliding window holds both
    batched_tokens: int = 2048  # --max-num-batched-tokens

    @classmethod
    def from_argv(cls, argv: list[str]) -> Flags:
        values = {name: str(value) for name, value in flag_values(argv).items()}  # as the logs check reads them
        spec = json.loads(values["speculative_config"]) if values.get("speculative_config") else {}
        return cls(kv_dtype=values.get("kv_cache_dtype", "auto"), max_len=int(values["max_model_len"]),
                   util=float(values.get("gpu_memory_utilization", "0.92")),
                   block=int(values["block_size"]) if values.get("block_size") else None,
                   kv_bytes=int(values["kv_cache_memory_bytes"]) if values.get("kv_cache_memory_bytes") else None,
                   method=spec.get("method"), drafts=int(spec.get("num_speculative_tokens", 0)),
                   # vLLM 0.31.0 caches prefixes unless told not to; the GDN groups then keep one block more
                   prefix_caching="no_enable_prefix_caching" not in values,
                   ssm_bytes=4 if values.get("mamba_ssm_cache_dtype") == "float32" else 2,
                   async_scheduling="no_async_scheduling" not in values,
                   batched_tokens=int(values.get("max_num_batched_tokens", 2048)))


@dataclass(frozen=True)
class Need:
    """One request's KV: the block size, the layers' grouping, and the blocks and bytes of one request."""
    block: int
    group_size: int
    groups: int
    block_bytes: int  # one block id: a page for every layer of a group
    blocks_per_request: int

    @property
    def request_bytes(self) -> int:
        return self.blocks_per_request * self.block_bytes

    def pool(self, kv_available: float, max_len: int) -> tuple[int, int]:
        """(blocks, the pool in tokens as vLLM logs it) for `kv_available` bytes."""
        blocks = int(kv_available // self.block_bytes)
        return blocks, int(blocks / self.blocks_per_request * max_len)


class NotPredicted(Exception):
    """A profile whose KV this arithmetic does not cover, and why."""


def need(layout: Layout, flags: Flags) -> Need:
    if flags.method not in (None, "mtp", "dflash"):
        raise NotPredicted(f"{flags.method} drafting: its layers' KV is not in this arithmetic")
    if flags.kv_dtype not in KV_BYTES:
        raise NotPredicted(f"KV dtype {flags.kv_dtype}: its page is not in this arithmetic")
    attention_page = _token_page(flags.kv_dtype, layout.kv_heads, layout.head_dim)
    drafts = flags.drafts if flags.method else 0  # every drafter's verify step widens the GDN conv state
    gdn_page = (layout.conv_rows + drafts) * layout.conv_dim * 2 + layout.ssm_elements * flags.ssm_bytes
    block = flags.block or ALIGN * math.ceil(gdn_page / (ALIGN * attention_page))
    # (layers, the bytes one token takes in one of them, the blocks one request of max_len holds at a block size)
    # per kind: vLLM's max_memory_usage_bytes over the page
    specs: list[tuple[int, int | None, Callable[[int], int]]] = [
        (layout.attention_layers + (1 if flags.method == "mtp" else 0),  # the MTP head's one attention layer
         attention_page, lambda size: math.ceil(flags.max_len / size)),
        (layout.gdn_layers, None, lambda size: 1 + drafts + (1 if flags.prefix_caching else 0))]  # align mode: +1
    if flags.method == "dflash":
        specs.append(_window_spec(layout, flags))
    # vLLM evens the pages to the largest (unify_kv_cache_spec_page_size): an attention kind whose page divides it
    # takes blocks that many times longer, any other (the GDN state, a drafter's page of per-head scales for twice
    # the heads) is padded to it
    def page_of(token: int | None) -> int:
        return block * token if token else gdn_page

    page = max(page_of(token) for _, token, _ in specs)
    kinds = [(layers, held(block * page // page_of(token) if token and page % page_of(token) == 0 else block))
             for layers, token, held in specs]
    group = _group_size(kinds)
    per_request = sum(math.ceil(layers / group) * blocks for layers, blocks in kinds)
    return Need(block, group, sum(math.ceil(layers / group) for layers, _ in kinds), group * page, per_request)


def _token_page(kv_dtype: str, kv_heads: int, head_dim: int) -> int:
    """An attention layer's KV bytes for one token."""
    per_element, per_head = KV_BYTES[kv_dtype]
    return int(2 * kv_heads * (head_dim * per_element + per_head))


def _window_spec(layout: Layout, flags: Flags) -> tuple[int, int, Callable[[int], int]]:
    """The DFlash drafter's sliding-window layers: their page a token, and in blocks the window less one and every
    token in flight (two batches under async scheduling), and one more for a window that starts mid-block."""
    d = layout.drafter
    if d is None:
        raise NotPredicted("dflash drafting: no drafter config to size its window layers from")
    held = min(d.window - 1 + (2 if flags.async_scheduling else 1) * flags.batched_tokens, flags.max_len)
    return d.window_layers, _token_page(flags.kv_dtype, d.kv_heads, d.head_dim), lambda size: math.ceil(held / size) + 1


def _group_size(kinds: list[tuple[int, int]]) -> int:
    """The layers in a KV cache group, as the series' kv-group-by-request picks it: among the sizes that make no
    more groups than vLLM's own choice (the smallest kind's count), the one that makes a request cost the fewest
    pages (a group pays a page per slot, padding included, for every block its kind holds); vLLM's choice wins ties,
    then the fewest groups."""
    released = min(layers for layers, _ in kinds)

    def groups(size: int) -> int:
        return sum(math.ceil(layers / size) for layers, _ in kinds)

    def pages(size: int) -> int:
        return sum(math.ceil(layers / size) * size * blocks for layers, blocks in kinds)

    sizes = [size for size in range(1, max(layers for layers, _ in kinds) + 1) if groups(size) <= groups(released)]
    best = min(pages(size) for size in sizes)
    return released if pages(released) == best else min((s for s in sizes if pages(s) == best),
                                                         key=lambda s: (groups(s), s))


@dataclass(frozen=True)
class Calibration:
    """What vLLM kept for itself in a full-size report of the profile: requested less available for the KV."""
    overhead_gib: float
    report: str
    host: str


# The one knob a calibrating run may set: it moves what vLLM is given, not what it keeps for itself. Any other
# (INT8_ACT's kernels, MAX_LEN's buffers, KV_MEM's pin, ...) measured another configuration than the profile's own.
CALIBRATING_KNOBS = {"GPU_UTIL"}


def calibrations(root: Path) -> dict[tuple[str, str], Calibration]:
    """(profile, host) -> its newest full-size report's overhead (a report of an emulated card with vLLM's budget,
    the profile as shipped but for GPU_UTIL), from the checkout's report folders (each run's named for its start
    time, so the newest sorts last)."""
    out: dict[tuple[str, str], Calibration] = {}
    for path in sorted(report_files(root), key=lambda p: p.parent.name):
        try:  # a report of another shape (an older one, a process engine's) calibrates nothing
            doc = json.loads(path.read_text())
            budget = (doc.get("boot") or {}).get("budget") or {}
            overhead = budget["requested_gib"] - budget["kv_available_gib"]
            key = (str(doc["profile"]), str(doc["host"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if doc.get("card") and not set(doc.get("knobs") or {}) - CALIBRATING_KNOBS:
            out[key] = Calibration(round(overhead, 2), path.parent.name, key[1])
    return out


def calibration_for(measured: dict[tuple[str, str], Calibration], profile: str, host: str) -> Calibration | None:
    """The profile's overhead measured on this host kind, else on another (which the prediction then names)."""
    return measured.get((profile, host)) or next((c for (p, _), c in sorted(measured.items()) if p == profile), None)


@dataclass(frozen=True)
class Prediction:
    profile: str
    host: str
    flags: Flags
    need: Need | None
    calibration: Calibration | None
    kv_available_gib: float | None
    blocks: int | None
    pool_tokens: int | None
    fits: bool | None
    why: str
    source_pool: int | None

    def to_json(self) -> dict:
        return {"profile": self.profile, "host": self.host, "kv_dtype": self.flags.kv_dtype,
                "max_len": self.flags.max_len, "util": self.flags.util,
                "block": self.need.block if self.need else None,
                "request_gib": round(self.need.request_bytes / GiB, 2) if self.need else None,
                "overhead_gib": self.calibration.overhead_gib if self.calibration else None,
                "calibrated_by": self.calibration.report if self.calibration else None,
                "kv_available_gib": self.kv_available_gib, "blocks": self.blocks, "pool_tokens": self.pool_tokens,
                "fits": self.fits, "why": self.why, "source_pool_tokens": self.source_pool}


def predict(profile: str, host: str, argv: list[str], layout: Layout, card_gib: float,
            calibration: Calibration | None, source_pool: int | None = None) -> Prediction:
    """One profile on one card: its pool where the overhead was measured at size, else what one request needs."""
    flags = Flags.from_argv(argv)
    try:
        one = need(layout, flags)
    except NotPredicted as exc:
        return Prediction(profile, host, flags, None, calibration, None, None, None, None, str(exc), source_pool)
    request = f"one request of {flags.max_len:,} tokens needs {one.request_bytes / GiB:.2f} GiB of KV"
    if flags.kv_bytes:
        available = flags.kv_bytes / GiB
    elif calibration:
        available = card_gib * flags.util - calibration.overhead_gib
    else:
        return Prediction(profile, host, flags, one, None, None, None, None, None,
                          f"{request}; vLLM's own overhead not yet measured at size (no full-size report of "
                          f"{profile})", source_pool)
    blocks, pool = one.pool(max(available, 0) * GiB, flags.max_len)
    fits = blocks >= one.blocks_per_request
    why = (f"{available:.2f} GiB for the KV cache, {request}" if fits else
           f"{request}, {available:.2f} GiB left for the KV cache")
    if calibration and calibration.host != host:
        why += f" (vLLM's overhead as measured on a {calibration.host} host)"
    return Prediction(profile, host, flags, one, calibration, round(available, 2), blocks, pool, fits, why,
                      source_pool)


def predict_all(matrix: Matrix, root: Path, target: str, layout: Layout, profiles: list[str] | None = None,
                hosts: list[str] | None = None, card: str | None = None) -> list[tuple[str, Prediction]]:
    """(card, prediction) for each host (each on its own card unless `card` names one) and profile of `target`,
    calibrated by the full-size reports in docs/gpu and reports/."""
    rendered = render_profiles(matrix, target)
    measured = calibrations(root)
    out = []
    for host in hosts or list(matrix.hosts):
        on = card or matrix.hosts[host].card
        if on is None:
            continue
        for name in profiles or list(rendered["profiles"]):
            argv, _ = build_command(rendered, name, host, {})
            source = (matrix.profiles[name].source_budget or {}).get(host)
            out.append((on, predict(name, host, argv, layout, matrix.cards[on].memory_gib,
                                    calibration_for(measured, name, host),
                                    source.kv_pool_tokens if source else None)))
    return out


def summary(matrix: Matrix, root: Path, host: str) -> str:
    """One line for `doctor`: which of the GPU target's profiles fit this host kind's card."""
    target = next((t for t, spec in matrix.targets.items() if spec.gpu), None)
    if target is None or matrix.hosts[host].card is None:
        return "no GPU target, or no card for this host kind in images.yaml"
    predictions = predict_all(matrix, root, target, Layout.from_config(FULL, DRAFTER_FULL), hosts=[host])
    said = {verdict: [p.profile for _, p in predictions if p.fits is fits]
            for verdict, fits in (("fit", True), ("do not fit", False), ("not predicted", None))}
    return (f"on {matrix.hosts[host].card} ({host}): " + "; ".join(f"{verdict}: {', '.join(names)}"
                                                                    for verdict, names in said.items() if names)
            + " (`python3 build.py fit` says why)")
