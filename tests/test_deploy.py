"""Deploy and watch: compose files, the prepare step, the boot watcher, and real boots of the cpu image."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml
from support import (
    LAUNCHER,
    ROOT,
    TEST_PORT,
    TEST_PROJECT,
    compose_dir,
    ctrl_c_reaches_it,
    follow_logs,
    project_containers,
    run_build_py,
    serving,
    tracked_copy,
    work_dir,
)

from servekit.config.load import load_matrix
from servekit.engines.failures import classify
from servekit.image.prepare import COMPLETE, is_complete, prepare
from servekit.layout import IMAGE_UID, PROFILE_LABEL, PROJECT_LABEL
from servekit.serve.watch import BootRecord, LogFollower, without_frames

PROFILES = ["default", "batch", "alternative", "mtp", "mtp-long", "dflash2", "dflash2-k15", "huge"]


# --- the watcher's reading of vLLM's log (no engine) -------------------------------------------

@pytest.mark.parametrize("line,reason", [
    ("(VllmWorker-0 pid=37) ERROR 11-29 09:01:46 [multiproc_executor.py:948] ValueError: Available memory", "error"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB", "out of memory"),
    ("ValueError: No available memory for the cache blocks. Try increasing", "out of memory (no room for the KV cache)"),
    ("(EngineCore pid=25) ERROR 11-29 09:01:47 [core.py:1433] EngineCore failed to start.", "EngineCore failed to start"),
    ("RuntimeError: UVA is not available", "UVA is not available (WSL2: pinned memory is off)"),
    ("RuntimeError: CUDA error: device not ready", "device not ready (WSL2: expandable_segments must be off)"),
    ("launcher: refusing to start: PREFIX_CACHE='maybe': expected one of", "launcher refused"),
    ("Traceback (most recent call last):", "traceback"),
])
def test_failure_lines_are_classified(line, reason):
    assert (classify(line) or (None,))[0] == reason


@pytest.mark.parametrize("line", [
    "(APIServer pid=1) WARNING 11-29 09:08:17 [system_utils.py:249] failed with error OSError: [Errno 24] Too many",
    "(APIServer pid=1) INFO 11-29 09:02:33 [kv_cache_utils.py:2464] CPU KV cache size: 1,247,360 tokens",
    "INFO:     Application startup complete.",
])
def test_ordinary_lines_are_not_failures(line):
    assert classify(line) is None


def test_the_follower_records_pool_readiness_and_the_error_with_its_detail():
    record = BootRecord(started=time.time())
    follower = LogFollower(server=None, record=record)
    for line in ["2026-11-29T09:02:33.123456789Z (EngineCore pid=25) INFO [x] GPU KV cache size: 88,666 tokens",
                 "2026-11-29T09:02:40.500000000Z INFO:     Application startup complete.",
                 "2026-11-29T09:02:41.0Z Traceback (most recent call last):",
                 '2026-11-29T09:02:41.0Z   File "/x.py", line 3, in <module>',
                 "2026-11-29T09:02:41.0Z     raise ValueError(msg)",
                 "2026-11-29T09:02:41.0Z pydantic_core._pydantic_core.ValidationError: 1 validation error",
                 "2026-11-29T09:02:41.0Z   Value error, max_model_len (100000) is greater than 2048"]:
        follower.feed(line)
    assert record.kv_pool_tokens == 88666
    assert record.ready_logged_at is not None and abs(record.ready_logged_at - 1795942960.5) < 1e-3
    assert follower.failure is not None
    reason, text = follower.failure
    assert reason == "error" and "1 validation error" in text and "max_model_len (100000)" in text


@pytest.mark.parametrize("status, restarts", [("exited", 0), ("restarting", 0), ("running", 1)])
def test_an_exit_during_a_boot_fails_it_even_when_the_engine_restarts_the_server(status, restarts):
    """compose.yaml asks for restart: unless-stopped (as the source's did); a boot still ends at the first exit."""
    from servekit.engines import ServerState
    from servekit.errors import BootFailed
    from servekit.serve.watch import StillRunning
    state = ServerState(name="s", profile="default", status=status, running=status == "running", exit_code=2,
                        restarts=restarts, started_at="", health=None, image="x", env={}, port=None)
    follower = LogFollower(server=None, record=BootRecord(started=time.time()))
    follower.ended.set()
    with pytest.raises(BootFailed, match="exited with code 2"):
        StillRunning(lambda: state, follower, lambda: []).poll()


def test_frames_are_dropped_from_the_quoted_tail():
    lines = ["Traceback (most recent call last):", '  File "/a.py", line 1, in f', "    f()", "    ^^^",
             "ValueError: bad", "  Value error, detail"]
    assert without_frames(lines) == ["ValueError: bad", "  Value error, detail"]


# --- the prepare step (no engine) ----------------------------------------------------------------

def _generated(tmp_path, name: str, text: str) -> dict:
    """A generated model baked into tmp_path/baked with one file, to be prepared into tmp_path/models/demo."""
    baked = tmp_path / "baked"
    baked.mkdir(exist_ok=True)
    (baked / name).write_text(text)
    return {"source": "generated", "path": str(tmp_path / "models/demo"), "baked": str(baked)}


def test_prepare_copies_the_generated_model_once_and_marks_it(tmp_path):
    model = _generated(tmp_path, "config.json", "{}")
    prepare(model, say=lambda s: None)
    assert (tmp_path / "models/demo/config.json").is_file() and (tmp_path / "models/demo" / COMPLETE).is_file()
    said: list[str] = []
    prepare(model, say=said.append)
    assert said == [f"prepare: {tmp_path / 'models/demo'} is complete"]


def test_a_volume_holding_an_older_model_gets_the_images_one(tmp_path):
    model = _generated(tmp_path, "model.safetensors", "trained 400 steps")
    prepare(model, say=lambda s: None)
    _generated(tmp_path, "model.safetensors", "trained 900 steps")  # a newer image bakes another model
    assert not is_complete(model)
    said: list[str] = []
    prepare(model, say=said.append)
    assert "holds another model" in said[0] and is_complete(model)
    assert (tmp_path / "models/demo/model.safetensors").read_text() == "trained 900 steps"


def test_a_half_prepared_model_is_redone_and_never_served(tmp_path):
    baked = tmp_path / "baked"
    baked.mkdir()
    (baked / "weights").write_text("whole")
    dest = tmp_path / "models/demo"
    dest.mkdir(parents=True)
    (dest / "weights").write_text("half")  # a copy that stopped: no completion marker
    profiles = tmp_path / "profiles.json"
    from servekit.config.load import load_matrix
    from servekit.config.profiles import render_profiles
    rendered = render_profiles(load_matrix(ROOT / "images.yaml"), "cpu")
    rendered["model"].update(path=str(dest), baked=str(baked))
    profiles.write_text(json.dumps(rendered))
    key = tmp_path / "key"
    key.write_text("sk-a-key-long-enough-to-serve\n")
    env = {"SERVEKIT_PROFILES": str(profiles), "PATH": os.environ["PATH"], "API_KEY_FILE": str(key)}
    refused = subprocess.run([*LAUNCHER, "serve", "default"], env=env,
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "missing or incomplete" in refused.stderr
    done = subprocess.run([*LAUNCHER, "prepare"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (dest / "weights").read_text() == "whole" and (dest / COMPLETE).is_file()


def test_a_key_that_is_empty_short_or_a_link_is_made_again_and_the_link_target_left_alone(tmp_path):
    from servekit.engines.deployment import Deployment
    from servekit.image.launcher import MIN_KEY_CHARS
    from servekit.serve.deploy import ensure_secrets
    dep = Deployment(tmp_path, "cpu", "native", "x", "127.0.0.1", 18000)
    key = dep.api_key_file
    key.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("not a key\n")
    for setup in (lambda: key.write_text(""), lambda: key.write_text("short\n"), lambda: key.symlink_to(elsewhere)):
        key.unlink(missing_ok=True)
        setup()
        ensure_secrets(dep)
        assert not key.is_symlink() and len(key.read_text().strip()) >= MIN_KEY_CHARS
        assert key.stat().st_mode & 0o777 == 0o600
    assert elsewhere.read_text() == "not a key\n"
    kept = key.read_text()
    ensure_secrets(dep)  # a good key stays
    assert key.read_text() == kept


# --- compose files (engine's compose, no containers) --------------------------------------------

@pytest.fixture
def compose_env(tmp_path):
    key, token = tmp_path / "api_key", tmp_path / "hf_token"
    key.write_text("sk-test\n")
    token.write_text("")
    return dict(os.environ, SERVEKIT_IMAGE="vllm-serve:test", SERVEKIT_API_KEY_FILE=str(key),
                SERVEKIT_HF_TOKEN_FILE=str(token), COMPOSE_FILE="")


def _config(env, files: list[str], service: str) -> dict:
    cmd = ["docker", "compose", "--project-directory", str(compose_dir())]
    for f in files:
        cmd += ["-f", str(compose_dir() / f)]
    done = subprocess.run([*cmd, "--profile", "*", "config", "--format", "json"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["services"][service]


@pytest.mark.engine
@pytest.mark.parametrize("overrides", [[], ["compose.cpu.yaml"], ["compose.wsl2.yaml"],
                                       ["compose.cpu.yaml", "compose.wsl2.yaml"]])
def test_every_combination_passes_compose_config(compose_env, overrides):
    for profile in PROFILES if "compose.cpu.yaml" not in overrides else ["default"]:
        service = _config(compose_env, ["compose.yaml", *overrides], profile)
        assert service["command"] == ["serve", profile]
        assert [p["host_ip"] for p in service["ports"]] == ["127.0.0.1"]
        assert service["user"] == f"{IMAGE_UID}:{IMAGE_UID}"
        assert service["depends_on"]["prepare"]["condition"] == "service_completed_successfully"
        assert service["healthcheck"]["test"][-1].endswith("urlopen('http://127.0.0.1:8000/health', timeout=4)")
        leaked = {k: v for k, v in service["environment"].items() if k != "SERVEKIT_HOST"}
        assert "SERVEKIT" not in json.dumps(leaked)  # no secret or host path leaks in (the host's kind is meant to)
        # unset, the launcher tells a WSL2 kernel itself (test_launcher); the overrides name it
        assert service["environment"].get("SERVEKIT_HOST") == ("wsl2" if "compose.wsl2.yaml" in overrides else None)
        gpu = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        assert bool(gpu) is ("compose.cpu.yaml" not in overrides)
        assert service["restart"] == "unless-stopped" and service["stop_grace_period"] == "30s"
        if gpu:
            assert gpu[0]["count"] == 1  # the source's GPU_COUNT, 1 unless set


@pytest.mark.engine
def test_without_an_image_named_compose_runs_the_release_at_the_named_registry(compose_env):
    """A pull-only user (no `image` run, so no SERVEKIT_IMAGE): each target's moving release tag, at SERVEKIT_REGISTRY
    when set, else at images.yaml's release.registry; compose/.env's SERVEKIT_IMAGE wins over both."""
    del compose_env["SERVEKIT_IMAGE"]
    compose_env.pop("SERVEKIT_REGISTRY", None)
    registry = load_matrix(ROOT / "images.yaml").release.registry
    assert _config(compose_env, ["compose.yaml"], "alternative")["image"] == f"{registry}/vllm-serve:v0.31.0-cuda"
    compose_env["SERVEKIT_REGISTRY"] = "registry.example:5000/team"
    cpu = ["compose.yaml", "compose.cpu.yaml"]
    assert _config(compose_env, cpu, "default")["image"] == "registry.example:5000/team/vllm-serve:v0.31.0-cpu"
    assert _config(compose_env, cpu, "prepare")["image"] == "registry.example:5000/team/vllm-serve:v0.31.0-cpu"
    compose_env["SERVEKIT_IMAGE"] = "vllm-serve:mine"
    assert _config(compose_env, cpu, "default")["image"] == "vllm-serve:mine"


@pytest.mark.engine
def test_knobs_pass_through_only_when_set(compose_env):
    unset = _config(compose_env, ["compose.yaml"], "alternative")["environment"]
    assert unset.get("PREFIX_CACHE") is None
    compose_env["PREFIX_CACHE"] = "0"
    assert _config(compose_env, ["compose.yaml"], "alternative")["environment"]["PREFIX_CACHE"] == "0"


def test_wsl2_env_file_selects_the_wsl2_overrides(tmp_path, monkeypatch):
    from servekit.engines.compose import write_env
    from servekit.engines.deployment import Deployment
    (tmp_path / "compose").mkdir()
    dep = Deployment(tmp_path, "cuda", "wsl2", "vllm-serve:x", "127.0.0.1", 8000)
    text = write_env(dep).read_text()
    assert "COMPOSE_FILE=compose.yaml:compose.wsl2.yaml" in text and "SERVEKIT_HOST=wsl2" in text
    assert "COMPOSE_FILE=compose.yaml:compose.cpu.yaml\n" in write_env(
        Deployment(tmp_path, "cpu", "native", "x", "127.0.0.1", 8000, overrides=("compose.cpu.yaml",))).read_text()


def test_the_env_file_names_its_path_separator_for_compose_on_windows(tmp_path):
    """Compose on Windows splits COMPOSE_FILE at ';' by default; the env file says ':' itself, so `docker compose up`
    from PowerShell reads both files. Compose takes COMPOSE_PATH_SEPARATOR from the env file: shown here by the
    Windows spelling, which Linux's Compose then follows too."""
    from servekit.engines.compose import write_env
    from servekit.engines.deployment import Deployment
    root = tracked_copy(tmp_path)
    env_file = write_env(Deployment(root, "cuda", "wsl2", "vllm-serve:x", "127.0.0.1", 8000))
    assert env_file is not None
    text = env_file.read_text()
    assert "COMPOSE_PATH_SEPARATOR=:\n" in text and "COMPOSE_FILE=compose.yaml:compose.wsl2.yaml\n" in text
    clean = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}

    def services_and_files() -> tuple[list[str], str]:
        done = subprocess.run(["docker", "compose", "--profile", "alternative", "config", "--format", "json"],
                              cwd=env_file.parent, env=clean,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        return sorted(doc["services"]), json.dumps(doc["services"]["alternative"])
    ours = services_and_files()
    assert '"SERVEKIT_HOST": "wsl2"' in ours[1]  # the WSL2 overrides are in
    env_file.write_text(text.replace("COMPOSE_PATH_SEPARATOR=:", "COMPOSE_PATH_SEPARATOR=;").replace(
        "compose.yaml:compose.wsl2.yaml", "compose.yaml;compose.wsl2.yaml"))
    assert services_and_files() == ours
    env_file.write_text(text.replace("compose.yaml:compose.wsl2.yaml", "compose.yaml;compose.wsl2.yaml"))
    done = subprocess.run(["docker", "compose", "config"], cwd=env_file.parent, env=clean, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0  # the separator really matters: ';' under ':' names one file that is not there


def test_a_users_env_lines_survive_image_and_up(tmp_path):
    """compose/.env is the user's as much as servekit's: the source's way of setting knobs (MAX_SEQS=4 there) and any
    comment stay through every rewrite; servekit's block changes with the deployment and comes last."""
    from servekit.config.userenv import ENV_END
    from servekit.engines.compose import write_env
    from servekit.engines.deployment import Deployment
    (tmp_path / "compose").mkdir()
    env_file = tmp_path / "compose" / ".env"
    mine = ["# my box", "MAX_SEQS=4", "VLLM_WSL2_ENABLE_PIN_MEMORY=1", "", "PREFIX_CACHE=0"]
    env_file.write_text("\n".join(mine) + "\n")
    write_env(Deployment(tmp_path, "cuda", "native", "vllm-serve:a", "127.0.0.1", 8000))  # as `image` does
    write_env(Deployment(tmp_path, "cuda", "wsl2", "vllm-serve:b", "127.0.0.1", 9000))  # as `up --port 9000` does
    lines = env_file.read_text().splitlines()
    assert lines[:len(mine)] == mine and lines[-1] == ENV_END
    assert "SERVEKIT_IMAGE=vllm-serve:b" in lines and "SERVEKIT_PORT=9000" in lines
    assert sum(line.startswith("SERVEKIT_IMAGE=") for line in lines) == 1


def test_what_compose_file_names_needs_is_saved_beside_it(tmp_path):
    """A later plain `docker compose ps` reads only compose/.env: every variable the named files require is there
    (MODEL_DIR for compose.model-dir.yaml, the key files), a user's compose.override.yaml is named last (so it wins),
    and a key file the user's lines name stays theirs."""
    from servekit.config.userenv import users_settings
    from servekit.engines.compose import write_env
    from servekit.engines.deployment import Deployment
    root = tracked_copy(tmp_path)
    env_file = write_env(Deployment(root, "cpu", "native", "x", "127.0.0.1", 8000, overrides=("compose.cpu.yaml",),
                                    model_dir="/srv/models/mine"))
    assert env_file is not None
    saved = {**users_settings(env_file), **dict(line.split("=", 1) for line in env_file.read_text().splitlines()
                                                if "=" in line and not line.startswith("#"))}
    assert saved["COMPOSE_FILE"] == "compose.yaml:compose.cpu.yaml:compose.model-dir.yaml"
    assert saved["MODEL_DIR"] == "/srv/models/mine" and saved["SERVEKIT_API_KEY_FILE"] == "./secrets/api_key"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SERVEKIT_")) and k != "MODEL_DIR"}
    config = subprocess.run(["docker", "compose", "config", "--format", "json"], cwd=env_file.parent, env=clean,
                            capture_output=True, text=True, timeout=60)
    assert config.returncode == 0, config.stderr  # nothing the files require is missing from the env file
    (root / "compose" / "compose.override.yaml").write_text("services:\n  default:\n    environment:\n"
                                                            "      MY_SETTING: mine\n")
    env_file.write_text("SERVEKIT_API_KEY_FILE=/etc/my-key\n")
    text = write_env(Deployment(root, "cpu", "native", "x", "127.0.0.1", 8000,
                                overrides=("compose.cpu.yaml",))).read_text()
    assert "COMPOSE_FILE=compose.yaml:compose.cpu.yaml:compose.override.yaml\n" in text and "MODEL_DIR" not in text
    assert text.count("SERVEKIT_API_KEY_FILE=") == 1 and "SERVEKIT_HF_TOKEN_FILE=./secrets/hf_token" in text
    config = subprocess.run(["docker", "compose", "config", "--format", "json"], cwd=env_file.parent, env=clean,
                            capture_output=True, text=True, timeout=60)
    assert config.returncode == 0, config.stderr
    assert json.loads(config.stdout)["services"]["default"]["environment"]["MY_SETTING"] == "mine"


@pytest.mark.parametrize("value, refused", [("models", True), ("my-models", True), ("./models", False),
                                             ("/srv/models", False), ("~/models", False), ("../models", False)])
def test_a_models_dir_that_compose_would_take_for_a_named_volume_is_refused(tmp_path, monkeypatch, value, refused):
    """MODELS_DIR=models would mount a named volume called models, not the folder the docs promise: refused with the
    spelling that is a folder (./models)."""
    from servekit.engines.compose import write_env
    from servekit.engines.deployment import Deployment
    from servekit.errors import UserError
    monkeypatch.delenv("MODELS_DIR", raising=False)
    (tmp_path / "compose").mkdir()
    (tmp_path / "compose" / ".env").write_text(f"MODELS_DIR={value}\n")
    dep = Deployment(tmp_path, "cuda", "native", "x", "127.0.0.1", 8000)
    if refused:
        with pytest.raises(UserError, match=f"MODELS_DIR='{value}' .*write ./{value} for the folder"):
            write_env(dep)
    else:
        assert write_env(dep) is not None


def test_env_lines_that_reach_nothing_are_named(tmp_path):
    """A line of the source's .env that nothing reads (a vLLM variable, a typo) is named, once, by `up`; knobs,
    the settings the Compose files read and Compose's own are not."""
    from servekit.config.userenv import unread_names
    from servekit.engines.compose import env_file, write_env
    from servekit.engines.deployment import Deployment
    (tmp_path / "compose").mkdir()
    (tmp_path / "compose" / ".env").write_text("MAX_SEQS=4\nVLLM_API_KEY=sk-0123456789abcdef0123\nHF_TOKEN=hf_x\n"
                                               "COMPOSE_PARALLEL_LIMIT=1\nVLLM_WSL2_ENABLE_PIN_MEMORY=1\nMAX_SEQ=4\n")
    dep = Deployment(tmp_path, "cuda", "native", "x", "127.0.0.1", 8000)
    write_env(dep)
    assert unread_names(env_file(dep)) == ["VLLM_WSL2_ENABLE_PIN_MEMORY", "MAX_SEQ"]


def test_an_env_file_from_before_the_block_keeps_the_users_lines_and_drops_servekits(tmp_path):
    from servekit.engines.compose import write_env
    from servekit.engines.deployment import Deployment
    (tmp_path / "compose").mkdir()
    env_file = tmp_path / "compose" / ".env"
    env_file.write_text("# Written by `python3 build.py image` / `up`; edit by hand if you like.\nSERVEKIT_IMAGE=old\n"
                        "SERVEKIT_PORT=8000\nCOMPOSE_FILE=compose.yaml\nSPEC=dflash2\n")
    write_env(Deployment(tmp_path, "cuda", "native", "vllm-serve:new", "127.0.0.1", 8000))
    text = env_file.read_text()
    assert text.startswith("SPEC=dflash2\n") and "SERVEKIT_IMAGE=old" not in text and text.count("SERVEKIT_PORT=") == 1


def test_a_knob_in_the_users_env_file_reaches_the_container(tmp_path):
    """A bare knob name in compose.yaml takes its value from the shell or the env file, as the source's env_file did."""
    from servekit.engines.compose import write_env
    from servekit.engines.deployment import Deployment
    root = tracked_copy(tmp_path)
    env_file = root / "compose" / ".env"
    env_file.write_text("MAX_SEQS=4\n")
    write_env(Deployment(root, "cuda", "native", "vllm-serve:x", "127.0.0.1", 8000))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SERVEKIT_")) and k != "MAX_SEQS"}
    done = subprocess.run(["docker", "compose", "--profile", "alternative", "config", "--format", "json"],
                          cwd=env_file.parent, env=clean, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["services"]["alternative"]["environment"]["MAX_SEQS"] == "4"


def test_a_non_loopback_bind_warns():
    from servekit.serve.deploy import check_bind
    said: list[str] = []
    check_bind("127.0.0.1", said.append)
    assert said == []
    check_bind("0.0.0.0", said.append)
    assert len(said) == 1 and "reachable from other machines" in said[0]


# --- real boots of the cpu image ------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_built(cpu_image):
    yield
    run_build_py("down")


@pytest.mark.slow
@pytest.mark.engine
def test_up_brings_the_real_server_to_healthy_and_down_removes_it(cpu_built):
    """Buys `up` and `down` against a real vLLM server in a real container: healthy, the URL, key and figures printed,
    and nothing of the project left after `down`."""
    up = run_build_py("up", "default", "--target", "cpu", "--json", timeout=600)
    assert up.returncode == 0, up.stderr[-3000:]
    result = json.loads(up.stdout)
    assert result["url"] == f"http://127.0.0.1:{TEST_PORT}"
    assert result["time_to_healthy_s"] > 0 and result["kv_pool_tokens"] > 0
    assert result["detection_lag_s"] is not None and result["detection_lag_s"] >= 0
    key_file = Path(result["api_key_file"])
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    key = key_file.read_text().strip()
    assert key not in up.stdout + up.stderr
    assert requests.get(f"{result['url']}/health", timeout=5).status_code == 200
    assert requests.get(f"{result['url']}/v1/models", timeout=5).status_code == 401
    assert requests.get(f"{result['url']}/metrics", timeout=5).status_code == 401
    models = requests.get(f"{result['url']}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)
    assert [m["id"] for m in models.json()["data"]] == ["servekit-demo"]
    user = subprocess.run(["docker", "exec", result["container"], "id", "-u"], capture_output=True, text=True)
    assert user.stdout.strip() == str(IMAGE_UID)
    ps = run_build_py("ps", "--json")
    assert ps.returncode == 0, ps.stderr
    row = next(r for r in json.loads(ps.stdout) if r["profile"] == "default")
    assert row["state"] == "running" and row["url"] == result["url"] and row["up_s"] >= 0
    assert row["knobs"] == {} and row["image"] == result["image"]
    logs = run_build_py("logs", "default", "--tail", "1000")
    assert logs.returncode == 0 and "launcher: profile default: vllm serve" in logs.stdout
    assert key not in logs.stdout
    assert follow_logs("default", "--tail", "1000", wanted="launcher: profile default: vllm serve") == (True, 0)
    down = run_build_py("down")
    assert down.returncode == 0 and "nothing left running" in down.stdout
    assert project_containers() == []


@pytest.mark.slow
@pytest.mark.engine
def test_plain_compose_works_without_build_py(cpu_built):
    """Buys the source users' path: the committed Compose files serve a profile with `docker compose` alone, no
    servekit in between."""
    up = subprocess.run(["docker", "compose", "-f", "compose/compose.yaml", "-f", "compose/compose.cpu.yaml", "up",
                         "-d", "--wait", "default"], cwd=work_dir(), capture_output=True, text=True, timeout=600)
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        assert requests.get(f"http://127.0.0.1:{TEST_PORT}/health", timeout=5).status_code == 200
    finally:
        run_build_py("down")
    assert project_containers() == []


@pytest.mark.slow
@pytest.mark.engine
def test_a_newcomer_serves_a_fresh_clone_with_plain_compose_and_vllm_api_key(cpu_image, tmp_path):
    """The source user's first minutes: a fresh copy of the repository (no compose/secrets, no servekit block), the
    key as VLLM_API_KEY in compose/.env and nothing else there; plain `docker compose up -d --wait default` is healthy
    and answers with that key only, and `docker compose down default` (as README's quickstart names it: Compose acts
    on a profile's service only where it is named or its profile active) leaves nothing running. The shell names the
    image (a newcomer's would be the pulled release) and, to keep the test apart, its project and port."""
    from servekit.engines.docker import free_port
    root = tracked_copy(tmp_path / "clone")
    work = root / "compose"
    assert not (work / "secrets").exists() and not (work / ".env").exists()
    key = "sk-newcomer-0123456789abcdef0123"
    (work / ".env").write_text(f"VLLM_API_KEY={key}\n")
    project, port = f"{TEST_PROJECT}-newcomer", free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SERVEKIT_", "VLLM_", "HF_"))}
    env.update(SERVEKIT_IMAGE=cpu_image, COMPOSE_PROJECT_NAME=project, PORT=str(port))

    def compose(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", "compose", "-f", "compose.yaml", "-f", "compose.cpu.yaml", *args], cwd=work,
                              env=env, capture_output=True, text=True, timeout=600)
    try:
        up = compose("up", "-d", "--wait", "default")
        assert up.returncode == 0, up.stderr[-3000:]
        models = f"http://127.0.0.1:{port}/v1/models"
        assert requests.get(models, headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code == 200
        assert requests.get(models, headers={"Authorization": "Bearer sk-not-the-key-0123456789"},
                            timeout=10).status_code == 401
        assert not (work / "secrets").exists()  # nothing was bound in place of a missing file
        down = compose("down", "default")
        assert down.returncode == 0, down.stderr[-2000:]
        running = subprocess.run(["docker", "ps", "-q", "--filter", f"label={PROJECT_LABEL}={project}"],
                                 capture_output=True, text=True).stdout.split()
        assert running == [], "`docker compose down default` left the project running"
    finally:
        compose("--profile", "*", "down", "-v", "--remove-orphans")


def _readme_block(first_line: str) -> str:
    """The README's ```bash block that starts with `first_line`."""
    import re
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    found = [b for b in blocks if b.startswith(first_line)]
    assert len(found) == 1, f"README.md has {len(found)} bash blocks starting with {first_line!r}"
    return found[0]


@pytest.mark.slow
@pytest.mark.engine
def test_the_readmes_quickstart_without_a_gpu_runs_as_written(cpu_image, tmp_path):
    """README's cpu quickstart, line by line in a fresh copy of the repository (its .venv this checkout's), each line
    stopping the block when it fails: the image, plain Compose healthy, the models list with the key file's key, and
    `docker compose down`. Only the port differs from what it says: the test's own, never a developer's 18020."""
    from servekit.engines.docker import free_port
    root = tracked_copy(tmp_path / "clone")
    (root / ".venv").symlink_to(ROOT / ".venv")
    assert subprocess.run(["make", "-q", ".venv/.installed"], cwd=root).returncode == 0, \
        "the venv is older than requirements.lock or pyproject.toml: `make venv` here first"
    project, port = f"{TEST_PROJECT}-quickstart", free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "VLLM_", "PORT", "BIND"))}
    env.update(SERVEKIT_PROJECT=project, PORT=str(port))
    block = _readme_block("make image TARGET=cpu")
    assert "18020" in block
    try:
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.replace("18020", str(port))], cwd=root,
                              env=env, capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1])["data"][0]["id"] == "servekit-demo"
        left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={PROJECT_LABEL}={project}"],
                              capture_output=True, text=True).stdout.split()
        assert left == []
    finally:
        subprocess.run(["docker", "compose", "--profile", "*", "down", "-v", "--remove-orphans"], cwd=root / "compose",
                       env=env, capture_output=True, timeout=300)


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("env,within_s,says", [
    ({"PREFIX_CACHE": "maybe"}, 30, "PREFIX_CACHE='maybe'"),  # the launcher refuses before vLLM starts
    ({"EXTRA_ARGS": "--max-model-len 100000"}, 120, "max_model_len (100000)"),  # vLLM's own line, not the timeout
], ids=["bad-knob", "argument-vllm-rejects"])
def test_a_bad_setting_fails_fast_naming_it(cpu_built, env, within_s, says):
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(ROOT / "build.py"), "up", "default", "--target", "cpu",
                             "--timeout", "300"], cwd=work_dir(), env=dict(os.environ, **env), capture_output=True,
                            text=True, timeout=400)
    assert result.returncode == 1
    assert time.monotonic() - started < within_s
    assert says in result.stderr
    assert project_containers() == []


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_during_up_leaves_nothing_running(cpu_built, sig):
    proc = subprocess.Popen([sys.executable, str(ROOT / "build.py"), "up", "default", "--target", "cpu"], cwd=work_dir(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_reaches_it)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not subprocess.run(
            ["docker", "ps", "-q", "--filter", f"label={PROJECT_LABEL}={TEST_PROJECT}",
             "--filter", f"label={PROFILE_LABEL}=default"],
            capture_output=True, text=True).stdout.strip():
        time.sleep(0.5)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert project_containers() == []



@pytest.mark.slow
@pytest.mark.engine
def test_a_run_stopped_by_sigterm_during_the_boot_writes_what_it_got_to(cpu_built):
    """`timeout 300 build.py run ...` on a boot that outlives it: the report says where the boot was, fails the
    gate, and nothing is left running."""
    before = set((work_dir() / "reports").glob("*-default-cpu"))
    proc = subprocess.Popen([sys.executable, str(ROOT / "build.py"), "run", "--profile", "default", "--target", "cpu",
                             "--json"], cwd=work_dir(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not project_containers():
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert project_containers() == []
    [folder] = set((work_dir() / "reports").glob("*-default-cpu")) - before
    said = json.loads(out)  # --json names the report on this path too
    assert said["interrupted"] is True and said["passed"] is False and said["reports"] == [str(folder)]
    doc = json.loads((folder / "report.json").read_text())
    boot = doc["checks"][0]
    assert boot["name"] == "boot" and boot["status"] == "not_run" and "s into the boot" in boot["reason"]
    assert doc["passed"] is False and {c["status"] for c in doc["checks"][1:]} <= {"not_run", "not_required"}
    assert "default: interrupted; report in" in err
    assert "The boot did not finish: interrupted" in (folder / "report.md").read_text()



@pytest.mark.slow
@pytest.mark.engine
def test_up_as_another_uid_on_fresh_volumes(cpu_built):
    """Docker Desktop and a non-root host run the containers as the user's uid, not the image's 10001: prepare
    must write into fresh volumes and the server must read its key as that uid."""
    project = f"{TEST_PROJECT}-uid"
    env = dict(os.environ, SERVEKIT_PROJECT=project, SERVEKIT_UID="4321", SERVEKIT_GID="4321")
    from servekit.engines.docker import free_port
    try:
        up = subprocess.run([sys.executable, str(ROOT / "build.py"), "up", "default", "--target", "cpu", "--json",
                             "--port", str(free_port())], cwd=work_dir(), env=env, capture_output=True, text=True,
                            timeout=1200)
        assert up.returncode == 0, up.stderr[-3000:]
        container = json.loads(up.stdout)["container"]
        user = subprocess.run(["docker", "inspect", "-f", "{{.Config.User}}", container], capture_output=True,
                              text=True).stdout.strip()
        assert user == "4321:4321"
    finally:
        subprocess.run([sys.executable, str(ROOT / "build.py"), "down"], cwd=work_dir(), env=env, capture_output=True,
                       timeout=600)
        volumes = subprocess.run(["docker", "volume", "ls", "-q", "--filter", f"label={PROJECT_LABEL}={project}"],
                                 capture_output=True, text=True).stdout.split()
        if volumes:
            subprocess.run(["docker", "volume", "rm", *volumes], capture_output=True)


@pytest.mark.slow
@pytest.mark.engine
def test_up_shows_the_download_from_a_hub_before_the_boot_and_serves_what_arrived(cpu_image, tmp_path):
    """`up` of a model the image fetches (#62): prepare's download from a hub (a stand-in speaking the hub's API,
    reached from the container as the host) shows the repository's size first, its progress while it comes, and its
    end, all before the boot; the server then serves the files that arrived. The model and the hub's address reach
    the containers through compose.override.yaml, as a user's own Compose settings would. Buys what no in-process
    test can: Compose carrying HF_ENDPOINT to prepare, and prepare's lines reaching `up` as they come."""
    from standins.hub_server import COMMIT, Hub

    from servekit.config.profiles import render_profiles
    from servekit.engines.docker import free_port
    root = tracked_copy(tmp_path / "clone")
    demo = ROOT / "docker" / "demo-model"
    Hub.repos = {"org/demo": {p.name: p.read_bytes() for p in demo.iterdir() if p.is_file()}}
    Hub.paced, Hub.sha, Hub.answers, Hub.stop = {"model.safetensors"}, COMMIT, {}, threading.Event()
    Hub.drop_once, Hub.trickle, Hub.ranges, Hub.resolved, Hub.hang = set(), set(), [], [], threading.Event()
    # the address host-gateway names inside a container: where the stand-in hub listens, and nowhere else
    gateway = subprocess.run(["docker", "run", "--rm", "--add-host", "hub.test:host-gateway", "--entrypoint",
                              "getent", cpu_image, "hosts", "hub.test"], capture_output=True, text=True, timeout=120)
    assert gateway.returncode == 0, gateway.stderr
    profiles = render_profiles(load_matrix(root / "images.yaml"), "cpu")
    profiles["model"] = {**profiles["model"], "source": "huggingface", "repo": "org/demo", "revision": "main",
                         "path": "/app/models/demo-from-hub", "baked": None}
    (root / "compose" / "hub-profiles.json").write_text(json.dumps(profiles))
    project = f"{TEST_PROJECT}-hub"
    env = {**os.environ, "SERVEKIT_PROJECT": project}
    with serving(Hub, gateway.stdout.split()[0]) as hub:
        profiles_env = {"SERVEKIT_PROFILES": "/opt/hub-profiles.json"}
        mounted = ["./hub-profiles.json:/opt/hub-profiles.json:ro"]
        (root / "compose" / "compose.override.yaml").write_text(yaml.safe_dump({"services": {
            "default": {"environment": profiles_env, "volumes": mounted},
            "prepare": {"volumes": mounted, "extra_hosts": ["hub.test:host-gateway"], "environment": {
                **profiles_env, "HF_ENDPOINT": f"http://hub.test:{hub.server_port}", "PREPARE_PROGRESS_S": "0.5"}}}}))
        try:
            up = subprocess.run([sys.executable, str(ROOT / "build.py"), "up", "default", "--target", "cpu", "--port",
                                 str(free_port()), "--json"], cwd=root, env=env, capture_output=True, text=True,
                                timeout=1200)
            assert up.returncode == 0, up.stderr[-3000:]
            said = up.stderr
            size_at, progress_at, done_at, ready_at = (said.find(text) for text in (
                f"prepare: org/demo@{COMMIT[:12]}: 7 files", " GB, ", "prepare: org/demo: downloaded ",
                "prepare: /app/models/demo-from-hub ready"))
            assert -1 < size_at < progress_at < done_at < ready_at, said[-3000:]  # as they came, before the boot
            assert said.count("of 7 files") >= 2, said[-3000:]  # a line every 0.5 s of a 3 s download
            result = json.loads(up.stdout)
            key = Path(result["api_key_file"]).read_text().strip()
            models = requests.get(f"{result['url']}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
            assert [m["id"] for m in models.json()["data"]] == ["servekit-demo"]
            assert any("/org/demo/resolve/" in path for path, _ in Hub.resolved)
        finally:
            Hub.stop.set()
            subprocess.run([sys.executable, str(ROOT / "build.py"), "down"], cwd=root, env=env, capture_output=True,
                           timeout=600)
            volumes = subprocess.run(["docker", "volume", "ls", "-q", "--filter",
                                      f"label={PROJECT_LABEL}={project}"], capture_output=True,
                                     text=True).stdout.split()
            if volumes:
                subprocess.run(["docker", "volume", "rm", *volumes], capture_output=True)
