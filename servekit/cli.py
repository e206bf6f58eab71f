"""The command line: parse, dispatch to a stage, print. Nothing here does a stage's work."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import CheckFailed, EnvironmentProblem, UserError

EPILOG = """exit codes: 0 ok, 1 a check failed (or the machine lacks something), 2 bad input or usage.
The matrix (images.yaml) is the single source of truth; see README.md and docs/."""


def threading_is_main() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # usage errors: one line, exit 2
        self.print_usage(sys.stderr)
        raise UserError(f"{self.prog}: {message}")


def _root(args) -> Path:
    return Path(args.matrix).resolve().parent


def _cache(args) -> Path:
    return _root(args) / ".cache"


def _matrix(args):
    from .matrix import load_matrix
    return load_matrix(args.matrix)


def _settings(args, matrix):
    from .settings import BuildSettings
    return BuildSettings.from_args(args, matrix)


def _plans(args, matrix, targets: list[str] | None, image_exists=None, settings=None):
    """Each target's plan under this machine's settings (--base, --without): the tag every command agrees on."""
    from .plan import plan_targets
    return plan_targets(matrix, _root(args), targets, image_exists, settings or _settings(args, matrix))


def _emit_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def _console():
    from rich.console import Console
    return Console(highlight=False)


def _print_table(title: str, header: list[str], rows: list[list]) -> None:
    from rich.table import Table
    table = Table(title=title)
    for col in header:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*("" if cell is None else str(cell) for cell in row))
    _console().print(table)


# ---------------------------------------------------------------------------------------------


def cmd_engine(args) -> int:
    from .bootstrap import ensure_engine, ensure_test_tools
    say = lambda s: print(f"engine: {s}", file=sys.stderr)  # noqa: E731
    ensure_engine(_cache(args) / "engine", say=say)
    if args.test_tools:
        ensure_test_tools(say=say)
    print("engine: ready (docker, compose" + (", the tests' registry and sshd)" if args.test_tools else ")"))
    return 0


def _image_exists_probe():
    """A function tag -> True/False, or None when no engine answers (then `exists` is unknown)."""
    from .engines import local
    engine = local()
    return engine.image_exists if engine.answers() else None


def cmd_plan(args) -> int:
    matrix = _matrix(args)
    for t in args.target or []:
        _check_target(matrix, t)
    plans = _plans(args, matrix, args.target, _image_exists_probe())
    if args.json:
        _emit_json({"matrix": str(args.matrix), "vllm": matrix.vllm, "targets": [p.to_json() for p in plans]})
        return 0
    from rich.table import Table
    table = Table(title=f"build plan (vLLM {matrix.vllm})")
    for col in ("target", "base", "python", "pins", "tag", "built"):
        table.add_column(col, overflow="fold")
    for p in plans:
        built = {True: "yes", False: "no", None: "unknown (no engine)"}[p.exists]
        how = "made here (debootstrap)" if p.base_made_here else "pulled"
        table.add_row(p.target, f"{p.base_name}\n{p.base}\n{how}", p.python,
                      "\n".join(f"{k}=={v}" for k, v in p.pins.items()), p.tag, built)
    console = _console()
    console.print(table)
    for p in plans:
        for note in p.notes:
            console.print(f"[yellow]{p.target}: {note}[/yellow]")
        for name, state in p.components.items():
            if state == "absent":
                console.print(f"[yellow]{p.target}: component {name} is absent; profiles unavailable: "
                              f"{', '.join(p.unavailable_profiles) or 'none'}[/yellow]")
    return 0


def cmd_verify(args) -> int:
    from .pins import Findings, copin_problems, mirror_problems
    matrix = _matrix(args)
    from .derived import stale
    findings = Findings()
    findings.extend(mirror_problems(matrix, _root(args)))
    findings.problems += stale(matrix, _root(args))
    if args.offline:
        findings.notes.append("--offline: co-pins checked only from the metadata cache")
    findings.extend(copin_problems(matrix, _cache(args) / "metadata"))
    if not args.no_series:
        findings.extend(_prove_series(args, matrix))
    if args.resolve:
        from .pins import resolve_dry_run
        for target in matrix.targets:
            findings.extend(resolve_dry_run(matrix, target, _settings(args, matrix).wheel_dirs,
                                            say=lambda s: print(f"verify: {s}", file=sys.stderr)))
    return _report_findings(args, findings, "verify")


def _prove_series(args, matrix):
    """The series applied, per target, to a pristine tree of that target's pinned vLLM wheel."""
    from .index import IndexUnreachable, NotOnIndex, download_wheel
    from .pins import Findings
    from .image.series import SeriesError, prove_on_pristine
    out = Findings()
    series_dir = _root(args) / matrix.series.dir
    for name, target in matrix.targets.items():
        dist = target.vllm_distribution
        cached = sorted((_cache(args) / "pristine").glob(f"{dist.replace('-', '_')}-{matrix.vllm}-*.whl"))
        if cached:
            wheel = cached[-1]
        elif args.offline:
            out.notes.append(f"--offline: no cached {dist} {matrix.vllm} wheel; series not proven for {name}")
            continue
        else:
            print(f"verify: fetching the pristine {dist} {matrix.vllm} wheel (once; cached)", file=sys.stderr)
            try:
                wheel = download_wheel(dist, matrix.vllm, matrix.indexes["pypi"].url, _cache(args) / "pristine")
            except (IndexUnreachable, NotOnIndex) as exc:
                out.notes.append(f"series not proven on a pristine {dist} tree: {exc}")
                continue
        try:
            problems = prove_on_pristine(series_dir, wheel, name, say=lambda s: None)
        except SeriesError as exc:
            problems = [str(exc)]
        out.problems += [f"series on pristine {dist} {matrix.vllm} ({name}): {p}" for p in problems]
        if not problems:
            out.notes.append(f"series applies at fuzz 0 to a pristine {dist} {matrix.vllm} tree ({name})")
    return out


def _report_findings(args, findings, what: str) -> int:
    if args.json:
        _emit_json({"ok": not findings.problems, "problems": findings.problems, "notes": findings.notes})
    else:
        for note in findings.notes:
            print(f"note: {note}", file=sys.stderr)
        for problem in findings.problems:
            print(f"problem: {problem}")
        print(f"{what}: {'ok' if not findings.problems else f'{len(findings.problems)} problem(s)'}")
    return 1 if findings.problems else 0


def cmd_bump(args) -> int:
    from packaging.version import InvalidVersion, Version
    from .pins import apply_bump, plan_bump
    try:
        Version(args.to)
    except InvalidVersion:
        raise UserError(f"--to {args.to!r}: not a version (expected e.g. 0.32.0)") from None
    matrix = _matrix(args)
    if args.to == matrix.vllm:
        raise UserError(f"--to {args.to}: vLLM is already pinned at {args.to}")
    root = _root(args)
    bump, writes = plan_bump(matrix, Path(args.matrix).resolve(), root, args.to, _cache(args) / "metadata")
    if not args.dry_run:
        apply_bump(bump, writes, root)
    if args.json:
        _emit_json({"from": bump.old, "to": bump.new, "dry_run": args.dry_run, "changes": bump.changes,
                    "renames": bump.renames, "review": bump.review, "problems": bump.findings.problems,
                    "notes": bump.findings.notes})
    else:
        verb = "would change" if args.dry_run else "changed"
        print(f"bump vLLM {bump.old} -> {bump.new}{' (dry run: nothing written)' if args.dry_run else ''}")
        for path, count in bump.changes.items():
            print(f"  {verb} {path}: {count} pin(s)")
        for src, dst in bump.renames:
            print(f"  {'would rename' if args.dry_run else 'renamed'} {src} -> {dst}")
        if bump.review:
            print(f"lines that still name {bump.old}, for a person to review:")
            for line in bump.review:
                print(f"  {line}")
        for note in bump.findings.notes:
            print(f"note: {note}", file=sys.stderr)
        for problem in bump.findings.problems:
            print(f"problem: {problem}")
    return 1 if bump.findings.problems else 0


def cmd_doctor(args) -> int:
    from .doctor import base_findings, diagnose
    findings = diagnose()
    if findings and findings[0].status == "ok":
        try:
            matrix = _matrix(args)
            findings += base_findings(matrix)
        except UserError as exc:
            findings.append(type(findings[0])("matrix", "fail", str(exc), "fix images.yaml"))
    if args.json:
        _emit_json([f.__dict__ for f in findings])
    else:
        marks = {"ok": "[green]ok  [/green]", "warn": "[yellow]warn[/yellow]", "fail": "[red]fail[/red]"}
        console = _console()
        for f in findings:
            console.print(f"{marks[f.status]} {f.name}: {f.detail}" + (f"  [dim]fix: {f.fix}[/dim]" if f.fix and
                                                                      f.status != "ok" else ""))
    return 1 if any(f.status == "fail" for f in findings) else 0


def _default_target(matrix, engine=None) -> str:
    """The first GPU target where the engine (default: this machine's) can give a container a GPU, else the
    first without one."""
    from .engines import resolve
    try:
        gpu = (engine or resolve(None)).gpu_problem() is None
    except Exception:  # no engine answers: a target without a GPU is what can run anywhere
        gpu = False
    wanted = [name for name, t in matrix.targets.items() if t.gpu == gpu]
    return wanted[0] if wanted else next(iter(matrix.targets))


def _step_printer():
    """Show each BuildKit step header and the series' own lines; the full output goes to the log."""
    import re
    step = re.compile(r"^#\d+ \[[^\]]+\] ")
    mine = re.compile(r"^#\d+ [0-9.]+ (== |-- |verify: |demo model|step \d+/)")

    def show(line: str) -> None:
        if step.match(line) or mine.match(line):
            print(f"  {line[:110]}", file=sys.stderr, flush=True)
    return show


def cmd_image(args) -> int:
    from .builder import build_image
    matrix = _matrix(args)
    targets = [_check_target(matrix, t) for t in args.target or [_default_target(matrix)]]
    settings = _settings(args, matrix)
    results = []
    for plan in _plans(args, matrix, targets, settings=settings):
        for name, state in plan.components.items():
            if state == "absent":
                print(f"image: {plan.target}: component {name} is absent "
                      f"({matrix.components[name].source}/); profiles that need it are unavailable: "
                      f"{', '.join(plan.unavailable_profiles)}", file=sys.stderr)
        for note in plan.notes:
            print(f"image: {plan.target}: {note}", file=sys.stderr)
        print(f"image: {plan.target} on base {plan.base_name} ({plan.base}) -> {plan.tag}", file=sys.stderr)
        result = build_image(matrix, plan, _root(args), settings, force=args.force, show=_step_printer(),
                             say=lambda line: print(f"image: {line}", file=sys.stderr))
        results.append({"target": plan.target, "tag": result.tag, "built": result.built,
                        "seconds": round(result.seconds, 1), "log": str(result.log) if result.log else None})
        if not args.json:
            print(f"{plan.target}: {result.tag} " + (f"built in {result.seconds:.0f} s (log: {result.log})"
                                                      if result.built else "already built; nothing to do"))
    # A plain `docker compose up PROFILE` in compose/ runs the image just built (the last target named).
    from .deploy import write_env
    write_env(_deployment(args, matrix, targets[-1]))
    if args.json:
        _emit_json({"images": results})
    return 0


def _engine(args):
    from .engines import resolve
    return resolve(getattr(args, "engine", None))


def _host(args, matrix, engine) -> str:
    """--host, or for `auto` what the engine runs on (WSL2 or native; native when it does not answer,
    which its own check then reports)."""
    wanted = getattr(args, "host", "auto")
    if wanted in (None, "auto"):
        try:
            return engine.host_kind()
        except Exception:  # the SDK's many kinds of "cannot connect"
            return "native"
    if wanted not in matrix.hosts:
        raise UserError(f"--host {wanted}: expected one of auto, {', '.join(matrix.hosts)}")
    return wanted


def _deployment(args, matrix, target: str, engine=None):
    from .deploy import Deployment
    engine = engine or _engine(args)
    tag = _plans(args, matrix, [target])[0].tag
    return Deployment(_root(args), target, _host(args, matrix, engine), tag, matrix.serve.bind,
                      getattr(args, "port", None) or matrix.serve.port, engine=engine,
                      overrides=tuple(matrix.targets[target].compose))


def _check_target(matrix, target: str) -> str:
    if target not in matrix.targets:
        raise UserError(f"--target {target}: no such target; expected one of {', '.join(matrix.targets)}")
    return target


def _require_gpu(matrix, target: str, engine, what: str) -> None:
    """A GPU target on an engine that cannot give it a GPU ends here, in one line, before anything starts."""
    if not matrix.targets[target].gpu:
        return
    problem = engine.gpu_problem()
    if problem:
        others = [name for name, t in matrix.targets.items() if not t.gpu]
        raise EnvironmentProblem(f"{what} needs a GPU (target {target}), and engine {engine.given}: {problem}"
                                 + (f"; or use --target {others[0]}" if others else ""))


def _profile_target(matrix, profile: str, wanted: str | None, engine=None) -> str:
    """The target to use for `profile`: the one asked for (or the engine's default), if the profile runs there."""
    target = _check_target(matrix, wanted or _default_target(matrix, engine))
    if profile not in matrix.profiles:
        raise UserError(f"profile {profile!r}: expected one of {', '.join(matrix.profiles)}")
    if target not in matrix.profiles[profile].targets:
        raise UserError(f"profile {profile} does not run on the {target} target (it runs on "
                        f"{', '.join(matrix.profiles[profile].targets)})")
    return target


def cmd_up(args) -> int:
    from dataclasses import replace
    from .deploy import check_bind, ensure_secrets, write_env
    from .pipeline import boot
    from .engines import address, reach
    from .transfer import ensure_image
    from .watch import BootFailed
    matrix = _matrix(args)
    engine = _engine(args)
    engine.check()
    target = _profile_target(matrix, args.profile, args.target, engine)
    _require_gpu(matrix, target, engine, f"up: {args.profile}")
    dep = _deployment(args, matrix, target, engine)
    arrived = ensure_image(engine, dep.image, say=lambda line: print(f"up: {line}", file=sys.stderr))
    check_bind(dep.bind, warn=lambda w: print(f"warning: {w}", file=sys.stderr))
    key_file = ensure_secrets(dep)
    write_env(dep)
    timeout = args.timeout or matrix.serve.boot_timeout_s
    where = "" if engine.is_local else f" on engine {engine.given} (image {arrived})"
    print(f"up: {args.profile} on {target} ({dep.host}){where}, {dep.image}", file=sys.stderr)
    from rich.console import Console
    try:
        with reach(engine, dep.bind, dep.port) as url, \
                Console(stderr=True).status(f"waiting for {args.profile} to become healthy") as status:
            booted = boot(replace(dep, reached_at=url), args.profile, timeout, say=status.update)
    except BootFailed as exc:
        print(f"up: {args.profile} failed: {exc}", file=sys.stderr)
        for line in exc.last_lines[-12:]:
            print(f"  | {line[:300]}", file=sys.stderr)
        return 1
    booted.stop_samplers()  # `up` ends at healthy; `run` keeps them going through the traffic
    record, memory = booted.record, booted.memory()
    url = address(engine, dep.bind, dep.port)
    result = {"profile": args.profile, "target": target, "host": dep.host, "engine": engine.given,
              "image": dep.image, "url": url,
              "api_key_file": str(key_file), "container": booted.container.name,
              "time_to_healthy_s": record.time_to_healthy_s, "kv_pool_tokens": record.kv_pool_tokens,
              "detection_lag_s": record.detection_lag_s, "phases": memory["phases"],
              "gpu": memory["gpus"][0] if memory["gpus"] else None, "shared_usage": memory["shared_usage"]}
    if result["shared_usage"]:
        result["shared_usage"] = {k: v for k, v in result["shared_usage"].items() if k != "series"}
    if args.json:
        _emit_json(result)
    else:
        print(f"{args.profile} is healthy at {url} (API key in {key_file})")
        print(f"  time to healthy {record.time_to_healthy_s} s, KV pool {record.kv_pool_tokens} tokens, "
              f"detection lag {record.detection_lag_s} s")
        if result["gpu"]:
            print(f"  GPU peak {result['gpu']['peak_used_bytes'] / 2**30:.2f} GiB, margin "
                  f"{result['gpu']['min_margin_bytes'] / 2**30:.2f} GiB")
        if result["shared_usage"]:
            print(f"  Shared Usage baseline {result['shared_usage']['baseline_bytes'] / 1e6:.0f} MB, spill "
                  f"{result['shared_usage']['spill_bytes'] / 1e6:.0f} MB")
    return 0


def cmd_down(args) -> int:
    from .deploy import Deployment, down, ensure_secrets, running_profiles, write_env
    matrix = _matrix(args)
    engine = _engine(args)
    engine.check()
    dep = Deployment(_root(args), next(iter(matrix.targets)), "native", "unused", matrix.serve.bind,
                     matrix.serve.port, engine=engine)
    if not dep.env_file.exists():
        write_env(dep)
    ensure_secrets(dep)  # Compose checks the secrets' sources even to take a project down
    down(dep, args.profile)
    left = [p for p in running_profiles(engine) if not args.profile or p == args.profile]
    print(f"down: {'nothing left running' if not left else 'still present: ' + ', '.join(left)}")
    return 0 if not left else 1


def cmd_monitor(args) -> int:
    """GPU memory (NVML) and, on WSL2, Shared Usage for N seconds or until Ctrl-C.

    Imports only the standard library, nvidia-ml-py and (for the adapter name) PyYAML, so that it
    runs on a GPU machine without the rest of the stack.
    """
    import time
    from wsl2.detect import is_wsl2
    from wsl2.shared_usage import SharedUsageSampler, SharedUsageUnavailable
    from .gpu import NvmlSampler, NvmlUnavailable
    gpu_sampler = shared_sampler = None
    try:
        gpu_sampler = NvmlSampler(interval_s=args.interval)
    except NvmlUnavailable as exc:
        print(f"monitor: GPU memory not sampled: {exc}", file=sys.stderr)
    if is_wsl2():
        try:
            shared_sampler = SharedUsageSampler().start()
            if not shared_sampler.wait_for_baseline(20):
                print("monitor: Get-Counter gave no sample within 20 s", file=sys.stderr)
        except SharedUsageUnavailable as exc:
            print(f"monitor: Shared Usage not sampled: {exc}", file=sys.stderr)
    else:
        print("monitor: not WSL2: Shared Usage not sampled", file=sys.stderr)
    if gpu_sampler:
        gpu_sampler.start()
    try:
        deadline = time.monotonic() + args.seconds if args.seconds else None
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass
    finally:
        if gpu_sampler:
            gpu_sampler.stop()
        if shared_sampler:
            shared_sampler.stop()
    gpus = gpu_sampler.summary() if gpu_sampler else []
    shared = shared_sampler.summary(nvml_used=gpus[0]["end_used_bytes"] if gpus else None,
                                    named=args.adapter or _wsl2_adapter(args)) if shared_sampler else None
    if shared:
        shared.pop("series")
    result = {"gpu": ({k: v for k, v in gpus[0].items() if k != "phases"} if gpus else None), "gpus": gpus,
              "shared_usage": shared}
    if args.json:
        _emit_json(result)
        return 0
    for g in gpus:
        print(f"GPU {g['index']} {g['name']}: peak {g['peak_used_bytes'] / 2**30:.3f} GiB of "
              f"{g['total_bytes'] / 2**30:.1f} GiB, margin {g['min_margin_bytes'] / 2**30:.3f} GiB, "
              f"{g['samples']} samples")
    if shared:
        print(f"Shared Usage ({shared['adapter']}): baseline {shared['baseline_bytes'] / 1e6:.0f} MB, peak "
              f"{shared['peak_bytes'] / 1e6:.0f} MB, end {shared['end_bytes'] / 1e6:.0f} MB, spill "
              f"{shared['spill_bytes'] / 1e6:.0f} MB, {shared['samples']} samples")
    return 0


def _wsl2_adapter(args) -> str | None:
    """hosts.wsl2.adapter from the matrix, read with PyYAML alone (no pydantic on a bare GPU machine)."""
    try:
        import yaml
        data = yaml.safe_load(Path(args.matrix).read_text())
        return ((data or {}).get("hosts") or {}).get("wsl2", {}).get("adapter")
    except (ImportError, OSError, yaml.YAMLError, AttributeError):
        return None


def cmd_run(args) -> int:
    """image, up, smoke, down and a report for each profile, on one engine or several at once."""
    from .builder import build_image
    from .deploy import ensure_secrets, write_env
    from .release import released
    from .engines import parse_engines
    matrix = _matrix(args)
    engines = parse_engines(args.engines) if args.engines else [_engine(args)]
    target = _check_target(matrix, args.target or _default_target(matrix, engines[0]))
    profiles = args.profile or [p for p, spec in matrix.profiles.items() if target in spec.targets][:1]
    for name in profiles:
        if name not in matrix.profiles or target not in matrix.profiles[name].targets:
            raise UserError(f"--profile {name}: not a profile of the {target} target (those are: "
                            f"{', '.join(p for p, s in matrix.profiles.items() if target in s.targets)})")
    if not args.engines:  # a fleet records each engine's failure as its row instead
        engines[0].check()
        _require_gpu(matrix, target, engines[0], f"run: {', '.join(profiles)}")
    settings = _settings(args, matrix)
    plan = _plans(args, matrix, [target], settings=settings)[0]
    print(f"run: {target} image {plan.tag}", file=sys.stderr)
    build_image(matrix, plan, _root(args), settings, show=_step_printer())
    release = released(_root(args), matrix, target, plan.digest)
    if args.engines:
        return _run_fleet(args, matrix, target, plan.tag, engines, profiles, release)
    dep = _deployment(args, matrix, target, engines[0])
    key_file = ensure_secrets(dep)
    write_env(dep)
    say = lambda line: print(line, file=sys.stderr)  # noqa: E731
    from .pipeline import run_profiles
    from .report import write_report
    done = run_profiles(matrix, dep, profiles, key_file, release=release, say=say,
                        write=lambda report, series: write_report(_root(args) / "reports" / report["run_id"], report,
                                                                  series))
    for report, run_dir in done:
        failed = [c["name"] for c in report["checks"] if c["status"] == "failed"]
        say(f"run: {report['profile']}: {'passed' if report['passed'] else 'FAILED: ' + ', '.join(failed)}; report "
            f"in {run_dir.relative_to(_root(args))}/report.md")
    passed = all(report["passed"] for report, _ in done)
    if args.json:
        _emit_json({"passed": passed, "reports": [str(run_dir) for _, run_dir in done]})
    return 0 if passed else 1


def _run_fleet(args, matrix, target: str, tag: str, engines, profiles: list[str], release) -> int:
    import datetime as dt
    from . import fleet
    from .deploy import Deployment, ensure_secrets, write_env
    base = args.port or matrix.serve.port  # each engine its own port: engines on one machine share its loopback
    deps = [Deployment(_root(args), target, _host(args, matrix, e), tag, matrix.serve.bind, base + i, engine=e,
                       overrides=tuple(matrix.targets[target].compose)) for i, e in enumerate(engines)]
    for dep in deps:  # here, not in the threads: the key file is one for all, and each env file is written once
        key_file = ensure_secrets(dep)
        write_env(dep)
    out = _root(args) / "reports" / f"{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}-fleet-{target}"
    print(f"run: {', '.join(profiles)} on {len(engines)} engines in parallel: "
          f"{', '.join(f'{d.engine.given} ({d.host}, port {d.port})' for d in deps)}", file=sys.stderr)
    runs = fleet.run_fleet(matrix, deps, profiles, key_file, out, release=release,
                           say=lambda line: print(line, file=sys.stderr))
    doc, summary_md = fleet.write_summary(out, runs)
    if args.json:
        _emit_json({"passed": doc["passed"], "summary": str(summary_md), "engines": doc["engines"]})
    else:
        if sys.stdout.isatty():
            _print_table(f"{sum(r.passed for r in runs)} of {len(runs)} engines passed", doc["table"]["header"],
                         doc["table"]["rows"])
        else:  # a log or a pipe: a nine-column box folds into an unreadable one; Markdown stays a row a line
            print(summary_md.read_text(), end="")
        print(f"run: summary in {summary_md.relative_to(_root(args))}")
    return 0 if doc["passed"] else 1


def cmd_smoke(args) -> int:
    """The profile's checks against a running server, local or remote."""
    from contextlib import nullcontext
    from smoke import Context
    from .deploy import find_container, published_port
    from .pipeline import smoke
    from .engines import reach
    from .watch import READY
    matrix = _matrix(args)
    engine = _engine(args)
    if args.url and args.engine:
        raise UserError("--url and --engine: name the server one way (--engine finds it on that engine)")
    target = _check_target(matrix, args.target or _default_target(matrix, engine))
    if args.profile not in matrix.profiles:
        raise UserError(f"profile {args.profile!r}: expected one of {', '.join(matrix.profiles)}")
    dep = _deployment(args, matrix, target, engine)
    key_path = Path(args.api_key_file) if args.api_key_file else dep.api_key_file
    if not key_path.is_file():
        raise UserError(f"no API key file at {key_path}: pass --api-key-file")
    logs, port, healthy_line = None, dep.port, 0
    if not args.url:  # a profile on an engine: its log is readable, so the log checks can run
        engine.check()
        container = find_container(args.profile, engine)
        if container is None:
            raise UserError(f"{args.profile} is not running on engine {engine.given}: start it with "
                            f"`python build.py up {args.profile}" + ("" if engine.is_local else
                                                                     f" --engine {engine.given}") + "`")
        logs = lambda: container.logs().decode("utf-8", "replace").splitlines()  # noqa: E731
        port = published_port(container) or port
        # compiles while booting are expected; the log checks judge what came after the server was ready
        healthy_line = next((i + 1 for i, line in enumerate(logs()) if READY.search(line)), 0)
    with (nullcontext(args.url) if args.url else reach(engine, dep.bind, port)) as url:
        ctx = Context(url.rstrip("/"), key_path.read_text().strip(),
                      matrix.models[matrix.targets[target].model].served_name, gpu=matrix.targets[target].gpu,
                      logs=logs, healthy_line=healthy_line)
        results = smoke(ctx, matrix.profile_checks(args.profile, target), say=None if args.json else
                        lambda r: print(f"{r.status:7} {r.name} ({r.seconds} s) {r.reason}"))
    if args.json:
        _emit_json({"url": ctx.url, "checks": [r.to_json() for r in results]})
    return 0 if all(r.status != "failed" for r in results) else 1


def cmd_compare(args) -> int:
    from .report import compare, load_report
    reports = [load_report(Path(path)) for path in (args.report_a, args.report_b)]
    rows = compare(*reports, threshold=args.threshold)
    if args.json:
        _emit_json([{"metric": m, "a": a, "b": b, "differs": d} for m, a, b, d in rows])
        return 0
    _print_table(f"A: {reports[0]['run_id']}   B: {reports[1]['run_id']}   (marked: differs by more than "
                 f"{args.threshold:.0%})", ["metric", "A", "B", ""],
                 [[metric, a, b, "<>" if differs else ""] for metric, a, b, differs in rows])
    return 0


def cmd_release(args) -> int:
    """Push the checked images: immutable and moving tags, digests read back, then the manifest."""
    from .engines import local
    from .release import dirty, git_tag, release_targets, summary_text, write_manifest
    matrix = _matrix(args)
    root = _root(args)
    if args.git_tag and not args.dry_run:
        changes = dirty(root)
        if changes:
            raise CheckFailed(f"--git-tag: the working tree has uncommitted changes ({len(changes)} path(s), e.g. "
                              f"{changes[0].strip()}); commit or stash them first")
    engine = local()
    engine.check()
    targets = [_check_target(matrix, t) for t in (args.target or list(matrix.targets))]
    plans = {p.target: p for p in _plans(args, matrix, targets)}
    releases = release_targets(matrix, root, engine, (args.registry or matrix.release.registry).rstrip("/"), plans,
                               explicit=bool(args.target), dry_run=args.dry_run,
                               say=lambda line: print(line, file=sys.stderr))
    if args.dry_run:
        print("release: dry run; nothing pushed")
        return 0
    if not releases:
        raise CheckFailed("nothing released: no target has a built image")
    manifest = write_manifest(root, matrix, releases)
    if args.git_tag:
        git_tag(root, f"v{matrix.vllm}", summary_text(matrix, releases))
    if args.json:
        _emit_json({"manifest": str(manifest), "releases": releases})
    else:
        print(summary_text(matrix, releases))
        print(f"manifest: {manifest.relative_to(root)}")
    return 0


def cmd_render(args) -> int:
    """Kubernetes manifests for one profile, validated against the Kubernetes schemas before writing."""
    from . import k8s
    matrix = _matrix(args)
    target = _profile_target(matrix, args.profile, args.target)
    host = args.host if args.host != "auto" else "native"
    if host not in matrix.hosts:
        raise UserError(f"--host {host}: expected one of {', '.join(matrix.hosts)}")
    image, how = k8s.image_reference(matrix, _plans(args, matrix, [target])[0], _root(args))
    docs = k8s.render(matrix, args.profile, target, host, image)
    problems = k8s.validate(docs, args.kube_version)
    if problems:
        raise CheckFailed("the rendered manifests do not validate: " + "; ".join(problems))
    paths = k8s.write(docs, Path(args.out))
    print(f"image {how}", file=sys.stderr)
    print("create the key Secret first: kubectl create secret generic servekit-api-key "
          "--from-file=api-key=compose/secrets/api_key", file=sys.stderr)
    for path in paths:
        print(path)
    return 0


def cmd_sweep(args) -> int:
    """Every combination of knob values, N boots each; a failed cell is recorded and the sweep goes on."""
    import datetime as dt
    from .builder import build_image
    from .deploy import ensure_secrets, write_env
    from .image.knobs import KNOBS
    from . import sweep as sw
    matrix = _matrix(args)
    target = _profile_target(matrix, args.profile, args.target)
    knobs = []
    for spec in args.knob:
        name, _, values = spec.partition("=")
        if name not in KNOBS or not values:
            raise UserError(f"--knob {spec!r}: expected NAME=V1,V2 with NAME one of {', '.join(KNOBS)}")
        for value in values.split(","):
            if problem := KNOBS[name].check(value):
                raise UserError(f"--knob {name}={value!r}: {problem}")
        knobs.append((name, values.split(",")))
    only = args.checks.split(",") if args.checks else None
    for name in only or []:
        if name not in matrix.checks:
            raise UserError(f"--checks {name}: expected one of {', '.join(matrix.checks)}")
    _require_gpu(matrix, target, _engine(args), f"sweep: {args.profile}")
    settings = _settings(args, matrix)
    plan = _plans(args, matrix, [target], settings=settings)[0]
    build_image(matrix, plan, _root(args), settings, show=_step_printer())
    dep = _deployment(args, matrix, target)
    key_file = ensure_secrets(dep)
    write_env(dep)
    cells, interrupted = sw.run_sweep(matrix, dep, args.profile, key_file, knobs, args.boots, only,
                                      say=lambda line: print(line, file=sys.stderr))
    doc, markdown = sw.sweep_document(matrix, dep, args.profile, plan.tag, knobs, args.boots, cells, interrupted)
    out = _root(args) / "reports" / f"{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}-sweep-{args.profile}-{target}"
    sw.write(out, doc, markdown, cells, knobs[0][0])
    if sys.stdout.isatty():
        _print_table(doc["title"], doc["table"]["header"], doc["table"]["rows"])
        if doc["advice"]:
            print(doc["advice"])
    else:  # a log or a pipe: nine columns would fold into an unreadable box; Markdown stays one row a line
        print(markdown, end="")
    print(f"sweep: report in {out.relative_to(_root(args))}/report.md")
    return 130 if interrupted else 0


def cmd_derive(args) -> int:
    from .derived import derive
    root = _root(args)
    try:
        files = derive(_matrix(args), root)
    except (OSError, ValueError) as exc:
        raise UserError(str(exc)) from None
    changed = [rel for rel, (now, wanted) in files.items() if now != wanted]
    if not args.check:
        from .atomic import write_text
        for rel in changed:
            write_text(root / rel, files[rel][1])
    for rel in changed:
        print(f"{'stale' if args.check else 'rewrote'}: {rel}")
    print(f"derive: {len(files)} files, {len(changed)} {'stale' if args.check else 'rewritten'}")
    return 1 if args.check and changed else 0


def cmd_schema(args) -> int:
    from .matrix import render_json_schema
    sys.stdout.write(render_json_schema())
    return 0


# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    # Options every command takes, before or after its name; defined once, defaults set once below.
    shared = _Parser(add_help=False)
    shared.add_argument("--matrix", default=argparse.SUPPRESS, metavar="PATH", help="the image matrix (default: "
                        "images.yaml)")
    machine = shared.add_argument_group("this machine's build settings (each also read from the environment; "
                                        "--base and --without change the image's tag, so give them to every command)")
    machine.add_argument("--base", default=argparse.SUPPRESS, metavar="NAME", help="build on this base where the "
                         "target lists it, e.g. cuda-local when nvidia/cuda cannot be pulled (SERVEKIT_BASE)")
    machine.add_argument("--without", action="append", default=argparse.SUPPRESS, metavar="PIN", help="leave out a "
                         "pin listed under may_omit, e.g. flashinfer-cubin where its index cannot be reached "
                         "(SERVEKIT_WITHOUT; repeatable)")
    machine.add_argument("--wheels", default=argparse.SUPPRESS, metavar="DIR[:DIR]", help="folders of wheels offered "
                         "to the build, exact pinned versions only (SERVEKIT_WHEELS; default: the find-links your pip "
                         "is configured with)")
    parser = _Parser(prog="build.py", description="Build, deploy, check and release patched vLLM serving images "
                     "from one pinned matrix.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                     parents=[shared])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def add_engine(p) -> None:
        p.add_argument("--engine", metavar="ENGINE", help="the Docker engine: a DOCKER_HOST URL (unix://, tcp://, "
                       "ssh://user@host) or a context name (default: this machine's, `local`)")

    def add_target(p, many: bool = False, help: str | None = None) -> None:
        """--target, the same words everywhere; the default follows the engine (a GPU target where it can
        give containers a GPU)."""
        p.add_argument("--target", action="append" if many else "store", metavar="NAME",
                       help=help or "a target of images.yaml (default: the first GPU target where the engine can give "
                       "containers a GPU, else the first without one)" + ("; repeatable" if many else ""))

    def add_host(p, default: str = "auto") -> None:
        p.add_argument("--host", default=default, metavar="KIND", help="a host of images.yaml whose defaults apply, "
                       f"or auto: WSL2 or native, asked of the engine (default: {default})")

    def add(name: str, func, help: str, json_out: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, parents=[shared])
        if json_out:
            p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
        p.set_defaults(func=func)
        return p

    p = add("plan", cmd_plan, "show what each target would build: base, pins, content digest, tag, already built")
    add_target(p, many=True, help="only this target (repeatable)")
    p = add("verify", cmd_verify, "check pins against every file that repeats them and against vLLM's own "
            "declared requirements, and the Compose files against the profiles and knobs (no image needed)")
    p.add_argument("--offline", action="store_true", help="do not ask the index; use cached metadata and wheels")
    p.add_argument("--no-series", action="store_true", help="skip applying the series to pristine vLLM trees")
    p.add_argument("--resolve", action="store_true", help="also run pip's resolver (dry run) on each target's pins "
                   "for its Python and manylinux x86_64 (a minute or two per target)")
    p = add("bump", cmd_bump, "move every mechanical vLLM pin to a new version and report co-pin problems")
    p.add_argument("--to", required=True, metavar="VERSION", help="the new vLLM version, e.g. 0.32.0")
    p.add_argument("--dry-run", action="store_true", help="report only; write nothing")
    p = add("image", cmd_image, "build the image of a target (content-addressed: an image already built for "
            "its digest is not rebuilt)")
    add_target(p, many=True)
    p.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    p = add("up", cmd_up, "start a profile through Compose and watch it until it is healthy or has failed")
    p.add_argument("profile", metavar="PROFILE", help="a profile of images.yaml (default, batch, alternative, ...)")
    add_target(p)
    add_host(p)
    p.add_argument("--timeout", type=float, metavar="S", help="seconds to wait (default: serve.boot_timeout_s)")
    add_engine(p)
    p.add_argument("--port", type=int, metavar="N", help="publish on this port (default: serve.port)")
    p = add("down", cmd_down, "stop and remove a profile's containers (all profiles when none is named); "
            "volumes stay", json_out=False)
    p.add_argument("profile", nargs="?", metavar="PROFILE")
    add_engine(p)
    p = add("monitor", cmd_monitor, "sample GPU memory (NVML, every 50 ms) and, on WSL2, the Windows Shared "
            "Usage counter (every second) for N seconds or until Ctrl-C, then print the summary")
    p.add_argument("--seconds", type=float, metavar="N", help="how long (default: until Ctrl-C)")
    p.add_argument("--interval", type=float, default=0.05, metavar="S", help="NVML sampling interval (default 0.05)")
    p.add_argument("--adapter", metavar="LUID", help="the WSL2 adapter to report (default: the one matching NVML)")
    p = add("run", cmd_run, "image, up, smoke checks, down and a report for each profile, on one engine or on "
            "several in parallel; exit 0 only when every check passed")
    add_target(p)
    p.add_argument("--profile", action="append", metavar="NAME", help="a profile (repeatable; default: the "
                   "target's first)")
    add_host(p)
    where = p.add_mutually_exclusive_group()
    add_engine(where)
    where.add_argument("--engines", metavar="A,B,...", help="run on several engines in parallel (each as --engine "
                       "takes it; `local` is this machine's): one report per engine and a summary table")
    p.add_argument("--port", type=int, metavar="N", help="publish on this port (default: serve.port; with "
                   "--engines, serve.port plus the engine's position)")
    p = add("smoke", cmd_smoke, "run a profile's smoke checks against a running server (local or --url)")
    p.add_argument("profile", metavar="PROFILE")
    p.add_argument("--url", help="the server's base URL (default: the profile's container on --engine)")
    add_engine(p)
    p.add_argument("--api-key-file", metavar="F", help="file holding the API key (default: compose/secrets/api_key)")
    add_target(p, help="which target's sizes and model name to expect")
    p = add("compare", cmd_compare, "one table with two reports side by side, marking differences")
    p.add_argument("report_a", metavar="REPORT_A", help="a report.json or its folder")
    p.add_argument("report_b", metavar="REPORT_B")
    p.add_argument("--threshold", type=float, default=0.10, help="relative difference to mark (default 0.10)")
    p = add("release", cmd_release, "push each target's checked image: immutable and moving tags, digests read "
            "back, then releases/v<vllm>.json")
    p.add_argument("--registry", metavar="HOST[:PORT]/NAMESPACE", help="default: release.registry in images.yaml")
    add_target(p, many=True, help="only this target (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="check and report; push nothing")
    p.add_argument("--git-tag", action="store_true", help="also create an annotated git tag v<vllm> with the summary")
    p = add("render", cmd_render, "render deployment manifests for one profile (Kubernetes), validated offline "
            "against the Kubernetes schemas", json_out=False)
    p.add_argument("kind", choices=["k8s"], help="what to render")
    p.add_argument("--profile", required=True, metavar="NAME")
    add_target(p)
    add_host(p, default="native")
    p.add_argument("--out", default="k8s", metavar="DIR", help="folder to write into (default: k8s/)")
    p.add_argument("--kube-version", default="1.31", metavar="X.Y", help="schema version to validate against")
    p = add("sweep", cmd_sweep, "boot a profile across knob values, several boots a cell, and print the table "
            "(boots survived, margin, KV pool, tokens/s, and whether the spread is below the gap)", json_out=False)
    p.add_argument("profile", metavar="PROFILE")
    p.add_argument("--knob", action="append", required=True, metavar="NAME=V1,V2", help="a knob and its values "
                   "(repeatable: every combination is booted)")
    p.add_argument("--boots", type=int, default=2, metavar="N", help="boots per cell (default 2)")
    add_target(p)
    add_host(p)
    p.add_argument("--checks", metavar="C1,C2", help="checks to run per boot (default: the profile's own)")
    add("doctor", cmd_doctor, "check the engine, Compose, the builder, the NVIDIA runtime, WSL2 and GPUs")
    p = add("engine", cmd_engine, "make a Docker engine answer: install and start one on Debian/Ubuntu as root "
            "and add Compose v2 (idempotent); base images are made by the build that needs them", json_out=False)
    p.add_argument("--test-tools", action="store_true", help="also install what the tests use: a Docker registry "
                   "and an SSH server (Debian packages)")
    add("schema", cmd_schema, "print the JSON Schema of images.yaml (images.schema.json is this output)",
        json_out=False)
    p = add("derive", cmd_derive, "rewrite what docs/profiles.md and the Compose files derive from images.yaml and "
            "the knob table (one service per profile, the knob pass-through, the tables)", json_out=False)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each file that is stale")
    return parser


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
        return args.func(args)
    except (UserError, CheckFailed, EnvironmentProblem) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `build.py plan --json | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except Exception as exc:  # a bug or an exception a stage did not turn into ours: one line, the rest in a log
        from .engines import is_client_error, said
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
