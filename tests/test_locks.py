"""Package locks: what verify says of a lock that is missing, stale or edited, what a build takes from one, and
uv making one for real against PyPI."""

from __future__ import annotations

import json
import re

import pytest
from support import ROOT, with_prebuilt_cubins

from servekit.build.locks import (
    HOST_LOCK,
    HOST_PINS,
    PACKAGE,
    for_build,
    image_locks,
    inputs_digest,
    installable,
    lock_file,
    problems,
    read,
)
from servekit.config.load import load_matrix
from servekit.errors import UserError

pytestmark = pytest.mark.network  # verify reads vLLM's metadata (cached after the first read)


def _verify_problems(cli, repo) -> list[str]:
    code, out, err = cli("--matrix", str(repo / "images.yaml"), "verify", "--no-series", "--json")
    return json.loads(out)["problems"]


def test_the_repository_has_every_lock_and_each_is_current():
    matrix = load_matrix(ROOT / "images.yaml")
    assert image_locks(matrix) == [("cuda", "3.11"), ("cuda", "3.12"), ("cpu", "3.11")]
    found, notes = problems(matrix, ROOT)
    assert found == [], found
    assert not [n for n in notes if "left out" in n], notes  # the default installs only what PyPI serves


def test_every_package_of_a_lock_is_pinned_with_hashes():
    for path in [ROOT / HOST_LOCK, *sorted((ROOT / "docker" / "locks").glob("*.txt"))]:
        lines = path.read_text().splitlines()
        entries = [i for i, line in enumerate(lines) if PACKAGE.match(line)]
        assert len(entries) > 50, path
        for i in entries:
            assert lines[i].endswith("\\") and lines[i + 1].strip().startswith("--hash=sha256:"), (path, lines[i])


def test_verify_names_a_lock_made_from_other_pins(repo, cli):
    matrix = repo / "images.yaml"
    text = matrix.read_text()
    assert "\n      torchcodec: as torchvision" in text
    matrix.write_text(text.replace("\n      torchcodec: as torchvision", "\n      #torchcodec: as torchvision"))
    found = _verify_problems(cli, repo)
    stale = [p for p in found if "stale" in p]
    assert stale == ["docker/locks/cpu-py3.11.txt: stale: made from other pins or exclusions than images.yaml "
                     "names now; make it again with `python3 build.py lock --target cpu`"], found


def test_verify_names_a_lock_edited_by_hand_and_one_missing(repo, cli):
    cpu = repo / lock_file("cpu", "3.11")
    cpu.write_text(cpu.read_text().replace("\nxgrammar==0.2.7 \\", "\nxgrammar==0.2.6 \\"))
    (repo / lock_file("cuda", "3.12")).unlink()
    found = _verify_problems(cli, repo)
    assert any(p.startswith("docker/locks/cpu-py3.11.txt: xgrammar is 0.2.6, the pin is 0.2.7") for p in found), found
    assert "docker/locks/cuda-py3.12.txt: missing; make it with `python3 build.py lock --target cuda`" in found


def test_verify_names_the_host_lock_stale_against_its_pins(repo, cli):
    pins = repo / HOST_PINS
    pins.write_text(pins.read_text().replace("tenacity==9.2.1", "tenacity==9.2.0"))
    found = _verify_problems(cli, repo)
    assert f"{HOST_LOCK}: stale against {HOST_PINS}; make it again with `python3 build.py lock --host-tool`" in found


def test_a_build_takes_the_lock_less_what_it_leaves_out_and_refuses_what_it_lacks(repo):
    """With the prebuilt kernels added (docs/build.md) and the lock made where FlashInfer's index did not answer."""
    matrix = load_matrix(with_prebuilt_cubins(repo))
    lock = read(repo / lock_file("cuda", "3.12"))
    (repo / lock_file("cuda", "3.12")).write_text(lock.text.replace(
        lock.inputs or "?", inputs_digest(matrix, "cuda", "3.12")))
    lock = read(repo / lock_file("cuda", "3.12"))
    if "flashinfer-cubin" not in lock.left_out:  # made where FlashInfer's index answers: leave it out here
        (repo / lock_file("cuda", "3.12")).write_text(installable(lock, {"flashinfer-cubin"}).replace(
            "# servekit-lock-inputs:", "# left out: flashinfer-cubin (test)\n# servekit-lock-inputs:"))
    with pytest.raises(UserError, match=r"flashinfer-cubin is not in the lock .*build --without flashinfer-cubin"):
        for_build(matrix, repo, "cuda", "3.12", omitted=set())
    text = for_build(matrix, repo, "cuda", "3.12", omitted={"flashinfer-cubin"})
    assert "vllm==0.31.0 \\" in text.splitlines()
    # Leaving out a pin drops its line, its hashes and its comments, and nothing else.
    without = installable(read(repo / lock_file("cuda", "3.12")), {"flashinfer-python"})
    kept = [m[1] for m in map(PACKAGE.match, without.splitlines()) if m]
    assert "flashinfer-python" not in kept and len(kept) == len(lock.packages) - 1
    assert "# left out by --without: flashinfer-python==0.7.0.post1" in without
    assert not re.search(r"^# left out by --without: .*\n\s+--hash", without, re.M)
    # A stale lock is refused, naming the command that makes it again.
    yaml_path = repo / "images.yaml"
    yaml_path.write_text(yaml_path.read_text().replace('xgrammar: "0.2.7"', 'xgrammar: "0.2.6"'))
    with pytest.raises(UserError, match=r"cpu-py3.11.txt: stale: .*`python3 build.py lock --target cpu`"):
        for_build(load_matrix(yaml_path), repo, "cpu", "3.11", omitted=set())


def test_the_image_digest_follows_the_lock_not_a_file_that_mirrors_the_pins(repo, cli):
    def digests():
        return {t["target"]: t["digest"] for t in json.loads(cli("--matrix", str(repo / "images.yaml"), "plan",
                                                                 "--json")[1])["targets"]}
    before = digests()
    req = repo / "docs/install.md"
    req.write_text(req.read_text() + "\nA line of prose: the pins are the same, so is the image.\n")
    assert digests() == before
    lock = repo / lock_file("cpu", "3.11")
    lock.write_text(lock.read_text() + "# any change to the lock is a new image\n")
    after = digests()
    assert after["cpu"] != before["cpu"] and after["cuda"] == before["cuda"]


@pytest.mark.slow
def test_uv_makes_the_cpu_lock_and_the_host_lock_from_the_pins(repo, cli):
    """The real resolver against PyPI (torch 2.13.0+cpu from the folder of wheels pip is configured with, as the
    build takes it): every pin at its version, the excluded distributions absent, verify content."""
    for rel in (lock_file("cpu", "3.11"), HOST_LOCK):
        (repo / rel).unlink()
    code, out, err = cli("--matrix", str(repo / "images.yaml"), "lock", "--target", "cpu", "--host-tool")
    assert code == 0, err
    assert re.search(r"lock: docker/locks/cpu-py3.11.txt: \d+ packages in \d+ s", err), err
    made = read(repo / lock_file("cpu", "3.11"))
    matrix = load_matrix(repo / "images.yaml")
    for dist, version in matrix.target_pins("cpu").items():
        assert made.packages[dist.lower().replace("_", "-")] == version, dist
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(made.packages)
    assert read(repo / HOST_LOCK).packages["uv"] == "0.13.9"
    assert problems(matrix, repo)[0] == []


def test_a_lock_is_installed_in_layers_that_change_as_rarely_as_their_packages():
    """torch and what it needs (by the lock's `via` notes) in one slice, the rest in the other; each slice only
    package and hash lines, so a pin moving in one slice (and every `via` note) leaves the other's text alone."""
    from packaging.utils import canonicalize_name

    from servekit.build.locks import LAYERS, layers
    lock = read(ROOT / lock_file("cuda", "3.11"))
    sliced = layers(lock.text)
    assert list(sliced) == list(LAYERS) == ["torch", "serving"]
    names = {layer: {canonicalize_name(m[1]) for m in map(PACKAGE.match, text.splitlines()) if m}
             for layer, text in sliced.items()}
    assert {"torch", "triton", "nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13"} <= names["torch"]
    assert {"vllm", "flashinfer-python", "transformers", "xgrammar"} <= names["serving"]
    assert names["torch"].isdisjoint(names["serving"])
    assert names["torch"] | names["serving"] == set(lock.packages)
    assert not [line for text in sliced.values() for line in text.splitlines() if line.lstrip().startswith("#")]
    bumped = lock.text.replace("\nxgrammar==0.2.7 \\", "\nxgrammar==0.2.8 \\").replace("# via vllm", "# via vllm, x")
    again = layers(bumped)
    assert again["torch"] == sliced["torch"] and again["serving"] != sliced["serving"]
