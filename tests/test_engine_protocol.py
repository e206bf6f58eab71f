"""The engines are peers behind one protocol of our own (servekit/engines/protocol.py): each is an Engine, its
servers are Servers, and nothing outside servekit/engines/ names one engine's classes or asks which it has."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from support import ROOT

from servekit.engines import Engine, Server, resolve
from servekit.engines.docker import DockerEngine, DockerServer
from servekit.engines.process import ProcessEngine, ProcessServer

KINDS = {"DockerEngine", "DockerServer", "ProcessEngine", "ProcessServer", "servekit.engines.process"}


def test_both_engines_are_the_protocols_engine_and_their_servers_its_server(tmp_path):
    docker_engine, process_engine = resolve("unix:///run/x/docker.sock"), resolve(f"venv:{tmp_path}")
    assert isinstance(docker_engine, DockerEngine) and isinstance(process_engine, ProcessEngine)
    assert isinstance(docker_engine, Engine) and isinstance(process_engine, Engine)
    assert not issubclass(ProcessEngine, DockerEngine), "peers, not one engine dressed as the other"
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    record = {"profile": "default", "pid": proc.pid, "started": None, "port": 1, "bind": "127.0.0.1",
              "target": "cpu", "image": "env", "started_at": "x", "knobs": {}}
    assert isinstance(ProcessServer(process_engine, record, proc), Server)
    assert all(hasattr(DockerServer, name) for name in ("state", "log", "follow_log", "memory", "environ", "image_id"))


def _names(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(alias.name for alias in node.names)}
        elif isinstance(node, ast.Name):
            found.add(node.id)
    return found


def test_nothing_outside_the_engines_names_one_engines_classes():
    outside = [p for folder in ("servekit", "smoke", "wsl2") for p in (ROOT / folder).rglob("*.py")
               if "engines" not in p.relative_to(ROOT).parts]
    named = {str(p.relative_to(ROOT)): sorted(_names(ast.parse(p.read_text())) & KINDS) for p in outside}
    assert {path: names for path, names in named.items() if names} == {}


@pytest.mark.parametrize("stats, shown", [
    # cgroup v2 (Debian 12, Docker Desktop): usage less inactive_file, as `docker stats` shows it
    ({"usage": 6_000_000_000, "stats": {"inactive_file": 4_500_000_000, "active_file": 100}}, 1_500_000_000),
    # cgroup v1: total_inactive_file
    ({"usage": 3_000_000_000, "stats": {"total_inactive_file": 1_000_000_000, "cache": 2_000_000_000}}, 2_000_000_000),
    # no page-cache figure, or one not below the usage: the usage itself
    ({"usage": 2_000_000_000, "stats": {}}, 2_000_000_000),
    ({"usage": 1_000, "stats": {"inactive_file": 5_000}}, 1_000),
    ({}, None),
])
def test_container_memory_is_what_docker_stats_shows_not_the_page_cache(stats, shown):
    """The files a boot reads (the weights) sit in the container's page cache, which raw cgroup usage counts and
    `docker stats` leaves out; the report's container memory is docker stats' figure."""
    from servekit.engines.docker import memory_in_use
    assert memory_in_use(stats) == shown


DOCKER_CLIENTS = ("servekit.engines.docker", "docker", "python_on_whales")


def _imported_modules(tree: ast.AST) -> set[str]:
    """Every module a file imports, anywhere in it (functions and TYPE_CHECKING blocks too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def test_only_the_engines_talk_to_docker():
    """The docker SDK, python-on-whales and engines/docker.py are the Docker engine's own: a stage reaches an engine
    through servekit.engines (its protocol, `local`, the CLI and registry doors), so another engine needs no stage
    changed."""
    outside = [p for folder in ("servekit", "smoke", "wsl2") for p in (ROOT / folder).rglob("*.py")
               if "engines" not in p.relative_to(ROOT).parts]
    talking = {}
    for path in outside:
        modules = _imported_modules(ast.parse(path.read_text()))
        clients = sorted(m for m in modules if any(m == c or m.startswith(c + ".") for c in DOCKER_CLIENTS))
        if clients:
            talking[str(path.relative_to(ROOT))] = clients
    assert talking == {}
