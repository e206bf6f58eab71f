"""Kubernetes manifests: every profile validates against the schemas, and matches its compose service."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import yaml
from support import ROOT, compose_dir, run_build_py

from servekit.config.load import load_matrix
from servekit.config.profiles import resolve_knobs
from servekit.layout import IMAGE_UID
from servekit.release import k8s

MATRIX = load_matrix(ROOT / "images.yaml")
CASES = [(p, t, h) for p, spec in MATRIX.profiles.items() for t in spec.targets for h in MATRIX.hosts]


@pytest.mark.parametrize("profile,target,host", CASES, ids=[f"{p}-{t}-{h}" for p, t, h in CASES])
def test_every_profile_validates_and_carries_its_knobs(profile, target, host):
    docs = k8s.render(MATRIX, profile, target, host, "127.0.0.1:5000/serve/vllm-serve@sha256:" + "a" * 64)
    assert k8s.validate(docs) == []
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert {k: env[k] for k in resolve_knobs(MATRIX, profile, target, host)} == resolve_knobs(MATRIX, profile, target,
                                                                                               host)
    assert container["args"] == ["serve", profile] and env["SERVEKIT_HOST"] == host
    assert ("nvidia.com/gpu" in container["resources"].get("limits", {})) is MATRIX.targets[target].gpu
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": 8000}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= MATRIX.serve.boot_timeout_s
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "PersistentVolumeClaim"}
    assert "sk-" not in json.dumps(docs)  # the key comes from a Secret, never a manifest


def test_the_written_manifests_carry_no_anchors_and_read_back_the_same(tmp_path):
    """kubectl users read these: every value written out (the init container shares the server's security context,
    which PyYAML would otherwise write as &id001 and *id001)."""
    docs = k8s.render(MATRIX, "default", "cuda", "native", "x")
    for path in k8s.write(docs, tmp_path):
        text = path.read_text()
        assert not re.search(r"[&*]id\d+", text), text
    deployment = yaml.safe_load((tmp_path / "deployment-servekit-default.yaml").read_text())
    assert deployment == docs[0]


def test_the_prepare_init_container_reads_the_token_from_an_optional_secret():
    pod = k8s.render(MATRIX, "default", "cuda", "native", "x")[0]["spec"]["template"]["spec"]
    [prepare] = pod["initContainers"]
    assert {"name": "HF_TOKEN_FILE", "value": "/run/secrets/hf_token"} in prepare["env"]
    token = next(v for v in pod["volumes"] if v["name"] == "hf-token")
    assert token["secret"]["secretName"] == "servekit-hf-token" and token["secret"]["optional"] is True
    assert any(m["name"] == "hf-token" for m in prepare["volumeMounts"])


def test_before_a_release_the_image_is_named_as_release_will_push_it(tmp_path, monkeypatch):
    from servekit.build.plan import plan_targets
    from servekit.release.naming import release_tags
    plan = plan_targets(MATRIX, ROOT, ["cpu"])[0]
    monkeypatch.delenv("SERVEKIT_REGISTRY", raising=False)
    reference, how = k8s.image_reference(MATRIX, plan, tmp_path)  # no releases/ there
    pushed = release_tags(MATRIX, plan)[0]  # the immutable tag: v<vllm>-<target>-<digest12>
    assert pushed == f"v0.31.0-cpu-{plan.digest[:12]}"
    assert reference == f"{MATRIX.release.registry}/vllm-serve:{pushed}" and "not released yet" in how
    monkeypatch.setenv("SERVEKIT_REGISTRY", "registry.example:5000/team/")
    assert k8s.image_reference(MATRIX, plan, tmp_path)[0] == f"registry.example:5000/team/vllm-serve:{pushed}"


def test_a_broken_manifest_is_caught():
    docs = k8s.render(MATRIX, "default", "cpu", "native", "x")
    docs[0]["spec"]["template"]["spec"]["containers"][0]["portz"] = []
    assert k8s.validate(docs) and "portz" in k8s.validate(docs)[0]


@pytest.mark.engine
def test_manifests_match_the_compose_service(tmp_path):
    env = dict(os.environ, SERVEKIT_IMAGE="x", SERVEKIT_API_KEY_FILE=str(tmp_path / "k"),
               SERVEKIT_HF_TOKEN_FILE=str(tmp_path / "t"), COMPOSE_FILE="")
    (tmp_path / "k").write_text("k")
    (tmp_path / "t").write_text("")
    compose = json.loads(subprocess.run(
        ["docker", "compose", "--project-directory", str(compose_dir()), "-f", str(compose_dir() / "compose.yaml"),
         "--profile", "*", "config", "--format", "json"], env=env, capture_output=True, text=True, check=True).stdout)
    for profile in ("default", "batch", "alternative"):
        service = compose["services"][profile]
        container = k8s.render(MATRIX, profile, "cuda", "native", "x")[0]["spec"]["template"]["spec"]["containers"][0]
        assert container["args"] == service["command"]
        assert service["healthcheck"]["test"][-1].find(f"127.0.0.1:{k8s.PORT}/health") > 0
        assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert service["user"] == f"{IMAGE_UID}:{IMAGE_UID}" and container["securityContext"]["runAsUser"] == IMAGE_UID


def test_render_command_writes_valid_files(tmp_path):
    result = run_build_py("render", "k8s", "--profile", "alternative", "--target", "cuda", "--host", "wsl2",
                          "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "deployment-servekit-alternative.yaml" in files and "service-servekit-alternative.yaml" in files
    deployment = yaml.safe_load((tmp_path / "deployment-servekit-alternative.yaml").read_text())
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MAX_LEN"] == "160000" and env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    assert "kubectl create secret" in result.stderr
