"""The burst client must never be the bottleneck: its rate against a trivial local HTTP server,
next to the rate the demo model serves (from reports/latest, or a number you pass).

Run: .venv/bin/python bench/burst_client.py [--served-rps N]
"""

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from servekit.smoke import Context  # noqa: E402
from servekit.smoke.load import burst_requests  # noqa: E402

BODY = json.dumps({"usage": {"completion_tokens": 32}}).encode()


class Trivial(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--served-rps", type=float, help="requests/s the demo model served in the burst check")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Trivial)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ctx = Context(f"http://127.0.0.1:{server.server_address[1]}", "k", "m", timeout_s=30)

    def send(i, session):
        r = ctx.post("/v1/chat/completions", {"model": "m", "messages": []}, session=session)
        return r.status_code, r.json()["usage"]["completion_tokens"]
    results, seconds = burst_requests(send, args.clients, args.requests)
    server.shutdown()
    assert all(status == 200 for status, _ in results)
    client_rps = args.requests / seconds
    served = args.served_rps
    if served is None:
        report = ROOT / "reports" / "latest" / "report.json"
        burst = next((c for c in json.loads(report.read_text())["checks"] if c["name"] == "burst"), None) \
            if report.exists() else None
        served = burst["figures"]["requests_per_s"] if burst else None
    print(f"burst client against a trivial local server: {client_rps:,.0f} requests/s "
          f"({args.clients} clients, {args.requests} requests, {seconds:.2f} s)")
    if served:
        print(f"demo model served in the burst check: {served:,.1f} requests/s; client headroom "
              f"{client_rps / served:.1f}x (goal: at least 10x)")


if __name__ == "__main__":
    main()
