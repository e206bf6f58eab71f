"""Load YAML into plain data while remembering the line of every key, and refuse duplicates.

PyYAML keeps the last of two equal keys without a word; a matrix must not, so the node tree
is walked by hand. The line map lets a validation error point at the line a person edits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from servekit.errors import UserError
from servekit.image.boundary import Missing, Refused, control_character, read_text

Location = tuple  # a path of keys and indexes, as pydantic reports it


class LoadedYaml:
    def __init__(self, path: Path, data: Any, lines: dict[Location, int]) -> None:
        self.path = path
        self.data = data
        self.lines = lines

    def line_of(self, loc: Location) -> int:
        """The line of the deepest key of `loc` that the file has (1 for the top)."""
        loc = tuple(loc)
        while loc:
            if loc in self.lines:
                return self.lines[loc]
            loc = loc[:-1]
        return 1

    def where(self, loc: Location) -> str:
        return f"{self.path}:{self.line_of(loc)}"


MAX_BYTES = 1 << 20  # the matrix is a few KB; a megabyte is no matrix
MAX_DEPTH = 32  # the matrix nests about six levels


def _construct(node: yaml.Node, loc: Location, lines: dict[Location, int], path: Path, seen: set[int]) -> Any:
    # An alias is a node met twice: refused, so an alias bomb or a recursive alias cannot expand.
    if id(node) in seen:
        raise UserError(f"{path}:{node.start_mark.line + 1}: YAML anchors and aliases are not allowed in the matrix; "
                        "write the value out")
    seen.add(id(node))
    if len(loc) > MAX_DEPTH:
        raise UserError(f"{path}:{node.start_mark.line + 1}: nested deeper than {MAX_DEPTH} levels; is this the matrix?")
    lines.setdefault(loc, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise UserError(f"{path}:{key_node.start_mark.line + 1}: a key must be a plain word, found a "
                                f"{'list' if isinstance(key_node, yaml.SequenceNode) else 'mapping'}")
            key = yaml.SafeLoader.construct_scalar(_SCALAR_LOADER, key_node)
            where = ".".join(str(p) for p in (*loc, key))
            _one_line(key, where, key_node, path)
            if key in out:
                raise UserError(f"{path}:{key_node.start_mark.line + 1}: {where}: duplicate key (first at line "
                                f"{lines[(*loc, key)]}); keep one of them")
            lines[(*loc, key)] = key_node.start_mark.line + 1
            out[key] = _construct(value_node, (*loc, key), lines, path, seen)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(item, (*loc, i), lines, path, seen) for i, item in enumerate(node.value)]
    try:
        value = _SCALAR_LOADER.construct_object(node, deep=True)
    except ValueError:  # an integer of more digits than Python converts (4300)
        raise UserError(f"{path}:{node.start_mark.line + 1}: a number of {len(node.value)} digits; no setting of the "
                        "matrix is that large") from None
    _one_line(value, ".".join(str(p) for p in loc) or "(top)", node, path)
    return value


def _one_line(text: Any, where: str, node: yaml.Node, path: Path) -> None:
    """Every key and string of the matrix is one line: each may become a line of a requirements, .env, pip or
    Compose file, or one argument of a command, where a line break would add a line of its own."""
    if isinstance(text, str) and (problem := control_character(text)):
        shown = repr(where)[1:-1]  # a key with a line break stays on the one line of the error
        raise UserError(f"{path}:{node.start_mark.line + 1}: {shown}: expected {problem}; every key and value of the "
                        "matrix is one line (each may become a line of a requirements, .env or Compose file)")


_SCALAR_LOADER = yaml.SafeLoader("")


def _read(path: Path) -> str:
    """The file's text, through the one bounded reader (a FIFO, a device or /dev/zero is refused unread)."""
    try:
        return read_text(path, MAX_BYTES)
    except Missing:
        raise UserError(f"{path}: no such file; run from a servekit checkout (the folder that holds images.yaml) "
                        "or pass --matrix PATH") from None
    except Refused as exc:
        fix = "pass the matrix file itself" if "regular file" in str(exc) else "is this the matrix?"
        raise UserError(f"{exc}; {fix}") from None


def load_yaml(path: Path) -> LoadedYaml:
    text = _read(path)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise UserError(f"{path}:{line}: YAML syntax error: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:  # a ReaderError: a character YAML takes in no file
        where = f" at character {exc.position}" if isinstance(exc, yaml.reader.ReaderError) else ""
        raise UserError(f"{path}: YAML error{where}: {str(exc).splitlines()[0]}") from None
    except RecursionError:  # PyYAML's composer recurses once per level of nesting
        raise UserError(f"{path}: nested deeper than the YAML parser can follow; is this the matrix?") from None
    if node is None:
        raise UserError(f"{path}:1: the file is empty; expected a mapping that starts with schema_version")
    lines: dict[Location, int] = {}
    try:
        data = _construct(node, (), lines, path, set())
    except yaml.constructor.ConstructorError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else 1
        raise UserError(f"{path}:{line}: YAML error: {exc.problem}") from None
    return LoadedYaml(path, data, lines)
