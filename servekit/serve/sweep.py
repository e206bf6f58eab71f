"""Sweeps: boot a profile across knob values, several boots a cell, and draw the table the source
document drew by hand, with the spread between boots measured so a reader knows which gaps are claims.
"""

from __future__ import annotations

import datetime as dt
import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servekit.config.knobargs import parse_knobs
from servekit.config.matrix import Matrix
from servekit.config.profiles import render_profiles
from servekit.config.session import Session
from servekit.engines import Engine, resolve
from servekit.engines.deployment import Deployment
from servekit.errors import UserError
from servekit.image.boundary import write_text_atomic
from servekit.image.launcher import build_command
from servekit.output import Say
from servekit.records.models import RunReport, SweepCell, SweepReport, Table, save
from servekit.records.report import markdown_table, quiet_matplotlib
from servekit.serve.pipeline import run_profile
from servekit.serve.ready import ready_to_serve

GiB = 2**30


@dataclass
class Cell:
    knobs: dict[str, str]
    boots: list[dict] = field(default_factory=list)  # one summary per boot

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.knobs.items())


def combinations(knobs: list[tuple[str, list[str]]]) -> list[dict[str, str]]:
    names = [name for name, _ in knobs]
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*(vals for _, vals in knobs))]


def failure_kind(reason: str) -> str:
    text = reason.lower()
    if "memory" in text:
        return "out of memory"
    if "within" in text and "healthy" in text:
        return "timeout"
    if "exited" in text:
        return "exit"
    return "failed"


def summarize_boot(report: RunReport) -> dict:
    """What a sweep keeps of one boot's report."""
    boot_check = next((c for c in report.checks if c.name == "boot"), None)
    gpu = report.memory.gpus[0] if report.memory.gpus else None
    shared = report.memory.shared_usage
    by_name = {c.name: c for c in report.checks}
    burst, spill, spec = by_name.get("burst"), by_name.get("spill"), by_name.get("spec_decode")
    out: dict[str, Any] = {"survived": boot_check is None, "reason": boot_check.reason if boot_check else "",
           "kind": failure_kind(boot_check.reason) if boot_check else "survived",
           "time_to_healthy_s": report.boot.time_to_healthy_s, "kv_pool_tokens": report.boot.kv_pool_tokens,
           "gpu_peak_bytes": gpu["peak_used_bytes"] if gpu else None,
           "gpu_margin_bytes": gpu["min_margin_bytes"] if gpu else None,
           "traffic_rise_bytes": shared.get("traffic_rise_bytes") if shared else None,
           "checks": {c.name: {"status": c.status, "figures": c.figures, "reason": c.reason}
                      for c in report.checks if c.name != "boot"},
           "report_run_id": report.run_id,
           "tokens_per_s": burst.figures.get("tokens_per_s") if burst and burst.status == "passed" else None,
           # a spill check that did not measure says nothing either way
           "spilled": spill.status == "failed" if spill and spill.status in ("passed", "failed") else None,
           "tokens_per_step": spec.figures if spec and spec.status == "passed" else None}
    return out


def _range(values: list, fmt: Callable[[Any], str]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    return fmt(lo) if lo == hi else f"{fmt(lo)}-{fmt(hi)}"


def boots_text(cell: Cell) -> str:
    n, ok = len(cell.boots), sum(b["survived"] for b in cell.boots)
    if ok == n:
        return f"{n}/{n} survive"
    kinds = sorted({b["kind"] for b in cell.boots if not b["survived"]})
    return f"{', '.join(kinds)}, {n - ok}/{n}" + (f" ({ok} survive)" if ok else "")


def primary_metric(cells: list[Cell]) -> str:
    """The figure the spread column judges: tokens/s when the burst ran, else the time to healthy."""
    return "tokens_per_s" if any(b["tokens_per_s"] for c in cells for b in c.boots) else "time_to_healthy_s"


def spread_versus_gap(cells: list[Cell], metric: str) -> list[str]:
    """Per row: whether the spread between its boots (and the next row's) is smaller than the gap between them."""
    out = []
    for cell, nxt in zip(cells, cells[1:] + [None], strict=True):
        mine = [b[metric] for b in cell.boots if b[metric] is not None]
        if nxt is None:
            out.append("")
            continue
        theirs = [b[metric] for b in nxt.boots if b[metric] is not None]
        if len(mine) < 2 or len(theirs) < 2:
            out.append("too few boots")
            continue
        spread = max(max(mine) - min(mine), max(theirs) - min(theirs))
        gap = abs(statistics.mean(mine) - statistics.mean(theirs))
        out.append(f"{'yes' if spread < gap else 'no'} (spread {spread:.3g}, gap {gap:.3g})")
    return out


def table_rows(cells: list[Cell], speculates: bool) -> tuple[list[str], list[list[str]]]:
    metric = primary_metric(cells)
    header = ["value", "boots", "GPU margin", "KV pool (tokens)", "tokens/s", "time to healthy (s)", "spill",
              f"spread < gap to next ({metric})", "tokens per step (T=0 / default)"]
    rows = []
    for cell, claim in zip(cells, spread_versus_gap(cells, metric), strict=True):
        b = cell.boots
        spec = [x["tokens_per_step"] for x in b if x["tokens_per_step"]]
        rows.append([
            cell.label, boots_text(cell),
            _range([x["gpu_margin_bytes"] for x in b], lambda v: f"{v / 2**20:.0f} MiB") or "no GPU",
            _range([x["kv_pool_tokens"] for x in b], lambda v: f"{v:,}"),
            _range([x["tokens_per_s"] for x in b], lambda v: f"{v:,.0f}"),
            _range([x["time_to_healthy_s"] for x in b], lambda v: f"{v:.1f}"),
            spill_text(cell),
            claim,
            (f"{spec[0]['greedy']:.3f} / {spec[0]['sampled']:.3f}" if spec else
             ("not measured" if speculates else "no speculation in this profile or target")),
        ])
    return header, rows


def spill_text(cell: Cell) -> str:
    """The spill column: the spill check's verdict per boot with the traffic's rise; where it did not run, the
    rise alone (or nothing, off WSL2)."""
    b = cell.boots
    rise = _range([x["traffic_rise_bytes"] for x in b], lambda v: f"+{v / 1e6:.0f} MB")
    judged = [x["spilled"] for x in b if x["spilled"] is not None]
    if not judged:
        return rise
    verdict = f"spilled {sum(judged)}/{len(judged)}" if any(judged) else "none"
    return f"{verdict} ({rise})" if rise else verdict


def sizing_advice(cells: list[Cell], knob: str, min_margin_bytes: int, current: str | None,
                  host: str = "native") -> str | None:
    """For a GPU_UTIL sweep: the largest value whose every boot survived with the margin required and, on WSL2,
    passed the spill check (where going over does not fail, it spills: the margin alone cannot tell)."""
    if knob != "GPU_UTIL":
        return None
    wsl2 = host == "wsl2"
    ok = [c for c in cells if c.boots and all(b["survived"] and b["gpu_margin_bytes"] is not None and
                                               b["gpu_margin_bytes"] >= min_margin_bytes and
                                               (not wsl2 or b.get("spilled") is False) for b in c.boots)]
    without_spill = " and without spill (the spill check passed)" if wsl2 else ""
    if not ok:
        return (f"no GPU_UTIL value had every boot survive with a margin of {min_margin_bytes / 2**20:.0f} MiB"
                f"{without_spill} (or no GPU was sampled); no advice")
    best = max(ok, key=lambda c: float(c.knobs[knob]))
    return (f"recommended GPU_UTIL default: {best.knobs[knob]} (largest value whose every boot survived with at "
            f"least {min_margin_bytes / 2**20:.0f} MiB to spare{without_spill}); current default: "
            f"{current or 'unset'}")


def render_markdown(title: str, header: list[str], rows: list[list[str]], advice: str | None, notes: list[str]) -> str:
    lines = [f"# {title}", "", *markdown_table(header, rows)]
    if advice:
        lines += ["", advice]
    lines += [f"\nNote: {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot(path: Path, cells: list[Cell], knob: str) -> None:
    quiet_matplotlib()
    import matplotlib  # only when a sweep's plot is drawn (a second to import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # only when a sweep's plot is drawn (a second to import)

    xs = [c.knobs.get(knob, c.label) for c in cells]
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    for i, c in enumerate(cells):
        pools = [b["kv_pool_tokens"] for b in c.boots if b["kv_pool_tokens"]]
        ax.scatter([i] * len(pools), pools, color="tab:blue", label="KV pool (tokens)" if i == 0 else None)
        failed = [b for b in c.boots if not b["survived"]]
        if failed:
            ax.annotate(f"{len(failed)} failed", (i, ax.get_ylim()[0]), color="tab:red", fontsize=8)
    ax.set_xticks(range(len(cells)), xs)
    ax.set_xlabel(knob)
    ax.set_ylabel("KV pool, tokens", color="tab:blue")
    margins = [[b["gpu_margin_bytes"] / 2**20 for b in c.boots if b["gpu_margin_bytes"] is not None] for c in cells]
    if any(margins):
        ax2 = ax.twinx()
        for i, m in enumerate(margins):
            ax2.scatter([i] * len(m), m, color="tab:orange", marker="x", label="GPU margin (MiB)" if i == 0 else None)
        ax2.set_ylabel("GPU margin, MiB", color="tab:orange")
    ax.set_title(f"sweep of {knob}: every boot a point")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write(out: Path, doc: SweepReport, markdown: str, cells: list[Cell], knob: str) -> None:
    save(out / "report.json", doc)
    write_text_atomic(out / "report.md", markdown)
    plot(out / "sweep.png", cells, knob)


def run_sweep(matrix: Matrix, dep: Deployment, profile: str, key_file: Path, knobs: list[tuple[str, list[str]]], boots: int,
              only: list[str] | None, say: Say) -> tuple[list[Cell], bool]:
    """Boot every combination `boots` times; (the cells that have boots, whether Ctrl-C stopped it).

    A cell whose boot fails is recorded and the sweep goes on; Ctrl-C stops after run_profile has
    taken the current boot down."""
    cells = [Cell(c) for c in combinations(knobs)]
    try:
        for cell in cells:
            for n in range(1, boots + 1):
                say(f"sweep: {cell.label}, boot {n}/{boots}")
                report, _ = run_profile(matrix, dep, profile, key_file, knobs=cell.knobs, only=only, say=say)
                cell.boots.append(summarize_boot(report))
    except KeyboardInterrupt:
        return [c for c in cells if c.boots], True
    return cells, False


def sweep_document(matrix: Matrix, dep: Deployment, profile: str, image: str, knobs: list[tuple[str, list[str]]], boots: int,
                   cells: list[Cell], interrupted: bool) -> tuple[SweepReport, str]:
    """The sweep's report.json content and its Markdown."""
    names = [k for k, _ in knobs]
    argv, _ = build_command(render_profiles(matrix, dep.target), profile, dep.host, {})  # what it runs untouched
    current = argv[argv.index("--gpu-memory-utilization") + 1] if "--gpu-memory-utilization" in argv else None
    header, rows = table_rows(cells, "--speculative-config" in argv)
    advice = sizing_advice(cells, names[0], matrix.sweep.min_margin_mib * 2**20, current, dep.host) \
        if len(names) == 1 else None
    notes = ["interrupted: the table holds the boots that finished"] if interrupted else []
    if dep.card:
        notes.append(dep.card.said() + "; margins are the card's")
    on = f", card {dep.card.card} emulated" if dep.card else ""
    title = f"sweep of {profile} on {dep.target} ({dep.host}{on}): {', '.join(names)}, {boots} boots a cell"
    doc = SweepReport(profile=profile, target=dep.target, host=dep.host, image=image,
                      boots_per_cell=boots, interrupted=interrupted, advice=advice,
                      cells=[SweepCell(knobs=c.knobs, boots=c.boots) for c in cells],
                      table=Table(header=header, rows=rows), notes=notes, title=title)
    return doc, render_markdown(title, header, rows, advice, notes)


def sweep(session: Session, profile: str, knob_specs: list[str], boots: int = 2, target: str | None = None,
          host: str | None = "auto", checks: list[str] | None = None, say: Say = print,
          engine: Engine | None = None, card: str | None = None) -> tuple[Path, SweepReport, str]:
    """Every combination of knob values, `boots` boots each, on `engine` (this machine's Docker engine when None);
    a failed cell is recorded and the sweep goes on. (the report's folder, its document, its Markdown)."""

    matrix = session.matrix
    engine = engine or resolve(None)
    knobs = parse_knobs(knob_specs)
    for name in checks or []:
        if name not in matrix.checks:
            raise UserError(f"--checks {name}: expected one of {', '.join(matrix.checks)}")
    ready = ready_to_serve(session, [engine], "sweep", [profile], target=target, host=host,
                           knob_sets=list(combinations(knobs)), card=card, say=say)
    target, plan, dep, key_file = ready.target, ready.plan, ready.deployments[0], ready.key_file
    assert plan is not None, "a sweep builds"
    if checks and dep.host == "wsl2" and "spill" not in checks:  # on WSL2 every cell is judged for spill
        checks = [*checks, "spill"]
    cells, interrupted = run_sweep(matrix, dep, profile, key_file, knobs, boots, checks, say=say)
    doc, markdown = sweep_document(matrix, dep, profile, plan.tag, knobs, boots, cells, interrupted)
    out = session.root / "reports" / f"{dt.datetime.now(dt.UTC):%Y%m%d-%H%M%S}-sweep-{profile}-{target}"
    write(out, doc, markdown, cells, knobs[0][0])
    return out, doc, markdown
