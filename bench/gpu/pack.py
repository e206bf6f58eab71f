"""Pack what a GPU host without a network needs to serve the built cuda image through the project's own commands:
the image, the engine's Debian packages, the host tool's wheels, zstd, and the model folders it is to serve.

    python bench/gpu/pack.py PARTS_DIR [--tag TAG] [--part-size MIB] [--python X.Y] [--model DIR] [--drafter DIR]
    python bench/gpu/pack.py PARTS_DIR --on-top-of OLD_PARTS_DIR|IMAGE [--tag TAG] [--part-size MIB]

PARTS_DIR gets kit-NNN and image-NNN parts of at most --part-size MiB each (default 256; any whole number down to 1,
for a transfer that takes small pieces), SHA256SUMS naming every part, and IMAGE (the tag and its ID):

- kit-*: a tar of the engine's Debian 12 packages (bootstrap.ENGINE_DEBS, `apt-get download`) and the Compose sdist,
  the host tool's wheels for the host's Python (requirements.lock, hash-checked by pip), this machine's zstd with its
  liblz4 (a bare host has neither), and the --model and --drafter folders (served through MODEL_DIR and DRAFTER_DIR;
  without them the host serves the stand-in its checkout carries, images.yaml models.qwen35-mini);
- image-*: `docker save TAG | zstd -3`, split (the image ID survives save and load, so the reports made there name
  the image built here).

Every pack also writes LAYERS, the image's layers (DiffIDs, lowest first). `--on-top-of` packs an update for a host
that has loaded an earlier pack (its parts folder, read for its LAYERS and IMAGE) or an image built here (a tag or
ID): no kit, and of the image only the layers it does not share with that one from the bottom up, plus ON-TOP-OF,
the image ID the host must have. A change to the series or the image's code rebuilds only the layers above the
wheels, so its update is a few MiB where the whole image is GBs. `docker load` of the kit's engine (Docker 20.10)
reads a layer's tar only where the host lacks its chain, so the update loads as the very image ID built here.

Copy PARTS_DIR and a checkout of this repository to the host by any means, then there, from the checkout:
`bench/gpu/airgap.sh setup PARTS_DIR` (an update: `bench/gpu/airgap.sh update PARTS_DIR`) and
`bench/gpu/airgap.sh run ...` (docs/gpu/README.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from servekit.engines.bootstrap import COMPOSE_DIST, ENGINE_DEBS  # noqa: E402

DEFAULT_PART_MIB = 256
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def part_size(text: str) -> int:
    """--part-size: a whole number of MiB, at least 1."""
    if not text.isdigit() or not 1 <= int(text) <= 1 << 20:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of MiB from 1 to 1048576, e.g. 256")
    return int(text)


def python_version(text: str) -> str:
    """--python: the host's Python as X.Y."""
    if not (parts := text.split(".")) or len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[0]) != 3:
        raise argparse.ArgumentTypeError(f"{text!r}: expected the host's Python as 3.Y, e.g. 3.12")
    return text


def model_folder(text: str) -> Path:
    path = Path(text).expanduser()
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text}: expected a model folder (one with a config.json)")
    return path.resolve()


def gather_kit(folder: Path, python: str, models: dict[str, Path]) -> None:
    engine = folder / "engine"
    engine.mkdir()
    subprocess.run(["apt-get", "download", *ENGINE_DEBS], cwd=engine, check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d",
                    str(engine), COMPOSE_DIST], check=True)
    platforms = [a for p in WHEEL_PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", *platforms, "--platform", "any", "-d",
                    str(folder / "wheels"), "--require-hashes", "-r", str(ROOT / "requirements.lock")], check=True)
    tools = folder / "tools"
    tools.mkdir()
    zstd = shutil.which("zstd")
    if not zstd:
        sys.exit("pack: no zstd here (apt-get install zstd)")
    shutil.copy2(zstd, tools / "zstd")
    for line in subprocess.run(["ldd", zstd], capture_output=True, text=True, check=True).stdout.splitlines():
        if "liblz4" in line:
            shutil.copy2(line.split("=>")[1].split()[0], tools)
    for name, source in models.items():
        shutil.copytree(source, folder / "models" / name)


def split(stream, prefix: str, out: Path, sums: list[str], size: int) -> int:
    """`stream` cut into OUT/PREFIX-NNN files of `size` bytes, each named in `sums`; how many."""
    n = 0
    while chunk := stream.read(size):
        name = f"{prefix}-{n:03d}"
        (out / name).write_bytes(chunk)
        sums.append(f"{hashlib.sha256(chunk).hexdigest()}  {name}")
        n += 1
    return n


def planned_tag() -> str:
    planned = subprocess.run([sys.executable, str(ROOT / "build.py"), "plan", "--json", "--target", "cuda"],
                             capture_output=True, text=True, check=True).stdout
    return json.loads(planned)["targets"][0]["tag"]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, metavar="PARTS_DIR", help="the folder to write the parts into (replaced)")
    parser.add_argument("--tag", help="the image (default: the cuda tag `build.py plan` names)")
    parser.add_argument("--part-size", type=part_size, default=DEFAULT_PART_MIB, metavar="MIB",
                        help=f"the largest part, in MiB (default {DEFAULT_PART_MIB})")
    parser.add_argument("--python", type=python_version, default=f"{sys.version_info[0]}.{sys.version_info[1]}",
                        metavar="X.Y", help="the host's Python, for the host tool's wheels (default: this one's)")
    parser.add_argument("--model", type=model_folder, metavar="DIR", help="a model folder for the host to serve")
    parser.add_argument("--drafter", type=model_folder, metavar="DIR", help="its drafter's folder")
    parser.add_argument("--on-top-of", metavar="OLD_PARTS_DIR|IMAGE", help="pack an update for a host that loaded "
                        "that pack (or has that image): no kit, only the layers it lacks")
    return parser.parse_args(argv)


def base_of(given: str) -> tuple[str, list[str]]:
    """--on-top-of: (the image ID the host has, its layers) from an earlier pack's folder or an image here."""
    folder = Path(given)
    if folder.is_dir():
        if not (folder / "LAYERS").is_file() or not (folder / "IMAGE").is_file():
            sys.exit(f"pack: {given}: no LAYERS and IMAGE: not a folder of parts (packs before LAYERS need the image)")
        return (folder / "IMAGE").read_text().split()[1], (folder / "LAYERS").read_text().split()
    found = inspect(given)
    if found is None:
        sys.exit(f"pack: --on-top-of {given}: neither a folder of parts nor an image here")
    return found["Id"], found["RootFS"]["Layers"]


def inspect(image: str) -> dict | None:
    """`docker image inspect IMAGE`, or None where there is no such image here."""
    found = subprocess.run(["docker", "image", "inspect", image], capture_output=True, text=True)
    return json.loads(found.stdout)[0] if found.returncode == 0 else None


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    tag = args.tag or planned_tag()
    image = inspect(tag)
    if image is None:
        sys.exit(f"pack: {tag} is not built here: run `make image TARGET=cuda` first")
    image_id = image["Id"]
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    sums: list[str] = []
    size = args.part_size * 2**20
    (args.out / "LAYERS").write_text("\n".join(image["RootFS"]["Layers"]) + "\n")
    (args.out / "IMAGE").write_text(f"{tag} {image_id}\n")
    if args.on_top_of:
        return pack_update(tag, image_id, args, sums, size)
    models = {name: path for name, path in (("model", args.model), ("drafter", args.drafter)) if path}
    with tempfile.TemporaryDirectory() as tmp:
        kit = Path(tmp) / "kit"
        kit.mkdir()
        gather_kit(kit, args.python, models)
        tar_path = Path(tmp) / "kit.tar"
        with tarfile.open(tar_path, "w") as tar:
            tar.add(kit, arcname="kit")
        with open(tar_path, "rb") as stream:
            kit_parts = split(stream, "kit", args.out, sums, size)
    print(f"pack: the kit in {kit_parts} part(s); saving {tag} ({image_id[:19]})", flush=True)
    save = subprocess.Popen(["docker", "save", tag], stdout=subprocess.PIPE)
    # -3: on 600 MB of this image's stream -9 --long saved 2.6% in 3 times the time and -15 3.7% in 20 (2026-12-03)
    zstd = subprocess.Popen(["zstd", "-3", "-T0", "-q", "-c"], stdin=save.stdout, stdout=subprocess.PIPE)
    assert save.stdout and zstd.stdout
    save.stdout.close()
    image_parts = split(zstd.stdout, "image", args.out, sums, size)
    if zstd.wait() or save.wait():
        sys.exit("pack: docker save | zstd failed")
    (args.out / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    print(f"pack: {kit_parts + image_parts} parts of at most {args.part_size} MiB in {args.out} ({image_parts} of "
          "the image); there: bench/gpu/airgap.sh setup PARTS_DIR")
    return 0


def pack_update(tag: str, image_id: str, args: argparse.Namespace, sums: list[str], size: int) -> int:
    """The image's layers the host lacks, zstd-compressed and split, and ON-TOP-OF: no kit."""
    from servekit.engines.transfer import save_on_top_of
    base_id, base_layers = base_of(args.on_top_of)
    (args.out / "ON-TOP-OF").write_text(base_id + "\n")
    zstd = subprocess.Popen(["zstd", "-3", "-T0", "-q", "-c"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert zstd.stdin and zstd.stdout
    counted: dict[str, int] = {}

    def feed() -> None:  # the save streams into zstd while the parts are cut from its output
        assert zstd.stdin
        try:
            counted.update(save_on_top_of(tag, base_layers, zstd.stdin, say=lambda line: print(f"pack: {line}")))
        finally:
            zstd.stdin.close()
    feeder = threading.Thread(target=feed)
    feeder.start()
    parts = split(zstd.stdout, "image", args.out, sums, size)
    feeder.join()
    if zstd.wait() or not counted:
        sys.exit("pack: docker save | zstd failed")
    (args.out / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    carried = sum((args.out / f"image-{n:03d}").stat().st_size for n in range(parts))
    print(f"pack: an update of {tag} on top of {base_id[:19]}: {counted['carried']} of {counted['layers']} layers "
          f"({counted['bytes'] / 2**20:.1f} MiB, {carried / 2**20:.1f} MiB compressed) in {parts} part(s) in "
          f"{args.out}; there: bench/gpu/airgap.sh update PARTS_DIR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
