"""The GPU kit (bench/gpu/): a part fits one command sent to the host beside the tree it travels with, what a visit keeps, and
the process engine's environment holds the host tool's own dependencies."""

from __future__ import annotations

import hashlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

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
    assert "\"${SERVEKIT_GPU_MODEL:-$PWD/bench/gpu/qwen35-mini}\"" in served
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


# --- the kit's scripts doubt their arguments (issue #47) ----------------------------------------------------------

CARRIED = ROOT / "bench" / "gpu" / "carried.sh"


def _sourced(step: str, cwd, home, **env: str) -> subprocess.CompletedProcess:
    settings = "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())
    return _bash(f"say() {{ echo \"$*\" >&2; }}; {settings}. {CARRIED}; {step}", cwd, home)


def test_a_model_path_with_a_trailing_slash_keeps_the_home_folder(tmp_path):
    home, tree = tmp_path / "home", tmp_path / "tree"
    home.mkdir()
    (home / "mine").write_text("the user's own file")
    model = _tree(tree, with_model=True)
    done = _sourced("keep", tree, home, SERVEKIT_GPU_MODEL=f"{model}//")
    assert done.returncode == 0, done.stderr
    assert (home / "mine").read_text() == "the user's own file"
    assert (home / "qwen35-mini" / "config.json").is_file()
    assert _sourced("keep", tree, home, SERVEKIT_GPU_MODEL="/").returncode == 2


def test_a_folder_with_files_but_no_config_is_never_replaced_on_restore(tmp_path):
    home, whole, tree = tmp_path / "home", tmp_path / "whole", tmp_path / "tree"
    home.mkdir()
    _tree(whole, with_model=True)
    assert _sourced("keep", whole, home).returncode == 0
    model = _tree(tree, with_model=False)
    (model / "model.safetensors").write_text("someone's weights")
    done = _sourced("restore", tree, home)
    assert done.returncode == 1 and "holds files but no config.json: not replaced" in done.stderr
    assert (model / "model.safetensors").read_text() == "someone's weights"


def test_a_part_that_the_checksums_do_not_name_is_said_and_refused(tmp_path):
    carried, parts, home = tmp_path / "carried", tmp_path / "parts", tmp_path / "home"
    for folder in (carried, home):
        folder.mkdir()
    (carried / "kit-000").write_bytes(b"checked")
    (carried / "kit-001").write_bytes(b"smuggled")
    (carried / "SHA256SUMS").write_text(f"{hashlib.sha256(b'checked').hexdigest()}  kit-000\n")
    took = _sourced(f"take_parts {parts} {carried}", tmp_path, home)
    assert took.returncode == 0, took.stderr
    assert "kit-000 ok" in took.stderr and "kit-001: not named in SHA256SUMS" in took.stderr
    refused = _sourced(f"only_named {parts} IMAGE", tmp_path, home)
    assert refused.returncode == 1 and f"{parts}/kit-001: not named in SHA256SUMS, so never checked" in refused.stderr
    (parts / "kit-001").unlink()
    (parts / "IMAGE").write_text("tag id\n")
    assert _sourced(f"only_named {parts} IMAGE", tmp_path, home).returncode == 0


@pytest.mark.parametrize("argv, says", [
    (["behind.sh", "start", "../..", "true"], "NAME '../..': expected a plain name"),
    (["behind.sh", "start", "", "true"], "NAME '': expected a plain name"),
    (["behind.sh", "wait", "job", "a[$(touch pwned)]"], "SECS 'a[$(touch pwned)]': expected a whole number"),
    (["behind.sh", "wait", "job", "08 + 1"], "expected a whole number"),
    (["visit.sh", "run", "../../escaped", "run"], "LABEL '../../escaped': expected a plain name"),
])
def test_a_job_name_or_number_that_is_no_such_thing_is_refused_before_any_use(tmp_path, argv, says):
    home, tree = tmp_path / "home", tmp_path / "tree"
    for folder in (home, tree):
        folder.mkdir()
    (home / "mine").write_text("kept")
    script = ROOT / "bench" / "gpu" / argv[0]
    done = subprocess.run(["bash", str(script), *argv[1:]], cwd=tree, capture_output=True, text=True, timeout=60,
                          env={"HOME": str(home), "PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert (home / "mine").read_text() == "kept" and not (tree / "pwned").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "tree"]


def test_each_script_of_the_kit_sets_u_and_removes_only_what_it_quotes():
    for script in sorted((ROOT / "bench" / "gpu").glob("*.sh")):
        text = script.read_text()
        assert "set -euo pipefail" in text or "set -u" in text, script.name
        for line in text.splitlines():
            if "rm -rf" in line:
                assert re.search(r'rm -rf -- "\$', line), f"{script.name}: {line.strip()}"
