"""The commands of checking and comparing: run, smoke, sweep, compare."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from servekit import arguments
from servekit.commands.console import channel, emit_json, engine_of, open_session, print_table, print_wide
from servekit.commands.parsing import Commands
from servekit.errors import UserError

# Each command imports its stage when it runs, inside its function: `--help`, completion and a refused argument
# answer in a tenth of a second, without loading the engine's SDK, pydantic or Rich (a second and more).


def cmd_run(args: argparse.Namespace) -> int:
    session = open_session(args)
    if args.engines and (args.knob or args.timeout or args.card):
        raise UserError("--knob, --timeout and --card apply to one engine's run; leave out --engines")
    if args.engines:
        from servekit.engines import parse_engines
        from servekit.serve import fleet
        doc, summary_md, runs = fleet.run(session, parse_engines(args.engines), args.target, args.profile, args.host,
                                    args.port, say=channel(), only=args.check)
        if args.json:
            emit_json({"passed": doc.passed, "summary": str(summary_md),
                       "engines": [e.model_dump() for e in doc.engines]})
        else:
            print_wide(f"{sum(r.passed for r in runs)} of {len(runs)} engines passed", doc.table.header,
                        doc.table.rows, summary_md.read_text())
            print(f"run: summary in {summary_md.relative_to(session.root)}")
        return 0 if doc.passed else 1
    from servekit.config.knobargs import parse_settings
    from servekit.serve import commands
    from servekit.serve.pipeline import RunInterrupted
    from servekit.smoke import GATE_PASSES
    try:
        done = commands.run(session, args.target, args.profile, args.host, engine_of(args), args.port, say=channel(),
                            knobs=parse_settings(args.knob or []), only=args.check, boot_timeout_s=args.timeout,
                            card=args.card)
    except RunInterrupted as exc:  # its reports are written: a caller reading --json finds them as on any end
        if args.json:
            emit_json({"passed": False, "interrupted": True, "reports": [str(folder) for folder in exc.written]})
        raise
    for report, run_dir in done:
        failed = [f"{c.name}{' (not run)' if c.status == 'not_run' else ''}" for c in report.checks
                  if c.status not in GATE_PASSES]
        print(f"run: {report.profile}: {'passed' if report.passed else 'FAILED: ' + ', '.join(failed)}; report "
              f"in {run_dir.relative_to(session.root)}/report.md", file=sys.stderr)
    passed = all(report.passed for report, _ in done)
    if args.json:
        emit_json({"passed": passed, "interrupted": False, "reports": [str(run_dir) for _, run_dir in done]})
    return 0 if passed else 1


def cmd_smoke(args: argparse.Namespace) -> int:
    from servekit.serve.checks import console_line
    from servekit.serve.commands import smoke_running
    from servekit.smoke import all_passed
    url, results = smoke_running(open_session(args), args.profile, args.target, engine_of(args) if args.engine else None,
                                 args.url, Path(args.api_key_file) if args.api_key_file else None,
                                 on_result=None if args.json else lambda r: print(console_line(r)),
                                 only=args.check, timeout_s=args.timeout, card=args.card)
    if args.json:
        emit_json({"url": url, "checks": [r.to_json() for r in results]})
    return 0 if all_passed(r.status for r in results) else 1


def cmd_sweep(args: argparse.Namespace) -> int:
    from servekit.serve.sweep import sweep
    session = open_session(args)
    out, doc, markdown = sweep(session, args.profile, args.knob, args.boots, args.target, args.host,
                               args.checks.split(",") if args.checks else None, say=channel(),
                               engine=engine_of(args) if args.engine else None, card=args.card)
    print_wide(doc.title, doc.table.header, doc.table.rows, markdown)
    if sys.stdout.isatty() and doc.advice:
        print(doc.advice)
    print(f"sweep: report in {out.relative_to(session.root)}/report.md")
    return 130 if doc.interrupted else 0


def cmd_run_plan(args: argparse.Namespace) -> int:
    from servekit.serve.runplan import TABLE_HEADER, record_path, run_plan, table_rows
    session = open_session(args)
    plan = Path(args.plan)
    results, left = run_plan(session, plan, args.target, engine_of(args) if args.engine else None, args.until,
                             say=channel())
    rows = table_rows(results)
    if args.json:
        emit_json({"passed": not left and all(r is not None and r.passed for _, r in results), "left": left,
                   "runs": [dict(zip(TABLE_HEADER, row, strict=True)) for row in rows]})
    else:
        from servekit.records.report import markdown_table
        print_wide(f"plan {plan.name}", TABLE_HEADER, rows, "\n".join(markdown_table(TABLE_HEADER, rows)))
    record = record_path(session.root, plan).relative_to(session.root)
    if left:
        print(f"run-plan: stopped before {', '.join(left)}: --until leaves less than their bounds; the same command "
              f"again resumes there ({record} names what is done)", file=sys.stderr)
        return 3
    return 0 if all(r is not None and r.passed for _, r in results) else 1


def cmd_compare(args: argparse.Namespace) -> int:
    from servekit.records.report import compare, load_report
    reports = [load_report(Path(path)) for path in (args.report_a, args.report_b)]
    rows = compare(reports[0], reports[1], threshold=args.threshold)
    if args.json:
        emit_json([{"metric": m, "a": a, "b": b, "differs": d} for m, a, b, d in rows])
        return 0
    print_table(f"A: {reports[0].run_id}   B: {reports[1].run_id}   (marked: differs by more than "
                 f"{args.threshold:.0%})", ["metric", "A", "B", ""],
                 [[metric, a, b, "<>" if differs else ""] for metric, a, b, differs in rows])
    return 0


def register(c: Commands) -> None:
    p = c.add("run", cmd_run, "image, up, smoke checks, down and a report for each profile, on one engine or on "
            "several in parallel; exit 0 only when every check passed or is not required on the target", locked=True)
    c.target(p)
    p.add_argument("--profile", action="append", metavar="NAME", help="a profile (repeatable; default: the "
                   "target's first)")
    c.host(p)
    where = p.add_mutually_exclusive_group()
    c.engine(where)
    where.add_argument("--engines", metavar="A,B,...", help="run on several engines in parallel (each as --engine "
                       "takes it; `local` is this machine's): one report per engine and a summary table")
    p.add_argument("--port", type=arguments.port, metavar="N", help="publish on this port (default: serve.port; with "
                   "--engines, serve.port plus the engine's position)")
    p.add_argument("--knob", action="append", metavar="NAME=VALUE", help="set a knob for every boot, over the "
                   "profile's (repeatable; recorded in the report)")
    p.add_argument("--check", action="append", metavar="NAME", help="run this check instead of the profile's own "
                   "(repeatable; its parameters from images.yaml; on every engine with --engines)")
    p.add_argument("--timeout", type=arguments.seconds, metavar="S", help="seconds each boot may take to healthy; a "
                   "boot past it fails with its report written (default: serve.boot_timeout_s)")
    c.card(p)
    p = c.add("run-plan", cmd_run_plan, "run a plan of runs back to back (profiles, cards, knobs, checks, model "
              "folders; a YAML file), each boot bounded, skipping those done: one table at the end; exit 0 when every "
              "run passed, 1 when one failed, 3 when --until stopped it with runs left (run it again to resume)",
              locked=True)
    p.add_argument("plan", metavar="PLAN", help="the plan's YAML file (servekit/serve/runplan.py shows one)")
    c.target(p)
    c.engine(p)
    p.add_argument("--until", type=arguments.seconds, metavar="S", help="start no run whose own bound would carry "
                   "this call past S seconds (a host reachable in short calls); the next call resumes")
    p = c.add("smoke", cmd_smoke, "run a profile's smoke checks against a running server (local or --url)")
    p.add_argument("profile", metavar="PROFILE")
    p.add_argument("--url", type=arguments.http_url, help="the server's base URL (default: the profile's container "
                   "on --engine); a redirect to another origin fails the check")
    p.add_argument("--timeout", type=arguments.seconds, metavar="S", help="the most one check may take, all its "
                   "requests together (default: 600, more for a check of many requests)")
    c.engine(p)
    p.add_argument("--api-key-file", metavar="F", help="file holding the API key (default: compose/secrets/api_key)")
    p.add_argument("--check", action="append", metavar="NAME", help="run this check instead of the profile's own "
                   "(repeatable)")
    c.target(p, help="which target's sizes and model name to expect")
    p.add_argument("--card", metavar="NAME", help="the card the server must be emulating (`up --card`); a server "
                   "on another card, or on none, is refused")
    p = c.add("sweep", cmd_sweep, "boot a profile across knob values, several boots a cell, and print the table "
            "(boots survived, margin, KV pool, tokens/s, and whether the spread is below the gap)", json_out=False, locked=True)
    p.add_argument("profile", metavar="PROFILE")
    p.add_argument("--knob", action="append", required=True, metavar="NAME=V1,V2", help="a knob and its values "
                   "(repeatable: every combination is booted)")
    p.add_argument("--boots", type=arguments.count, default=2, metavar="N", help="boots per cell (default 2)")
    c.target(p)
    c.host(p)
    p.add_argument("--checks", metavar="C1,C2", help="checks to run per boot (default: the profile's own)")
    c.card(p)
    c.engine(p)
    p = c.add("compare", cmd_compare, "one table with two reports side by side, marking differences")
    p.add_argument("report_a", metavar="REPORT_A", help="a report.json or its folder")
    p.add_argument("report_b", metavar="REPORT_B")
    p.add_argument("--threshold", type=arguments.share, default=0.10, help="relative difference to mark (default 0.10)")

