"""What a package index answers is doubted (issue #47): a stand-in PEP 691 index on 127.0.0.1 that is down, answers
HTML, an error, JSON of another shape, a wheel named as a path, a wheel whose sha256 is not its listing's, or
trickles a byte at a time. Each is one line naming the index (through `port`, the command that downloads wheels),
nothing is written outside the download folder, and nothing waits past its deadline."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from support import serving

from servekit.build import index

WHEEL = b"PK\x05\x06" + bytes(18)  # an empty zip: the bytes of a wheel, as far as a download is concerned
NAME = "vllm-0.32.0-cp38-abi3-manylinux1_x86_64.whl"


def _listing(**entry) -> dict:
    return {"meta": {"api-version": "1.0"}, "name": "vllm", "files": [
        {"filename": NAME, "url": f"/files/{NAME}", "hashes": {"sha256": hashlib.sha256(WHEEL).hexdigest()},
         "size": len(WHEEL), **entry}]}


class Index(BaseHTTPRequestHandler):
    answer: tuple[int, str, bytes] = (200, index.JSON_ACCEPT, json.dumps(_listing()).encode())
    trickle = False
    stop = threading.Event()

    def do_GET(self):
        if self.path.startswith("/files/"):
            return self._send(200, "application/octet-stream", WHEEL)
        code, kind, body = self.answer
        if self.trickle:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for byte in body:
                if self.stop.wait(0.5):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            return
        self._send(code, kind, body)

    def _send(self, code: int, kind: str, body: bytes):
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in():
    Index.answer, Index.trickle, Index.stop = (200, index.JSON_ACCEPT, json.dumps(_listing()).encode()), False, \
        threading.Event()
    with serving(Index) as server:
        yield f"http://127.0.0.1:{server.server_port}/simple"
        Index.stop.set()


def test_a_listing_with_a_relative_url_and_its_hash_downloads_the_wheel(stand_in, tmp_path):
    path = index.download_wheel("vllm", "0.32.0", stand_in, tmp_path)
    assert path == tmp_path / NAME and path.read_bytes() == WHEEL


HOSTILE = [
    ((200, "text/html", b"<html><body>maintenance</body></html>"), "does not answer in PEP 691 JSON (it sent text/html)"),
    ((503, index.JSON_ACCEPT, b"{}"), "answered HTTP 503 for vllm"),
    ((200, index.JSON_ACCEPT, b"<html>not json</html>"), "with no PEP 691 listing"),
    ((200, index.JSON_ACCEPT, b'{"files": "none"}'), "with no PEP 691 listing"),
    ((200, index.JSON_ACCEPT, b'["files"]'), "with no PEP 691 listing"),
    ((200, index.JSON_ACCEPT, json.dumps(_listing(filename=f"../../{NAME}")).encode()), "which is no file name"),
    ((200, index.JSON_ACCEPT, json.dumps(_listing(filename=f"/tmp/{NAME}")).encode()), "which is no file name"),
    ((200, index.JSON_ACCEPT, json.dumps(_listing(url=None)).encode()), "a file entry without a filename, url"),
    ((200, index.JSON_ACCEPT, json.dumps(_listing(hashes={"sha256": "0" * 64})).encode()),
     f"served a {NAME} whose sha256 is not the one its listing names"),
]


@pytest.mark.parametrize("answer, says", HOSTILE, ids=[says.split(" (")[0][:40] for _, says in HOSTILE])
def test_a_hostile_listing_is_one_line_naming_the_index_and_nothing_lands(stand_in, tmp_path, answer, says):
    Index.answer = answer
    with pytest.raises(index.IndexUnreachable) as refused:
        index.download_wheel("vllm", "0.32.0", stand_in, tmp_path / "wheels")
    assert str(refused.value).startswith(stand_in) and says in str(refused.value), refused.value
    assert "\n" not in str(refused.value)
    landed = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert landed == [], landed


def test_an_index_that_trickles_is_left_at_its_deadline(stand_in, tmp_path, monkeypatch):
    monkeypatch.setattr(index, "EXCHANGE_DEADLINE_S", 1.0)
    Index.trickle = True
    started = time.monotonic()
    for ask in (lambda: index.download_wheel("vllm", "0.32.0", stand_in, tmp_path),
                lambda: index.release_exists("vllm", "0.32.0", stand_in),
                lambda: index.fetch_metadata("vllm", "0.32.0", stand_in, tmp_path / "cache")):
        with pytest.raises(index.IndexUnreachable) as refused:
            ask()
        assert "took more than 1 s: the index is too slow or trickles" in str(refused.value)
    assert time.monotonic() - started < 15


def _on_stand_in(repo: Path, url: str) -> None:
    matrix = repo / "images.yaml"
    matrix.write_text(matrix.read_text().replace("url: https://pypi.org/simple", f"url: {url}", 1))


@pytest.mark.parametrize("down", [True, False], ids=["down", "html"])
def test_port_against_an_index_that_is_down_or_answers_html_says_so_in_one_line(repo, cli, stand_in, down):
    _on_stand_in(repo, "http://127.0.0.1:9/simple" if down else stand_in)
    Index.answer = (200, "text/html", b"<html>a captive portal</html>")
    code, _, err = cli("--matrix", str(repo / "images.yaml"), "port", "--to", "0.32.0", "--target", "cpu")
    last = err.strip().splitlines()[-1]
    assert code == 1 and "unexpected" not in err and "Traceback" not in err, err
    assert last == ("error: http://127.0.0.1:9/simple could not be reached (ConnectionError)" if down else
                    f"error: {stand_in} does not answer in PEP 691 JSON (it sent text/html)"), last
