"""The project's modules import each other in one direction, counting the imports inside functions too (an import
moved into a function to dodge a cycle still ties the two modules): no cycle of modules or of packages, each stage
importing only the stages below it; and no function longer than a screen."""

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
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_no_module_of_the_project_imports_one_that_imports_it_back():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The stages, lowest first: a package imports only those before it. The modules at servekit's top level are shared
# by all (they import only the image's code, itself the lowest); the door (cli, its commands, session) imports
# anything.
LAYERS = ("servekit.image", "servekit.wsl2", "servekit.smoke", "servekit.config", "servekit.records",
          "servekit.engines", "servekit.build", "servekit.serve", "servekit.release", "servekit.machine")
DOOR = ("servekit.cli", "servekit.commands")
MAX_FUNCTION_LINES = 80


def _layer(module: str) -> int | None:
    """The module's place in LAYERS; -1 for a shared module; None for the door."""
    if any(module == door or module.startswith(door + ".") for door in DOOR):
        return None
    return next((i for i, layer in enumerate(LAYERS) if module == layer or module.startswith(layer + ".")), -1)


def _upward(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for name, targets in sorted(graph.items()):
        here = _layer(name)
        for target in sorted(targets):
            there = _layer(target)
            if here is not None and (there is None or there > max(here, 0)):
                out.append(f"{name} -> {target}")
    return out


def _packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between stages: an edge wherever a module of one imports a module of another."""
    def stage(module: str) -> str:
        place = _layer(module)
        return LAYERS[place] if place is not None and place >= 0 else module
    out: dict[str, set[str]] = {stage(m): set() for m in {*graph, *(t for ts in graph.values() for t in ts)}}
    for name, targets in graph.items():
        out[stage(name)] |= {stage(t) for t in targets} - {stage(name)}
    return out


def test_no_stage_imports_a_stage_that_imports_it_back():
    assert _cycles(_packages(_graph())) == []


def test_each_stage_imports_only_the_stages_below_it():
    assert _upward(_graph()) == []


def test_the_layer_rule_finds_an_upward_import():
    graph = {"servekit.config.load": {"servekit.build.plan"}, "servekit.build.plan": {"servekit.config.matrix"},
             "servekit.atomic": {"servekit.serve.deploy"}, "servekit.serve.deploy": {"servekit.cli"}}
    assert _upward(graph) == ["servekit.atomic -> servekit.serve.deploy", "servekit.config.load -> servekit.build.plan",
                              "servekit.serve.deploy -> servekit.cli"]
    assert _cycles(_packages(graph)) == [["servekit.build", "servekit.config"]]


def _long_functions(path: Path, root: Path = ROOT) -> list[str]:
    functions = [node for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    spans = [(node, (node.end_lineno or node.lineno) - node.lineno + 1) for node in functions]
    return [f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)"
            for node, lines in spans if lines > MAX_FUNCTION_LINES]


def test_no_function_is_longer_than_a_screen():
    assert [hit for path in _modules().values() for hit in _long_functions(path)] == []


def test_the_length_rule_finds_a_long_function(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("def short():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1)
                    + "\n\ndef long():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert _long_functions(path, tmp_path) == [f"probe.py:{MAX_FUNCTION_LINES + 3} long (81 lines)"]


def test_the_command_line_parses_and_dispatches_only():
    cli = ROOT / "servekit" / "cli.py"
    assert len(cli.read_text().splitlines()) < 300
    assert not [n.name for n in ast.parse(cli.read_text()).body
                if isinstance(n, ast.FunctionDef) and n.name.startswith("cmd_")]


def _uncommented_imports_in_functions(path: Path, root: Path = ROOT) -> list[str]:
    lines = path.read_text().splitlines()
    return [f"{path.relative_to(root)}:{s.lineno} {lines[s.lineno - 1].strip()}"
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for s in ast.walk(node) if isinstance(s, (ast.Import, ast.ImportFrom)) and "#" not in lines[s.lineno - 1]]


def test_imports_are_at_the_top_unless_a_comment_says_why_not():
    """The image's code imports the standard library only at import, by design (inside a function, what the target's
    lock installs); each command of servekit/commands/ imports its stage when it runs, as that module's comment says."""
    lazy_by_design = (ROOT / "servekit" / "image", ROOT / "servekit" / "commands")
    found = [hit for path in _modules().values() if not any(path.is_relative_to(folder) for folder in lazy_by_design)
             for hit in _uncommented_imports_in_functions(path)]
    assert found == []


def test_the_import_rule_finds_an_import_hidden_in_a_function(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    import json\n    import yaml  # why: a reason\n    return json, yaml\n")
    assert _uncommented_imports_in_functions(path, tmp_path) == ["probe.py:2 import json"]


def test_smoke_and_wsl2_are_linked_into_servekit_as_the_names_the_code_imports():
    for name in ("smoke", "wsl2"):
        link = ROOT / "servekit" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), name


# Exceptions that never reach a person: each is caught where it is raised and said another way.
INTERNAL_EXCEPTIONS = {
    "servekit.records.fit.NotPredicted": "fit turns it into its table's 'not predicted' line",
    "servekit.serve.boot.Stopped": "a boot's stop signal, which the run that sent it catches",
    "servekit.serve.boot.BootInterrupted": "Ctrl-C or SIGTERM in a boot (a KeyboardInterrupt): the report says it",
    "servekit.serve.pipeline.RunInterrupted": "the same for a run, carrying its report",
    "servekit.smoke.core.CheckFailure": "a check's verdict, which its result in the report carries",
    "servekit.smoke.core.NotRun": "a check that could not measure, which its result carries",
}


def test_every_error_a_person_can_see_has_one_root():
    """Every exception class servekit defines, the image's own included, is a ServekitError (whose message the
    command line prints as one line with its exit code), but the few listed as internal, each with why."""
    import importlib
    import inspect

    from servekit.errors import ServekitError
    strays = []
    for name in _modules():
        module = importlib.import_module(name)
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name and issubclass(cls, BaseException) and not issubclass(cls, ServekitError) \
                    and f"{name}.{cls_name}" not in INTERNAL_EXCEPTIONS:
                strays.append(f"{name}.{cls_name}")
    assert strays == []
    for listed in INTERNAL_EXCEPTIONS:  # none listed in vain
        module_name, cls_name = listed.rsplit(".", 1)
        assert issubclass(getattr(importlib.import_module(module_name), cls_name), BaseException), listed
