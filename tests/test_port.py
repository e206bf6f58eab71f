"""The series' trailers against the vLLM pin: a stale Cut-against, a patch the pin retires, Supersedes honoured;
each planted in a patch of its own in a copy of the series."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servekit.image.series import SeriesError, read_series

pytestmark = pytest.mark.network  # verify reads vLLM's metadata (cached after the first read)

HUNK = """--- a/version.py
+++ b/version.py
@@ -1 +1 @@
-a
+b
"""


def _plant(repo: Path, name: str, **trailers: str) -> None:
    fields = {"Kind": "fix", "What": "a test patch", "Upstream": "none", "Cut-against": "v0.31.0", **trailers}
    text = "Planted by a test.\n\n" + "".join(f"{k.replace('_', '-')}: {v}\n" for k, v in fields.items())
    (repo / "docker/patches" / name).write_text(text + "\n" + HUNK)
    series = repo / "docker/patches/series"
    series.write_text(series.read_text() + name + "\n")


def _verify(cli, repo: Path) -> tuple[int, dict]:
    code, out, _ = cli("--matrix", str(repo / "images.yaml"), "verify", "--no-series", "--json")
    return code, json.loads(out)


def test_a_patch_cut_against_another_vllm_is_named_for_a_recut(repo, cli):
    _plant(repo, "old-cut.patch", Cut_against="0.30.0: before the scheduler rewrite")
    code, found = _verify(cli, repo)
    assert code == 0, found  # a warning: whether it still applies is the series proof's to say
    assert any(n.startswith("old-cut.patch: cut against vLLM 0.30.0, the pin is 0.31.0: re-cut it")
               for n in found["notes"]), found["notes"]


def test_a_cut_against_without_a_version_is_a_problem(repo, cli):
    _plant(repo, "no-version.patch", Cut_against="main")
    code, found = _verify(cli, repo)
    assert code == 1 and any(p.startswith("no-version.patch: Cut-against: 'main' names no vLLM version")
                             for p in found["problems"]), found


@pytest.mark.slow  # bump runs the port checks too
def test_a_patch_the_pin_retires_is_named_and_bump_names_the_ones_the_new_pin_retires(repo, cli):
    _plant(repo, "retired-now.patch", Retires_when="vLLM 0.31.0 ships the fix (vllm #40000)")
    _plant(repo, "retired-next.patch", Retires_when="vllm >= 0.32.0")
    _plant(repo, "retired-never.patch", Retires_when="upstream takes an allow-list")
    code, found = _verify(cli, repo)
    retire = [n for n in found["notes"] if "retire this patch" in n]
    assert len(retire) == 1 and retire[0].startswith("retired-now.patch: retire this patch: Retires-when names "
                                                     "vLLM 0.31.0"), found["notes"]
    code, out, err = cli("--matrix", str(repo / "images.yaml"), "bump", "--to", "0.32.0", "--dry-run", "--json")
    notes = [n for n in json.loads(out)["notes"] if "retire this patch" in n]
    assert sorted(n.split(":")[0] for n in notes) == ["retired-next.patch", "retired-now.patch"], notes


def test_a_patch_and_the_one_it_supersedes_are_never_both_in_the_series(repo, cli):
    _plant(repo, "first-try.patch")
    _plant(repo, "second-try.patch", Supersedes="first-try.patch")
    with pytest.raises(SeriesError, match="second-try.patch supersedes first-try.patch, which the series lists too; "
                                          "drop first-try.patch"):
        read_series(repo / "docker/patches")
    code, found = _verify(cli, repo)
    assert code == 1 and any("second-try.patch supersedes first-try.patch" in p for p in found["problems"])
    series = repo / "docker/patches/series"
    series.write_text(series.read_text().replace("first-try.patch\n", ""))
    (repo / "docker/patches/first-try.patch").unlink()
    assert [p.name for p in read_series(repo / "docker/patches")][-1] == "second-try.patch"
