"""What a GPU boot compiles, checked where there is no GPU: a C compiler and Python's headers, with which
Triton builds its CUDA driver stub (a Python extension) at the first use of a GPU. An image without them
passes every check a build can run and then fails on the card before the model loads (`Python.h: No such
file or directory`), so the base stage refuses early and the in-image verify compiles Triton's own stub.
Standard library only: it runs on the base's bare Python before any wheel is there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

PROBE = "#include <Python.h>\nint servekit_probe(void) { return PY_MAJOR_VERSION; }\n"


def compiler() -> str | None:
    """The C compiler Triton picks: $CC, else gcc, else clang."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def problems(sources: list[Path] | None = None, include_dirs: list[Path] | None = None) -> list[str]:
    """Each of `sources` (else a probe that includes Python.h) compiled as Triton compiles its stub."""
    cc = compiler()
    if not cc:
        return ["no C compiler (gcc): Triton compiles its CUDA driver stub with one at the first GPU use; add gcc "
                "to the base"]
    headers = Path(sysconfig.get_paths()["include"])
    if not (headers / "Python.h").is_file():
        return [f"Python's headers are missing ({headers}/Python.h): Triton compiles its CUDA driver stub against "
                "them at the first GPU use; add the base's Python development package (libpython3.X-dev, "
                "python3-dev)"]
    with tempfile.TemporaryDirectory(prefix="servekit-boot-") as tmp:
        if not sources:
            sources = [Path(tmp) / "probe.c"]
            sources[0].write_text(PROBE)
        for source in sources:
            argv = [cc, "-c", "-O0", "-fPIC", f"-I{headers}", *(f"-I{d}" for d in include_dirs or []),
                    str(source), "-o", str(Path(tmp) / f"{source.stem}.o")]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                return [f"{source.name} does not compile as Triton compiles it at the first GPU use: {last[-300:]}"]
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    found = problems()
    for problem in found:
        print(f"bootneeds: {problem}", file=sys.stderr)
    if not found:
        print(f"bootneeds: ok ({compiler()} compiles against Python.h)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
