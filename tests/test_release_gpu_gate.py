"""release's gate for a GPU target: only the image itself, served on a GPU by a Docker engine with NVML's memory, by
image ID, for each required profile; read from reports/ and from the GPU runs committed under docs/gpu/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servekit.config.load import load_matrix
from servekit.errors import CheckFailed
from servekit.records.models import ProfileGate, ReleaseRecord
from servekit.release.publish import gate, summary_text

ROOT = Path(__file__).resolve().parent.parent
IMAGE_ID = "sha256:" + "ab" * 32
GPU_RUN = ROOT / "docs" / "gpu" / "20261201-045103-default-cuda" / "report.json"  # a real H200 run, brought back


def _passing(profile: str, engine: str, gpus: bool) -> dict:
    """The H200 report, as a passing run of `profile` on IMAGE_ID by `engine`, with or without its NVML samples."""
    report = json.loads(GPU_RUN.read_text())
    report.update(profile=profile, engine=engine, passed=True)
    report["image"] = {"tag": "vllm-serve:0.31.0-cuda-test", "id": IMAGE_ID, "arrived": "sent"}
    report["checks"] = [{**c, "status": "passed"} for c in report["checks"]]
    if not gpus:
        report["memory"]["gpus"] = []
    return report


def _write(root: Path, folder: str, name: str, report: dict) -> None:
    (root / folder / name).mkdir(parents=True)
    (root / folder / name / "report.json").write_text(json.dumps(report))


@pytest.fixture
def matrix():
    return load_matrix(ROOT / "images.yaml")


def _required(matrix) -> list[str]:
    return [p for p, spec in matrix.profiles.items() if spec.required_for_release and "cuda" in spec.targets]


def test_committed_gpu_reports_of_this_image_pass_the_gate(matrix, tmp_path):
    for profile in _required(matrix):
        _write(tmp_path, "docs/gpu", f"run-{profile}", _passing(profile, "local", gpus=True))
    found = gate(matrix, "cuda", IMAGE_ID, tmp_path)
    assert sorted(found) == sorted(_required(matrix)) and all(g.report.startswith("docs/gpu/") for g in found.values())
    with pytest.raises(CheckFailed, match="the passing default reports are of another image"):
        gate(matrix, "cuda", "sha256:" + "cd" * 32, tmp_path)


@pytest.mark.parametrize("engine,gpus,said", [
    ("venv:/root/vllm-cuda", True, "served by the process engine (venv:/root/vllm-cuda), not by the image"),
    ("local", False, "no GPU memory samples"),
])
def test_a_passing_report_that_is_no_gpu_proof_is_refused(matrix, tmp_path, engine, gpus, said):
    for profile in _required(matrix):
        _write(tmp_path, "reports", f"run-{profile}", _passing(profile, engine, gpus))
    with pytest.raises(CheckFailed, match="is no GPU proof") as refused:
        gate(matrix, "cuda", IMAGE_ID, tmp_path)
    assert said in str(refused.value)


def test_without_reports_the_gpu_target_is_refused(matrix, tmp_path):
    with pytest.raises(CheckFailed, match="no passing default report"):
        gate(matrix, "cuda", IMAGE_ID, tmp_path)


def test_the_release_summary_counts_a_check_not_required_apart(matrix):
    """As alternative on the stand-in, whose spec_decode is not required (a random drafter): 2 of 2 passed and 1 not
    required, where it read 2/3 passed."""
    checks = {"health": "passed", "logs": "passed", "spec_decode": "not_required"}
    gate_of_alternative = ProfileGate(report="docs/gpu/x/report.json", passed=True, run_id="x", checks=checks)
    record = ReleaseRecord(target="cuda", repository="127.0.0.1:5000/serve/vllm-serve", tags=["v0.31.0-cuda"],
                           registry_digest="sha256:" + "ef" * 32, image_id=IMAGE_ID, content_digest="6ef256cc6fea",
                           pins={"vllm": "0.31.0"}, smoke={"alternative": gate_of_alternative})
    assert "alternative: 2/2 checks passed, 1 not required (docs/gpu/x/report.json)" in summary_text(matrix, [record])
