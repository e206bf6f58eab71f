"""The canonical image: the same contents give the same bytes and image ID, whenever the build ran."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile

import pytest
from support import TEST_PROJECT

from servekit.build import reproducible
from servekit.errors import EnvironmentProblem

EPOCH = reproducible.epoch_seconds("2026-12-01T00:00:00Z")


def _layer(mtime: float, atime: str) -> bytes:
    """A layer as a build writes it: files stamped with the build's time, atime in PAX headers."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, when in (("usr/old.txt", b"from a package", 1_600_000_000), ("opt/new.py", b"print(1)", mtime)):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.uname = len(data), when, "builder"
            info.pax_headers = {"atime": atime, "SCHILY.xattr.security.capability": "cap"}
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _saved(layer: bytes, created: str, repeated: bool = False) -> list[bytes]:
    """`docker save` of a one-layer image, as chunks; `repeated`: the layer twice, the second a link to the first
    (as Docker saves a layer an image repeats, such as an empty one)."""
    paths = ["abc/layer.tar", "def/layer.tar"] if repeated else ["abc/layer.tar"]
    config = {"architecture": "amd64", "os": "linux", "created": created, "config": {"Labels": {"a": "b"}},
              "history": [{"created": created, "created_by": "RUN x"}] * len(paths),
              "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()] * len(paths)}}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("abc/layer.tar", layer), ("cfg.json", json.dumps(config).encode()),
                           ("manifest.json", json.dumps([{"Config": "cfg.json", "Layers": paths}]).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if repeated:
            link = tarfile.TarInfo("def/layer.tar")
            link.type, link.linkname = tarfile.SYMTYPE, "../abc/layer.tar"
            tar.addfile(link)
    data = buf.getvalue()
    return [data[i:i + 1000] for i in range(0, len(data), 1000)]


def _canonical(mtime: float, atime: str, created: str) -> tuple[str, bytes]:
    out = io.BytesIO()
    image_id = reproducible.canonical_archive(iter(_saved(_layer(mtime, atime), created)), "x:y", EPOCH, {},
                                              out, say=lambda line: None).image_id
    return image_id, out.getvalue()


def test_two_builds_at_different_times_give_one_image_id_and_the_same_bytes():
    first = _canonical(EPOCH + 10_000.25, "1764800000.1", "2026-12-04T09:00:00Z")
    second = _canonical(EPOCH + 99_999.5, "1764900000.7", "2026-12-05T10:00:00Z")
    assert first[0] == second[0]
    assert first[1] == second[1]
    # and the raw layers did differ, so the sameness is the canonical form's doing
    assert _layer(EPOCH + 10_000.25, "1") != _layer(EPOCH + 99_999.5, "2")


def test_the_canonical_layer_clamps_times_drops_atime_and_keeps_extended_attributes():
    out = io.BytesIO()
    digest, size = reproducible.canonical_layer(io.BytesIO(_layer(EPOCH + 500, "1764800000.1")), out, EPOCH)
    assert hashlib.sha256(out.getvalue()).hexdigest() == digest and size == len(out.getvalue())
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
        entries = {m.name: m for m in tar.getmembers()}
    assert entries["opt/new.py"].mtime == EPOCH  # built after the epoch: clamped
    assert entries["usr/old.txt"].mtime == 1_600_000_000  # older than the epoch: kept
    assert all("atime" not in m.pax_headers and m.uname == "" for m in entries.values())
    assert entries["opt/new.py"].pax_headers["SCHILY.xattr.security.capability"] == "cap"


def test_the_canonical_config_records_the_epoch_and_names_the_canonical_layers():
    out = io.BytesIO()
    image_id = reproducible.canonical_archive(iter(_saved(_layer(EPOCH + 1, "1"), "2026-12-04T09:00:00Z")), "x:y",
                                              EPOCH, {"org.opencontainers.image.created": "2026-12-01T00:00:00Z"},
                                              out, say=lambda line: None).image_id
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
        def read(name: str) -> bytes:
            fh = tar.extractfile(name)
            assert fh is not None
            return fh.read()
        manifest = json.loads(read("manifest.json"))
        config_bytes = read(manifest[0]["Config"])
        layer = read(manifest[0]["Layers"][0])
    assert image_id == "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    config = json.loads(config_bytes)
    assert config["created"] == "2026-12-01T00:00:00Z" and config["history"][0]["created"] == config["created"]
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]
    assert config["config"]["Labels"] == {"a": "b", "org.opencontainers.image.created": "2026-12-01T00:00:00Z"}
    assert manifest[0]["RepoTags"] == ["x:y"]


def test_a_layer_saved_once_and_linked_to_is_both_of_the_images_layers():
    out = io.BytesIO()
    image_id = reproducible.canonical_archive(iter(_saved(_layer(EPOCH + 1, "1"), "2026-12-04T09:00:00Z", True)),
                                              "x:y", EPOCH, {}, out, say=lambda line: None).image_id
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
        config = json.load(tar.extractfile(manifest[0]["Config"]))  # type: ignore[arg-type]
        layer_files = [m.name for m in tar.getmembers() if m.name.endswith("layer.tar")]
    first, second = manifest[0]["Layers"]
    assert first == second and layer_files == [first]  # written once, named twice
    assert len(set(config["rootfs"]["diff_ids"])) == 1 and len(config["rootfs"]["diff_ids"]) == 2
    assert image_id.startswith("sha256:")


def _saved_oci(layer: bytes, created: str) -> list[bytes]:
    """`docker save` of the same image from the containerd image store: blobs named by digest, the layer gzipped,
    an index and manifest.json written after the blobs."""
    blob = gzip.compress(layer, mtime=0)
    config = {"architecture": "amd64", "os": "linux", "created": created, "config": {"Labels": {"a": "b"}},
              "history": [{"created": created, "created_by": "RUN x"}],
              "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]}}
    config_bytes = json.dumps(config).encode()
    names = {data: f"blobs/sha256/{hashlib.sha256(data).hexdigest()}" for data in (blob, config_bytes)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in ((names[blob], blob), (names[config_bytes], config_bytes),
                           ("index.json", b'{"schemaVersion": 2, "manifests": []}'),
                           ("manifest.json", json.dumps([{"Config": names[config_bytes],
                                                          "Layers": [names[blob]]}]).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return [buf.getvalue()]


def test_a_save_from_the_containerd_image_store_gives_the_same_canonical_image_as_the_classic_one():
    layer, created = _layer(EPOCH + 7, "1764800000.1"), "2026-12-04T09:00:00Z"
    classic, oci = io.BytesIO(), io.BytesIO()
    from_classic = reproducible.canonical_archive(iter(_saved(layer, created)), "x:y", EPOCH, {}, classic,
                                                  say=lambda line: None)
    from_oci = reproducible.canonical_archive(iter(_saved_oci(layer, created)), "x:y", EPOCH, {}, oci,
                                              say=lambda line: None)
    assert from_oci == from_classic and len(from_oci.diff_ids) == 1
    assert oci.getvalue() == classic.getvalue()


EMPTY_LAYER = b"\0" * 1024  # what a step that changes no file (WORKDIR of a folder that is there) leaves


def _save_of_two_layers(oci: bool) -> list[bytes]:
    """`docker save` of an image of a layer and an empty one, in the classic layout or the containerd store's."""
    layer = _layer(EPOCH + 3, "1")
    names = [f"blobs/sha256/{hashlib.sha256(d).hexdigest()}" if oci else f"{i}/layer.tar"
             for i, d in enumerate((layer, EMPTY_LAYER))]
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {}, "history": [{}, {}],
                         "rootfs": {"type": "layers", "diff_ids": [
                             "sha256:" + hashlib.sha256(d).hexdigest() for d in (layer, EMPTY_LAYER)]}}).encode()
    config_name = f"blobs/sha256/{hashlib.sha256(config).hexdigest()}" if oci else "cfg.json"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in ((names[0], layer), (names[1], EMPTY_LAYER), (config_name, config),
                           ("manifest.json", json.dumps([{"Config": config_name, "Layers": names}]).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return [buf.getvalue()]


@pytest.mark.parametrize("oci", [False, True], ids=["classic", "containerd-store"])
def test_an_empty_layer_is_a_layer_in_either_layout(oci):
    out = io.BytesIO()
    archive = reproducible.canonical_archive(iter(_save_of_two_layers(oci)), "x:y", EPOCH, {}, out,
                                             say=lambda line: None)
    assert len(archive.diff_ids) == 2 and archive.diff_ids[0] != archive.diff_ids[1]


@pytest.mark.slow
@pytest.mark.engine
def test_two_real_builds_made_canonical_are_compared_to_the_file_that_differs(cpu_base, tmp_path):
    """On a real engine: a step whose output is the same each build gives the same canonical image; a step that
    writes the time does not, and the comparison names that layer and that file."""
    from servekit.engines.docker import local
    engine = local()
    made = []
    for n in (1, 2):
        (tmp_path / "Dockerfile").write_text(f"FROM {cpu_base}\nRUN echo same > /same && date +%s%N > /stamp\n")
        tag = f"{TEST_PROJECT}-canonical:{n}"
        built = subprocess.run(["docker", "build", "-q", "--no-cache", "-t", f"{tag}-raw", str(tmp_path)], capture_output=True,
                               text=True, timeout=300, env={**os.environ, "DOCKER_BUILDKIT": "0"})  # any builder will do
        assert built.returncode == 0, built.stderr[-2000:]
        made.append(reproducible.make_canonical(engine, f"{tag}-raw", tag, EPOCH, {}, tmp_path,
                                                say=lambda line: None))
    try:
        assert made[0].image_id != made[1].image_id
        difference = reproducible.compare(engine, f"{TEST_PROJECT}-canonical:1", f"{TEST_PROJECT}-canonical:2")
        assert difference.config == []  # the times were the build's: made canonical, the configs agree
        [(index, step, paths)] = difference.layers
        assert "date +%s%N > /stamp" in step and paths == ["stamp (contents)"]  # /same is the same file
        assert engine.image(f"{TEST_PROJECT}-canonical:1-raw") is None  # the builder's tag went with the rewrite
    finally:
        for n in (1, 2):
            subprocess.run(["docker", "image", "rm", "-f", f"{TEST_PROJECT}-canonical:{n}"], capture_output=True)


@pytest.mark.slow
def test_a_rebuild_reuses_the_canonical_layers_its_unchanged_build_layers_had(cpu_base, tmp_path):
    """A change to the last step only (a patch of the series, say): the base's and the first step's layers are the
    builder's cached ones, so the canonical pass reuses their canonical form from the first build instead of
    rewriting them, and the image is the very one a pass that rewrites every layer gives."""
    from servekit.engines.docker import local
    from servekit.exclusive import one_buildkit_solve
    engine = local()
    tags = [f"{TEST_PROJECT}-canonical-reuse:{n}" for n in (1, 2)]
    made = []
    try:
        for n, tag in enumerate(tags, 1):
            (tmp_path / "Dockerfile").write_text(f"FROM {cpu_base}\nRUN date +%s%N > /first\nRUN echo {n} > /last\n")
            compose = tmp_path / "compose.build.yaml"  # BuildKit, as the builder runs it: its cache outlives
            compose.write_text(json.dumps({"services": {"image": {"image": f"{tag}-raw",  # the replaced image
                                                                  "build": {"context": str(tmp_path)}}}}))
            with one_buildkit_solve():
                built = subprocess.run(["docker", "compose", "-p", f"{TEST_PROJECT}-canonical-reuse", "-f",
                                        str(compose), "build", "image"], capture_output=True, text=True, timeout=300)
            assert built.returncode == 0, built.stderr[-2000:]
            if n == 2:  # what a pass that rewrites every layer makes of the second build
                whole = reproducible.canonical_archive(engine.sdk().api.get_image(f"{tag}-raw"), tag, EPOCH, {},
                                                       io.BytesIO(), say=lambda line: None)
            made.append(reproducible.make_canonical(engine, f"{tag}-raw", tag, EPOCH, {}, tmp_path,
                                                    say=lambda line: None))
        base_layers = len(engine.held(cpu_base).attrs["RootFS"]["Layers"])
        assert made[0].reused == 0 and made[1].reused == base_layers + 1  # the base's and `RUN date`'s
        assert made[1].image_id == whole.image_id and engine.held(tags[1]).id == whole.image_id
        remembered = json.loads((tmp_path / reproducible.CANONICAL_MEMORY).read_text())["images"]
        assert set(remembered) == {engine.held(tag).id for tag in tags}
    finally:
        for tag in tags:
            subprocess.run(["docker", "image", "rm", "-f", tag, f"{tag}-raw"], capture_output=True)


def test_the_memory_offers_only_layers_the_image_it_names_still_holds(tmp_path):
    """A remembered layer is reused only while the engine holds that very digest in that image, under the same
    canonical form: an image since removed, a digest it does not hold (a stale or altered memory), or another epoch
    offers nothing, and the pass then rewrites the layer."""
    from types import SimpleNamespace
    held = {"sha256:img1": SimpleNamespace(attrs={"RootFS": {"Layers": ["sha256:aaa", "sha256:bbb"]}})}
    engine = SimpleNamespace(image=lambda ref: held.get(ref))
    memory_file = tmp_path / reproducible.CANONICAL_MEMORY
    memory_file.write_text(json.dumps({"images": {
        "sha256:img1": {"form": "1:0", "layers": {"x/layer.tar": "aaa", "y/layer.tar": "ccc"}},
        "sha256:gone": {"form": "1:0", "layers": {"z/layer.tar": "bbb"}}}}))
    assert reproducible._CanonicalMemory(memory_file, engine, "1:0").known() == {"x/layer.tar": "aaa"}
    assert reproducible._CanonicalMemory(memory_file, engine, "1:99").known() == {}
    memory_file.write_text("not json")
    assert reproducible._CanonicalMemory(memory_file, engine, "1:0").known() == {}


def test_a_disk_without_room_for_the_canonical_archive_is_refused_before_the_pass(tmp_path):
    """The canonical pass writes an archive of up to the image's size; a disk without room for it is said in one
    line before the pass starts (a full disk had stopped a cuda build minutes into the pass, its archive half
    written)."""
    free = shutil.disk_usage(tmp_path).free
    reproducible.check_room(tmp_path, free // 2)
    with pytest.raises(EnvironmentProblem, match=r"needs up to .* GB free in .*docker builder prune"):
        reproducible.check_room(tmp_path, free + 10**12)
