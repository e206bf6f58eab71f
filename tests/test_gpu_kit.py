"""The GPU kit (bench/gpu/): a part fits one command sent to the host beside the tree it travels with, what a visit keeps, and
the process engine's environment holds the host tool's own dependencies."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from support import ROOT

sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import pack  # noqa: E402
import wheels  # noqa: E402


def test_a_part_and_the_sparse_tree_fit_one_call():
    assert pack.tree_bytes() + pack.part_bytes() <= pack.CALL_BYTES


def test_what_travels_once_is_tracked_and_what_the_visit_serves():
    tracked = subprocess.run(["git", "ls-files", *pack.TRAVEL_ONCE], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for folder in pack.TRAVEL_ONCE:  # a renamed folder would travel with every part again, or not at all
        assert any(name.startswith(folder) for name in tracked), folder
    served = (ROOT / "bench" / "gpu" / "carried.sh").read_text()  # the folders visit.sh and acceptance.sh serve
    assert "MODEL=${SERVEKIT_GPU_MODEL:-$PWD/bench/gpu/qwen35-mini}" in served
    assert "bench/gpu/qwen35-mini/" in pack.TRAVEL_ONCE and "bench/gpu/qwen35-mini-dflash2/" in pack.TRAVEL_ONCE
    assert pack.SPARSE.startswith("git sparse-checkout set --no-cone '/*' ")


def _bash(script: str, cwd, home) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=cwd, env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)


def _tree(root, with_model: bool):
    model = root / "bench" / "gpu" / "qwen35-mini"
    (root / "bench" / "gpu" / "qwen35-mini-dflash2").mkdir(parents=True)
    model.mkdir(parents=True)
    if with_model:
        for folder in (model, model.with_name("qwen35-mini-dflash2")):
            (folder / "config.json").write_text("{}")
    return model


def test_the_stand_in_is_kept_whole_and_put_back_over_the_empty_folders_a_sparse_carry_leaves(tmp_path):
    carried = ROOT / "bench" / "gpu" / "carried.sh"
    home, sparse, whole = tmp_path / "home", tmp_path / "sparse", tmp_path / "whole"
    home.mkdir()
    model = _tree(sparse, with_model=False)
    _tree(whole, with_model=True)
    for tree, step in ((sparse, "keep"), (whole, "keep"), (sparse, "restore")):  # a sparse call first keeps nothing
        assert _bash(f"say() {{ :; }}; . {carried}; {step}", tree, home).returncode == 0
    assert (home / "qwen35-mini" / "config.json").is_file()
    assert (model / "config.json").is_file() and (model.with_name("qwen35-mini-dflash2") / "config.json").is_file()


def test_work_left_behind_runs_in_its_own_copy_of_the_tree(tmp_path):
    behind = ROOT / "bench" / "gpu" / "behind.sh"
    home, tree, out = tmp_path / "home", tmp_path / "tree", tmp_path / "out"
    for folder in (home, tree, out):
        folder.mkdir()
    (tree / "served").write_text("weights")
    started = _bash(f"{behind} start job 'cat served > \"$OUT/seen\" && pwd > \"$OUT/where\"'", tree, home)
    assert started.returncode == 0, started.stderr
    (tree / "served").unlink()  # what the next call's carry does to a folder restored into the checkout
    waited = _bash(f"OUT={out} {behind} wait job 30", tree, home)
    assert waited.returncode == 0, waited.stderr
    job = home / "behind" / "job"
    assert (job / "seen").read_text() == "weights"
    assert (job / "where").read_text().strip() == str(job / "tree")
    names = subprocess.run(["tar", "-tzf", str(out / "job.tgz")], capture_output=True, text=True, check=True).stdout
    assert "job/seen" in names and "job/tree" not in names  # the copy stays there: only what the job wrote comes back


def test_the_process_engines_wheels_carry_every_dependency_of_the_host_tool():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = wheels.host_tool()
    pinned = {r.split("==")[0] for r in wanted}
    assert len(pinned) == len(declared) and "sseclient-py" in pinned  # the one a hand-kept list once left out
    assert all(re.fullmatch(r"[a-z0-9.-]+==[0-9][0-9a-z.]*", r) for r in wanted), wanted


def test_the_process_engines_environment_is_refused_short_of_the_host_tools_dependencies(tmp_path):
    script = (ROOT / "bench" / "gpu" / "acceptance.sh").read_text()
    guard = script.split("<<'EOF'\n")[1].split("import torch")[0]  # install's check, before it imports the GPU stack
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    for python, refused in ((sys.executable, False), (bare / "bin" / "python", True)):
        result = subprocess.run([str(python), "-c", guard], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert (result.returncode != 0) == refused, result.stderr
        assert ("sseclient-py" in result.stderr) == refused, result.stderr
