"""Where things run: a Docker engine, this machine's or another's (docker.py), or a Python environment served as
processes (process.py); `resolve` turns an `--engine` argument into one of them."""

from __future__ import annotations

from servekit.engines import docker, process
from servekit.engines.docker import (
    PROJECT,
    EngineError,
    address,
    docker_errors,
    is_client_error,
    local,
    local_url,
    reach,
    said,
)
from servekit.engines.protocol import Engine, Server, ServerState
from servekit.errors import UserError

__all__ = ["PROJECT", "Engine", "EngineError", "Server", "ServerState", "address", "docker_errors", "is_client_error",
           "local", "local_url", "parse_engines", "reach", "resolve", "said"]


def resolve(spec: str | None) -> Engine:
    """`--engine` as typed: None or "local" is this machine's default engine, venv:PATH the process engine of the
    Python environment there, anything else a Docker engine by URL or context name."""
    if spec and spec.startswith("venv:"):
        return process.resolve(spec)
    return docker.resolve(spec)


def parse_engines(specs: str) -> list[Engine]:
    """`--engines A,B,...`: each resolved, no engine twice."""
    engines = [resolve(s.strip()) for s in specs.split(",") if s.strip()]
    if not engines:
        raise UserError("--engines: name at least one engine, e.g. --engines local,ssh://user@gpu-box")
    urls = [e.url for e in engines]
    twice = sorted({u for u in urls if urls.count(u) > 1})
    if twice:
        raise UserError(f"--engines: {', '.join(twice)} named twice; each engine runs the profile once")
    return engines
