"""What every command shares on its way out: the session it opens, the engine it names, its output channel, JSON,
tables and the findings of a check."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from servekit.output import Output

if TYPE_CHECKING:  # for the types alone: at run time each is imported by the command that uses it
    from rich.console import Console

    from servekit.build.findings import Findings
    from servekit.config.session import Session
    from servekit.engines import Engine

# The session, the engine and Rich are imported when a command uses them: `--help` and a refused argument answer
# without loading the engine's SDK, pydantic or Rich.


def open_session(args: argparse.Namespace) -> Session:
    from servekit.config.session import Session
    return Session.open(args.matrix, args.base, args.without, args.wheels)


def engine_of(args: argparse.Namespace) -> Engine:
    from servekit.engines import resolve
    return resolve(args.engine)


def channel(prefix: str = "", live: Callable[[str], None] | None = None) -> Output:
    """The command's output channel: lines on stderr, a build's steps through the step printer, progress to `live`
    (a terminal's status line) where given."""
    return Output(prefix=prefix, live=live, step=step_printer())


def emit_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def console() -> Console:
    from rich.console import Console
    return Console(highlight=False)


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    from rich.table import Table
    from rich.text import Text
    table = Table(title=Text(title))  # Text, never markup: a report's words are not Rich's to interpret ("[/x]")
    for col in header:
        table.add_column(Text(col), overflow="fold")
    for row in rows:
        table.add_row(*(Text("" if cell is None else str(cell)) for cell in row))
    console().print(table)


def print_wide(title: str, header: list[str], rows: list[list], markdown: str) -> None:
    """A table on a terminal; in a log or a pipe the Markdown, which stays one row a line."""
    if sys.stdout.isatty():
        print_table(title, header, rows)
    else:
        print(markdown, end="")


def step_printer(every_s: float = 5.0) -> Callable[[str], None]:
    """Each BuildKit step header, the series' own lines and each step's time when done; inside a long step its
    latest output line (with BuildKit's elapsed seconds) every `every_s`. The full output goes to the log."""
    step = re.compile(r"^#\d+ \[[^\]]+\] ")
    mine = re.compile(r"^#\d+ [0-9.]+ (== |-- |verify: |demo model|step \d+/)")
    done = re.compile(r"^#\d+ DONE [0-9.]+s$")
    output = re.compile(r"^#\d+ [0-9.]+ \S")
    last = [time.monotonic()]

    def show(line: str) -> None:
        if step.match(line) or mine.match(line) or (done.match(line) and not line.endswith(" 0.0s")) or output.match(line) and time.monotonic() - last[0] >= every_s:
            print(f"  {line[:110]}", file=sys.stderr, flush=True)
            last[0] = time.monotonic()
    return show


def print_findings(args: argparse.Namespace, findings: Findings, what: str) -> int:
    if args.json:
        emit_json({"ok": not findings.problems, "problems": findings.problems, "notes": findings.notes})
    else:
        for note in findings.notes:
            print(f"note: {note}", file=sys.stderr)
        for problem in findings.problems:
            print(f"problem: {problem}")
        print(f"{what}: {'ok' if not findings.problems else f'{len(findings.problems)} problem(s)'}")
    return 1 if findings.problems else 0

