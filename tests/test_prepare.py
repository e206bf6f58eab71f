"""prepare, through huggingface_hub, against a stand-in hub on 127.0.0.1 that speaks the Hugging Face HTTP API
(a revision's commit, the file tree at a commit, files by `resolve`, byte ranges): a whole download with its drafter, a connection dropped mid-shard
(resumed, not restarted), a shard the repository holds truncated (refused, never marked), and two at once."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml
from standins.hub_server import COMMIT, Hub, repo_files, shard_bytes
from support import LAUNCHER, ROOT, serving


@pytest.fixture
def hub():
    Hub.repos, Hub.drop_once, Hub.ranges, Hub.resolved = {"org/model": repo_files(2), "org/drafter": repo_files(1)}, set(), [], []
    Hub.sha, Hub.trickle, Hub.hang, Hub.stop = COMMIT, set(), threading.Event(), threading.Event()
    Hub.answers = {}
    Hub.paced = set()
    with serving(Hub) as server:
        yield f"http://127.0.0.1:{server.server_port}"
        Hub.stop.set()


def _profiles(tmp_path: Path, **model) -> Path:
    """The rendered profiles of a model fetched from the stand-in hub (`model` overrides its fields)."""
    models = tmp_path / "models"
    doc = {"model": {"source": "huggingface", "repo": "org/model", "revision": COMMIT, "path": str(models / "m"),
                     "served_name": "m", **model, "drafters": {"dflash": {"repo": "org/drafter", "revision": COMMIT,
                                                                  "path": str(models / "m-dflash")}}},
           "profiles": {}, "hosts": {}}
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps(doc))
    return path


def _prepare(profiles: Path, endpoint: str, **settings: str) -> subprocess.CompletedProcess:
    env = {"SERVEKIT_PROFILES": str(profiles), "HF_ENDPOINT": endpoint, "PATH": os.environ["PATH"], **settings}
    return subprocess.run([*LAUNCHER, "prepare"], env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_model_and_its_drafter_arrive_whole_and_marked(tmp_path, hub):
    done = _prepare(_profiles(tmp_path), hub)
    assert done.returncode == 0, done.stderr
    for folder, repo in (("m", "org/model"), ("m-dflash", "org/drafter")):
        for name, body in Hub.repos[repo].items():
            assert (tmp_path / "models" / folder / name).read_bytes() == body
        assert json.loads((tmp_path / "models" / folder / ".servekit-complete").read_text())["identity"] == \
            f"{repo}@{COMMIT}"
    pin = yaml.safe_load((ROOT / "images.yaml").read_text())["pins"]["huggingface_hub"]
    files = [agent for path, agent in Hub.resolved if "/resolve/" in path]
    assert files and all(f"hf_hub/{pin};" in agent for agent in files)  # fetched by the image's client
    again = _prepare(_profiles(tmp_path), hub)
    assert again.returncode == 0 and again.stderr.count("is complete") == 2


def test_a_download_says_how_far_it_is_as_it_goes_and_what_it_fetched(tmp_path, hub):
    """The 20 GB download is most of a first boot: prepare says its size first, then GB of GB, the rate and the whole
    files every PREPARE_PROGRESS_S, and at the end what it fetched; `up` shows these lines as they come."""
    import re
    shard = "model-00001-of-00002.safetensors"
    Hub.repos["org/model"][shard] = shard_bytes(2, 5_000_000)  # 40 MB: the client writes 10 MiB at a time
    Hub.paced = {shard}
    total = sum(len(b) for b in Hub.repos["org/model"].values())
    done = _prepare(_profiles(tmp_path), hub, PREPARE_PROGRESS_S="0.5")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("prepare: org/model")]
    assert f"{len(Hub.repos['org/model'])} files, {total / 1e9:.2f} GB; fetching" in lines[0]
    found = (re.search(r": ([\d.]+) of ([\d.]+) GB, ([\d.]+) MB/s, (\d+) of (\d+) files$", line) for line in lines)
    ticks = [t for t in found if t is not None]
    assert len(ticks) >= 2, lines  # about 3 s of download, a line every 0.5 s
    assert all(t[2] == f"{total / 1e9:.2f}" and t[5] == str(len(Hub.repos["org/model"])) for t in ticks)
    assert float(ticks[-1][1]) >= float(ticks[0][1]) and any(float(t[3]) > 0 for t in ticks)
    assert re.search(rf"downloaded {total / 1e9:.2f} GB in [\d.]+ s \([\d.]+ MB/s\), 4 of 4 files whole$", lines[-1])
    from servekit.serve.boot import prepare_figures  # what the host makes of these lines for the report
    figures = prepare_figures(done.stderr.splitlines())
    drafter = sum(len(b) for b in Hub.repos["org/drafter"].values())
    assert figures["download_gb"] == round(total / 1e9, 2) + round(drafter / 1e9, 2) and figures["download_s"] >= 2.5
    assert figures["conversion_s"] == 0  # not a compressed-tensors checkpoint: nothing to convert


def test_a_connection_dropped_mid_shard_resumes_where_it_stopped(tmp_path, hub):
    shard = "model-00001-of-00002.safetensors"
    # big enough that the client wrote some of it before the drop (it writes in 10 MiB pieces)
    Hub.repos["org/model"][shard] = shard_bytes(2, 3_000_000)
    Hub.drop_once = {shard}
    done = _prepare(_profiles(tmp_path), hub)
    assert done.returncode == 0, done.stderr
    resumed = [int(r.split("=")[1].rstrip("-")) for name, r in Hub.ranges if name == shard]
    half = len(Hub.repos["org/model"][shard]) // 2
    assert len(resumed) == 1 and 0 < resumed[0] <= half  # from the bytes it had, not from the start
    assert (tmp_path / "models/m" / shard).read_bytes() == Hub.repos["org/model"][shard]


def test_a_shard_the_repository_holds_truncated_is_refused_and_nothing_is_marked(tmp_path, hub):
    Hub.repos["org/model"] = repo_files(2, cut=1000)
    done = _prepare(_profiles(tmp_path), hub)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("prepare: error: org/model/model-00002-of-00002.safetensors: holds"), lines[-1]
    assert "its header declares" in lines[-1]
    assert not (tmp_path / "models/m/.servekit-complete").exists()
    assert not (tmp_path / "models/m/model-00002-of-00002.safetensors").exists()  # removed: the next run fetches it


def test_a_repository_the_hub_lacks_or_cannot_be_reached_is_said_in_one_line(tmp_path, hub):
    missing = _prepare(_profiles(tmp_path, repo="org/nothing"), hub)
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines()[-1] == ("prepare: error: org/nothing: the hub has no such repository, "
                                                       "or it is private (give a token: HF_TOKEN_FILE)")
    unreachable = _prepare(_profiles(tmp_path), "http://127.0.0.1:9")
    assert unreachable.returncode == 1 and "Traceback" not in unreachable.stderr
    assert unreachable.stderr.strip().splitlines()[-1].startswith(
        "prepare: error: http://127.0.0.1:9 cannot be reached (")


def test_a_branch_is_resolved_to_one_commit_and_every_file_comes_from_it(tmp_path, hub):
    done = _prepare(_profiles(tmp_path, revision="main"), hub)
    assert done.returncode == 0, done.stderr
    assert f"org/model@{COMMIT[:12]}" in done.stderr
    assert {p for p, _ in Hub.resolved if p.startswith("/org/model/")} == \
        {f"/org/model/resolve/{COMMIT}/{name}" for name in Hub.repos["org/model"]}


def test_two_prepares_at_once_download_once(tmp_path, hub):
    profiles = _profiles(tmp_path)
    env = {"SERVEKIT_PROFILES": str(profiles), "HF_ENDPOINT": hub, "PATH": os.environ["PATH"]}
    procs = [subprocess.Popen([*LAUNCHER, "prepare"], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert sum("is complete" in e for e in errs) == 1  # the second found the first's work done


def test_a_profile_whose_drafter_is_missing_is_refused_before_vllm_starts(tmp_path, hub):
    from servekit.config.load import load_matrix
    from servekit.config.profiles import render_profiles
    rendered = render_profiles(load_matrix(ROOT / "images.yaml"), "cuda")
    model = rendered["model"]
    drafter = model["drafters"]["dflash"]
    model["path"], drafter["path"] = str(tmp_path / "m"), str(tmp_path / "m-dflash")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / ".servekit-complete").write_text(json.dumps({"identity": f"{model['repo']}@main"}))
    profiles, key = tmp_path / "profiles.json", tmp_path / "key"
    profiles.write_text(json.dumps(rendered))
    key.write_text("sk-a-key-long-enough-to-serve")
    env = {"SERVEKIT_PROFILES": str(profiles), "API_KEY_FILE": str(key), "PATH": os.environ["PATH"]}
    done = subprocess.run([*LAUNCHER, "serve", "alternative"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"launcher: refusing to start: the drafter this profile needs in {drafter['path']} "
                                   "is missing or incomplete; run the prepare step first (docker compose runs it "
                                   "before every profile)")


def test_a_model_you_already_have_is_used_where_it_is_and_checked_whole(tmp_path, hub):
    from servekit.config.load import load_matrix
    from servekit.config.profiles import render_profiles
    mine = tmp_path / "mine"
    mine.mkdir()
    for name, body in Hub.repos["org/model"].items():
        (mine / name).write_bytes(body)
    rendered = render_profiles(load_matrix(ROOT / "images.yaml"), "cuda")
    profiles, key = tmp_path / "profiles.json", tmp_path / "key"
    profiles.write_text(json.dumps(rendered))
    key.write_text("sk-a-key-long-enough-to-serve")
    env = {"SERVEKIT_PROFILES": str(profiles), "API_KEY_FILE": str(key), "MODEL_DIR": str(mine),
           "PATH": os.environ["PATH"], "HF_ENDPOINT": hub}
    printed = subprocess.run([*LAUNCHER, "serve", "batch"], env={**env, "PRINT_ARGV": "1"},
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0 and f"--model {mine} " in printed.stdout
    shard = next(mine.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-10])  # a copy cut short
    done = subprocess.run([*LAUNCHER, "serve", "batch"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and f"the model in {mine} is missing or incomplete" in done.stderr
    prepared = subprocess.run([*LAUNCHER, "prepare"], env=env, capture_output=True, text=True,
                              timeout=60)
    assert prepared.returncode == 1 and "not a whole model" in prepared.stderr and shard.name in prepared.stderr


def test_a_models_folder_of_the_sources_is_served_where_it_is_and_never_fetched_again(tmp_path, hub):
    """MODELS_DIR (the source's ./models, mounted as the volume) holding its prepare's folders: a whole one is
    served where it is and prepare fetches nothing for it; one cut short is left alone and ours is fetched."""
    from servekit.config.load import load_matrix
    from servekit.config.profiles import render_profiles
    rendered = render_profiles(load_matrix(ROOT / "images.yaml"), "cuda")
    theirs = {"model": Path(rendered["model"]["source_path"]).name,
              "drafter": Path(rendered["model"]["drafters"]["dflash"]["source_path"]).name}
    assert theirs == {"model": "Qwen3.8-27B-W4A16-AutoRound", "drafter": "Qwen3.8-27B-DFlash2-W4A16"}
    models = tmp_path / "models"  # what /app/models is in the container
    for part, repo in (("model", "org/model"), ("drafter", "org/drafter")):
        (models / theirs[part]).mkdir(parents=True)
        for name, body in Hub.repos[repo].items():
            (models / theirs[part] / name).write_bytes(body)
    model = rendered["model"]
    model.update(repo="org/model", revision=COMMIT, path=str(models / "ours"),
                 source_path=str(models / theirs["model"]))
    model["drafters"]["dflash"].update(repo="org/drafter", revision=COMMIT, path=str(models / "ours-dflash"),
                                       source_path=str(models / theirs["drafter"]))
    profiles, key = tmp_path / "profiles.json", tmp_path / "key"
    profiles.write_text(json.dumps(rendered))
    key.write_text("sk-a-key-long-enough-to-serve")
    env = {"SERVEKIT_PROFILES": str(profiles), "API_KEY_FILE": str(key), "PATH": os.environ["PATH"],
           "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing answers: a fetch would fail
    prepared = subprocess.run([*LAUNCHER, "prepare"], env=env, capture_output=True, text=True,
                              timeout=60)
    assert prepared.returncode == 0, prepared.stderr
    assert not (models / "ours").exists() and not (models / "ours-dflash").exists()
    printed = subprocess.run([*LAUNCHER, "serve", "alternative"], env={**env, "PRINT_ARGV": "1"},
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert f"--model {models / theirs['model']} " in printed.stdout
    assert f'"model": "{models / theirs["drafter"]}"' in printed.stdout
    shard = next((models / theirs["model"]).glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-10])  # the source's download cut short: not served, not written into
    fetched = subprocess.run([*LAUNCHER, "prepare"], env={**env, "HF_ENDPOINT": hub},
                             capture_output=True, text=True, timeout=120)
    assert fetched.returncode == 0, fetched.stderr
    assert (models / "ours" / ".servekit-complete").is_file() and not (models / "ours-dflash").exists()
    assert len(shard.read_bytes()) == len(Hub.repos["org/model"][shard.name]) - 10


def test_prepare_for_a_profile_fetches_only_what_it_serves(tmp_path, hub):
    """The process engine prepares per profile: mtp needs no drafter (nothing fetched for it, so a machine without
    network serves it from MODEL_DIR); alternative's drafter is fetched."""
    from servekit.config.load import load_matrix
    from servekit.config.profiles import render_profiles
    mine = tmp_path / "mine"
    mine.mkdir()
    for name, body in Hub.repos["org/model"].items():
        (mine / name).write_bytes(body)
    rendered = render_profiles(load_matrix(ROOT / "images.yaml"), "cuda")
    drafter = rendered["model"]["drafters"]["dflash"]
    drafter.update(repo="org/drafter", revision=COMMIT, path=str(tmp_path / "m-dflash"))
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps(rendered))
    env = {"SERVEKIT_PROFILES": str(profiles), "MODEL_DIR": str(mine), "PATH": os.environ["PATH"]}
    offline = subprocess.run([*LAUNCHER, "prepare", "mtp"], capture_output=True, text=True,
                             env={**env, "HF_ENDPOINT": "http://127.0.0.1:9"}, timeout=60)
    assert offline.returncode == 0, offline.stderr
    assert not (tmp_path / "m-dflash").exists()
    for_alternative = subprocess.run([*LAUNCHER, "prepare", "alternative"], capture_output=True,
                                     text=True, env={**env, "HF_ENDPOINT": hub}, timeout=60)
    assert for_alternative.returncode == 0, for_alternative.stderr
    assert (tmp_path / "m-dflash" / ".servekit-complete").is_file()


# --- what a hub says is doubted ------------------------------------------------------------------------------------

def _last_line(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("sha", ["../../../escaped", "main", "0123456789abcdef", None])
def test_a_commit_the_hub_names_that_is_no_commit_is_refused_before_any_file(tmp_path, hub, sha):
    Hub.sha = sha
    done = _prepare(_profiles(tmp_path, revision="main"), hub)
    assert done.returncode == 1
    assert _last_line(done).startswith("prepare: error: org/model@main: the hub named ")
    assert "which is no commit id (40 hex digits); nothing was fetched" in _last_line(done)
    assert not [p for p, _ in Hub.resolved if "/resolve/" in p]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == \
        ["models/.prepare.lock", "profiles.json"]  # nothing written anywhere, inside the folder or out


@pytest.mark.parametrize("route, answer", [
    ("info", b'["a", "list"]'), ("info", b"[" * 100_000 + b"]" * 100_000), ("info", b'{"sha": '),
    ("tree", b'{"a": "mapping"}'), ("tree", b'[{"type": "file", "path": 7, "size": "big"}]'),
], ids=["info-a-list", "info-nested-deep", "info-cut-short", "tree-a-mapping", "tree-entry-of-wrong-types"])
def test_an_api_answer_of_another_shape_stops_prepare_in_one_line_before_any_file(tmp_path, hub, route, answer):
    """The model's information and its file tree come from a hub anybody can run: JSON of another shape is refused
    in one line naming the repository, never a traceback, and nothing is fetched."""
    Hub.answers = {route: answer}
    done = _prepare(_profiles(tmp_path, revision="main"), hub)
    assert done.returncode == 1, done.stderr
    assert _last_line(done).startswith("prepare: error: org/model@main: ")
    assert not [p for p, _ in Hub.resolved if "/resolve/" in p]


def test_an_index_that_names_a_shard_the_repository_lacks_is_never_marked_whole(tmp_path, hub):
    files = repo_files(2)
    files["model.safetensors.index.json"] = json.dumps({"weight_map": {
        "w0": "model-00001-of-00002.safetensors", "w1": "model-00002-of-00002.safetensors",
        "w2": "model-00003-of-00003.safetensors"}}).encode()
    Hub.repos["org/model"] = files
    done = _prepare(_profiles(tmp_path), hub)
    assert done.returncode == 1
    assert _last_line(done).startswith("prepare: error: org/model as the hub sent it is not a whole model: ")
    assert "model-00003-of-00003.safetensors, which the index names, is missing" in _last_line(done)
    assert not (tmp_path / "models/m/.servekit-complete").exists()


def _raw_shard(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + data


@pytest.mark.parametrize("body, says", [
    (_raw_shard(b"[1, 2]"), "is not a safetensors header"),
    (_raw_shard(b'{"w": {"dtype": "F32", "data_offsets": ["0", "8"]}}', bytes(8)), "is not a safetensors header"),
    (_raw_shard(b'{"w": {"data_offsets": [8, 0]}}', bytes(8)), "is not a safetensors header"),
    (_raw_shard(b'{"w": 3}'), "is not a safetensors header"),
    (_raw_shard(b"{}", length=1 << 40), "its header claims 1099511627776 bytes, more than safetensors allows"),
    (_raw_shard(b"{}", length=500), "its header claims 500 bytes, more than the file's 10"),
    (b"\x01\x02", "not a readable safetensors file"),
])
def test_a_shard_of_the_wrong_shape_is_named_as_such(tmp_path, body, says):
    from servekit.image.hub import shard_problem
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(body)
    assert says in (shard_problem(shard) or ""), shard_problem(shard)


@pytest.mark.parametrize("index, says", [
    ('{"weight_map": ["model.safetensors"]}', "no weight_map"),
    ('["weight_map"]', "not a readable index"),
    ('{"weight_map": {"w": 3}}', "no weight_map"),
    ('{"weight_map": {"w": "../../outside.safetensors"}}', "not a .safetensors file beside it"),
    ('{"weight_map": {"w": "/etc/passwd"}}', "not a .safetensors file beside it"),
    ('{"weight_map": {"w": "config.json"}}', "not a .safetensors file beside it"),
    ("not json", "not a readable index"),
])
def test_an_index_of_the_wrong_shape_is_named_and_nothing_outside_the_folder_is_read(tmp_path, index, says):
    from servekit.image.prepare import folder_problem
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(index)
    problem = folder_problem(tmp_path) or ""
    assert problem.startswith(f"{tmp_path}/model.safetensors.index.json: not a readable index") and says in problem, \
        problem


def test_a_shard_of_the_wrong_shape_from_the_hub_is_refused_in_one_line_and_not_marked(tmp_path, hub):
    Hub.repos["org/model"]["model-00002-of-00002.safetensors"] = _raw_shard(b"[1, 2]")
    done = _prepare(_profiles(tmp_path), hub)
    assert done.returncode == 1
    assert _last_line(done) == ("prepare: error: org/model/model-00002-of-00002.safetensors: its header is not a "
                                "safetensors header (a table of tensors, each with two data offsets); the file was "
                                "removed, run prepare again")
    assert not (tmp_path / "models/m/.servekit-complete").exists()


@pytest.mark.parametrize("what", ["trickles", "never answers"])
def test_a_hub_that_trickles_or_never_answers_is_abandoned_and_what_arrived_kept(tmp_path, hub, what):
    shard = "model-00001-of-00002.safetensors"
    if what == "trickles":
        Hub.trickle = {shard}
    else:
        Hub.hang.set()
    started = time.monotonic()
    done = _prepare(_profiles(tmp_path, revision="main" if what == "never answers" else COMMIT), hub,
                    PREPARE_STALL_S="1")
    assert done.returncode == 1
    assert time.monotonic() - started < 60
    assert _last_line(done) == (f"prepare: error: org/model: {hub} sent less than 1 MiB in 1 s (PREPARE_STALL_S): it "
                                "has stopped answering or trickles; what arrived is kept, run prepare again to resume")
    assert not (tmp_path / "models/m/.servekit-complete").exists()


@pytest.mark.parametrize("name, value, says", [
    ("PREPARE_LOCK_WAIT", "inf", "expected a finite number (seconds)"),
    ("PREPARE_LOCK_WAIT", "ten", "expected a finite number (seconds)"),
    ("PREPARE_LOCK_WAIT", "-1", "expected at least 0 (seconds)"),
    ("PREPARE_LOCK_WAIT", "1e9", "expected at most 86400 (seconds)"),
    ("PREPARE_STALL_S", "0", "expected at least 1 (seconds)"),
    ("PREPARE_STALL_S", "nan", "expected a finite number (seconds)"),
])
def test_a_prepare_setting_that_is_no_number_in_range_is_refused_in_one_line(tmp_path, hub, name, value, says):
    done = _prepare(_profiles(tmp_path), hub, **{name: value})
    assert done.returncode == 1
    assert _last_line(done) == f"prepare: error: {name}={value!r}: {says}"
    assert not (tmp_path / "models/m/.servekit-complete").exists()


@pytest.mark.parametrize("content", [None, "{", "[]", '{"model": {}}'])
def test_profiles_that_are_missing_or_not_profiles_are_refused_in_one_line(tmp_path, content):
    profiles = tmp_path / "profiles.json"
    if content is not None:
        profiles.write_text(content)
    for command in ("prepare", "serve"):
        done = subprocess.run([*LAUNCHER, command], capture_output=True, text=True, timeout=60,
                              env={"SERVEKIT_PROFILES": str(profiles), "PATH": os.environ["PATH"]})
        assert done.returncode == 2
        assert _last_line(done).startswith(f"launcher: refusing to start: {profiles}: ")
        assert _last_line(done).endswith("(SERVEKIT_PROFILES names the file; the image bakes it)")


def test_compose_hands_prepare_every_conversion_setting():
    """Each step of convert.py can be skipped through plain `docker compose` too: its setting reaches prepare."""
    from servekit.image.convert import STEPS
    prepare = yaml.safe_load((ROOT / "compose" / "compose.yaml").read_text())["services"]["prepare"]
    assert {setting: prepare["environment"].get(setting) for setting, _, _ in STEPS.values()} == {
        setting: f"${{{setting}:-1}}" for setting, _, _ in STEPS.values()}
