"""`series export`: a branch of one commit per topic over a vLLM tag becomes the series folder, which applies to the
tag's tree and gives the branch's, and comes out byte for byte the same when exported again."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
from pathlib import Path

import pytest

from servekit.build.seriesexport import export
from servekit.errors import UserError
from servekit.image.series import apply_series, read_series

CORE = "".join(f"def step_{i}(x):\n    return x + {i}\n\n\n" for i in range(12))


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                   check=True, capture_output=True)


def _commit(repo: Path, message: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)


@pytest.fixture
def fork(tmp_path) -> Path:
    """A vLLM-like repository: a tag v0.31.0, and a branch `series` with two topics on top of it."""
    repo = tmp_path / "vllm"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _commit(repo, "upstream", {"vllm/v1/core.py": CORE, "vllm/version.py": "__version__ = '0.31.0'\n",
                               "setup.py": "# outside the package\n"})
    _git(repo, "tag", "v0.31.0")
    _git(repo, "checkout", "-q", "-b", "series")
    _commit(repo, "Guard step 5 against None\n\nstep_5 crashed on a missing value.\n\nKind: fix\n"
                  "What: step_5 returns None for None\nUpstream: none\nRetires-when: vLLM 0.33.0\n",
            {"vllm/v1/core.py": CORE.replace("def step_5(x):\n", "def step_5(x):\n    if x is None:\n"
                                              "        return None\n"), "setup.py": "# not in the series\n"})
    _commit(repo, "Add the knob module\n\nKind: feature\nWhat: a module of knobs\nUpstream: none\n"
                  "Cut-against: v0.30.0\nTargets: cpu\n",
            {"vllm/knobs.py": "KNOBS = {}\n", "vllm/version.py": "__version__ = '0.31.0+series'\n"})
    return repo


def test_the_branch_becomes_a_series_that_rebuilds_it_from_the_tag(fork, tmp_path):
    out = tmp_path / "patches"
    names = export(fork, "v0.31.0", "series", out)
    assert names == ["guard-step-5-against-none.patch", "add-the-knob-module.patch"]
    patches = read_series(out)
    assert [p.name for p in patches] == names
    assert patches[0].trailers == {"Kind": "fix", "What": "step_5 returns None for None", "Upstream": "none",
                                   "Cut-against": "v0.31.0", "Retires-when": "vLLM 0.33.0"}
    assert patches[1].trailers["Cut-against"] == "v0.31.0" and patches[1].targets == ["cpu"]
    assert patches[0].files == ["v1/core.py"] and sorted(patches[1].files) == ["knobs.py", "version.py"]
    assert "step_5 crashed on a missing value." in (out / names[0]).read_text()
    # Applied to the tag's vllm/ as the image applies it, it gives the branch's vllm/.
    tree = tmp_path / "tree"
    subprocess.run(["git", "-C", str(fork), "worktree", "add", "-q", str(tree), "v0.31.0"], check=True)
    assert [name for name, _ in apply_series(out, tree / "vllm", "cpu", say=lambda line: None)] == names
    _git(fork, "checkout", "-q", "series")
    same = filecmp.dircmp(tree / "vllm", fork / "vllm")
    assert not same.diff_files and not same.left_only and not same.right_only
    assert all(not same.subdirs[d].diff_files for d in same.subdirs)


def test_exporting_twice_gives_identical_files_and_replaces_the_folder(fork, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    export(fork, "v0.31.0", "series", first)
    (second).mkdir()
    (second / "old-topic.patch").write_text("gone after the export\n")
    export(fork, "v0.31.0", "series", second)
    assert sorted(p.name for p in second.iterdir()) == sorted(p.name for p in first.iterdir())
    assert all((first / p.name).read_bytes() == (second / p.name).read_bytes() for p in first.iterdir())


def test_a_commit_without_the_trailers_is_refused_naming_it(fork, tmp_path):
    _commit(fork, "Quick hack", {"vllm/hack.py": "X = 1\n"})
    with pytest.raises(UserError, match=r"commit [0-9a-f]{12} \(Quick hack\): no Kind:, What: trailer"):
        export(fork, "v0.31.0", "series", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_command_writes_into_the_matrix_series_folder(fork, repo, cli):
    code, out, err = cli("--matrix", str(repo / "images.yaml"), "series", "export", "--repo", str(fork), "--tag",
                         "v0.31.0", "--branch", "series")
    assert code == 0, err
    assert "series: 2 patches from series on v0.31.0" in out
    assert [p.name for p in read_series(repo / "docker/patches")] == ["guard-step-5-against-none.patch",
                                                                       "add-the-knob-module.patch"]
    shutil.rmtree(repo / "docker/patches")


@pytest.mark.parametrize("base, branch, says", [
    ("--output=/tmp/servekit-pwned", "series", "--tag '--output=/tmp/servekit-pwned': expected a tag name"),
    ("v0.31.0", "--upload-pack=touch /tmp/servekit-pwned", "--branch '--upload-pack"),
    ("v0.31.0", "main..series", "expected a branch name"),
    ("v0.31.0", "series\nmain", "expected a branch name"),
    ("v0.99.0", "series", "--tag v0.99.0: "),
])
def test_a_tag_or_branch_that_is_no_name_never_reaches_git_as_an_option(fork, tmp_path, base, branch, says):
    with pytest.raises(UserError) as refused:
        export(fork, base, branch, tmp_path / "out")
    assert says in str(refused.value) and "\n" not in str(refused.value), refused.value
    assert not Path("/tmp/servekit-pwned").exists() and not (tmp_path / "out").exists()


def test_a_commit_that_changes_a_binary_file_is_refused_not_exported_as_nothing(fork, tmp_path):
    (fork / "vllm" / "kernel.bin").write_bytes(bytes(range(256)))
    _git(fork, "add", "-A")
    _git(fork, "commit", "-q", "-m", "Ship a kernel\n\nKind: feature\nWhat: a binary\nUpstream: none\n")
    with pytest.raises(UserError, match=r"commit [0-9a-f]{12} \(Ship a kernel\) changes kernel.bin, a binary file"):
        export(fork, "v0.31.0", "series", tmp_path / "out")
    assert not (tmp_path / "out").exists()
