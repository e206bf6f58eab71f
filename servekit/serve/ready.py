"""What every serving command does before its first boot, in one order: the target and profiles, the checks of what
the user asked (checks, knobs, card), the engine and its GPU, the image, the deployment with its secrets and .env.
`up`, `run`, `sweep` and `run --engines` call `ready_to_serve`; a refusal is one line before anything starts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from servekit.build.builder import ensure_built
from servekit.build.plan import TargetPlan, installed_pins, plan_for
from servekit.config.session import Session
from servekit.engines import Engine, choice, local
from servekit.engines.deployment import Deployment
from servekit.output import Say
from servekit.serve.checks import checks_to_run
from servekit.serve.deploy import ensure_secrets, published


def deployment(session: Session, target: str, engine: Engine, host: str | None = "auto", port: int | None = None,
               tag: str | None = None, card: str | None = None) -> Deployment:
    image, pins = engine.serving(tag or plan_for(session, target).tag,  # a caller with the tag has planned already
                                 installed_pins(session.matrix, target, session.settings))
    matrix = session.matrix
    bind, port = published(session.root, matrix.serve.bind, matrix.serve.port, port)
    # Folders of this machine served in place of the models volume's downloads: an image engine mounts them
    # (compose.*-dir.yaml); a process engine's launcher reads them from the environment it inherits.
    folders = {name: os.environ.get(name) or None for name in ("MODEL_DIR", "DRAFTER_DIR")}
    mounts = folders if engine.serves_images else {}
    stand_in = matrix.stand_in_at(session.root, folders["MODEL_DIR"], target) if folders["MODEL_DIR"] else None
    return Deployment(session.root, target, choice.host(session, host, engine), image, bind, port, engine=engine,
                      overrides=tuple(matrix.targets[target].compose), matrix=matrix, pins=pins,
                      left_out=tuple(w for w in session.settings.without if w not in matrix.may_omit),
                      gpu_devices=matrix.targets[target].gpu and engine.gpu_by_devices(),
                      model_dir=mounts.get("MODEL_DIR"), drafter_dir=mounts.get("DRAFTER_DIR"), stand_in=stand_in,
                      card=choice.emulation(session, card, target, engine) if card else None)


def ready_for_compose(session: Session, target: str, tag: str) -> None:
    """compose/.env and the secrets for the image `tag` of `target`: all a plain `docker compose up PROFILE` in
    compose/ needs (what `image` leaves behind)."""
    dep = deployment(session, target, local(), tag=tag)
    ensure_secrets(dep)
    dep.engine.write_settings(dep)


@dataclass(frozen=True)
class Ready:
    target: str
    profiles: list[str]
    plan: TargetPlan | None  # None where the command serves what is there (`up`), building nothing
    deployments: list[Deployment]  # one an engine, in the order given
    key_file: Path


def ready_to_serve(session: Session, engines: list[Engine], command: str, profiles: list[str] | None = None, *,
                   target: str | None = None, host: str | None = "auto", port: int | None = None,
                   knob_sets: list[dict[str, str]] | None = None, card: str | None = None,
                   checks: list[str] | None = None, build: bool = True, engines_checked: bool = True,
                   say: Say = print) -> Ready:
    """The target (the one asked for, else the first engine's default) and its profiles (those asked for, else its
    first), every check of the user's input, each engine's own check and GPU (unless `engines_checked` is False:
    `run --engines` records an engine that fails them as that engine's run, and the others go on), the image built
    (unless `build` is False; `say` hears which), and a deployment for each engine (several engines: ports one up
    from `port` each, as engines of one machine share its loopback) with its secrets and .env written. `command` names
    the command in a refusal ("run: default needs a GPU ...")."""
    first = engines[0]
    target = choice.target(session, target, first)
    profiles = session.profiles_of(target, profiles)
    checks_to_run(session.matrix, profiles[0], target, checks)  # a misspelt --check ends here, before any boot
    for knobs in knob_sets or [{}]:
        session.check_knobs(profiles, target, knobs)
    for engine in engines:
        choice.check_card(session, card, target, engine)
    for engine in engines if engines_checked else []:
        engine.check()
        choice.require_gpu(session, target, engine, f"{command}: {', '.join(profiles)}")
    plan = ensure_built(session, target, say=say, engine=first if len(engines) == 1 else None) if build else None
    base_port = port or (session.matrix.serve.port if len(engines) > 1 else None)
    deps = [deployment(session, target, engine, host, base_port + i if base_port else None,
                       tag=plan.tag if plan else None, card=card) for i, engine in enumerate(engines)]
    for dep in deps:  # here, not in the threads that boot them: the key file is one for all, each env file written once
        key_file = ensure_secrets(dep)
        dep.engine.write_settings(dep)
    return Ready(target, profiles, plan, deps, key_file)
