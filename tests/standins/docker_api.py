"""A stand-in Docker engine for tests: serves recorded `GET /info` and `GET /version` answers (tests/recorded/docker)
on 127.0.0.1 in the Engine API's format, so that the real Docker SDK and CLI read them. Anything else is the
engine's 404 with its message: an engine that holds no image, and knows no other route."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class RecordedEngine:
    def __init__(self, folder: Path):
        self.answers = {name: (folder / f"{name}.json").read_bytes() for name in ("info", "version")}
        self.api_version = json.loads(self.answers["version"])["ApiVersion"]
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet: the test reads its own output
                pass

            def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Api-Version", engine.api_version)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self) -> None:
                path = re.sub(r"^/v[\d.]+", "", self.path.split("?")[0])
                if path == "/_ping":
                    self._send(200, b"OK", "text/plain; charset=utf-8")
                elif path.strip("/") in engine.answers:
                    self._send(200, engine.answers[path.strip("/")])
                elif path == "/images/json":  # the list of an engine that holds no image
                    self._send(200, b"[]")
                elif image := re.fullmatch(r"/images/(.+)/json", path):
                    self._send(404, json.dumps({"message": f"No such image: {image[1]}"}).encode())
                else:
                    self._send(404, json.dumps({"message": "page not found"}).encode())

            do_HEAD = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"tcp://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> RecordedEngine:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
