"""Pack what a GPU machine without a network needs to serve the built cuda image: the image, the engine, the host tool.

Writes PARTS_DIR/NNN/ folders of one part each (one command to the host carries at most 64 MiB,
the working tree included, here without TRAVEL_ONCE), every part named in 000/SHA256SUMS:

- image-*: `docker save TAG | zstd -3`, split (the image ID survives save and load, so reports made there name
  the image built here);
- kit-*: a tar of the engine's Debian 12 packages (bootstrap.ENGINE_DEBS, `apt-get download`), the Compose
  sdist, the host tool's wheels for Python 3.12 (requirements.lock, hash-checked by pip) and this machine's
  zstd with its liblz4 (the GPU machine has neither).

    python bench/gpu/pack.py PARTS_DIR [--tag TAG]     # then bench/gpu/visit.sh there (docs/gpu/README.md)
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from servekit.engines.bootstrap import COMPOSE_DIST, ENGINE_DEBS  # noqa: E402

CALL_BYTES = 63 * 2**20  # what one command to the host carries, the working tree included (64 MiB, less a margin)
MAX_PART_BYTES = 59 * 2**20
# Out of the tree while the parts travel (git sparse-checkout): the shipped models go once, in the visit's first
# call with the whole tree (visit.sh take keeps them), and the calls that set up and run have the whole tree again.
TRAVEL_ONCE = ("bench/gpu/qwen35-mini/", "bench/gpu/qwen35-mini-dflash2/", "docker/demo-model/")
SPARSE = "git sparse-checkout set --no-cone '/*' " + " ".join(f"'!/{folder}'" for folder in TRAVEL_ONCE)
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def gather_kit(folder: Path) -> None:
    engine = folder / "engine"
    engine.mkdir()
    subprocess.run(["apt-get", "download", *ENGINE_DEBS], cwd=engine, check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d",
                    str(engine), COMPOSE_DIST], check=True)
    wheels = folder / "wheels"
    platforms = [a for p in WHEEL_PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "--platform", "any", "-d",
                    str(wheels), "--require-hashes", "-r", str(ROOT / "requirements.lock")], check=True)
    tools = folder / "tools"
    tools.mkdir()
    zstd = shutil.which("zstd")
    if not zstd:
        sys.exit("pack: no zstd here (apt-get install zstd)")
    shutil.copy2(zstd, tools / "zstd")
    for line in subprocess.run(["ldd", zstd], capture_output=True, text=True, check=True).stdout.splitlines():
        if "liblz4" in line:
            shutil.copy2(line.split("=>")[1].split()[0], tools)


def tree_bytes() -> int:
    """What travels with every part: tracked files and untracked ones git does not ignore, less TRAVEL_ONCE."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sum((ROOT / name).stat().st_size for name in listed
               if name and not name.startswith(TRAVEL_ONCE) and (ROOT / name).is_file())


def part_bytes() -> int:
    """The largest part that still fits one call beside the working tree (the shipped models ride along)."""
    room = CALL_BYTES - tree_bytes()
    if room < 8 * 2**20:
        sys.exit(f"pack: the working tree leaves {room >> 20} MiB of a call's 64 for a part; ignore what need not travel")
    return min(MAX_PART_BYTES, room) // 2**20 * 2**20


def split(stream, prefix: str, out: Path, sums: list[str], start: int, size: int) -> int:
    n = start
    while chunk := stream.read(size):
        name = f"{prefix}-{n - start:03d}"
        folder = out / f"{n:03d}"
        folder.mkdir()
        (folder / name).write_bytes(chunk)
        sums.append(f"{hashlib.sha256(chunk).hexdigest()}  {name}")
        n += 1
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tag", help="the image (default: the cuda tag `build.py plan` names)")
    args = parser.parse_args()
    if not args.tag:
        planned = subprocess.run([sys.executable, str(ROOT / "build.py"), "plan", "--json", "--target", "cuda"],
                                 capture_output=True, text=True, check=True).stdout
        args.tag = json.loads(planned)["targets"][0]["tag"]
    tag = args.tag
    image_id = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True,
                              text=True).stdout.strip()
    if not image_id:
        sys.exit(f"pack: {tag} is not built here: run `make image TARGET=cuda` first")
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    sums: list[str] = []
    size = part_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        kit = Path(tmp) / "kit"
        kit.mkdir()
        gather_kit(kit)
        tar_path = Path(tmp) / "kit.tar"
        with tarfile.open(tar_path, "w") as tar:
            tar.add(kit, arcname="kit")
        with open(tar_path, "rb") as stream:
            n = split(stream, "kit", args.out, sums, 0, size)
    print(f"pack: kit in {n} part(s); saving {tag} ({image_id[:19]})", flush=True)
    save = subprocess.Popen(["docker", "save", tag], stdout=subprocess.PIPE)
    # -3: on 600 MB of this image's stream -9 --long saved 2.6% in 3 times the time and -15 3.7% in 20 (2026-12-03)
    zstd = subprocess.Popen(["zstd", "-3", "-T0", "-q", "-c"], stdin=save.stdout, stdout=subprocess.PIPE)
    assert save.stdout and zstd.stdout
    save.stdout.close()
    total = split(zstd.stdout, "image", args.out, sums, n, size)
    if zstd.wait() or save.wait():
        sys.exit("pack: docker save | zstd failed")
    # In the first part's folder, so that they travel with it.
    (args.out / "000" / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    (args.out / "000" / "IMAGE").write_text(f"{tag} {image_id}\n")
    print(f"pack: {total} parts of at most {size >> 20} MiB in {args.out} ({total - n} of the image); they fit a "
          f"call with the tree sparse: after the first call, {SPARSE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
