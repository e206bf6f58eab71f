"""A stand-in Hugging Face hub: the routes huggingface_hub's model_info, list_repo_tree and snapshot_download use,
answered as the hub answers them, with the ways a real hub fails (a dropped connection, a trickle, a hang, an answer
of another shape). Served by support.serving; test_prepare drives it from the host, test_deploy from a container."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def shard_bytes(tensors: int, floats: int, cut: int = 0) -> bytes:
    header = {f"w{i}": {"dtype": "F32", "shape": [floats], "data_offsets": [i * floats * 4, (i + 1) * floats * 4]}
              for i in range(tensors)}
    raw = json.dumps(header).encode()
    body = struct.pack("<Q", len(raw)) + raw + os.urandom(tensors * floats * 4)
    return body[:len(body) - cut] if cut else body


def oid(body: bytes) -> str:
    return hashlib.sha1(body).hexdigest()


def repo_files(shards: int, cut: int = 0) -> dict[str, bytes]:
    files = {f"model-{i:05d}-of-{shards:05d}.safetensors": shard_bytes(2, 200_000, cut if i == shards else 0)
             for i in range(1, shards + 1)}
    files["model.safetensors.index.json"] = json.dumps({"weight_map": {f"w{i}": n for i, n in enumerate(files)}}).encode()
    files["config.json"] = b'{"model_type": "qwen3"}'
    return files


class Hub(BaseHTTPRequestHandler):
    """The routes huggingface_hub's snapshot_download uses, answered as the hub answers them: the revision's
    commit, the recursive tree (file entries with path, size and blob oid), and each file by `resolve` with the
    headers the client requires (X-Repo-Commit, ETag, Content-Length) on HEAD and GET, byte ranges on GET."""
    repos: dict[str, dict[str, bytes]] = {}
    drop_once: set[str] = set()  # files whose first download stops half way
    ranges: list[tuple[str, str]] = []
    resolved: list[tuple[str, str]] = []  # (path, user agent) of every file request
    sha = COMMIT  # the commit a revision resolves to
    trickle: set[str] = set()  # files sent a byte at a time, without end
    paced: set[str] = set()  # files sent in ten pieces, 0.3 s apart: a download that takes a while
    hang = threading.Event()  # set: the API never answers
    answers: dict[str, bytes] = {}  # "info" or "tree": the API's answer in place of the repository's own
    stop = threading.Event()
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        path = self.path.split("?")[0]
        if path.startswith("/api/models/"):
            if self.hang.is_set():
                self.stop.wait(120)
                return
            parts = path.split("/")
            files = self.repos.get("/".join(parts[3:5]))
            if files is None:
                return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            if (route := "tree" if parts[5] == "tree" else "info") in self.answers:
                return self._send(200, self.answers[route])
            if parts[5] == "tree":
                return self._send(200, json.dumps([{"type": "file", "path": n, "size": len(b), "oid": oid(b)}
                                                   for n, b in files.items()]).encode())
            return self._send(200, json.dumps({"id": "/".join(parts[3:5]), "sha": self.sha, "siblings": [
                {"rfilename": n} for n in files]}).encode())
        filename, body = self._file(path)
        if body is None:
            return
        start = 0
        if self.headers.get("Range"):
            start = int(self.headers["Range"].split("=")[1].rstrip("-"))
            self.ranges.append((filename, self.headers["Range"]))
        self.send_response(206 if start else 200)
        self._file_headers(body, len(body) - start)
        if filename in self.trickle:
            while not self.stop.wait(0.2):
                try:
                    self.wfile.write(body[start:start + 1])
                    self.wfile.flush()
                except OSError:  # the client left
                    return
                start += 1
            return
        if filename in self.paced:
            piece = -(-(len(body) - start) // 10)
            for at in range(start, len(body), piece):
                self.wfile.write(body[at:at + piece])
                self.wfile.flush()
                time.sleep(0.3)
            return
        if filename in self.drop_once:
            self.drop_once.discard(filename)
            self.wfile.write(body[start:start + (len(body) - start) // 2])
            self.wfile.flush()
            self.connection.shutdown(2)  # the connection drops mid-shard
            self.close_connection = True
            return
        self.wfile.write(body[start:])

    def do_HEAD(self):
        _, body = self._file(self.path.split("?")[0])
        if body is not None:
            self.send_response(200)
            self._file_headers(body, len(body))

    def _file(self, path: str) -> tuple[str, bytes | None]:
        self.resolved.append((path, self.headers.get("User-Agent", "")))
        parts = path.lstrip("/").split("/", 4)
        filename = parts[-1]
        body = self.repos.get("/".join(parts[:2]), {}).get(filename) if len(parts) == 5 and parts[2] == "resolve" \
            else None  # another route of the hub (the client asks for its agent registry): none here
        if body is None:
            self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"})
        return filename, body

    def _file_headers(self, body: bytes, length: int):
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{oid(body)}"')
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None):
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass
