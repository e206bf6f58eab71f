"""Base images: a pulled base is looked for; a base made here is made here, once per definition.

A made base is Debian from `debootstrap` and, where images.yaml lists `cuda_wheels`, the CUDA
toolchain from PyPI wheels laid out as /usr/local/cuda, as NVIDIA's devel images lay it out (nvcc
on PATH, headers in include/, libraries in lib64/, a libcuda stub in lib64/stubs/ to link
against), so the build, FlashInfer's JIT and verify see the same toolkit on either base. The image
carries the digest of its definition as a label: a changed definition is made anew.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from servekit.config.matrix import Base
from servekit.engines import local
from servekit.engines.bootstrap import apt_install, can_install
from servekit.engines.dockercli import docker_cli
from servekit.errors import EnvironmentProblem
from servekit.exclusive import machine_wide
from servekit.output import Say
from servekit.trust import ca_bundle

LABEL = "io.servekit.base.definition"
CUDA_HOME = "/usr/local/cuda"
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# How _make lays a base down, beside what images.yaml says of it: a change here makes every made base again (and,
# through build_facts, moves the image tags built on one).
RECIPE = 2  # 2: apt's downloaded packages and lists, docs, man pages and locales left out


def definition_digest(base: Base) -> str:
    return hashlib.sha256(json.dumps({**base.model_dump(), "recipe": RECIPE}, sort_keys=True).encode()).hexdigest()[:16]


# What a made base leaves out of debootstrap's tree, as Debian's slim images do: apt's downloaded .debs and package
# lists (a build that needs a package runs apt-get update first), man pages, translations, and documentation
# but each package's copyright file.
SLIMMED = ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*", "usr/share/man/*", "usr/share/locale/*",
           "usr/share/info/*", "usr/share/doc/*/*")


def _slim(rootfs: Path) -> None:
    for pattern in SLIMMED:
        for entry in rootfs.glob(pattern):
            if entry.name == "copyright" and entry.parent.parent.name == "doc":
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def made_base_current(base: Base) -> bool:
    image = local().image(base.image)
    return image is not None and (image.labels or {}).get(LABEL) == definition_digest(base)


def ensure_made_base(name: str, base: Base, cache_dir: Path, say: Say = print) -> bool:
    """Make `base` unless an image of this very definition is there; True when it was made now."""
    if made_base_current(base):
        return False
    with machine_wide("base", base.image, say=say):  # two checkouts making one base would import it twice
        if made_base_current(base):  # made by another while this one waited
            return False
        return _make_now(name, base, cache_dir, say)


def _make_now(name: str, base: Base, cache_dir: Path, say: Say) -> bool:
    if not shutil.which("debootstrap"):
        if not can_install():
            raise EnvironmentProblem(f"base {name} ({base.image}) is made with debootstrap, which needs root on "
                                     "Debian/Ubuntu (apt-get install debootstrap); or build on another base with --base")
        apt_install(["debootstrap"], say)
    started = time.monotonic()
    _make(name, base, cache_dir, say)
    say(f"base {name} ({base.image}) made in {time.monotonic() - started:.0f} s")
    return True


def _make(name: str, base: Base, cache_dir: Path, say: Say) -> None:
    boot = base.debootstrap
    assert boot is not None, "only a base with debootstrap is made here"
    say(f"making base {name} ({base.image}) with debootstrap {boot.suite}"
        + (f" and {len(base.cuda_wheels)} CUDA toolchain wheels" if base.cuda_wheels else "") + " (a minute or two)")
    with tempfile.TemporaryDirectory(prefix="servekit-rootfs-") as rootfs_name:
        rootfs = Path(rootfs_name)
        done = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(boot.packages)}", boot.suite,
                               str(rootfs)], capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            raise EnvironmentProblem(f"debootstrap {boot.suite} for base {name} failed: {done.stderr.strip()[-300:]}")
        _slim(rootfs)
        changes = [f"LABEL {LABEL}={definition_digest(base)}"]
        if base.cuda_wheels:
            _lay_cuda_toolkit(name, base.cuda_wheels, rootfs, cache_dir / "cuda-wheels", say)
            changes += [f"ENV PATH={CUDA_HOME}/bin:{_DEFAULT_PATH}", f"ENV CUDA_HOME={CUDA_HOME}"]
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        # The CLI reads the tar from the pipe as it is made; python-on-whales' import takes a file, and a rootfs
        # written to disk first would double what a base needs there.
        imported = docker_cli(["import", *[x for c in changes for x in ("--change", c)], "-", base.image],
                              timeout=900, stdin=tar.stdout)
        if tar.stdout:
            tar.stdout.close()
        tar.wait()
        if imported.returncode != 0:
            raise EnvironmentProblem(f"docker import {base.image} failed: {imported.stderr.strip()[-300:]}")


def _lay_cuda_toolkit(name: str, wheels: dict[str, str], rootfs: Path, cache: Path, say: Say) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    wanted = [f"{dist}=={version}" for dist, version in sorted(wheels.items())]
    say(f"downloading {', '.join(wanted)}")
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:", "-d", str(cache)]
    bundle = ca_bundle()
    if bundle:
        cmd += ["--cert", str(bundle)]
    done = subprocess.run([*cmd, *wanted], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "ERROR" in line] or done.stderr.splitlines()[-1:]
        raise EnvironmentProblem(f"base {name}: could not download the CUDA toolchain wheels: {' '.join(errors)[-300:]}")
    home = rootfs / CUDA_HOME.lstrip("/")
    for dist, version in sorted(wheels.items()):
        prefix = dist.replace("-", "_") + f"-{version}-"
        found = sorted(cache.glob(f"{prefix}*.whl"))
        if not found:
            raise EnvironmentProblem(f"base {name}: pip reported {dist}=={version} downloaded, but no wheel is in {cache}")
        _extract_toolkit_files(found[-1], home)
    _link_like_devel_image(home)
    _make_driver_stub(rootfs, name)


def _extract_toolkit_files(wheel: Path, home: Path) -> None:
    """nvidia/<flavour>/X of the wheel becomes X under the toolkit's home, modes kept (nvcc must run)."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            parts = Path(info.filename).parts
            if len(parts) < 3 or parts[0] != "nvidia" or info.is_dir():
                continue
            dest = home.joinpath(*parts[2:])
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
            mode = (info.external_attr >> 16) & 0o777
            dest.chmod(mode or 0o644)


def _link_like_devel_image(home: Path) -> None:
    """lib64 as in NVIDIA's images, and the unversioned names a linker asks for (-lcudart)."""
    lib = home / "lib"
    lib.mkdir(exist_ok=True)
    if not (home / "lib64").exists():
        (home / "lib64").symlink_to("lib")
    for versioned in lib.glob("*.so.*"):
        plain = lib / (versioned.name.split(".so.")[0] + ".so")
        if not plain.exists():
            plain.symlink_to(versioned.name)
    for tool in [*(home / "bin").glob("*"), *(home / "nvvm" / "bin").glob("*")]:
        if tool.is_file() and tool.suffix != ".profile":  # nvcc, ptxas, cicc, ...: executable whatever the zip said
            tool.chmod(tool.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _make_driver_stub(rootfs: Path, name: str) -> None:
    """libcuda.so to link against, named libcuda.so.1 as the driver is: the GPU host's driver is what loads."""
    stubs = rootfs / CUDA_HOME.lstrip("/") / "lib" / "stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["chroot", str(rootfs), "gcc", "-shared", "-x", "c", "-", "-Wl,-soname,libcuda.so.1",
                           "-o", f"{CUDA_HOME}/lib/stubs/libcuda.so"], input="", capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0:
        raise EnvironmentProblem(f"base {name}: could not make the libcuda stub with the base's gcc (is g++ among "
                                 f"its debootstrap packages?): {done.stderr.strip()[-200:]}")
