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


class Dockerd:
    """A dockerd of our own: its socket, data root, bridge and address pool apart from the first engine's."""

    def __init__(self, data: Path, run: Path, bridge: str, bridge_address: str, pool: str):
        self.data, self.run, self.bridge, self.bridge_address, self.pool = data, run, bridge, bridge_address, pool
        self.url = f"unix://{run}/docker.sock"

    def answers(self) -> bool:
        got = subprocess.run(["docker", "--host", self.url, "version", "--format", "{{.Server.Version}}"],
                             capture_output=True, timeout=20)
        return got.returncode == 0

    def _ensure_bridge(self) -> None:
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode == 0:
            return
        for cmd in (["ip", "link", "add", self.bridge, "type", "bridge"],
                    ["ip", "addr", "add", self.bridge_address, "dev", self.bridge],
                    ["ip", "link", "set", self.bridge, "up"]):
            subprocess.run(cmd, check=True, capture_output=True)

    def start(self, wait_s: float = 60) -> str:
        """Start it unless it answers already; its DOCKER_HOST URL."""
        if self.answers():
            return self.url
        self._ensure_bridge()
        # Started again over a store that holds its default bridge network, a dockerd with address pools set
        # deletes the interface named docker0 (moby's initNetworkController): the first engine's bridge. An
        # empty network store avoids that; images and volumes stay.
        (self.data / "data" / "network" / "files" / "local-kv.db").unlink(missing_ok=True)
        self.data.mkdir(parents=True, exist_ok=True)
        self.run.mkdir(parents=True, exist_ok=True)
        log = open(self.data / "dockerd.log", "ab")
        subprocess.Popen(["dockerd", "--host", self.url, "--data-root", str(self.data / "data"),
                          "--exec-root", str(self.run / "exec"), "--pidfile", str(self.run / "dockerd.pid"),
                          "--iptables=false", "--ip-masq=false", f"--bridge={self.bridge}",
                          "--default-address-pool", f"base={self.pool},size=24"],
                         stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + wait_s
        while not self.answers():
            if time.monotonic() > deadline:
                tail = (self.data / "dockerd.log").read_text(errors="replace").splitlines()[-5:]
                raise RuntimeError(f"the engine at {self.url} did not answer within {wait_s:.0f} s: {' | '.join(tail)}")
            time.sleep(0.3)
        return self.url

    def stop(self, wait_s: float = 60) -> None:
        pidfile = self.run / "dockerd.pid"
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


SECOND = Dockerd(DATA, RUN, "sk-engine2", "10.212.0.1/24", "10.213.0.0/16")
URL = SECOND.url


def start(wait_s: float = 60) -> str:
    return SECOND.start(wait_s)


def stop(wait_s: float = 60) -> None:
    SECOND.stop(wait_s)


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
