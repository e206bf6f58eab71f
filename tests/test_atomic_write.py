"""The one atomic writer (servekit/image/boundary.py), which the host's records and the image's prepare both use: a
reader sees the old file or the new one, never half of either, and the mode is what was asked, kept or private."""

from __future__ import annotations

import os

import pytest

from servekit.image.boundary import write_text_atomic


def test_a_new_file_is_private_unless_a_mode_is_given_and_a_replaced_one_keeps_its_mode(tmp_path):
    write_text_atomic(tmp_path / "deep" / "new.json", "{}\n")
    assert (tmp_path / "deep" / "new.json").stat().st_mode & 0o777 == 0o600
    write_text_atomic(tmp_path / "shared.json", "{}\n", mode=0o644)
    assert (tmp_path / "shared.json").stat().st_mode & 0o777 == 0o644
    write_text_atomic(tmp_path / "shared.json", '{"a": 1}\n')
    assert (tmp_path / "shared.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "shared.json").read_text() == '{"a": 1}\n'


def test_a_link_in_the_way_is_replaced_and_its_target_left_alone(tmp_path):
    (tmp_path / "elsewhere").write_text("theirs")
    (tmp_path / "config.json").symlink_to(tmp_path / "elsewhere")
    write_text_atomic(tmp_path / "config.json", "ours")
    assert not (tmp_path / "config.json").is_symlink() and (tmp_path / "config.json").read_text() == "ours"
    assert (tmp_path / "elsewhere").read_text() == "theirs"


def test_a_write_that_fails_leaves_the_old_file_and_no_staging_file(tmp_path, monkeypatch):
    (tmp_path / "report.json").write_text("old")

    def refused(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(tmp_path / "report.json", "new")
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
    assert (tmp_path / "report.json").read_text() == "old"
