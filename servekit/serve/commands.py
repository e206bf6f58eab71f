"""The commands that compose a boot, its checks and its report: `up`, `run` and `smoke`."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from servekit import engines
from servekit.config.session import Session
from servekit.config.userenv import unread_names
from servekit.engines import Engine, choice, transfer
from servekit.errors import UserError
from servekit.image.boundary import Missing, Refused, read_secret
from servekit.image.launcher import HOST_KIND_ENV
from servekit.output import Say, as_output
from servekit.records.models import RunReport
from servekit.records.releases import released
from servekit.records.report import write_report
from servekit.serve import deploy
from servekit.serve.boot import boot
from servekit.serve.checks import checks_to_run, not_required_results, smoke
from servekit.serve.pipeline import run_profiles
from servekit.serve.ready import deployment, ready_to_serve
from servekit.serve.watch import READY
from servekit.smoke import Context, Result


@dataclass(frozen=True)
class Up:
    """What `up` started: where it serves, its key's file, the name it serves under, what it runs with, and how its
    boot went (timings, the first GPU's memory, WSL2's Shared Usage)."""

    profile: str
    target: str
    host: str
    engine: str
    image: str
    url: str
    api_key_file: str
    served_name: str
    knobs: dict[str, str]
    container: str
    time_to_healthy_s: float | None
    kv_pool_tokens: int | None
    detection_lag_s: float | None
    phases: list
    gpu: dict | None
    shared_usage: dict | None

    def to_json(self) -> dict:
        return asdict(self)


def up_profile(session: Session, profile: str, target: str | None = None, host: str | None = "auto", engine: Engine | None = None,
               port: int | None = None, timeout_s: float | None = None, say: Say = print,
               knobs: dict[str, str] | None = None, card: str | None = None) -> Up:
    """Start `profile` (with `knobs` over its own) and watch it to healthy; what it became (URL, key file, served
    name, the knobs it runs with, timings, memory). Raises BootFailed when it did not come up (it is taken down)."""
    engine = engine or engines.resolve(None)
    ready = ready_to_serve(session, [engine], "up", [profile], target=target, host=host, port=port,
                           knob_sets=[knobs] if knobs else None, card=card, build=False)
    target, dep = ready.target, ready.deployments[0]
    arrived = transfer.ensure_image(engine, dep.image, say=lambda line: say(f"up: {line}"))
    deploy.check_bind(dep.bind, say)
    settings = engine.settings_file(dep)
    if settings and (unread := unread_names(settings)):
        say(f"up: note: {', '.join(unread)} in {settings.name} reach nothing: neither knobs nor settings that "
            "Compose or servekit read (compose/.env.example lists those); to hand one to the server, name it under "
            "`environment:` in compose/compose.override.yaml")
    where = "" if engine.is_local else f" on engine {engine.given} (image {arrived})"
    say(f"up: {profile} on {target} ({dep.host}){where}, {dep.image}")
    if dep.card:
        say(f"up: {dep.card.said()}")
    with engines.reach(engine, dep.bind, dep.port) as url:
        booted = boot(replace(dep, reached_at=url), profile, timeout_s or session.matrix.serve.boot_timeout_s,
                      say=say, knobs=knobs)
    booted.stop_samplers()  # `up` ends at healthy; `run` keeps them going through the traffic
    server = booted.server
    assert server is not None, "a boot returns with its server"
    record, memory = booted.record, booted.memory()
    shared = memory["shared_usage"]
    return Up(profile=profile, target=target, host=dep.host, engine=engine.given, image=dep.image,
              url=engines.address(engine, dep.bind, dep.port), api_key_file=str(ready.key_file),
              served_name=session.matrix.models[session.matrix.targets[target].model].served_name,
              knobs=deploy.knobs_of(server.state()),
              container=server.name, time_to_healthy_s=record.time_to_healthy_s,
              kv_pool_tokens=record.kv_pool_tokens, detection_lag_s=record.detection_lag_s,
              phases=memory["phases"], gpu=memory["gpus"][0] if memory["gpus"] else None,
              shared_usage={k: v for k, v in shared.items() if k != "series"} if shared else None)


def run(session: Session, target: str | None = None, profiles: list[str] | None = None, host: str | None = "auto",
        engine: Engine | None = None, port: int | None = None, say: Say = print, knobs: dict[str, str] | None = None,
        only: list[str] | None = None, boot_timeout_s: float | None = None,
        card: str | None = None) -> list[tuple[RunReport, Path]]:
    """image, up, smoke, down and a report for each profile on one engine: (report, its folder) per profile.
    `knobs` are set for every boot (and recorded); `only` runs those checks instead of each profile's own;
    `boot_timeout_s` bounds each boot (a failed boot still gets its report)."""
    engine = engine or engines.resolve(None)
    ready = ready_to_serve(session, [engine], "run", profiles,
                           target=target, host=host, port=port, knob_sets=[knobs] if knobs else None, card=card,
                           checks=only, say=as_output(say).child("run: "))
    plan, dep = ready.plan, ready.deployments[0]
    assert plan is not None, "run builds"
    if dep.card:
        say(f"run: {dep.card.said()}")
    return run_profiles(session.matrix, dep, ready.profiles, ready.key_file, say=say, knobs=knobs, only=only,
                        boot_timeout_s=boot_timeout_s,
                        release=released(session.root, session.matrix, ready.target, plan.digest),
                        write=lambda report, series: write_report(session.root / "reports" / report.run_id,
                                                                  report, series))


def smoke_running(session: Session, profile: str, target: str | None = None, engine: Engine | None = None, url: str | None = None,
                  api_key_file: Path | None = None,
                  on_result: Callable[[Result], None] | None = None, only: list[str] | None = None,
                  timeout_s: float | None = None, card: str | None = None) -> tuple[str, list]:
    """The profile's checks (or `only` those) against a server already running: its container on `engine`, or
    `url`; `timeout_s` bounds each check (every request of it, and each wait between bytes)."""


    if url and engine:
        raise UserError("--url and --engine: name the server one way (--engine finds it on that engine)")
    if url and card:
        raise UserError("--card and --url: the card is read from the server's container; name it by --engine")
    engine = engine or engines.resolve(None)
    matrix = session.matrix
    target = choice.target(session, target, engine)
    if profile not in matrix.profiles:
        raise UserError(f"profile {profile!r}: expected one of {', '.join(matrix.profiles)}")
    checks_to_run(matrix, profile, target, only)  # a misspelt --check ends here, before any request
    dep = deployment(session, target, engine, "native")
    key_path = api_key_file or dep.api_key_file
    try:
        api_key = read_secret(key_path)
    except Missing:
        raise UserError(f"no API key file at {key_path}: pass --api-key-file") from None
    except Refused as exc:
        raise UserError(f"--api-key-file {exc}; expected the file holding the server's key") from None
    logs, environ, port, healthy_line, host = None, None, dep.port, 0, "native"
    if not url:  # a profile on an engine: its log and environment are readable, so the log checks can run
        engine.check()
        server = deploy.find_server(profile, engine)
        if server is None:
            raise UserError(f"{profile} is not running on engine {engine.given}: start it with `python3 build.py up "
                            f"{profile}" + ("" if engine.is_local else f" --engine {engine.given}") + "`")
        logs = lambda: server.log().splitlines()  # noqa: E731
        environ = server.environ
        state = server.state()
        running_on = state.env.get("SERVEKIT_CARD")  # compose.card.yaml sets it on an emulated card's server
        if card and running_on != card:
            raise UserError(f"--card {card}: {profile} runs " + (f"on card {running_on}" if running_on else
                            "on the GPU as it is") + f"; start it with `python3 build.py up {profile} --card {card}`")
        port = state.port or port
        host = state.env.get(HOST_KIND_ENV) or host  # its host's checks (a WSL2 server gets spill, which smoke cannot judge)
        # compiles while booting are expected; the log checks judge what came after the server was ready
        healthy_line = next((i + 1 for i, line in enumerate(logs()) if READY.search(line)), 0)
    with (nullcontext(url) if url else engines.reach(engine, dep.bind, port)) as base_url:
        ctx = Context(base_url.rstrip("/"), api_key, matrix.models[matrix.targets[target].model].served_name,
                      gpu=matrix.targets[target].gpu, logs=logs, environ=environ, healthy_line=healthy_line)
        if timeout_s:  # --timeout: the bound of every check; a wait between bytes ends a second after it, so that
            # the deadline, never a read timeout racing it, names a check that got no answer
            ctx = replace(ctx, check_deadline_s=timeout_s, timeout_s=timeout_s + 1, deadline_scales=False)
        results = smoke(ctx, checks_to_run(matrix, profile, target, only, host), on_result=on_result)
        for result in not_required_results(matrix, profile, target, only):
            results.append(result)
            if on_result:
                on_result(result)
        return ctx.url, results
