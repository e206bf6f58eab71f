"""The matrix's one door: images.yaml read, validated section by section (matrix.py), its references checked
(references.py), then every profile it serves put to the launcher's own code on each target and host, so that what
the launcher would refuse at boot is refused at load. Every error is one line: file, line, key, what was expected
and what was found."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from servekit.config.matrix import _PATTERN_WORDS, SCHEMA_VERSION, Matrix
from servekit.config.profiles import refusal
from servekit.config.references import References
from servekit.config.yamlload import LoadedYaml, load_yaml
from servekit.errors import UserError

_TYPE_WORDS = {
    "string_type": "a string", "int_type": "an integer", "int_parsing": "an integer",
    "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
    "bool_parsing": "true or false", "dict_type": "a mapping", "list_type": "a list",
    "model_type": "a mapping", "model_attributes_type": "a mapping",
}


def _describe(error: Any) -> str:
    kind = error["type"]
    found = error.get("input")
    if kind == "extra_forbidden":
        return "unknown key (a typo?); remove it or check the spelling against images.schema.json"
    if kind == "missing":
        return "missing key; add it"
    if kind in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind]}, found {_show(found)}"
    if kind == "literal_error":
        return f"expected {error['ctx']['expected']}, found {_show(found)}"
    if kind == "string_pattern_mismatch":
        pattern = error["ctx"]["pattern"]
        return f"expected {_PATTERN_WORDS.get(pattern, 'text matching ' + pattern)}, found {_show(found)}"
    if kind == "value_error":
        return str(error["ctx"]["error"])
    return f"{error['msg']}, found {_show(found)}"


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing (null)"
    return repr(value)


def key_of(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(top)"


def parse_matrix(loaded: LoadedYaml) -> Matrix:
    data = loaded.data
    if not isinstance(data, dict):
        raise UserError(f"{loaded.where(())}: (top): expected a mapping with schema_version, found {_show(data)}")
    version = data.get("schema_version")
    if version is not None and version != SCHEMA_VERSION:
        raise UserError(f"{loaded.where(('schema_version',))}: schema_version: this servekit reads version "
                        f"{SCHEMA_VERSION}, found {version!r}")
    try:
        matrix = Matrix.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # A misspelt key is both unknown and missing; the unknown one is what the person typed, so it
        # comes first, then file order, which is where a person starts reading.
        first = min(errors, key=lambda e: (e["type"] != "extra_forbidden", loaded.line_of(_strip_loc(e["loc"]))))
        loc = _strip_loc(first["loc"])
        message = _describe(first)
        if first["type"] == "extra_forbidden" and loc:
            missing = [_strip_loc(e["loc"])[-1] for e in errors
                       if e["type"] == "missing" and _strip_loc(e["loc"])[:-1] == loc[:-1]]
            close = difflib.get_close_matches(str(loc[-1]), [str(m) for m in missing], n=1)
            if close:
                message = f"unknown key; did you mean {close[0]!r}?"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise UserError(f"{loaded.where(loc)}: {key_of(loc)}: {message}{more}") from None
    problems = References(matrix, loaded.path.resolve().parent).all()
    if problems:
        problems.sort(key=lambda p: loaded.line_of(p[0]))
        loc, message = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"{loaded.where(loc)}: {key_of(loc)}: {message}{more}")
    return matrix


def _strip_loc(loc: tuple) -> tuple:
    # pydantic adds the tag of a union member (e.g. 'ProfileTarget') to the location; drop it.
    return tuple(p for p in loc if not (isinstance(p, str) and (p[:1].isupper() or p.startswith("function-")
                                                                or p == "[key]")))



def load_matrix(path: str | Path) -> Matrix:
    loaded = load_yaml(Path(path))
    matrix = parse_matrix(loaded)
    for target in matrix.targets:
        if refused := refusal(matrix, target):
            profile, host, why = refused
            loc = ("profiles", profile)
            raise UserError(f"{loaded.where(loc)}: {key_of(loc)}: the launcher refuses it on target {target}, host "
                            f"{host}: {why}")
    return matrix
