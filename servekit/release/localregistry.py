"""A Docker registry on 127.0.0.1 from a config of our own (Debian's docker-registry, distribution 2.8).

The packaged config listens on every interface with htpasswd auth; this one listens on loopback
only, with its storage in a folder we name, open or (given an htpasswd file) behind a login. The
engine treats 127.0.0.0/8 as an insecure registry, so pushes over plain HTTP work, logins too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import shutil
import subprocess
from pathlib import Path

import requests

from servekit.errors import EnvironmentProblem
from servekit.waiting import until

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
HTPASSWD = """auth:
  htpasswd:
    realm: servekit
    path: {path}
"""


def htpasswd_line(user: str, password: str) -> str:
    """`user:bcrypt-hash`, the one hash the registry's htpasswd accepts, from the system's libcrypt (libxcrypt)."""
    lib = ctypes.CDLL(ctypes.util.find_library("crypt") or "libcrypt.so.1")
    lib.crypt_gensalt.restype = lib.crypt.restype = ctypes.c_char_p
    lib.crypt_gensalt.argtypes = [ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p, ctypes.c_int]
    salt = lib.crypt_gensalt(b"$2b$", 10, None, 0)
    hashed = lib.crypt(password.encode(), salt) if salt else None
    if not hashed or not hashed.startswith(b"$2b$"):
        raise EnvironmentProblem("this system's libcrypt makes no bcrypt hashes; the registry's htpasswd needs them")
    return f"{user}:{hashed.decode()}"


def start_registry(storage: Path, port: int, log: Path, htpasswd: Path | None = None) -> subprocess.Popen:
    """The registry on 127.0.0.1:port, answering; behind a login when `htpasswd` names its users' file."""
    binary = shutil.which("docker-registry") or shutil.which("registry")
    if not binary:
        raise EnvironmentProblem("no docker-registry binary: `python3 build.py engine --test-tools` installs Debian's docker-registry")
    storage.mkdir(parents=True, exist_ok=True)
    config = storage.parent / f"registry-{port}.yml"
    config.write_text(CONFIG.format(storage=storage, port=port) + (HTPASSWD.format(path=htpasswd) if htpasswd else ""))
    with open(log, "ab") as sink:  # the child's own descriptor once it started
        proc = subprocess.Popen([binary, "serve", str(config)], stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    def answers() -> bool:
        if proc.poll() is not None:
            raise EnvironmentProblem(f"the registry exited at start; see {log}")
        try:
            return requests.get(f"http://127.0.0.1:{port}/v2/", timeout=2).status_code in (200, 401)
        except requests.RequestException:
            return False
    if until(answers, 30, 0.2):
        return proc
    proc.kill()
    raise EnvironmentProblem(f"the registry on 127.0.0.1:{port} did not answer within 30 s; see {log}")
