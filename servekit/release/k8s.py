"""Kubernetes manifests for one profile: what the compose service does, in Kubernetes' terms.

A Deployment (the image by digest where a release recorded one, GPU limits on the cuda target,
startup/readiness/liveness probes on the keyless /health, resource requests, the knobs as
environment, the API key from a Secret, the prepare init container's Hugging Face token from an
optional one), a Service, and a PersistentVolumeClaim per volume. Neither secret is ever written into
a manifest: each Secret is created from its file.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from servekit.build.plan import TargetPlan, plan_for
from servekit.config.matrix import Matrix
from servekit.config.profiles import resolve_knobs
from servekit.config.session import Session
from servekit.engines import choice
from servekit.errors import CheckFailed, UserError
from servekit.image.boundary import write_text_atomic
from servekit.image.launcher import CONTAINER_PORT, HOST_KIND_ENV
from servekit.layout import CACHE_MOUNT, IMAGE_UID, MODELS_MOUNT
from servekit.records.releases import released
from servekit.release.naming import registry_path, released_reference

PORT = CONTAINER_PORT
PROBE_PERIOD_S = 10


def image_reference(matrix: Matrix, plan: TargetPlan, root: Path) -> tuple[str, str]:
    """(reference, how it was chosen): the released digest when this build was released, else the tag `release`
    will push to the registry (a node pulls from a registry, never a tag that exists only here)."""
    record = released(root, matrix, plan.target, plan.digest)
    if record:
        return f"{record.repository}@{record.registry_digest}", f"by digest, from releases/v{matrix.vllm}.json"
    return released_reference(matrix, plan), (
        f"by tag at {registry_path(matrix)}: this build is not released yet, so a node cannot pull it until "
        "`python3 build.py release` pushes it (then render again for the digest)")


def render(matrix: Matrix, profile: str, target: str, host: str, image: str) -> list[dict]:
    name = f"servekit-{profile}"
    labels = {"app.kubernetes.io/name": "servekit", "app.kubernetes.io/instance": name,
              "servekit/profile": profile, "servekit/target": target}
    spec = matrix.targets[target]
    knobs = resolve_knobs(matrix, profile, target, host)
    env = [{"name": HOST_KIND_ENV, "value": host}, {"name": "API_KEY_FILE", "value": "/run/secrets/api_key"}]
    env += [{"name": k, "value": str(v)} for k, v in sorted(knobs.items())]
    env += [{"name": k, "value": v} for k, v in sorted(matrix.hosts[host].env.items())]
    resources: dict = {"requests": {"cpu": "2", "memory": "8Gi" if not spec.gpu else "32Gi"}}
    if spec.gpu:
        resources["limits"] = {"nvidia.com/gpu": 1}
    probe = {"httpGet": {"path": "/health", "port": PORT}, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 5}
    startup_failures = -(-matrix.serve.boot_timeout_s // PROBE_PERIOD_S)  # covers a whole model load
    volumes = [("models", MODELS_MOUNT, "100Gi" if spec.gpu else "1Gi"), ("cache", CACHE_MOUNT, "20Gi")]
    container = {
        "name": "vllm", "image": image, "args": ["serve", profile], "env": env,
        "ports": [{"name": "http", "containerPort": PORT}],
        "resources": resources,
        "startupProbe": {**probe, "failureThreshold": startup_failures},
        "readinessProbe": {**probe, "failureThreshold": 3},
        "livenessProbe": {**probe, "failureThreshold": 3},
        "securityContext": {"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID,
                            "allowPrivilegeEscalation": False},
        "volumeMounts": [{"name": v, "mountPath": path} for v, path, _ in volumes] +
                        [{"name": "api-key", "mountPath": "/run/secrets/api_key", "subPath": "api_key",
                          "readOnly": True}, {"name": "shm", "mountPath": "/dev/shm"}],
    }
    prepare = {"name": "prepare", "image": image, "args": ["prepare"],  # a gated model's token from its own Secret
               "env": [{"name": "HF_TOKEN_FILE", "value": "/run/secrets/hf_token"}],
               "securityContext": dict(container["securityContext"]),
               "volumeMounts": [{"name": v, "mountPath": path} for v, path, _ in volumes] +
                               [{"name": "hf-token", "mountPath": "/run/secrets/hf_token", "subPath": "hf_token",
                                 "readOnly": True}]}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1, "strategy": {"type": "Recreate"},  # one GPU, one model load at a time
            "selector": {"matchLabels": {"app.kubernetes.io/instance": name}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "securityContext": {"fsGroup": IMAGE_UID},
                    "initContainers": [prepare],  # as compose's prepare service
                    "containers": [container],
                    "volumes": [{"name": v, "persistentVolumeClaim": {"claimName": f"{name}-{v}"}}
                                for v, _, _ in volumes] +
                               [{"name": "api-key", "secret": {"secretName": "servekit-api-key",
                                                               "items": [{"key": "api-key", "path": "api_key"}]}},
                                # optional: a public model needs no token, and prepare runs without one
                                {"name": "hf-token", "secret": {"secretName": "servekit-hf-token", "optional": True,
                                                                "items": [{"key": "token", "path": "hf_token"}]}},
                                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}],
                },
            },
        },
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"type": "ClusterIP", "selector": {"app.kubernetes.io/instance": name},
                        "ports": [{"name": "http", "port": PORT, "targetPort": "http"}]}}
    claims = [{"apiVersion": "v1", "kind": "PersistentVolumeClaim",
               "metadata": {"name": f"{name}-{v}", "labels": labels},
               "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}}
              for v, _, size in volumes]
    return [deployment, service, *claims]


def to_yaml(doc: dict) -> str:
    """The manifest as YAML a person reads and kubectl applies: every value written out, no anchors (`&id001`)."""

    class Written(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:
            return True
    return yaml.dump(doc, Dumper=Written, sort_keys=False)


def write(docs: list[dict], out: Path) -> list[Path]:
    paths = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for doc in docs:
            path = out / f"{doc['kind'].lower()}-{doc['metadata']['name']}.yaml"
            write_text_atomic(path, to_yaml(doc))
            paths.append(path)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write the manifests there ({exc.strerror}); name a folder of yours") \
            from None
    return paths


def validate(docs: list[dict], version: str = "1.31") -> list[str]:
    """Problems found by the Kubernetes schemas (offline, kubernetes-validate), strict about unknown fields."""
    import kubernetes_validate  # the Kubernetes schemas, loaded only by `render k8s` and --kube-version
    problems = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at "
                            f"{'.'.join(str(p) for p in exc.path)}")
    return problems


def render_profile(session: Session, profile: str, out: Path, target: str | None = None, host: str = "native",
                   kube_version: str = "1.31") -> tuple[list[Path], str]:
    """`render k8s`: the manifests for one profile, validated before anything is written; (paths, how the image
    is referenced)."""
    matrix = session.matrix
    target = choice.profile_target(session, profile, target)
    if host not in matrix.hosts:
        raise UserError(f"--host {host}: expected one of {', '.join(matrix.hosts)}")
    image, how = image_reference(matrix, plan_for(session, target), session.root)
    docs = render(matrix, profile, target, host, image)
    problems = validate(docs, kube_version)
    if problems:
        raise CheckFailed("the rendered manifests do not validate: " + "; ".join(problems))
    return write(docs, out), how
