"""WSL2 spill: going over the card's memory under WSL2 does not fail, the driver spills into shared system
memory and everything runs 2-6 times slower, silently. Windows counts it as the adapter's Shared Usage,
which this judges phase by phase from the run's samples (wsl2/shared_usage.py): the level the first request
met, and how far the traffic raised it. It runs after every other check, on the traffic they sent."""

from __future__ import annotations

from .core import CheckFailure, Context, NotRun, check

MB = 1_000_000


def _mb(value: int | None) -> str:
    return "?" if value is None else f"{value / MB:,.0f} MB"


def judge(summary: dict, max_rise_mb: float, settled_below_mb: float) -> dict:
    """The figures of a run without spill, or CheckFailure naming the phase and the figures of the one with."""
    phases = summary["phases"]
    load_peak = max((phases[p]["peak_bytes"] or 0 for p in ("load", "warm-up") if p in phases), default=0)
    start, rise, end = summary.get("traffic_start_bytes"), summary.get("traffic_rise_bytes"), \
        summary.get("traffic_end_bytes")
    figures = {"adapter": summary["adapter"], "baseline_mb": round(summary["baseline_bytes"] / MB),
               "load_peak_mb": round(load_peak / MB), "traffic_start_mb": None if start is None else round(start / MB),
               "traffic_peak_mb": None if summary.get("traffic_peak_bytes") is None
               else round(summary["traffic_peak_bytes"] / MB),
               "traffic_rise_mb": None if rise is None else round(rise / MB),
               "traffic_end_mb": None if end is None else round(end / MB)}
    if start is None or rise is None:
        raise CheckFailure("no Shared Usage sample before or during the traffic: nothing to judge a spill by "
                           f"({phases.get('traffic', {}).get('samples', 0)} samples in the traffic)", **figures)
    if start > settled_below_mb * MB:
        raise CheckFailure(f"phase healthy: Shared Usage was {_mb(start)} when the first request came, not back "
                           f"under {_mb(int(settled_below_mb * MB))} (baseline {_mb(summary['baseline_bytes'])}, "
                           f"load peak {_mb(load_peak)}): the server booted spilled into system memory; lower "
                           "GPU_UTIL or MAX_LEN", **figures)
    if rise > max_rise_mb * MB:
        raise CheckFailure(f"phase traffic: Shared Usage rose {_mb(rise)} above its {_mb(start)} when healthy, to "
                           f"{_mb(summary['traffic_peak_bytes'])} (ending the traffic at {_mb(end)}), more than the "
                           f"{_mb(int(max_rise_mb * MB))} allowed: the traffic spilled into system memory and ran "
                           "slower; lower GPU_UTIL", **figures)
    return figures


@check("spill", bounds={"max_rise_mb": (0, None), "settled_below_mb": (1, None)})
def spill(ctx: Context, max_rise_mb: float = 125.0, settled_below_mb: float = 400.0) -> dict:
    if ctx.shared_usage is None:
        raise NotRun("Shared Usage is read only under WSL2 (this run is not on a wsl2 host)")
    summary = ctx.shared_usage()
    if summary is None:
        raise CheckFailure("Shared Usage was not sampled on this WSL2 run (the report's notes say why), so a spill "
                           "could not be ruled out")
    if summary.get("adapter") is None:
        raise CheckFailure(f"no adapter to read: {summary['chosen_because']}")
    return judge(summary, max_rise_mb, settled_below_mb)
