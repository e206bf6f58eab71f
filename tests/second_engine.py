"""A second Docker engine on this machine, with its own socket and data folder: what a GPU box's engine
is to a fleet run, here. The tests start it; by hand: `python tests/second_engine.py start|stop`.

It shares this machine's network namespace, so it leaves iptables to the first engine (published
ports go through docker-proxy), has a bridge of its own (`--bridge=none` would delete the first
engine's docker0) and takes its networks from a pool of its own. Its data folder survives a stop,
so an image sent to it once is there the next time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / ".cache" / "second-engine"
RUN = Path("/run/servekit-second-engine")  # socket and exec root: short paths, as unix sockets need
URL = f"unix://{RUN}/docker.sock"
BRIDGE, BRIDGE_ADDRESS = "sk-engine2", "10.212.0.1/24"


def _answers() -> bool:
    got = subprocess.run(["docker", "--host", URL, "version", "--format", "{{.Server.Version}}"],
                         capture_output=True, timeout=20)
    return got.returncode == 0


def _ensure_bridge() -> None:
    if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0:
        return
    for cmd in (["ip", "link", "add", BRIDGE, "type", "bridge"], ["ip", "addr", "add", BRIDGE_ADDRESS, "dev", BRIDGE],
                ["ip", "link", "set", BRIDGE, "up"]):
        subprocess.run(cmd, check=True, capture_output=True)


def start(wait_s: float = 60) -> str:
    """Start it unless it answers already; its DOCKER_HOST URL."""
    if _answers():
        return URL
    _ensure_bridge()
    # Started again over a store that holds its default bridge network, a dockerd with address pools set
    # deletes the interface named docker0 (moby's initNetworkController): the first engine's bridge. An
    # empty network store avoids that; images and volumes stay.
    (DATA / "data" / "network" / "files" / "local-kv.db").unlink(missing_ok=True)
    DATA.mkdir(parents=True, exist_ok=True)
    RUN.mkdir(parents=True, exist_ok=True)
    log = open(DATA / "dockerd.log", "ab")
    subprocess.Popen(["dockerd", "--host", URL, "--data-root", str(DATA / "data"), "--exec-root", str(RUN / "exec"),
                      "--pidfile", str(RUN / "dockerd.pid"), "--iptables=false", "--ip-masq=false",
                      f"--bridge={BRIDGE}",
                      "--default-address-pool", "base=10.213.0.0/16,size=24"],
                     stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + wait_s
    while not _answers():
        if time.monotonic() > deadline:
            tail = (DATA / "dockerd.log").read_text(errors="replace").splitlines()[-5:]
            raise RuntimeError(f"the second engine did not answer within {wait_s:.0f} s: {' | '.join(tail)}")
        time.sleep(0.3)
    return URL


def stop(wait_s: float = 60) -> None:
    pidfile = RUN / "dockerd.pid"
    if not pidfile.exists():
        return
    pid = int(pidfile.read_text().strip())
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # started by this process, it stays a zombie until reaped
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    if sys.argv[1:] == ["start"]:
        print(start())
    elif sys.argv[1:] == ["stop"]:
        stop()
    else:
        sys.exit("usage: python tests/second_engine.py start|stop")
