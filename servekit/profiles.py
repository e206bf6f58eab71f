"""Resolve each profile's knobs for a target and host, in one documented order of precedence.

host knobs < host component knobs < profile knobs < profile's host knobs < target knobs <
profile's target knobs < the environment at launch (applied by the launcher).
"""

from __future__ import annotations

from .matrix import Matrix


def resolve_knobs(matrix: Matrix, profile: str, target: str, host: str) -> dict[str, str]:
    prof, spec, hst = matrix.profiles[profile], matrix.targets[target], matrix.hosts[host]
    knobs: dict[str, str] = dict(hst.knobs)
    for component in prof.components:
        knobs.update(hst.component_knobs.get(component, {}))
    knobs.update(prof.knobs)
    knobs.update(prof.hosts.get(host, {}))
    knobs.update(spec.knobs)
    override = prof.targets.get(target)
    knobs.update(override.knobs if override else {})
    return knobs


def render_profiles(matrix: Matrix, target: str) -> dict:
    """What the launcher inside the image reads: every profile of the target, resolved per host."""
    spec = matrix.targets[target]
    model = matrix.models[spec.model]
    return {
        "target": target,
        "model": {"served_name": model.served_name, "source": model.source, "repo": model.repo,
                  "revision": model.revision, "path": f"/app/models/{spec.model}",
                  "baked": "/opt/models/demo" if model.source == "generated" else None,
                  "drafters": {name: {"repo": d.repo, "revision": d.revision,
                                      "path": f"/app/models/{spec.model}-{name}"} for name, d in model.drafters.items()}},
        "env": spec.env,
        "hosts": {name: {"env": h.env} for name, h in matrix.hosts.items()},
        "profiles": {name: {host: resolve_knobs(matrix, name, target, host) for host in matrix.hosts}
                     for name, p in matrix.profiles.items() if target in p.targets},
        "without_key": [name for name, p in matrix.profiles.items() if target in p.targets and p.auth == "none"],
        "needs": {name: p.components for name, p in matrix.profiles.items() if target in p.targets and p.components},
    }
