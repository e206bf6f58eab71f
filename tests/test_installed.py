"""servekit/image/installed.py: the file of each locked distribution a slice installed, and the SBOM cut to it;
an SBOM that does not match what was installed stops the build in one line."""

from __future__ import annotations

import hashlib
import json

import pytest

from servekit.image import installed
from servekit.image.errors import ServekitError


def _sbom(*components: tuple[str, list[str]]) -> dict:
    return {"components": [{"name": name, "purl": f"pkg:pypi/{name}@1.0", "hashes": [
        {"alg": "SHA-256", "content": h} for h in hashes]} for name, hashes in components] + [
        {"name": "libc6", "purl": "pkg:deb/debian/libc6@2.36", "bom-ref": "deb"}]}


def test_a_slice_records_each_wheel_it_installed_by_distribution_name(tmp_path):
    (tmp_path / "Typing_Extensions-4.15.0-py3-none-any.whl").write_bytes(b"one")
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"two")
    (tmp_path / "notes.txt").write_text("not a wheel")
    out = tmp_path / "out" / "torch.json"
    assert installed.main(["record", str(tmp_path), str(out)]) == 0
    assert json.loads(out.read_text()) == {
        "torch": {"file": "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
                  "sha256": hashlib.sha256(b"two").hexdigest()},
        "typing-extensions": {"file": "Typing_Extensions-4.15.0-py3-none-any.whl",
                              "sha256": hashlib.sha256(b"one").hexdigest()}}


def test_each_distribution_keeps_only_the_hash_of_the_file_installed():
    sbom = installed.narrow(_sbom(("torch", ["a" * 64, "b" * 64]), ("typing-extensions", ["c" * 64])),
                            {"torch": {"file": "t.whl", "sha256": "b" * 64},
                             "typing-extensions": {"file": "x.whl", "sha256": "c" * 64}})
    hashes = {c["name"]: [h["content"] for h in c["hashes"]] for c in sbom["components"] if "hashes" in c}
    assert hashes == {"torch": ["b" * 64], "typing-extensions": ["c" * 64]}
    assert sbom["components"][-1] == {"name": "libc6", "purl": "pkg:deb/debian/libc6@2.36", "bom-ref": "deb"}


@pytest.mark.parametrize("sbom,chosen,says", [
    (_sbom(("torch", ["a" * 64])), {}, "the SBOM lists torch, which the build did not install"),
    (_sbom(("torch", ["a" * 64])), {"torch": {"file": "t.whl", "sha256": "f" * 64}},
     "t.whl (sha256 " + "f" * 64 + ") is not a file the lock accepts for torch"),
    (_sbom(("torch", ["a" * 64])), {"torch": {"file": "t.whl", "sha256": "a" * 64},
                                    "six": {"file": "s.whl", "sha256": "e" * 64}}, "installed but not in the SBOM: six"),
], ids=["not installed", "a file the lock does not accept", "installed, not listed"])
def test_an_sbom_that_is_not_what_was_installed_is_refused(sbom, chosen, says):
    with pytest.raises(ServekitError) as refused:
        installed.narrow(sbom, chosen)
    assert str(refused.value) == says


def test_narrow_rewrites_the_sbom_in_place_and_refuses_in_one_line(tmp_path, capsys):
    (tmp_path / "installed").mkdir()
    (tmp_path / "installed" / "torch.json").write_text(json.dumps({"torch": {"file": "t.whl", "sha256": "b" * 64}}))
    sbom = tmp_path / "sbom.cdx.json"
    sbom.write_text(json.dumps(_sbom(("torch", ["a" * 64, "b" * 64]))))
    assert installed.main(["narrow", str(sbom), str(tmp_path / "installed")]) == 0
    assert json.loads(sbom.read_text())["components"][0]["hashes"] == [{"alg": "SHA-256", "content": "b" * 64}]
    sbom.write_text(json.dumps(_sbom(("torch", ["a" * 64]))))
    assert installed.main(["narrow", str(sbom), str(tmp_path / "installed")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: t.whl (sha256 " + "b" * 64 + ") is not a file the lock accepts for torch"]
