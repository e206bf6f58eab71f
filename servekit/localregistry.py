"""A Docker registry on 127.0.0.1 from a config of our own (Debian's docker-registry, distribution 2.8).

The packaged config listens on every interface with htpasswd auth; this one listens on loopback
only, without auth, with its storage in a folder we name. The engine treats 127.0.0.0/8 as an
insecure registry, so pushes over plain HTTP work.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import requests

from .errors import EnvironmentProblem

CONFIG = """version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
"""


def start_registry(storage: Path, port: int, log: Path) -> subprocess.Popen:
    binary = shutil.which("docker-registry") or shutil.which("registry")
    if not binary:
        raise EnvironmentProblem("no docker-registry binary: `python build.py engine --test-tools` installs Debian's docker-registry")
    storage.mkdir(parents=True, exist_ok=True)
    config = storage.parent / f"registry-{port}.yml"
    config.write_text(CONFIG.format(storage=storage, port=port))
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EnvironmentProblem(f"the registry exited at start; see {log}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/v2/", timeout=2).status_code == 200:
                return proc
        except requests.RequestException:
            time.sleep(0.2)
    proc.kill()
    raise EnvironmentProblem(f"the registry on 127.0.0.1:{port} did not answer within 30 s; see {log}")
