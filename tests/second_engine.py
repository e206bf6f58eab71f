"""A second Docker engine on this machine, with its own socket and data folder: what a GPU box's engine
is to a fleet run, here. The tests start it (conftest's `second` fixture); by hand:
`python tests/second_engine.py start|stop`.

It shares this machine's network namespace, so it leaves iptables to the first engine (published
ports go through docker-proxy), has a bridge of its own (`--bridge=none` would delete the first
engine's docker0) and takes its networks from a pool of its own. Its data folder survives a stop,
so an image sent to it once is there the next time.

Each run of the suite has its own (its slot's: support.SLOT): socket, bridge, address pool and data folder, so
two runs on one machine never share one. Whoever starts a dockerd stops that one, by its process, and waits for it
to exit: a dockerd still shutting down once answered the next user, then took its socket away mid-run.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from servekit.engines.bootstrap import remove_stale_pid_file

ROOT = Path(__file__).resolve().parent.parent


class Dockerd:
    """A dockerd of our own: its socket, data root, bridge and address pool apart from the first engine's."""

    def __init__(self, data: Path, run: Path, bridge: str, bridge_address: str, pool: str, orphans_stop: bool = False):
        self.data, self.run, self.bridge, self.bridge_address, self.pool = data, run, bridge, bridge_address, pool
        self.url = f"unix://{run}/docker.sock"
        self.proc: subprocess.Popen | None = None  # the dockerd this object started, the only one it stops
        # A throwaway's socket belongs to the run holding its slot: a dockerd found there is a killed run's orphan.
        self.orphans_stop = orphans_stop

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

    def _remove_orphan_bridges(self) -> None:
        """Delete the bridges an earlier dockerd of this engine made for its networks and left behind: their routes
        sit in this engine's own pool, and a dockerd whose network store was dropped (start() below) no longer knows
        them, so it finds every subnet of the pool overlapping and creates no network at all."""
        pool = ipaddress.ip_network(self.pool)
        links = json.loads(subprocess.run(["ip", "-j", "addr", "show", "type", "bridge"], capture_output=True,
                                          text=True, check=True).stdout or "[]")
        for link in links:
            if link["ifname"] == self.bridge:
                continue
            if any(a.get("family") == "inet" and ipaddress.ip_address(a["local"]) in pool
                   for a in link.get("addr_info", [])):
                subprocess.run(["ip", "link", "del", link["ifname"]], capture_output=True, check=True)

    def start(self, wait_s: float = 60) -> bool:
        """Start it unless it answers already (left to whoever started it, but for a throwaway's orphan, which is
        stopped first); True when this call started it."""
        if self.orphans_stop:
            self.stop_by_pid_file()
        if self.answers():
            return False
        self._ensure_bridge()
        # Started again over a store that holds its default bridge network, a dockerd with address pools set
        # deletes the interface named docker0 (moby's initNetworkController): the first engine's bridge. An
        # empty network store avoids that; images and volumes stay.
        (self.data / "data" / "network" / "files" / "local-kv.db").unlink(missing_ok=True)
        self._remove_orphan_bridges()
        self._stop_leftover_containerd()  # a killed run's: else this dockerd waits on it and gives up
        remove_stale_pid_file(self.run / "dockerd.pid", "dockerd")  # a stopped machine's: else "pid file found"
        self.data.mkdir(parents=True, exist_ok=True)
        self.run.mkdir(parents=True, exist_ok=True)
        with open(self.data / "dockerd.log", "ab") as log:  # the child's own descriptor once it started
            self.proc = subprocess.Popen(["dockerd", "--host", self.url, "--data-root", str(self.data / "data"),
                                          "--exec-root", str(self.run / "exec"), "--pidfile",
                                          str(self.run / "dockerd.pid"), "--iptables=false", "--ip-masq=false",
                                          f"--bridge={self.bridge}", "--default-address-pool",
                                          f"base={self.pool},size=24"],
                                         stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + wait_s
        while not self.answers():
            if time.monotonic() > deadline:
                tail = (self.data / "dockerd.log").read_text(errors="replace").splitlines()[-5:]
                raise RuntimeError(f"the engine at {self.url} did not answer within {wait_s:.0f} s: {' | '.join(tail)}")
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine at {self.url} exited at start ({self.proc.returncode}); see "
                                   f"{self.data / 'dockerd.log'}")
            time.sleep(0.3)
        return True

    def stop(self, grace_s: float = 120) -> None:
        """Stop the dockerd this object started and wait until it has exited (SIGKILL after `grace_s`: it stops
        its containers first); one it did not start is left alone."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.proc = None
        self._leftovers_gone()

    def stop_by_pid_file(self, grace_s: float = 120) -> None:
        """The dockerd its pid file names (one started by hand, or left running by a run killed before its
        teardown): SIGTERM, and wait until it has exited (its pid file goes with it)."""
        pidfile = self.run / "dockerd.pid"
        try:
            pid = int(pidfile.read_text().strip())
            # only that dockerd (its command line names this run folder): a stale file's pid may be anyone's now
            if str(self.run).encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
                return
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):  # no pid file, or its dockerd is gone already
            return
        deadline = time.monotonic() + grace_s
        while pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.3)
        if not pidfile.exists():
            self._leftovers_gone()

    def _leftovers_gone(self) -> None:
        """What a dockerd that did not shut down cleanly (killed) leaves behind, gone: its containerd and its mounts."""
        self._stop_leftover_containerd()
        self._unmount_leftovers()

    def _stop_leftover_containerd(self, grace_s: float = 30) -> None:
        """The containerd a killed dockerd started, still running on this engine's exec root, and its pid file: the
        next dockerd here finds the pid alive, takes it for its own containerd and waits for a socket that never
        comes ("timeout waiting for containerd to start"). Only a containerd whose command line names this exec
        root: a stale file's pid may be anyone's."""
        pidfile = self.run / "exec" / "containerd" / "containerd.pid"
        try:
            pid = int(pidfile.read_text().strip())
            if str(self.run / "exec").encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)  # its dockerd is gone: nothing of it is worth a clean stop
                deadline = time.monotonic() + grace_s
                while _alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.1)
        except (OSError, ValueError):  # no file, or its process is gone already
            pass
        pidfile.unlink(missing_ok=True)

    def _unmount_leftovers(self) -> None:
        """What a dockerd that did not shut down cleanly left mounted under its data root, deepest first: it binds
        the root onto itself (and its containers' layers under it) and unmounts them only on a clean shutdown, and a
        mount left there makes the folder impossible to remove (pytest's clean-up then warns into every later run
        on the machine)."""
        root = str(self.data / "data")
        points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        for point in sorted((p for p in points if p == root or p.startswith(root + "/")), key=len, reverse=True):
            subprocess.run(["umount", point], capture_output=True)

    def remove_bridge(self) -> None:
        """The bridge start() made (a throwaway's, once its dockerd is stopped)."""
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _alive(pid: int) -> bool:
    """Whether `pid` runs: not gone, and not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class SocketWatch:
    """Looks every second whether the engine's socket file is still there; the first time it is not while the engine
    answers to its pid file, writes what ran on the machine then into the engine's folder and says so on stderr.
    (A loaded flake-finder round lost this socket under a running dockerd, and nothing logged who took it.)"""

    def __init__(self, engine: Dockerd, period_s: float = 1.0):
        self.engine, self.period_s = engine, period_s
        self.socket = Path(engine.url.removeprefix("unix://"))
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="second-engine-socket-watch")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._done.wait(self.period_s):
            pidfile = self.engine.run / "dockerd.pid"
            if self.socket.exists() or not pidfile.exists():
                continue
            stamp = time.strftime("%Y%m%d-%H%M%S")
            listing = subprocess.run(["ps", "-eo", "pid,ppid,lstart,args"], capture_output=True, text=True).stdout
            report = self.engine.data / f"socket-gone-{stamp}.txt"
            report.write_text(f"{self.socket} gone at {stamp} with dockerd {pidfile.read_text().strip()} running\n"
                              f"{listing}")
            print(f"second engine: {self.socket} is gone under a running dockerd; what ran: {report}",
                  file=sys.stderr)
            return


def for_slot(slot: int) -> Dockerd:
    """The second engine of the suite's slot `slot` (slot 0 keeps the names it always had)."""
    suffix = f"-{slot}" if slot else ""
    return Dockerd(ROOT / ".cache" / f"second-engine{suffix}", Path(f"/run/servekit-second-engine{suffix}"),
                   f"sk-engine2{suffix}", f"10.212.{slot}.1/24", f"10.213.{16 * slot}.0/20")


def throwaway(data: Path, slot: int) -> Dockerd:
    """A dockerd of one test's own (its data in `data`), for what must stop and start an engine: never the shared
    one, which other tests of the run may be using."""
    return Dockerd(data, Path(f"/run/servekit-throwaway-engine-{slot}"), f"sk-throwaway-{slot}",
                   f"10.212.{100 + slot}.1/24", f"10.216.{16 * slot}.0/20", orphans_stop=True)


if __name__ == "__main__":
    engine = for_slot(int(os.environ.get("SERVEKIT_TEST_SLOT", "0")))
    if sys.argv[1:] == ["start"]:
        engine.start()
        print(engine.url)  # left running: `stop` below finds it by its pid file
    elif sys.argv[1:] == ["stop"]:
        engine.stop_by_pid_file()
    else:
        sys.exit("usage: python tests/second_engine.py start|stop")
