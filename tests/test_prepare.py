"""prepare against a stand-in hub on 127.0.0.1 that speaks the Hugging Face HTTP API (the model listing at a
commit, files by `resolve`, byte ranges): a whole download with its drafter, a connection dropped mid-shard
(resumed, not restarted), a shard the repository holds truncated (refused, never marked), and two at once."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from support import ROOT

LAUNCHER = ROOT / "servekit/image/launcher.py"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _shard(tensors: int, floats: int, cut: int = 0) -> bytes:
    header = {f"w{i}": {"dtype": "F32", "shape": [floats], "data_offsets": [i * floats * 4, (i + 1) * floats * 4]}
              for i in range(tensors)}
    raw = json.dumps(header).encode()
    body = struct.pack("<Q", len(raw)) + raw + os.urandom(tensors * floats * 4)
    return body[:len(body) - cut] if cut else body


def _repo(shards: int, cut: int = 0) -> dict[str, bytes]:
    files = {f"model-{i:05d}-of-{shards:05d}.safetensors": _shard(2, 200_000, cut if i == shards else 0)
             for i in range(1, shards + 1)}
    files["model.safetensors.index.json"] = json.dumps({"weight_map": {f"w{i}": n for i, n in enumerate(files)}}).encode()
    files["config.json"] = b'{"model_type": "qwen3"}'
    return files


class Hub(BaseHTTPRequestHandler):
    repos: dict[str, dict[str, bytes]] = {}
    drop_once: set[str] = set()  # files whose first download stops half way
    ranges: list[tuple[str, str]] = []

    def do_GET(self):
        path = self.path.split("?")[0]
        if path.startswith("/api/models/"):
            repo = "/".join(path.split("/")[3:5])
            files = self.repos.get(repo)
            if files is None:
                return self._send(404, b"{}")
            return self._send(200, json.dumps({"sha": COMMIT, "siblings": [
                {"rfilename": n, "size": len(b)} for n, b in files.items()]}).encode())
        org, name, _, commit, filename = path.lstrip("/").split("/", 4)
        body = self.repos[f"{org}/{name}"][filename]
        start = 0
        if self.headers.get("Range"):
            start = int(self.headers["Range"].split("=")[1].rstrip("-"))
            self.ranges.append((filename, self.headers["Range"]))
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        if filename in self.drop_once:
            self.drop_once.discard(filename)
            self.wfile.write(body[start:start + (len(body) - start) // 2])
            self.wfile.flush()
            self.connection.shutdown(2)  # the connection drops mid-shard
            return
        self.wfile.write(body[start:])

    def _send(self, code: int, body: bytes):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def hub():
    Hub.repos, Hub.drop_once, Hub.ranges = {"org/model": _repo(2), "org/drafter": _repo(1)}, set(), []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def _profiles(tmp_path: Path) -> Path:
    models = tmp_path / "models"
    doc = {"model": {"source": "huggingface", "repo": "org/model", "revision": COMMIT, "path": str(models / "m"),
                     "served_name": "m", "drafters": {"dflash": {"repo": "org/drafter", "revision": COMMIT,
                                                                  "path": str(models / "m-dflash")}}},
           "profiles": {}, "hosts": {}}
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps(doc))
    return path


def _prepare(profiles: Path, endpoint: str) -> subprocess.CompletedProcess:
    env = {"SERVEKIT_PROFILES": str(profiles), "HF_ENDPOINT": endpoint, "PATH": os.environ["PATH"]}
    return subprocess.run([sys.executable, str(LAUNCHER), "prepare"], env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_model_and_its_drafter_arrive_whole_and_marked(tmp_path, hub):
    done = _prepare(_profiles(tmp_path), hub)
    assert done.returncode == 0, done.stderr
    for folder, repo in (("m", "org/model"), ("m-dflash", "org/drafter")):
        for name, body in Hub.repos[repo].items():
            assert (tmp_path / "models" / folder / name).read_bytes() == body
        assert json.loads((tmp_path / "models" / folder / ".servekit-complete").read_text())["identity"] == \
            f"{repo}@{COMMIT}"
    again = _prepare(_profiles(tmp_path), hub)
    assert again.returncode == 0 and again.stderr.count("is complete") == 2


def test_a_connection_dropped_mid_shard_resumes_where_it_stopped(tmp_path, hub):
    shard = "model-00001-of-00002.safetensors"
    Hub.drop_once = {shard}
    done = _prepare(_profiles(tmp_path), hub)
    assert done.returncode == 0, done.stderr
    assert f"{shard}: the transfer stopped at" in done.stderr and "resuming" in done.stderr
    half = len(Hub.repos["org/model"][shard]) // 2
    assert (shard, f"bytes={half}-") in Hub.ranges  # resumed from the bytes it had, not from the start
    assert (tmp_path / "models/m" / shard).read_bytes() == Hub.repos["org/model"][shard]


def test_a_shard_the_repository_holds_truncated_is_refused_and_nothing_is_marked(tmp_path, hub):
    Hub.repos["org/model"] = _repo(2, cut=1000)
    done = _prepare(_profiles(tmp_path), hub)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("prepare: error: org/model/model-00002-of-00002.safetensors: holds"), lines[-1]
    assert "its header declares" in lines[-1]
    assert not (tmp_path / "models/m/.servekit-complete").exists()
    assert not (tmp_path / "models/m/model.safetensors.index.json").exists()  # the index, last, never came


def test_two_prepares_at_once_download_once(tmp_path, hub):
    profiles = _profiles(tmp_path)
    env = {"SERVEKIT_PROFILES": str(profiles), "HF_ENDPOINT": hub, "PATH": os.environ["PATH"]}
    procs = [subprocess.Popen([sys.executable, str(LAUNCHER), "prepare"], env=env, stderr=subprocess.PIPE, text=True)
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
    done = subprocess.run([sys.executable, str(LAUNCHER), "serve", "alternative"], env=env, capture_output=True,
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
    printed = subprocess.run([sys.executable, str(LAUNCHER), "serve", "batch"], env={**env, "PRINT_ARGV": "1"},
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0 and f"--model {mine} " in printed.stdout
    shard = next(mine.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-10])  # a copy cut short
    done = subprocess.run([sys.executable, str(LAUNCHER), "serve", "batch"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and f"the model in {mine} is missing or incomplete" in done.stderr
    prepared = subprocess.run([sys.executable, str(LAUNCHER), "prepare"], env=env, capture_output=True, text=True,
                              timeout=60)
    assert prepared.returncode == 1 and "not a whole model" in prepared.stderr and shard.name in prepared.stderr


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
    offline = subprocess.run([sys.executable, str(LAUNCHER), "prepare", "mtp"], capture_output=True, text=True,
                             env={**env, "HF_ENDPOINT": "http://127.0.0.1:9"}, timeout=60)
    assert offline.returncode == 0, offline.stderr
    assert not (tmp_path / "m-dflash").exists()
    for_alternative = subprocess.run([sys.executable, str(LAUNCHER), "prepare", "alternative"], capture_output=True,
                                     text=True, env={**env, "HF_ENDPOINT": hub}, timeout=60)
    assert for_alternative.returncode == 0, for_alternative.stderr
    assert (tmp_path / "m-dflash" / ".servekit-complete").is_file()
