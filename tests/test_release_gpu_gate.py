"""release's gate for a GPU target: only the image itself, served on a GPU by a Docker engine with NVML's memory, by
image ID, for each required profile; read from reports/ and from the GPU runs committed under docs/gpu/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servekit.config.load import load_matrix
from servekit.engines.card import mps_cap_bytes
from servekit.errors import CheckFailed
from servekit.records.models import ProfileGate, ReleaseRecord, RunReport
from servekit.release.gate import gate, size_proof_problem
from servekit.release.publish import summary_text

ROOT = Path(__file__).resolve().parent.parent
IMAGE_ID = "sha256:" + "ab" * 32
GPU_RUN = ROOT / "docs" / "gpu" / "20261201-045103-default-cuda" / "report.json"  # a real H200 run, brought back


MATRIX = load_matrix(ROOT / "images.yaml")


def _passing(profile: str, engine: str, gpus: bool) -> dict:
    """The H200 report, as a passing run of `profile` on IMAGE_ID by `engine` with every check images.yaml requires
    of it, with or without its NVML samples."""
    report = json.loads(GPU_RUN.read_text())
    report.update(profile=profile, engine=engine, passed=True, notes=[])
    report["image"] = {"tag": "vllm-serve:0.31.0-cuda-test", "id": IMAGE_ID, "arrived": "sent"}
    report["checks"] = [{"name": name, "status": "passed", "reason": "", "figures": {"n": 1.5}, "seconds": 1.0}
                        for name in MATRIX.profile_checks(profile, "cuda", report["host"])]
    if not gpus:
        report["memory"]["gpus"] = []
    return report


RANDOM = "qwen38-27b-random"  # the served checkpoint's layout with random weights: it proves size, not function
CARD = round(23.56 * 2**30)


def _full_size(profile: str, peak: int = CARD - 2**28) -> dict:
    """A passing run of `profile` at full size on an emulated 3090: the random-weight stand-in, its excused checks
    not required, the card's memory as the report carries it."""
    report = _passing(profile, "local", gpus=True)
    excused = MATRIX.not_required(profile, "cuda", RANDOM)
    report.update(stand_in=RANDOM, card={"card": "rtx3090", "description": "NVIDIA GeForce RTX 3090, 24 GB",
                                         "total_bytes": CARD, "cuda_arch": "8.6", "forced": [],
                                         "emulated_on": {"name": "NVIDIA H200", "total_bytes": 150 * 2**30,
                                                         "cuda_arch": "9.0"}})
    report["checks"] = [{**c, "status": "not_required" if c["name"] in excused else "passed"}
                        for c in report["checks"]] + [
        {"name": name, "status": "not_required", "reason": why, "figures": {}, "seconds": 0.0}
        for name, why in excused.items() if name not in {c["name"] for c in report["checks"]}]
    report["memory"]["gpus"] = [{**report["memory"]["gpus"][0], "total_bytes": CARD, "peak_used_bytes": peak}]
    return report


def _write_full_size(root: Path) -> None:
    for profile in _required(MATRIX):
        _write(root, "docs/gpu", f"size-{profile}", _full_size(profile))


def _write(root: Path, folder: str, name: str, report: dict) -> None:
    (root / folder / name).mkdir(parents=True)
    (root / folder / name / "report.json").write_text(json.dumps(report))


@pytest.fixture
def matrix():
    return MATRIX


def _required(matrix) -> list[str]:
    return [p for p, spec in matrix.profiles.items() if spec.required_for_release and "cuda" in spec.targets]


def test_committed_gpu_reports_of_this_image_pass_the_gate(matrix, tmp_path):
    for profile in _required(matrix):
        _write(tmp_path, "docs/gpu", f"run-{profile}", _passing(profile, "local", gpus=True))
    _write_full_size(tmp_path)
    found = gate(matrix, "cuda", IMAGE_ID, tmp_path)
    assert sorted(found) == sorted(_required(matrix)) and all(g.report.startswith("docs/gpu/") for g in found.values())
    # which report proves what: the working one its checks, the full-size one the fit
    assert all(g.report.startswith("docs/gpu/run-") and g.size_report.startswith("docs/gpu/size-")
               for g in found.values() if g.size_report)
    with pytest.raises(CheckFailed, match="the passing default reports are of another image"):
        gate(matrix, "cuda", "sha256:" + "cd" * 32, tmp_path)


@pytest.mark.parametrize("engine,served_from,gpus,said", [
    # written at run time by the engine that served it; a report from before the field, by the engine's name
    ("venv:/root/vllm-cuda", "environment", True, "served from an environment (venv:/root/vllm-cuda), not by the image"),
    ("venv:/root/vllm-cuda", None, True, "served from an environment (venv:/root/vllm-cuda), not by the image"),
    ("local", "image", False, "no GPU memory samples"),
])
def test_a_passing_report_that_is_no_gpu_proof_is_refused(matrix, tmp_path, engine, served_from, gpus, said):
    for profile in _required(matrix):
        report = _passing(profile, engine, gpus)
        report.pop("served_from", None)
        if served_from:
            report["served_from"] = served_from
        _write(tmp_path, "reports", f"run-{profile}", report)
    with pytest.raises(CheckFailed, match="proves nothing") as refused:
        gate(matrix, "cuda", IMAGE_ID, tmp_path)
    assert said in str(refused.value)


def test_without_reports_the_gpu_target_is_refused(matrix, tmp_path):
    with pytest.raises(CheckFailed, match="no passing default report"):
        gate(matrix, "cuda", IMAGE_ID, tmp_path)


def test_a_gpu_release_needs_a_full_size_report_on_a_24_gb_card_beside_the_working_one(matrix, tmp_path):
    for profile in _required(matrix):
        _write(tmp_path, "docs/gpu", f"run-{profile}", _passing(profile, "local", gpus=True))
    with pytest.raises(CheckFailed, match="no passing full-size default report on a 24 GB card .*--card rtx3090"):
        gate(matrix, "cuda", IMAGE_ID, tmp_path)
    # the fit past the card's memory proves nothing, and says why
    _write(tmp_path, "docs/gpu", "size-default", _full_size("default", peak=CARD + 2**26))
    with pytest.raises(CheckFailed, match="passed the memory of the card it emulated"):
        gate(matrix, "cuda", IMAGE_ID, tmp_path)


def _card_of_nothing(r): r["card"] = {}
def _a_card_images_yaml_does_not_name(r): r["card"]["card"] = "a100-80gb"
def _an_emulated_80_gib_card(r):
    r["card"]["total_bytes"] = r["memory"]["gpus"][0]["total_bytes"] = 80 * 2**30
def _a_peak_of_nothing(r): r["memory"]["gpus"][0]["peak_used_bytes"] = 0
def _a_total_not_a_number(r): r["memory"]["gpus"][0]["total_bytes"] = float("nan")
def _a_total_of_10_to_the_30(r): r["card"]["total_bytes"] = r["memory"]["gpus"][0]["total_bytes"] = 10**30
def _a_total_of_400_digits(r): r["memory"]["gpus"][0]["total_bytes"] = int("9" * 400)
def _a_peak_past_its_card(r): r["memory"]["gpus"][0]["peak_used_bytes"] = CARD + 1
def _no_card_on_a_big_gpu(r):  # the H200's own memory, no emulation
    r["card"], r["memory"]["gpus"][0]["total_bytes"] = None, 150 * 2**30


@pytest.mark.parametrize("forge,says", [
    (_card_of_nothing, "could not be read, the last: docs/gpu/size-default/report.json: card.card: Field required"),
    (_a_card_images_yaml_does_not_name, "the card it emulated ('a100-80gb') is none of images.yaml's"),
    (_an_emulated_80_gib_card, "holds 85899345920 bytes, not the 25,297,357,373 images.yaml gives it"),
    (_a_peak_of_nothing, "peaks at 0 bytes"),
    (_a_total_not_a_number, "memory.gpus.0.total_bytes: Input should be a finite number"),
    (_a_total_of_10_to_the_30, "card.total_bytes: Input should be less than or equal to 4611686018427387904"),
    (_a_total_of_400_digits, "memory.gpus.0.total_bytes: Input should be less than or equal to"),
    (_a_peak_past_its_card, "passed the memory of the card it emulated"),
    (_no_card_on_a_big_gpu, "not a 24 GB card"),
], ids=lambda v: v.__name__.strip("_") if callable(v) else "")
def test_a_forged_full_size_proof_is_refused_with_why(matrix, tmp_path, forge, says):
    """The gate reads a size proof as an auditor would: a card of images.yaml with its bytes as the matrix has them,
    a positive, finite peak within it; a report that says otherwise proves no fit, and the refusal says why."""
    for profile in _required(matrix):
        _write(tmp_path, "docs/gpu", f"run-{profile}", _passing(profile, "local", gpus=True))
        report = _full_size(profile)
        if profile == "default":
            forge(report)
        _write(tmp_path, "docs/gpu", f"size-{profile}", report)
    with pytest.raises(CheckFailed, match="no passing full-size default report on a 24 GB card") as refused:
        gate(matrix, "cuda", IMAGE_ID, tmp_path)
    assert says in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_random_weights_prove_the_fit_but_not_the_answers(matrix, tmp_path):
    _write_full_size(tmp_path)
    with pytest.raises(CheckFailed, match="no passing default report .* served a model whose answers prove nothing"):
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


# --- a report that says it passed and proves nothing (the hostile corpus of the gate) --------------------------

def _no_checks(r): r["checks"] = []
def _one_check_of_fifteen(r): r["checks"] = [c for c in r["checks"] if c["name"] == "health"]  # `run --check health`
def _required_called_not_required(r): r["checks"][0]["status"] = "not_required"
def _a_check_twice(r): r["checks"].append(dict(r["checks"][0]))
def _a_figure_not_finite(r): r["checks"][1]["figures"] = {"tokens_per_s": float("nan")}
def _an_infinite_boot(r): r["boot"]["time_to_healthy_s"] = float("inf")
def _an_empty_gpu_entry(r): r["memory"]["gpus"] = [{}]
def _a_gpu_of_no_memory(r): r["memory"]["gpus"][0]["total_bytes"] = 0
def _a_peak_past_the_card(r): r["memory"]["gpus"][0]["peak_used_bytes"] = r["memory"]["gpus"][0]["total_bytes"] + 1
def _a_peak_in_words(r): r["memory"]["gpus"][0]["peak_used_bytes"] = "a lot"
def _an_unknown_host(r): r["host"] = "laptop"
def _an_unknown_stand_in(r): r["stand_in"] = "gpt-5"


@pytest.mark.parametrize("mutate,says", [
    (_no_checks, "holds 0 of the 15 checks"),
    (_one_check_of_fifteen, "holds 1 of the 15 checks"),
    (_required_called_not_required, "not required, and images.yaml requires it"),
    (_a_check_twice, "more than once"),
    (_a_figure_not_finite, "not finite"),
    (_an_infinite_boot, "boot.time_to_healthy_s: Input should be a finite number"),
    (_an_empty_gpu_entry, "memory.gpus.0.index: Field required"),
    (_a_gpu_of_no_memory, "is not a measurement"),
    (_a_peak_past_the_card, "is not a measurement"),
    (_a_peak_in_words, "memory.gpus.0.peak_used_bytes: Input should be a valid integer"),
    (_an_unknown_host, "its host 'laptop' is none of"),
    (_an_unknown_stand_in, "a model images.yaml does not name"),
], ids=lambda v: v.__name__.strip("_") if callable(v) else "")
def test_a_report_that_says_it_passed_but_proves_nothing_is_refused_with_why(matrix, tmp_path, mutate, says):
    for profile in _required(matrix):
        report = _passing(profile, "local", gpus=True)
        if profile == "default":
            mutate(report)
        _write(tmp_path, "docs/gpu", f"run-{profile}", report)
    # judged by the gate, or refused where the report is read (a number that is none, an entry of nothing)
    with pytest.raises(CheckFailed, match="the passing default report of sha256:abab.* proves nothing|no passing "
                       "default report for image sha256:abab.* could not be read") as refused:
        gate(matrix, "cuda", IMAGE_ID, tmp_path)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_stand_ins_report_is_judged_by_the_checks_images_yaml_gives_that_model(matrix, tmp_path):
    """The stand-in's drafter is random, so alternative's spec_decode is not required of it: its report may say so,
    and the same report of the target's own model may not."""
    stand_in = next(name for name, m in matrix.models.items() if m.stands_in_for == matrix.targets["cuda"].model)
    assert "spec_decode" in matrix.not_required("alternative", "cuda", stand_in)
    for profile in _required(matrix):
        report = _passing(profile, "local", gpus=True)
        if profile == "alternative":
            report["checks"] = [{**c, "status": "not_required" if c["name"] == "spec_decode" else "passed"}
                                for c in report["checks"]]
            report["stand_in"] = stand_in
        _write(tmp_path, "docs/gpu", f"run-{profile}", report)
    _write_full_size(tmp_path)
    assert gate(matrix, "cuda", IMAGE_ID, tmp_path)["alternative"].checks["spec_decode"] == "not_required"
    path = tmp_path / "docs/gpu/run-alternative/report.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "stand_in": None}))
    with pytest.raises(CheckFailed, match="calls spec_decode not required"):
        gate(matrix, "cuda", IMAGE_ID, tmp_path)


def test_a_run_on_the_wsl2_card_totals_to_its_mps_cap_and_that_is_its_cards_memory_to_the_gate(matrix):
    """The emulated WSL2 4090 caps the server at what vLLM finds free there and the context the cap holds; its GPU
    samples total to that cap, which the gate takes as the card's memory (the free figure alone it refuses)."""
    spec = matrix.cards["rtx4090-wsl2"]
    cap = mps_cap_bytes(spec.total_bytes, spec.free_bytes)
    assert spec.free_bytes is not None and cap > spec.free_bytes
    report = _full_size("default", peak=cap - 2**28)
    report["card"].update(card="rtx4090-wsl2", total_bytes=spec.total_bytes, cuda_arch="8.9")
    report["memory"]["gpus"][0]["total_bytes"] = cap
    assert size_proof_problem(matrix, RunReport.model_validate(report)) is None
    report["memory"]["gpus"][0]["total_bytes"] = spec.free_bytes
    said = size_proof_problem(matrix, RunReport.model_validate(report))
    assert said and f"not its card's {cap:,}" in said
