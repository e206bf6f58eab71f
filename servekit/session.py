"""What every command resolves once: the matrix, this machine's build settings, the engine, the target,
the host and the deployment. Explicit parameters, no argument namespace: callable from Python."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from servekit.build.plan import TargetPlan, installed_pins, plan_targets
from servekit.config.load import load_matrix
from servekit.config.matrix import Matrix
from servekit.config.profiles import refusal
from servekit.config.settings import BuildSettings
from servekit.engines import Engine, resolve
from servekit.engines import card as cards
from servekit.errors import EnvironmentProblem, UserError
from servekit.gpu import NvmlUnavailable, list_gpus
from servekit.serve.deploy import Deployment, published


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
        return cls(Path(matrix_path).resolve(), matrix, BuildSettings.resolve(matrix, base, without, wheels))

    @property
    def root(self) -> Path:
        return self.matrix_path.parent

    @property
    def cache(self) -> Path:
        return self.root / ".cache"

    # --- targets and plans -------------------------------------------------------------------------

    def check_target(self, target: str) -> str:
        if target not in self.matrix.targets:
            shown = target if target.isprintable() else repr(target)
            raise UserError(f"--target {shown}: no such target; expected one of {', '.join(self.matrix.targets)}")
        return target

    def default_target(self, engine: Engine | None = None) -> str:
        """The first GPU target where the engine (default: this machine's) can give a container a GPU, else the
        first without one."""
        try:
            gpu = (engine or resolve(None)).gpu_problem() is None
        except Exception:  # no engine answers: a target without a GPU is what can run anywhere
            gpu = False
        return self.matrix.default_target(gpu)

    def target(self, wanted: str | None, engine: Engine | None = None) -> str:
        return self.check_target(wanted or self.default_target(engine))

    def profile_target(self, profile: str, wanted: str | None, engine: Engine | None = None) -> str:
        """The target to use for `profile`: the one asked for (or the engine's default), if the profile runs there."""
        target = self.target(wanted, engine)
        profiles = self.matrix.profiles
        if profile not in profiles:
            raise UserError(f"profile {profile!r}: expected one of {', '.join(profiles)}")
        if target not in profiles[profile].targets:
            raise UserError(f"profile {profile} does not run on the {target} target (it runs on "
                            f"{', '.join(profiles[profile].targets)})")
        return target

    def plans(self, targets: list[str] | None = None, image_exists=None) -> list[TargetPlan]:
        """Each target's plan under this machine's settings: the tag every command agrees on."""
        return plan_targets(self.matrix, self.root, targets, image_exists, self.settings)

    def plan(self, target: str) -> TargetPlan:
        return self.plans([target])[0]

    # --- where it runs ---------------------------------------------------------------------------

    def host(self, wanted: str | None, engine: Engine) -> str:
        """`wanted`, or for auto/None what the engine runs on (WSL2 or native; native when it does not answer,
        which its own check then reports)."""
        if wanted in (None, "auto"):
            try:
                return engine.host_kind()
            except Exception:  # the SDK's many kinds of "cannot connect"
                return "native"
        if wanted not in self.matrix.hosts:
            raise UserError(f"--host {wanted}: expected one of auto, {', '.join(self.matrix.hosts)}")
        return wanted

    def deployment(self, target: str, engine: Engine, host: str | None = "auto", port: int | None = None,
                   tag: str | None = None, card: str | None = None):
        image, pins = engine.serving(tag or self.plan(target).tag,  # a caller with the tag has planned already
                                     installed_pins(self.matrix, target, self.settings))
        bind, port = published(self.root, self.matrix.serve.bind, self.matrix.serve.port, port)
        # Folders of this machine served in place of the models volume's downloads: an image engine mounts them
        # (compose.*-dir.yaml); a process engine's launcher reads them from the environment it inherits.
        folders = {name: os.environ.get(name) or None for name in ("MODEL_DIR", "DRAFTER_DIR")}
        mounts = folders if engine.serves_images else {}
        stand_in = self.matrix.stand_in_at(self.root, folders["MODEL_DIR"], target) if folders["MODEL_DIR"] else None
        return Deployment(self.root, target, self.host(host, engine), image, bind, port, engine=engine,
                          overrides=tuple(self.matrix.targets[target].compose), matrix=self.matrix, pins=pins,
                          gpu_devices=self.matrix.targets[target].gpu and engine.gpu_by_devices(),
                          model_dir=mounts.get("MODEL_DIR"), drafter_dir=mounts.get("DRAFTER_DIR"), stand_in=stand_in,
                          card=self.emulation(card, target, engine) if card else None)

    def check_card(self, card: str | None, target: str, engine: Engine) -> None:
        """A `--card` that cannot be, for reasons known without a GPU, ends here, before anything is built."""
        if card is None:
            return
        cards.card_spec(self.matrix, card)
        if not self.matrix.targets[target].gpu:
            raise UserError(f"--card {card}: target {target} has no GPU to emulate a card on")
        if not (engine.serves_images and engine.same_machine):
            raise UserError(f"--card {card}: the card is emulated by an MPS daemon of this machine, for a container of "
                            f"this machine's engine; engine {engine.given} is not one")

    def emulation(self, card: str, target: str, engine: Engine):
        """`--card`: the card emulated on this machine's GPU, or a one-line refusal of why it cannot be."""
        self.check_card(card, target, engine)
        try:
            gpus = list_gpus()
        except NvmlUnavailable as exc:
            raise EnvironmentProblem(f"--card {card}: no GPU to emulate it on: {exc}") from None
        if not gpus:
            raise EnvironmentProblem(f"--card {card}: NVML lists no GPU here")
        return cards.plan(self.matrix, card, gpus[0])

    def check_knobs(self, profiles: list[str], target: str, knobs: dict[str, str] | None) -> None:
        """`--knob` values the launcher would refuse with a profile (on any host) end here, before anything starts:
        the launcher's own code judges them, as it judges the matrix at load."""
        if knobs and (refused := refusal(self.matrix, target, profiles, knobs)):
            profile, _, why = refused
            shown = " ".join(f"--knob {k}={v!r}" for k, v in knobs.items())
            raise UserError(f"{shown}: the launcher would refuse to start {profile} with it: {why}")

    def require_gpu(self, target: str, engine: Engine, what: str) -> None:
        """A GPU target on an engine that cannot give it a GPU ends here, in one line, before anything starts."""
        if not self.matrix.targets[target].gpu:
            return
        problem = engine.gpu_problem()
        if problem:
            others = [name for name, t in self.matrix.targets.items() if not t.gpu]
            raise EnvironmentProblem(f"{what} needs a GPU (target {target}), and engine {engine.given}: {problem}"
                                     + (f"; or use --target {others[0]}" if others else ""))
