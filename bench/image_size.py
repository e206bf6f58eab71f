"""Image size benchmark: per layer of a built image, its size unpacked and compressed as `docker save | zstd -3`
compresses it, what Dockerfile step made it, the totals, and what a pull fetches again after each kind of change.

A registry keeps layers by content: a pull fetches the layers it lacks. A change invalidates its own layer and
every layer built after it, so for each kind of change (torch, vLLM and what it needs, the series, the code)
this prints the compressed bytes of those layers: what a pull re-fetches at most (a rebuilt layer whose files
came out the same is not fetched again). `--vs OLD` measures it: the layers of the image that OLD lacks.
`--simulate launcher|serving` makes such a change for real in a copy of the repository (a launcher edit; one
package only vLLM needs added to the lock, by taking `anthropic` off the cuda target's exclusions) and builds
it, then measures the new image against this one and removes it again.
Prints figures; asserts nothing.
Run: .venv/bin/python bench/image_size.py [TAG] [--vs OLD_TAG | --simulate launcher|serving] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The first layer each kind of change rebuilds, found by what its Dockerfile step ran.
CHANGES = (("torch (the CUDA libraries, torch, Triton)", "requirements-torch.txt"),
           ("vLLM, FlashInfer or a package only they need", "requirements-serving.txt"),
           ("the patch series", "series.py apply"),
           ("the launcher, the profiles or the other image code", "COPY servekit/image/ /opt/servekit/servekit/image/"))


def planned_tag(target: str) -> str:
    done = subprocess.run([sys.executable, "build.py", "plan", "--json", "--target", target], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)["targets"][0]["tag"]


class _Counter(threading.Thread):
    """Counts the bytes a zstd process writes."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.total = stream, 0

    def run(self) -> None:
        while piece := self.stream.read(1 << 20):
            self.total += len(piece)


def _zstd_size(member) -> int:
    zstd = subprocess.Popen(["zstd", "-3", "-T0", "-q", "-c"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    counter = _Counter(zstd.stdout)
    counter.start()
    assert zstd.stdin is not None
    while piece := member.read(1 << 22):
        zstd.stdin.write(piece)
    zstd.stdin.close()
    zstd.wait()
    counter.join()
    return counter.total


def layers(tag: str) -> list[dict]:
    """Each layer bottom-up: its diff ID, its sizes, and the history entry that made it."""
    save = subprocess.Popen(["docker", "save", tag], stdout=subprocess.PIPE)
    files: dict[str, dict] = {}
    documents: dict[str, bytes] = {}
    with tarfile.open(fileobj=save.stdout, mode="r|") as tar:
        for member in tar:
            stream = tar.extractfile(member) if member.isfile() else None
            if stream is None:
                continue
            if member.name.endswith(".json") or member.name == "index.json":
                documents[member.name] = stream.read()
            else:  # a layer: `<id>/layer.tar` (Docker's format) or `blobs/sha256/<digest>` (OCI's)
                files[member.name] = {"bytes": member.size, "zstd": _zstd_size(stream)}
    if save.wait() != 0:
        sys.exit(f"docker save {tag} failed")
    manifest = json.loads(documents["manifest.json"])[0]
    config = json.loads(documents[manifest["Config"]])
    made_by = [h.get("created_by", "") for h in config["history"] if not h.get("empty_layer")]
    diff_ids = config["rootfs"]["diff_ids"]
    return [{"diff_id": diff_id, **files[path], "made_by": step}
            for path, diff_id, step in zip(manifest["Layers"], diff_ids, made_by, strict=True)]


def refetched(found: list[dict]) -> list[dict]:
    out = []
    for change, marker in CHANGES:
        first = next((i for i, layer in enumerate(found) if marker in layer["made_by"]), None)
        if first is not None:
            rest = found[first:]
            out.append({"change": change, "layers": len(rest), "bytes": sum(x["bytes"] for x in rest),
                        "zstd": sum(x["zstd"] for x in rest)})
    return out


def _simulated(kind: str) -> str:
    """Build the image again in a copy of the repository with one change of `kind`; its tag."""
    sys.path.insert(0, str(ROOT / "tests"))
    from support import tracked_copy  # the tests' copy of the repository: what git tracks, the caches shared
    copy = tracked_copy(Path(tempfile.mkdtemp(prefix="servekit-bump-")))
    if kind == "launcher":
        path = copy / "servekit/image/launcher.py"
        path.write_text(path.read_text().replace('"""The launcher', '"""The  launcher', 1))
    else:
        path = copy / "images.yaml"
        text = path.read_text()
        line = next(x for x in text.splitlines() if x.strip().startswith("anthropic:"))
        path.write_text(text.replace(line + "\n", "", 1))
        subprocess.run([sys.executable, "build.py", "lock", "--target", "cuda"], cwd=copy, check=True)
    done = subprocess.run([sys.executable, "build.py", "image", "--target", "cuda", "--json"], cwd=copy,
                          capture_output=True, text=True)
    shutil.rmtree(copy, ignore_errors=True)
    if done.returncode != 0:
        sys.exit(f"the {kind} build failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)["images"][0]["tag"]


def _short(step: str) -> str:
    step = step.replace("/bin/sh -c ", "").replace(" # buildkit", "").strip()
    return step if len(step) <= 70 else step[:67] + "..."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tag", nargs="?", help="the image (default: the cuda tag `plan` names)")
    parser.add_argument("--vs", metavar="OLD_TAG", help="an earlier build: print what a pull of TAG fetches beyond it")
    parser.add_argument("--simulate", choices=("launcher", "serving"), help="build a copy with such a change and "
                        "print what a pull of it fetches beyond TAG")
    parser.add_argument("--json", action="store_true", help="the figures as JSON")
    args = parser.parse_args()
    tag = args.tag or planned_tag("cuda")
    found = layers(tag)
    figures: dict = {"tag": tag, "layers": found, "bytes": sum(x["bytes"] for x in found),
                     "zstd": sum(x["zstd"] for x in found), "refetch_at_most": refetched(found)}
    if args.vs:
        old = {x["diff_id"] for x in layers(args.vs)}
        new = [x for x in found if x["diff_id"] not in old]
        figures["vs"] = {"tag": args.vs, "layers": len(new), "bytes": sum(x["bytes"] for x in new),
                         "zstd": sum(x["zstd"] for x in new)}
    if args.simulate:
        bumped = _simulated(args.simulate)
        try:
            have = {x["diff_id"] for x in found}
            new = [x for x in layers(bumped) if x["diff_id"] not in have]
        finally:
            subprocess.run(["docker", "image", "rm", bumped], capture_output=True)
        figures["simulated"] = {"change": args.simulate, "tag": bumped, "layers": len(new),
                                "bytes": sum(x["bytes"] for x in new), "zstd": sum(x["zstd"] for x in new)}
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"{tag}: {len(found)} layers, {figures['bytes'] / 1e9:.2f} GB unpacked, {figures['zstd'] / 1e9:.2f} GB "
          "as docker save | zstd -3")
    print(f"{'#':>3} {'unpacked MB':>12} {'zstd MB':>9}  made by")
    for i, layer in enumerate(found):
        print(f"{i:>3} {layer['bytes'] / 1e6:>12.1f} {layer['zstd'] / 1e6:>9.1f}  {_short(layer['made_by'])}")
    print("a pull re-fetches at most, after a change of:")
    for row in figures["refetch_at_most"]:
        print(f"  {row['change']}: {row['layers']} layers, {row['zstd'] / 1e6:.1f} MB compressed "
              f"({row['bytes'] / 1e6:.1f} MB unpacked)")
    if "vs" in figures:
        vs = figures["vs"]
        print(f"beyond {vs['tag']}, a pull fetches {vs['layers']} layers: {vs['zstd'] / 1e6:.1f} MB compressed "
              f"({vs['bytes'] / 1e6:.1f} MB unpacked)")
    if "simulated" in figures:
        sim = figures["simulated"]
        print(f"after a {sim['change']} change (built as {sim['tag']}), a pull fetches {sim['layers']} layers: "
              f"{sim['zstd'] / 1e6:.3f} MB compressed ({sim['bytes'] / 1e6:.3f} MB unpacked)")


if __name__ == "__main__":
    main()
