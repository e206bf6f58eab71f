"""The matrix's one door: images.yaml read, validated section by section, then every profile it serves put to the
launcher's own code on each target and host, so that what the launcher would refuse at boot is refused at load."""

from __future__ import annotations

from pathlib import Path

from servekit.config.matrix import Matrix, key_of, parse_matrix
from servekit.config.profiles import refusal
from servekit.config.yamlload import load_yaml
from servekit.errors import UserError


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
