"""A cold `make demo`, as on a fresh machine of this kind: no engine, no venv, an empty builder cache.

Two pieces, each measured for real and then summed:
1. Nothing to an answering engine: in a fresh Debian container (a clean clone of HEAD mounted, nothing in it but
   Python and make), `make venv` (from requirements.lock) and `make engine`, which installs Debian's docker.io and
   Compose v2 (and, checked, neither a registry nor an SSH server). Starting dockerd needs privileges a container
   does not get here, so that step is timed on this machine: a dockerd on an empty data root.
2. An answering but empty engine to a passing report: `make venv` and `make demo` in another clean clone against
   that dockerd (no image, no builder cache, no pip cache mount).
Prints each piece and the parts of the second: the venv, the base image made here, the wheel stage, the rest
of the build, the boot and the checks. Touches neither the checkout nor the developer's engine (its own
clones, dockerd, bridge and port); everything it made is removed at the end.

Run as root (dockerd, a bridge, a privileged container): .venv/bin/python bench/demo_cold.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from second_engine import Dockerd  # noqa: E402

WORK = ROOT / ".cache" / "bench-cold"
LOGS = ROOT / "logs"
FRESH_DEBIAN = "servekit/bookworm-python:3.11"  # the base the project makes here: Debian with Python, nothing else
# (the bench runs on a machine that has made it once; it is the developer's engine that runs this container)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clone(name: str) -> Path:
    dest = WORK / name
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(dest)], check=True)
    matrix = dest / "images.yaml"  # its own port: a developer's server on 8000 stays as it is
    matrix.write_text(matrix.read_text().replace("\n  port: 8000\n", f"\n  port: {_free_port()}\n"))
    return dest


def _timed(cmd: list[str], cwd: Path, env: dict, log: Path) -> float:
    started = time.monotonic()
    with open(log, "ab") as out:
        done = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=3600)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {done.returncode}); see {log}")
    return time.monotonic() - started


def engine_from_nothing() -> dict[str, float]:
    """`make venv` and `make engine` in a fresh Debian container, timed inside it. `make engine` installs what is
    missing first, then starts dockerd, which a container here may not run: that last step's refusal is expected,
    and what was installed by then is checked (docker.io and Compose; no registry, no SSH server)."""
    repo = _clone("engine-clone")
    script = ("set -e; apt-get update -qq && apt-get install -y -qq make >/dev/null && rm -rf /var/lib/apt/lists/*; "
              "t0=$(date +%s.%N); make venv >/dev/null; t1=$(date +%s.%N); make engine || true; t2=$(date +%s.%N); "
              "docker compose version; for p in docker.io docker-registry openssh-server; do "
              "if dpkg-query -W -f='${Status}' $p 2>/dev/null | grep -q 'ok installed'; then echo \"$p installed\"; "
              "else echo \"$p absent\"; fi; done; "
              "echo \"TIMES $t0 $t1 $t2\"")
    from servekit.trust import ca_bundle
    bundle = ca_bundle()  # this machine's CA bundle (a TLS-intercepting proxy's CA): a fresh machine of its kind has it
    trust = ["-v", f"{bundle}:/etc/ssl/certs/ca-certificates.crt:ro", "-e",
             "PIP_CERT=/etc/ssl/certs/ca-certificates.crt"] if bundle else []
    done = subprocess.run(["docker", "run", "--rm", *trust, "-v", f"{repo}:/src", "-w", "/src", FRESH_DEBIAN, "sh",
                           "-c", script], capture_output=True, text=True, timeout=1800)
    log = LOGS / "bench-cold-engine.log"
    log.write_text(done.stdout + done.stderr)
    times = re.search(r"TIMES (\S+) (\S+) (\S+)", done.stdout)
    installed = "docker.io installed" in done.stdout and "Docker Compose version" in done.stdout
    extra = [p for p in ("docker-registry", "openssh-server") if f"{p} absent" not in done.stdout]
    if done.returncode != 0 or not times or not installed or extra:
        sys.exit(f"make engine in a fresh container did not install docker.io and Compose alone ({extra or 'see'} "
                 f"{log})")
    t0, t1, t2 = map(float, times.groups())
    return {"venv": t1 - t0, "install": t2 - t1}


def _build_steps(log: Path) -> dict[str, float]:
    """Seconds of the wheel stage and of the build's other steps, from BuildKit's plain log (its steps run one
    after another here, so their sum is the build's time)."""
    text = log.read_text(errors="replace")
    installs = set(re.findall(r"^#(\d+) \[image wheels \d+/\d+\] RUN", text, re.M))  # one per layer of the lock
    done = {m[1]: float(m[2]) for m in re.finditer(r"^#(\d+) DONE ([0-9.]+)s", text, re.M)}
    wheels = sum(done.get(step, 0.0) for step in installs)
    return {"wheels": wheels, "other build steps": sum(done.values()) - wheels}


BRIDGE, NET = "sk-bench", "10.214.0.0/24"


def _nat(add: bool) -> None:
    """The bench's dockerd leaves iptables to the first engine, so its containers (the build's pip among them) reach
    out through rules of ours: masquerade its bridge, and forward it in DOCKER-USER, the chain Docker leaves to
    users."""
    chain = "DOCKER-USER" if subprocess.run(["iptables", "-S", "DOCKER-USER"], capture_output=True).returncode == 0 \
        else "FORWARD"
    rules = [("nat", "POSTROUTING", ["-s", NET, "!", "-o", BRIDGE, "-j", "MASQUERADE"]),
             ("filter", chain, ["-i", BRIDGE, "-j", "ACCEPT"]),
             ("filter", chain, ["-o", BRIDGE, "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"])]
    for table, where, rule in rules:
        subprocess.run(["iptables", "-t", table, "-I" if add else "-D", where, *rule], capture_output=True,
                       check=add)


def demo_on_an_empty_engine() -> dict[str, float]:
    repo = _clone("demo-clone")
    engine = Dockerd(WORK / "engine", Path("/run/servekit-bench-engine"), BRIDGE, "10.214.0.1/24", "10.215.0.0/16")
    started = time.monotonic()
    engine.start()
    parts = {"dockerd start": time.monotonic() - started}
    _nat(True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "DOCKER_CONTEXT")}
    env["DOCKER_HOST"] = engine.url
    try:
        log = LOGS / "bench-cold-demo.log"
        log.unlink(missing_ok=True)
        parts["venv"] = _timed(["make", "venv"], repo, env, log)
        demo = _timed(["make", "demo"], repo, env, log)
        said = log.read_text(errors="replace")
        made = re.search(r"base \S+ \(\S+\) made in ([0-9.]+) s", said)
        report = json.loads((repo / "reports" / "latest" / "report.json").read_text())
        phases = dict(report["boot"]["phases"])
        parts["base image"] = float(made[1]) if made else 0.0
        builds = sorted((repo / "logs").glob("build-cpu-*.log"))
        parts.update(_build_steps(builds[-1]) if builds else {"wheels": 0.0, "other build steps": 0.0})
        parts["boot to healthy"] = phases.get("healthy", 0.0)
        parts["checks"] = phases.get("end", 0.0) - phases.get("traffic", 0.0)
        parts["everything else"] = demo - sum(v for k, v in parts.items() if k not in ("venv", "dockerd start"))
        parts["make demo"] = demo
        if not report["passed"]:
            sys.exit(f"the demo did not pass; see {repo / 'reports' / 'latest' / 'report.md'}")
        return parts
    finally:
        subprocess.run(["make", "down"], cwd=repo, env=env, capture_output=True, timeout=300)
        engine.stop()
        _nat(False)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def main() -> int:
    if os.geteuid() != 0:
        sys.exit("run as root: the bench starts a dockerd, a bridge and a privileged container")
    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True)
    LOGS.mkdir(exist_ok=True)
    try:
        first = engine_from_nothing()
        second = demo_on_an_empty_engine()
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    total = first["venv"] + first["install"] + second["dockerd start"] + second["make demo"]
    print(f"cold make demo: {total:.0f} s ({total / 60:.1f} min), the goal is 180 s")
    print(f"  1. nothing to an answering engine: venv {first['venv']:.0f} s, make engine's install (docker.io and "
          f"Compose; no registry, no SSH server) {first['install']:.0f} s, dockerd start {second['dockerd start']:.1f} s")
    print(f"  2. an empty engine to a passing report: make demo {second['make demo']:.0f} s "
          f"(its own venv {second['venv']:.0f} s is piece 1's, not counted twice)")
    for name in ("base image", "wheels", "other build steps", "boot to healthy", "checks", "everything else"):
        print(f"     {name:18} {second[name]:6.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
