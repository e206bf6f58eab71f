"""`--knob` on the command line: NAME=VALUE for a boot, NAME=V1,V2 for a sweep, every value checked by the knob
table before anything starts."""

from __future__ import annotations

from servekit.errors import UserError
from servekit.image.knobs import KNOBS, masked


def _checked(spec: str, form: str, split: bool) -> tuple[str, list[str]]:
    """`--knob` as (NAME, its values): several at commas for a sweep, else one, each checked by the knob table."""
    name, _, text = spec.partition("=")
    if name not in KNOBS or not text:
        raise UserError(f"--knob {spec!r}: expected {form} with NAME one of {', '.join(KNOBS)}")
    values = text.split(",") if split else [text]
    for value in values:
        if problem := KNOBS[name].check(value):
            raise UserError(f"--knob {name}={masked(value)!r}: {problem}")
    return name, values


def parse_knobs(specs: list[str]) -> list[tuple[str, list[str]]]:
    """`--knob NAME=V1,V2` each, every value checked by the knob table before anything boots."""
    return [_checked(spec, "NAME=V1,V2", split=True) for spec in specs]


def parse_settings(specs: list[str]) -> dict[str, str]:
    """`--knob NAME=VALUE` each (one value, commas and all: a setting, not a sweep), checked by the knob table."""
    return {name: values[0] for name, values in (_checked(spec, "NAME=VALUE", split=False) for spec in specs)}
