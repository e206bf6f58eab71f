"""Resolve each profile's knobs for a target and host, in one documented order of precedence.

host knobs < host component knobs < profile knobs < profile's host knobs < target knobs <
profile's target knobs < the environment at launch (applied by the launcher).
"""

from __future__ import annotations

from servekit.config.matrix import Matrix
from servekit.image.launcher import KnobError, build_command
from servekit.layout import MODELS_MOUNT

HOST_LAYERS = ("host", "host, component", "profile, host")  # the layers a host brings (docs/profiles.md shows them)


def layers(matrix: Matrix, profile: str, host: str, target: str | None = None) -> list[tuple[str, dict[str, str]]]:
    """The knob tables that apply to `profile` on `host` (and `target`, when given), lowest precedence first, each
    named: the one order every reader of knobs uses."""
    prof, hst = matrix.profiles[profile], matrix.hosts[host]
    components: dict[str, str] = {}
    for component in prof.components:
        components.update(hst.component_knobs.get(component, {}))
    out = [("host", dict(hst.knobs)), ("host, component", components), ("profile", dict(prof.knobs)),
           ("profile, host", dict(prof.hosts.get(host, {})))]
    if target is not None:
        override = prof.targets.get(target)
        out += [("target", dict(matrix.targets[target].knobs)),
                ("profile, target", dict(override.knobs) if override else {})]
    return out


def resolve_knobs(matrix: Matrix, profile: str, target: str, host: str) -> dict[str, str]:
    knobs: dict[str, str] = {}
    for _, table in layers(matrix, profile, host, target):
        knobs.update(table)
    return knobs


def _source_path(folder: str | None) -> str | None:
    """Where the source repository's models folder, mounted as the models volume (MODELS_DIR), holds a part."""
    return f"{MODELS_MOUNT}/{folder}" if folder else None


def render_profiles(matrix: Matrix, target: str) -> dict:
    """What the launcher inside the image reads: every profile of the target, resolved per host."""
    spec = matrix.targets[target]
    model = matrix.models[spec.model]
    return {
        "target": target,
        "model": {"served_name": model.served_name, "source": model.source, "repo": model.repo,
                  "revision": model.revision, "path": f"{MODELS_MOUNT}/{spec.model}",
                  "source_path": _source_path(model.source_folder),
                  "baked": "/opt/models/demo" if model.source == "generated" else None,
                  "drafters": {name: {"repo": d.repo, "revision": d.revision,
                                      "path": f"{MODELS_MOUNT}/{spec.model}-{name}",
                                      "source_path": _source_path(d.source_folder)}
                               for name, d in model.drafters.items()}},
        "env": spec.env,
        "hosts": {name: {"env": h.env, "batch": h.batch} for name, h in matrix.hosts.items()},
        "profiles": {name: {host: resolve_knobs(matrix, name, target, host) for host in matrix.hosts}
                     for name, p in matrix.profiles.items() if target in p.targets},
        "without_key": [name for name, p in matrix.profiles.items() if target in p.targets and p.auth == "none"],
        "needs": {name: p.components for name, p in matrix.profiles.items() if target in p.targets and p.components},
    }


def refusal(matrix: Matrix, target: str, profiles: list[str] | None = None,
            knobs: dict[str, str] | None = None) -> tuple[str, str, str] | None:
    """(profile, host, why) for the first of `profiles` (every one `target` serves when None) that the launcher inside
    the image would refuse to start on a host (with `knobs` set in its environment), or None: the launcher's own
    code decides, so the matrix, `--knob` and a boot agree."""
    rendered = render_profiles(matrix, target)
    for profile in profiles if profiles is not None else list(rendered["profiles"]):
        for host in matrix.hosts:
            try:
                build_command(rendered, profile, host, dict(knobs or {}))
            except KnobError as exc:
                return profile, host, str(exc)
    return None
