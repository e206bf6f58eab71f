"""`--knob` on the command line: NAME=VALUE for a boot, NAME=V1,V2 for a sweep, every value checked by the knob
table before anything starts."""

from __future__ import annotations

from servekit.errors import UserError
from servekit.image.knobs import KNOBS, masked, watched_problem


def _checked(spec: str, form: str, split: bool) -> tuple[str, list[str]]:
    """`--knob` as (NAME, its values): several at commas for a sweep, else one, each checked by the knob table."""
    name, _, text = spec.partition("=")
    if name not in KNOBS or not text:
        raise UserError(f"--knob {spec!r}: expected {form} with NAME one of {', '.join(KNOBS)}")
    values = text.split(",") if split else [text]
    for value in values:
        if problem := KNOBS[name].check(value) or watched_problem(name, value):
            raise UserError(f"--knob {name}={masked(value)!r}: {problem}")
    return name, values


SWEPT_KINDS = ("int", "float", "enum", "bool")  # values without commas of their own, each a cell of the table


def parse_knobs(specs: list[str]) -> list[tuple[str, list[str]]]:
    """`--knob NAME=V1,V2` each, every value checked by the knob table before anything boots: a knob once, of a kind
    whose values cannot hold the comma that separates them, each value once."""
    knobs = [_checked(spec, "NAME=V1,V2", split=True) for spec in specs]
    seen: set[str] = set()
    for name, values in knobs:
        if name in seen:
            raise UserError(f"--knob {name}: given twice; give one --knob {name}=V1,V2 with every value")
        seen.add(name)
        if KNOBS[name].kind not in SWEPT_KINDS:
            swept = ", ".join(n for n, k in KNOBS.items() if k.kind in SWEPT_KINDS)
            raise UserError(f"--knob {name}: a {KNOBS[name].kind} knob cannot be swept (its values may hold commas); "
                            f"expected one of {swept}, or set it in the profile")
        normal = [KNOBS[name].normalize(v) for v in values]
        if len(set(normal)) != len(normal):
            raise UserError(f"--knob {name}={masked(','.join(values))!r}: each value once (a cell of the table each)")
    return knobs


def parse_settings(specs: list[str]) -> dict[str, str]:
    """`--knob NAME=VALUE` each (one value, commas and all: a setting, not a sweep), checked by the knob table."""
    return {name: values[0] for name, values in (_checked(spec, "NAME=VALUE", split=False) for spec in specs)}
