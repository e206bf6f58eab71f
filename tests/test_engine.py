"""The engine that `make engine` provides: idempotent, and `doctor` reports it."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from support import run_build_py

from servekit.machine.doctor import disk_finding

pytestmark = pytest.mark.engine


def _dockerd_pids() -> set[str]:
    """The dockerds on the machine's own socket: those started without --host (the tests' second and throwaway
    engines, which other workers start and stop meanwhile, each name their own)."""
    found = subprocess.run(["pgrep", "-x", "dockerd"], capture_output=True, text=True).stdout.split()
    ours = set()
    for pid in found:
        try:
            if b"--host" not in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                ours.add(pid)
        except OSError:  # gone meanwhile: a throwaway stopped
            continue
    return ours


def test_engine_is_idempotent_and_starts_nothing_twice():
    first = run_build_py("engine")
    assert first.returncode == 0, first.stderr
    pids = _dockerd_pids()
    second = run_build_py("engine")
    assert second.returncode == 0, second.stderr
    assert "ready" in second.stdout
    assert second.stderr == ""  # nothing installed, started or built the second time
    assert _dockerd_pids() == pids


def test_doctor_reports_engine_compose_builder_and_no_gpu():
    result = run_build_py("doctor", "--json")
    findings = {f["name"]: f for f in json.loads(result.stdout)}
    failed = [name for name, f in findings.items() if f["status"] == "fail"]
    assert result.returncode == (1 if failed else 0), result.stdout + result.stderr
    # This machine's free disk is the host's to give (it has been 287 MB to 80 GB), so the disk row may fail;
    # nothing else may, and the disk row must judge the figure it shows.
    assert set(failed) <= {"disk"}, result.stdout
    assert findings["engine"]["status"] == "ok" and "API 1." in findings["engine"]["detail"]
    assert findings["compose"]["status"] == "ok"
    assert findings["builder"]["status"] == "ok"
    disk = findings["disk"]
    shown = re.match(r"(\d+) GB free for images at /", disk["detail"])
    assert shown, disk
    shown_gb = int(shown[1])  # rounded: the figure was within half a GB of it
    assert disk["status"] in {disk_finding(int((shown_gb + d) * 1e9), "/").status for d in (-0.5, 0.49)}, disk
    assert ("gpu container" in findings) == (findings["gpu access"]["status"] == "ok")  # tried where it can be
    gpus = findings["gpus"]  # a GPU host lists its cards; elsewhere a warning says why none is seen
    assert (gpus["status"] == "ok" and "GiB" in gpus["detail"]) or (gpus["status"] == "warn" and gpus["fix"])
    assert findings["base bookworm-local"]["status"] == "ok"
    assert findings["base cuda-devel"]["status"] == "warn" and "--base" in findings["base cuda-devel"]["fix"]


def test_plan_knows_whether_an_image_exists():
    result = run_build_py("plan", "--json")
    assert result.returncode == 0
    assert all(t["exists"] in (True, False) for t in json.loads(result.stdout)["targets"])


def test_doctor_tries_the_gpu_with_an_image_built_here_before_the_bases(cpu_image):
    from support import ROOT

    from servekit.config.load import load_matrix
    from servekit.engines.docker import local
    from servekit.machine.doctor import images_to_try
    matrix = load_matrix(ROOT / "images.yaml")
    images = images_to_try(local(), matrix)
    bases = [base.image for base in matrix.bases.values()]
    assert cpu_image in images and images.index(cpu_image) < len(images) - len(bases) and images[-len(bases):] == bases
