"""The command line: parse and dispatch. Each command's parser and what it prints live in its group's module of
`servekit/commands/`; each command's work in its stage's module."""

from __future__ import annotations

import argparse
import errno
import signal
import sys
import threading
import time
import tomllib
import traceback
from importlib.metadata import version as installed
from pathlib import Path
from typing import NoReturn

from servekit.commands import GROUPS
from servekit.commands.console import channel
from servekit.commands.parsing import Commands
from servekit.errors import ServekitError, UserError
from servekit.exclusive import exclusive

EPILOG = """exit codes: 0 ok, 1 a check failed (or the machine lacks something), 2 bad input or usage.
The matrix (images.yaml) is the single source of truth; see README.md and docs/."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # usage errors: one line, exit 2
        self.print_usage(sys.stderr)
        raise UserError(f"{self.prog}: {message}")

# ---------------------------------------------------------------------------------------------


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
    machine.add_argument("--without", action="append", default=argparse.SUPPRESS, metavar="NAME", help="leave out a "
                         "pin listed under may_omit, e.g. flashinfer-cubin where a target installs it and its index cannot "
                         "be reached, or a patch of the series to measure what it does, e.g. marlin-int8-signed-scales "
                         "(never released) (SERVEKIT_WITHOUT; repeatable)")
    machine.add_argument("--wheels", default=argparse.SUPPRESS, metavar="DIR[:DIR]", help="folders of wheels offered "
                         "to the build, exact pinned versions only (SERVEKIT_WHEELS; default: the find-links your pip "
                         "is configured with)")
    return shared


def version() -> str:
    """pyproject.toml's version: read there in a checkout (an editable install's metadata can be older), else the
    installed distribution's."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        with open(pyproject, "rb") as f:
            return tomllib.load(f)["project"]["version"]
    return installed("servekit")


def build_parser() -> argparse.ArgumentParser:
    shared = _shared_options()
    prog = "servekit" if Path(sys.argv[0]).name == "servekit" else "build.py"  # the console script, or the door
    parser = _Parser(prog=prog, description="Build, deploy, check and release patched vLLM serving images "
                     "from one pinned matrix.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                     parents=[shared])
    parser.add_argument("--version", action="version", version=f"servekit {version()}")
    commands = Commands(parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser), shared)
    for group in GROUPS:
        group.register(commands)
    return parser


SHARED_DEFAULTS = {"matrix": "images.yaml", "base": None, "without": None, "wheels": None}


def _terminated(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt  # SIGTERM (a CI timeout, pkill) tears down like Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is threading.main_thread():
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
        args.parser = parser  # for `completion`, which prints a script for the whole command line
        _check_cache_folder(Path(args.matrix).resolve().parent / ".cache")
        if not args.locked:
            return args.func(args)
        with exclusive(Path(args.matrix).resolve().parent / ".cache", args.command, say=channel()):
            return args.func(args)
    except ServekitError as exc:  # the image's errors, Refused included, are of it too
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `build.py plan --json | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except Exception as exc:  # a bug or an exception a stage did not turn into ours: one line, the rest in a log
        from servekit.engines import is_client_error, said  # the engines' clients, loaded only on this path
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            print(f"error: {_disk_full(exc)}", file=sys.stderr)
        else:
            print(f"error: {'docker: ' + said(exc) if is_client_error(exc) else _unexpected(exc, argv)}",
                  file=sys.stderr)
        return 1


def _check_cache_folder(cache: Path) -> None:
    """The checkout's .cache holds servekit's locks, bases, engines' settings and stand-ins: something else in its
    place is refused before any command works there."""
    if cache.exists() and not cache.is_dir():
        raise UserError(f"{cache} is not a folder; servekit keeps its locks and caches there: move it away")


def _disk_full(exc: OSError) -> str:
    """The disk filled under a build, a download or a report: the machine's to mend, not a bug to report (and no log
    could be written)."""
    where = f" writing {exc.filename}" if exc.filename else ""
    return (f"no space left on the device{where}: free some (old images: `docker image prune`; the builder's cache: "
            "`docker builder prune`) and run it again")


def _unexpected(exc: Exception, argv: list[str] | None) -> str:
    """One line for the terminal; the traceback goes to logs/error-<time>.log (or says why it could not)."""
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
