"""The kit for an air-gapped GPU host (bench/gpu/): pack's flags and parts, and the driver's checks before it uses
a part, a folder or a model."""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import re
import subprocess
import sys

import pytest
from support import ROOT

sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import pack  # noqa: E402

AIRGAP = ROOT / "bench" / "gpu" / "airgap.sh"


def test_the_part_size_is_a_flag_of_whole_mib_down_to_one():
    assert pack.parse(["out"]).part_size == pack.DEFAULT_PART_MIB == 256
    assert pack.parse(["out", "--part-size", "1"]).part_size == 1
    assert pack.parse(["out", "--python", "3.11"]).python == "3.11"
    assert pack.parse(["out"]).python == f"{sys.version_info[0]}.{sys.version_info[1]}"
    for bad in ("0", "-1", "1.5", "64MiB", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a whole number of MiB"):
            pack.part_size(bad)
    for bad in ("3", "2.7", "3.x", "3.12.1"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected the host's Python"):
            pack.python_version(bad)


def test_a_model_to_pack_is_a_model_folder(tmp_path):
    with pytest.raises(argparse.ArgumentTypeError, match="expected a model folder"):
        pack.model_folder(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert pack.model_folder(str(tmp_path)) == tmp_path.resolve()


def test_a_stream_is_cut_into_parts_of_the_size_asked_that_sha256sum_checks(tmp_path):
    data = os.urandom(5 * 1024 + 17)
    sums: list[str] = []
    assert pack.split(io.BytesIO(data), "image", tmp_path, sums, 1024) == 6
    assert [p.stat().st_size for p in sorted(tmp_path.glob("image-*"))] == [1024] * 5 + [17]
    assert b"".join(p.read_bytes() for p in sorted(tmp_path.glob("image-*"))) == data
    (tmp_path / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    assert subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=tmp_path).returncode == 0


def _airgap(*argv: str, cwd, home, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(AIRGAP), *argv], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={"HOME": str(home), "PATH": "/usr/bin:/bin", **env})


def _parts(folder, **parts: bytes):
    folder.mkdir()
    for name, data in parts.items():
        (folder / name).write_bytes(data)
    (folder / "IMAGE").write_text("vllm-serve:test sha256:abc\n")
    (folder / "SHA256SUMS").write_text("".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in parts.items()))


def test_setup_refuses_a_part_nobody_checked_and_a_damaged_one_before_it_unpacks_anything(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    _parts(tmp_path / "parts", **{"kit-000": b"kit", "image-000": b"image"})
    (tmp_path / "parts" / "image-001").write_bytes(b"smuggled")
    done = _airgap("setup", str(tmp_path / "parts"), cwd=tmp_path, home=home)
    assert done.returncode == 1 and "image-001: not named in SHA256SUMS, so never checked" in done.stderr
    (tmp_path / "parts" / "image-001").unlink()
    (tmp_path / "parts" / "image-000").write_bytes(b"imagf")
    done = _airgap("setup", str(tmp_path / "parts"), cwd=tmp_path, home=home)
    assert done.returncode == 1 and "a part is damaged" in done.stderr
    assert not (home / "servekit-kit").exists() and not (tmp_path / ".venv").exists()


def test_setup_takes_a_whole_folder_of_parts_past_the_check(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    _parts(tmp_path / "parts", **{"kit-000": b"not a tar"})
    done = _airgap("setup", str(tmp_path / "parts"), cwd=tmp_path, home=home)
    assert "1 parts checked" in done.stderr and done.returncode != 0  # then the tar says what it is


def _tar_in_two(tmp_path) -> tuple[bytes, bytes]:
    """A kit tar (kit/hello) cut in two parts."""
    import tarfile
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / "hello").write_text("hello")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(tmp_path / "kit", arcname="kit")
    data = buffer.getvalue()
    return data[:1000], data[1000:]


def _arrive(folder, name: str, data: bytes) -> None:
    """A part renamed into the folder whole, as a visit's call brings it."""
    (folder / f".{name}").write_bytes(data)
    (folder / f".{name}").rename(folder / name)


@pytest.mark.parametrize("second", ["whole", "damaged", "never"])
def test_setup_follow_uses_each_part_as_it_arrives_checked_and_gives_up_on_one_that_never_comes(tmp_path, second):
    """--follow: setup starts while the parts are still arriving (a visit's calls bring them one by one), waits for
    each in SHA256SUMS' order, checks it and unpacks it as it comes; a damaged part stops it, and so does one that
    has not come a given time after the last."""
    home = tmp_path / "home"
    home.mkdir()
    first, rest = _tar_in_two(tmp_path)
    parts = tmp_path / "parts"
    _parts(parts, **{"kit-000": first, "kit-001": rest})
    (parts / "kit-001").unlink()
    setup = subprocess.Popen(["bash", str(AIRGAP), "setup", str(parts), "--follow", "2"], cwd=tmp_path,
                             stderr=subprocess.PIPE, text=True, env={"HOME": str(home), "PATH": "/usr/bin:/bin"})
    assert setup.stderr is not None
    assert "waiting for kit-001" in setup.stderr.readline()
    if second != "never":
        _arrive(parts, "kit-001", rest if second == "whole" else rest[:-1] + b"x")
    said = setup.stderr.read()
    assert setup.wait(timeout=60) != 0  # a kit of one file has no wheels to install
    unpacked = home / "servekit-kit" / "kit" / "hello"
    if second == "whole":
        assert unpacked.read_text() == "hello" and "damaged" not in said, said
    elif second == "damaged":
        assert f"{parts}/kit-001: damaged; copy it again" in said and not unpacked.exists(), said
    else:
        assert f"{parts}/kit-001: not there after 2 s" in said and not unpacked.exists(), said


@pytest.mark.parametrize("argv, env, says", [
    ([], {}, "airgap.sh setup PARTS_DIR"),
    (["setup"], {}, "setup: expected the folder of parts"),
    (["setup", "/nonexistent"], {}, "setup: expected the folder of parts"),
    (["setup", ".", "--follow", "soon"], {}, "--follow soon: expected a whole number of seconds"),
    (["setup", ".", "--wait", "5"], {}, "setup: expected the folder of parts"),
    (["run"], {}, "run: expected a command of build.py"),
    (["setup", "."], {"SERVEKIT_KIT": "HOME"}, "expected a folder of its own"),
    (["setup", "."], {"SERVEKIT_KIT": "/"}, "expected a folder of its own"),
])
def test_a_call_that_names_nothing_usable_is_refused_with_what_to_give(tmp_path, argv, env, says):
    home = tmp_path / "home"
    home.mkdir()
    (home / "mine").write_text("kept")
    env = {k: str(home) if v == "HOME" else v for k, v in env.items()}
    done = _airgap(*argv, cwd=tmp_path, home=home, **env)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert (home / "mine").read_text() == "kept"


def _checkout(tmp_path):
    """A checkout whose .venv's python says what it was given."""
    tree = tmp_path / "tree"
    (tree / ".venv" / "bin").mkdir(parents=True)
    python = tree / ".venv" / "bin" / "python"
    python.write_text('#!/bin/sh\necho "MODEL_DIR=$MODEL_DIR DRAFTER_DIR=$DRAFTER_DIR ARGS=$*"\n')
    python.chmod(0o755)
    for name in ("qwen35-mini", "qwen35-mini-dflash2"):
        (tree / "bench" / "gpu" / name).mkdir(parents=True)
    return tree


def test_run_serves_the_checkouts_stand_in_unless_the_kit_carries_a_model(tmp_path):
    home, tree = tmp_path / "home", _checkout(tmp_path)
    home.mkdir()
    done = _airgap("run", "run", "--profile", "default", cwd=tree, home=home)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (f"MODEL_DIR={tree}/bench/gpu/qwen35-mini DRAFTER_DIR={tree}/bench/gpu/"
                                   "qwen35-mini-dflash2 ARGS=build.py run --target cuda --profile default")
    (home / "servekit-kit" / "kit" / "models" / "model").mkdir(parents=True)  # a model of the kit, no drafter
    done = _airgap("run", "sweep", "batch", cwd=tree, home=home)
    assert done.stdout.strip() == (f"MODEL_DIR={home}/servekit-kit/kit/models/model DRAFTER_DIR= "
                                   "ARGS=build.py sweep --target cuda batch")


def test_the_kit_sets_u_and_removes_only_what_it_quotes():
    for script in sorted((ROOT / "bench" / "gpu").glob("*.sh")):
        text = script.read_text()
        assert "set -euo pipefail" in text, script.name
        for line in text.splitlines():
            if "rm -rf" in line:
                assert re.search(r'rm -rf -- "\$', line), f"{script.name}: {line.strip()}"


def test_the_kit_and_its_page_name_no_particular_host_or_the_way_it_was_reached():
    """A user's host is any air-gapped GPU host: no fixed transfer size, no carried-tree tricks, no one machine."""
    said = [ROOT / "docs" / "gpu" / "README.md", ROOT / "docs" / "gpu" / "log.md", *sorted((ROOT / "bench" / "gpu").glob("*.[ps][yh]"))]
    pattern = re.compile(r"sparse-checkout|one (?:command|call) carries|64 MiB|\$OUT\b|the GPU machine|borrowed", re.I)
    assert {str(p.relative_to(ROOT)): pattern.findall(p.read_text()) for p in said if pattern.search(p.read_text())} == {}
