"""The project's modules import each other in one direction: no cycle, counting the imports inside functions too
(an import moved into a function to dodge a cycle still ties the two modules)."""

from __future__ import annotations

import ast
from pathlib import Path

from support import ROOT

PACKAGES = ("servekit", "smoke", "wsl2")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if package != "servekit":  # smoke/ and wsl2/ are servekit.smoke and servekit.wsl2
                parts = ("servekit", *parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))
    for node in graph:
        if node not in index:
            visit(node)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    # a package's __init__ that re-exports its modules is not an edge back from those modules to it
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    for name in graph:
        graph[name] = {t for t in graph[name] if not (name.startswith(t + ".") and modules[t].name == "__init__.py")}
    return graph


def test_no_module_of_the_project_imports_one_that_imports_it_back():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
