"""The commands of the matrix and its pins: plan, verify, lock, bump, port, series, schema, derive."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from servekit import arguments
from servekit.commands.console import channel, emit_json, open_session, print_findings, print_table
from servekit.commands.parsing import Commands

# Each command imports its stage when it runs, inside its function: `--help`, completion and a refused argument
# answer in a tenth of a second, without loading the engine's SDK, pydantic or Rich (a second and more).


def cmd_plan(args: argparse.Namespace) -> int:
    from servekit.build.plan import plans_for
    from servekit.engines import local
    session = open_session(args)
    for t in args.target or []:
        session.check_target(t)
    engine = local()
    plans = plans_for(session, args.target, engine.image_exists if engine.answers() else None)
    if args.json:
        emit_json({"matrix": str(args.matrix), "vllm": session.matrix.vllm, "targets": [p.to_json() for p in plans]})
        return 0
    rows = []
    for p in plans:
        built = {True: "yes", False: "no", None: "unknown (no engine)"}[p.exists]
        how = "made here (debootstrap)" if p.base_made_here else "pulled"
        rows.append([p.target, f"{p.base_name}\n{p.base}\n{how}", p.python,
                     "\n".join(f"{k}=={v}" for k, v in p.pins.items()), p.tag, built])
    print_table(f"build plan (vLLM {session.matrix.vllm})", ["target", "base", "python", "pins", "tag", "built"], rows)
    for p in plans:
        for note in p.notes:
            print(f"{p.target}: {note}")
        for name, state in p.components.items():
            if state == "absent":
                print(f"{p.target}: component {name} is absent; profiles unavailable: "
                      f"{', '.join(p.unavailable_profiles) or 'none'}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from servekit.build.verify import verify
    return print_findings(args, verify(open_session(args), args.offline, series=not args.no_series, say=channel("verify: ")),
                     "verify")


def cmd_lock(args: argparse.Namespace) -> int:
    from servekit.build.locks import make_locks
    session = open_session(args)
    targets = [session.check_target(t) for t in args.target or []]
    everything = not targets and not args.host_tool
    written = make_locks(session, targets or None, host=args.host_tool or everything, images=bool(targets) or
                         everything, say=channel())
    if args.json:
        emit_json({"written": [str(p) for p in written]})
    return 0


def cmd_bump(args: argparse.Namespace) -> int:
    from servekit.build.pins import bump
    b = bump(open_session(args), args.to, args.dry_run, say=channel())
    if args.json:
        emit_json({"from": b.old, "to": b.new, "dry_run": args.dry_run, "changes": b.changes, "renames": b.renames,
                    "review": b.review, "locks": b.locks, "problems": b.findings.problems, "notes": b.findings.notes})
        return 1 if b.findings.problems else 0
    verb = "would change" if args.dry_run else "changed"
    print(f"bump vLLM {b.old} -> {b.new}{' (dry run: nothing written)' if args.dry_run else ''}")
    for path, count in b.changes.items():
        print(f"  {verb} {path}: {count} pin(s)")
    for src, dst in b.renames:
        print(f"  {'would rename' if args.dry_run else 'renamed'} {src} -> {dst}")
    for lock in b.locks:
        print(f"  {'would make again' if args.dry_run else 'made again'} {lock}")
    if b.review:
        print(f"lines that still name {b.old}, for a person to review:")
        for line in b.review:
            print(f"  {line}")
    for note in b.findings.notes:
        print(f"note: {note}", file=sys.stderr)
    for problem in b.findings.problems:
        print(f"problem: {problem}")
    return 1 if b.findings.problems else 0


def cmd_port(args: argparse.Namespace) -> int:
    from servekit.build.portcheck import run_port
    session = open_session(args)
    report = run_port(session, args.to, [session.check_target(t) for t in args.target or []] or None,
                      dict(args.accept or []),
                      say=channel())
    if args.json:
        emit_json({"lines": report.lines, "summaries": report.summaries, "failures": report.failures})
    else:
        print("\n".join(report.lines))
    return 1 if report.failures else 0


def cmd_series(args: argparse.Namespace) -> int:
    from servekit.build.seriesexport import export
    session = open_session(args)
    out = Path(args.out) if args.out else session.root / session.matrix.series.dir
    names = export(Path(args.repo), args.tag, args.branch, out)
    if args.json:
        emit_json({"series": names, "folder": str(out)})
    else:
        print(f"series: {len(names)} patches from {args.branch} on {args.tag} into {out}")
        for name in names:
            print(f"  {name}")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from servekit.config.matrix import render_json_schema
    sys.stdout.write(render_json_schema())
    return 0


def cmd_derive(args: argparse.Namespace) -> int:
    from servekit.config.derived import derive_files
    session = open_session(args)
    count, changed = derive_files(session.matrix, session.root, args.check)
    for rel in changed:
        print(f"{'stale' if args.check else 'rewrote'}: {rel}")
    print(f"derive: {count} files, {len(changed)} {'stale' if args.check else 'rewritten'}")
    return 1 if args.check and changed else 0


def cmd_fit(args: argparse.Namespace) -> int:
    import json

    from servekit.errors import UserError
    from servekit.records.fit import DRAFTER_FULL, FULL, Layout, predict_all
    session = open_session(args)
    matrix = session.matrix
    target = session.check_target(args.target or matrix.default_target(gpu=True))
    try:
        # the DFlash profiles' drafter: the served one's layout (servekit/image/standin.py)
        layout = Layout.from_config(json.loads(Path(args.config).read_text()) if args.config else FULL, DRAFTER_FULL)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"fit: --config {args.config}: not a Qwen3.5-family config.json ({exc})") from None
    served = [name for name, p in matrix.profiles.items() if target in p.targets]
    for name in args.profile or []:
        if name not in served:
            raise UserError(f"fit: --profile {name}: not a profile of target {target} ({', '.join(served)})")
    if args.card and args.card not in matrix.cards:
        raise UserError(f"fit: --card {args.card}: expected one of {', '.join(matrix.cards)}")
    if args.host and args.host not in matrix.hosts:
        raise UserError(f"fit: --host {args.host}: expected one of {', '.join(matrix.hosts)}")
    predictions = predict_all(matrix, session.root, target, layout, args.profile,
                              [args.host] if args.host else None, args.card)
    if args.json:
        emit_json([{"card": card, **p.to_json()} for card, p in predictions])
        return 0
    print(f"which profiles fit (target {target}, vLLM {matrix.vllm}):")
    for card, p in predictions:
        verdict = {True: "fits", False: "DOES NOT FIT", None: "not predicted"}[p.fits]
        pool = f"pool {p.pool_tokens:,} tokens" if p.pool_tokens is not None else ""
        source = f" (the source's: {p.source_pool:,})" if p.source_pool else ""
        calibrated = f"; overhead {p.calibration.overhead_gib} GiB from {p.calibration.report}" if p.calibration else ""
        print(f"  {p.profile} on {card} ({p.host}, {p.flags.kv_dtype} KV, MAX_LEN {p.flags.max_len:,}): {verdict}"
              f"{', ' + pool if pool else ''}{source}: {p.why}{calibrated}")
    return 0


def register(c: Commands) -> None:
    p = c.add("fit", cmd_fit, "which profiles fit a card, before the checkpoint is downloaded: each profile's KV "
              "pool from the checkpoint's config, the profile's flags and vLLM's overhead as the full-size reports "
              "measured it (docs/gpu, reports/), or what one request needs where none has")
    c.target(p)
    p.add_argument("--profile", action="append", metavar="NAME", help="a profile (default: every one); repeatable")
    p.add_argument("--card", metavar="NAME", help="a card of images.yaml (default: each host's own card)")
    p.add_argument("--host", metavar="KIND", help="a host of images.yaml (default: every one)")
    p.add_argument("--config", metavar="FILE", help="the checkpoint's config.json (default: the served model's "
                   "layout, servekit/image/standin.py)")
    p = c.add("plan", cmd_plan, "show what each target would build: base, pins, content digest, tag, already built")
    c.target(p, many=True, help="only this target (repeatable)")
    p = c.add("verify", cmd_verify, "check pins against every file that repeats them and against vLLM's own "
            "declared requirements, and the Compose files against the profiles and knobs (no image needed)")
    p.add_argument("--offline", action="store_true", help="do not ask the index; use cached metadata and wheels")
    p.add_argument("--no-series", action="store_true", help="skip applying the series to pristine vLLM trees")
    p = c.add("lock", cmd_lock, "make the package locks again from the pins: each target's (docker/locks/, every "
            "package and hash for its Python and platform) and the host tool's (requirements.lock from "
            "requirements.in); uv resolves, seconds each", locked=True)
    c.target(p, many=True, help="only this target's locks (repeatable)")
    p.add_argument("--host-tool", action="store_true", help="only the host tool's requirements.lock (with --target: "
                   "that target's too)")
    p = c.add("bump", cmd_bump, "move every mechanical vLLM pin to a new version, make the locks again, and report "
            "co-pin problems")
    p.add_argument("--to", required=True, type=arguments.version, metavar="VERSION",
                   help="the new vLLM version, e.g. 0.32.0")
    p.add_argument("--dry-run", action="store_true", help="report only; write nothing")
    p = c.add("port", cmd_port, "check the series against a newer vLLM from the two pristine wheels alone: names our "
            "lines use that it removed, calls of ours that no longer bind to its signatures, and whether each patch "
            "still applies at fuzz 0 (and at what offsets); exit 1 on anything not accepted")
    p.add_argument("--to", required=True, type=arguments.version, metavar="VERSION", help="the newer vLLM, e.g. 0.32.0")
    c.target(p, many=True, help="only this target's vLLM distribution (repeatable; default: every target)")
    p.add_argument("--accept", action="append", type=arguments.accepted, metavar="NAME=REASON", help="a reviewed exception, recorded in the "
                   "series folder (port-accept) so that the next port sees it too (repeatable)")
    p = c.add("series", cmd_series, "export a git branch that carries one commit per topic on top of a vLLM tag "
            "as the patch series: one patch per commit, its message's prose and trailers kept, Cut-against set to "
            "the tag, the series file in commit order", locked=True)
    p.add_argument("action", choices=["export"])
    p.add_argument("--repo", required=True, metavar="PATH", help="the vLLM git repository that holds the branch")
    p.add_argument("--tag", required=True, metavar="TAG", help="the vLLM tag the branch sits on, e.g. v0.31.0")
    p.add_argument("--branch", required=True, metavar="BRANCH", help="the branch with one commit per topic")
    p.add_argument("--out", type=arguments.folder, metavar="DIR", help="the series folder to write (default: images.yaml's series.dir)")
    c.add("schema", cmd_schema, "print the JSON Schema of images.yaml (images.schema.json is this output)",
        json_out=False)
    p = c.add("derive", cmd_derive, "rewrite what docs/profiles.md, docs/architecture.md and the Compose files derive "
              "from images.yaml, the knob table and the modules' docstrings (one service per profile, the knob "
              "pass-through, the tables)", json_out=False)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each file that is stale")

