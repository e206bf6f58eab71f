"""How a command's parser is made: the shared options, --json, and the options several commands share (--engine,
--target, --host), worded once."""

from __future__ import annotations

import argparse
from collections.abc import Callable


class Commands:
    """What every subcommand is made with: its parser (the shared options, --json), and the options several share
    (--engine, --target, --host), worded once."""

    def __init__(self, sub: argparse._SubParsersAction, shared: argparse.ArgumentParser) -> None:
        self.sub, self.shared = sub, shared

    def add(self, name: str, func: Callable[[argparse.Namespace], int], help: str, json_out: bool = True, locked: bool = False) -> argparse.ArgumentParser:
        """A command; `locked`: it builds, boots or releases, so it waits for another such command to end."""
        p = self.sub.add_parser(name, help=help, description=help, parents=[self.shared])
        if json_out:
            p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
        p.set_defaults(func=func, locked=locked)
        return p

    @staticmethod
    def engine(p: argparse._ActionsContainer) -> None:
        p.add_argument("--engine", metavar="ENGINE", help="the Docker engine: a DOCKER_HOST URL (unix://, tcp://, "
                       "ssh://user@host) or a context name (default: this machine's, `local`); or venv:PATH, the "
                       "process engine: profiles served as processes of the Python environment at PATH, no Docker "
                       "(docs/install.md)")

    @staticmethod
    def target(p: argparse._ActionsContainer, many: bool = False, help: str | None = None) -> None:
        """--target, the same words everywhere; the default follows the engine (a GPU target where it can
        give containers a GPU)."""
        p.add_argument("--target", action="append" if many else "store", metavar="NAME",
                       help=help or "a target of images.yaml (default: the first GPU target where the engine can give "
                       "containers a GPU, else the first without one)" + ("; repeatable" if many else ""))

    @staticmethod
    def card(p: argparse._ActionsContainer) -> None:
        p.add_argument("--card", metavar="NAME", help="emulate a card of images.yaml (rtx3090, rtx4090) on this "
                       "machine's bigger NVIDIA GPU: the server capped at the card's memory by CUDA MPS, vLLM sizing "
                       "from it, the kernels the card runs (`doctor` says whether this host can)")

    @staticmethod
    def host(p: argparse._ActionsContainer, default: str = "auto") -> None:
        p.add_argument("--host", default=default, metavar="KIND", help="a host of images.yaml whose defaults apply, "
                       f"or auto: WSL2 or native, asked of the engine (default: {default})")

