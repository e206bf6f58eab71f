"""The installed command's dependencies: every package the host tool imports is one `pip install .` (or `uv tool
install .`, `pipx install .`) brings, so the console script works outside this checkout's venv."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, packages_distributions, requires

from packaging.requirements import Requirement
from support import ROOT

# Imported only by code that runs inside an image, from the image's own lock (each import says so beside it)
IMAGE_ONLY = {"torch", "transformers", "tokenizers"}


def _imports() -> dict[str, set[str]]:
    """top-level module -> the host tool's files that import it (servekit/image runs inside the image)."""
    found: dict[str, set[str]] = {}
    for folder in ("servekit", "smoke", "wsl2"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.relative_to(ROOT).parts[:2] == ("servekit", "image"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "servekit" and top not in IMAGE_ONLY:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {Requirement(r).name.lower().replace("_", "-") for r in project["dependencies"]}


def _brought(names: set[str]) -> set[str]:
    """`names` and every distribution they require (extras left out), as pip installs them."""
    out, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        try:
            needs = requires(name) or []
        except PackageNotFoundError:
            continue
        todo += [Requirement(r).name.lower().replace("_", "-") for r in needs if "extra ==" not in r]
    return out


def test_every_package_the_host_tool_imports_is_a_dependency_of_the_project():
    distributions = packages_distributions()
    declared = _brought(_declared())
    missing = {top: sorted(files)[0] for top, files in _imports().items()
               if not {d.lower().replace("_", "-") for d in distributions.get(top, [top])} & declared}
    assert missing == {}, f"imported but not in pyproject.toml's dependencies: {missing}"


def test_every_dependency_is_pinned_in_requirements_in():
    pinned = {Requirement(line.split("#")[0]).name.lower().replace("_", "-")
              for line in (ROOT / "requirements.in").read_text().splitlines() if line.split("#")[0].strip()}
    assert _declared() - pinned == set()
