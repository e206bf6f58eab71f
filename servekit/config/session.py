"""What every command resolves once: the matrix it reads and this machine's build settings. Data, and the lookups
the matrix alone answers; what an engine, a build or a deployment makes of it lives in those stages (engines.choice,
build.plan, serve.ready), so every stage can take a typed Session without importing one above it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from servekit.config.load import load_matrix
from servekit.config.matrix import Matrix
from servekit.config.profiles import refusal
from servekit.config.settings import BuildSettings
from servekit.errors import UserError


@dataclass(frozen=True)
class Session:
    matrix_path: Path
    matrix: Matrix
    settings: BuildSettings

    @classmethod
    def open(cls, matrix_path: str | Path = "images.yaml", base: str | None = None,
             without: list[str] | None = None, wheels: str | None = None) -> Session:
        """Load the matrix and this machine's settings: each given here, else from the environment."""
        matrix = load_matrix(matrix_path)
        path = Path(matrix_path).resolve()
        return cls(path, matrix, BuildSettings.resolve(matrix, base, without, wheels, path.parent / matrix.series.dir))

    @property
    def root(self) -> Path:
        return self.matrix_path.parent

    @property
    def cache(self) -> Path:
        return self.root / ".cache"

    def check_target(self, target: str) -> str:
        if target not in self.matrix.targets:
            shown = target if target.isprintable() else repr(target)
            raise UserError(f"--target {shown}: no such target; expected one of {', '.join(self.matrix.targets)}")
        return target

    def check_profile(self, profile: str, target: str) -> str:
        """`profile`, if it is one and runs on `target`."""
        profiles = self.matrix.profiles
        if profile not in profiles:
            raise UserError(f"profile {profile!r}: expected one of {', '.join(profiles)}")
        if target not in profiles[profile].targets:
            raise UserError(f"profile {profile} does not run on the {target} target (it runs on "
                            f"{', '.join(profiles[profile].targets)})")
        return profile

    def profiles_of(self, target: str, wanted: list[str] | None) -> list[str]:
        """The profiles asked for (each must run on `target`), else the target's first."""
        mine = [p for p, spec in self.matrix.profiles.items() if target in spec.targets]
        for name in wanted or []:
            if name not in mine:
                raise UserError(f"--profile {name}: not a profile of the {target} target (those are: "
                                f"{', '.join(mine)})")
        return wanted or mine[:1]

    def check_knobs(self, profiles: list[str], target: str, knobs: dict[str, str] | None) -> None:
        """`--knob` values the launcher would refuse with a profile (on any host) end here, before anything starts:
        the launcher's own code judges them, as it judges the matrix at load."""
        if knobs and (refused := refusal(self.matrix, target, profiles, knobs)):
            profile, _, why = refused
            shown = " ".join(f"--knob {k}={v!r}" for k, v in knobs.items())
            raise UserError(f"{shown}: the launcher would refuse to start {profile} with it: {why}")
