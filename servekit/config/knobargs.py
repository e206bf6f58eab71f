"""`--knob` on the command line: NAME=VALUE for a boot, NAME=V1,V2 for a sweep, every value checked by the knob
table before anything starts."""

from __future__ import annotations

from servekit.errors import UserError
from servekit.image.knobs import KNOBS


def parse_knobs(specs: list[str]) -> list[tuple[str, list[str]]]:
    """`--knob NAME=V1,V2` each, every value checked by the knob table before anything boots."""
    knobs = []
    for spec in specs:
        name, _, values = spec.partition("=")
        if name not in KNOBS or not values:
            raise UserError(f"--knob {spec!r}: expected NAME=V1,V2 with NAME one of {', '.join(KNOBS)}")
        for value in values.split(","):
            if problem := KNOBS[name].check(value):
                raise UserError(f"--knob {name}={value!r}: {problem}")
        knobs.append((name, values.split(",")))
    return knobs


def parse_settings(specs: list[str]) -> dict[str, str]:
    """`--knob NAME=VALUE` each (one value, commas and all: a setting, not a sweep), checked by the knob table."""
    settings = {}
    for spec in specs:
        name, _, value = spec.partition("=")
        if name not in KNOBS or not value:
            raise UserError(f"--knob {spec!r}: expected NAME=VALUE with NAME one of {', '.join(KNOBS)}")
        if problem := KNOBS[name].check(value):
            raise UserError(f"--knob {name}={value!r}: {problem}")
        settings[name] = value
    return settings
