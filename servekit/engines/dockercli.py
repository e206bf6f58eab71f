"""The docker CLI's two doors, for what neither client does, each pointed at an engine: one-shot (`docker_cli`: a
deadline neither client gives, the plugins' versions, contexts, `docker run` with the very flags the docs give a
user, `docker import` reading a tar from a pipe) and streaming (`docker_process`: a BuildKit build's plain progress
read line by line, stopped by Ctrl-C as the very process)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import IO, Any, Protocol


class Addressed(Protocol):
    """A Docker engine as the CLI is pointed at it (docker.py's DockerEngine)."""

    def cli_options(self) -> dict: ...


def _where(engine: Addressed | None) -> list[str]:
    return [f"--{key}={value}" for key, value in (engine.cli_options() if engine else {}).items()]


def docker_cli(args: list[str], timeout: float, engine: Addressed | None = None, text: bool = True,
               stdin: IO[Any] | None = None) -> subprocess.CompletedProcess:
    """`docker ARGS` on `engine` (this machine's when None) to its end, its output captured."""
    return subprocess.run(["docker", *_where(engine), *args], capture_output=True, text=text, timeout=timeout,
                          stdin=stdin)


def docker_process(args: list[str], cwd: Path, env: dict[str, str],
                   engine: Addressed | None = None) -> subprocess.Popen[str]:
    """`docker ARGS` on `engine` started, its output and errors as one text stream to read as it comes."""
    return subprocess.Popen(["docker", *_where(engine), *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
