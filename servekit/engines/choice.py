"""What a session's target, host and card come to on an engine: the target it can run (a GPU one where it gives a
container a GPU), the host it serves on, a `--card` emulated on this machine's GPU, and the refusals of each in one
line, before anything is built or started."""

from __future__ import annotations

from servekit.config.session import Session
from servekit.engines import card as cards
from servekit.engines import resolve
from servekit.engines.protocol import Engine
from servekit.errors import EnvironmentProblem, UserError
from servekit.gpu import NvmlUnavailable, list_gpus


def default_target(session: Session, engine: Engine | None = None) -> str:
    """The first GPU target where the engine (default: this machine's) can give a container a GPU, else the first
    without one."""
    try:
        gpu = (engine or resolve(None)).gpu_problem() is None
    except Exception:  # no engine answers: a target without a GPU is what can run anywhere
        gpu = False
    return session.matrix.default_target(gpu)


def target(session: Session, wanted: str | None, engine: Engine | None = None) -> str:
    return session.check_target(wanted or default_target(session, engine))


def profile_target(session: Session, profile: str, wanted: str | None, engine: Engine | None = None) -> str:
    """The target to use for `profile`: the one asked for (or the engine's default), if the profile runs there."""
    chosen = target(session, wanted, engine)
    session.check_profile(profile, chosen)
    return chosen


def host(session: Session, wanted: str | None, engine: Engine) -> str:
    """`wanted`, or for auto/None what the engine runs on (WSL2 or native; native when it does not answer, which its
    own check then reports)."""
    if wanted in (None, "auto"):
        try:
            return engine.host_kind()
        except Exception:  # the SDK's many kinds of "cannot connect"
            return "native"
    if wanted not in session.matrix.hosts:
        raise UserError(f"--host {wanted}: expected one of auto, {', '.join(session.matrix.hosts)}")
    return wanted


def check_card(session: Session, card: str | None, target: str, engine: Engine) -> None:
    """A `--card` that cannot be, for reasons known without a GPU, ends here, before anything is built."""
    if card is None:
        return
    cards.card_spec(session.matrix, card)
    if not session.matrix.targets[target].gpu:
        raise UserError(f"--card {card}: target {target} has no GPU to emulate a card on")
    if not (engine.serves_images and engine.same_machine):
        raise UserError(f"--card {card}: the card is emulated by an MPS daemon of this machine, for a container of "
                        f"this machine's engine; engine {engine.given} is not one")


def emulation(session: Session, card: str, target: str, engine: Engine) -> cards.Emulation:
    """`--card`: the card emulated on this machine's GPU, or a one-line refusal of why it cannot be."""
    check_card(session, card, target, engine)
    try:
        gpus = list_gpus()
    except NvmlUnavailable as exc:
        raise EnvironmentProblem(f"--card {card}: no GPU to emulate it on: {exc}") from None
    if not gpus:
        raise EnvironmentProblem(f"--card {card}: NVML lists no GPU here")
    return cards.plan(session.matrix, card, gpus[0])


def require_gpu(session: Session, target: str, engine: Engine, what: str) -> None:
    """A GPU target on an engine that cannot give it a GPU ends here, in one line, before anything starts."""
    if not session.matrix.targets[target].gpu:
        return
    problem = engine.gpu_problem()
    if problem:
        others = [name for name, t in session.matrix.targets.items() if not t.gpu]
        raise EnvironmentProblem(f"{what} needs a GPU (target {target}), and engine {engine.given}: {problem}"
                                 + (f"; or use --target {others[0]}" if others else ""))
