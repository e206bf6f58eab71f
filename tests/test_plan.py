"""The plan: every input an image bakes moves its tag; targets and bases are data; per-machine settings."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml
from support import ROOT, tracked_copy, with_prebuilt_cubins

from servekit.build.builder import offered_wheels, stage_series
from servekit.build.plan import plan_targets
from servekit.config.load import load_matrix
from servekit.config.settings import BuildSettings, _pip_find_links
from servekit.errors import UserError
from servekit.image.series import read_series


def _tag(root: Path, target: str, settings: BuildSettings | None = None) -> str:
    return plan_targets(load_matrix(root / "images.yaml"), root, [target], settings=settings)[0].tag


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


# Each kind of input the image bakes, changed once: (what, target, change).
CHANGES = [
    ("a profile knob in images.yaml", "cuda",
     lambda r: _edit(r / "images.yaml", "        MAX_SEQS: 4", "        MAX_SEQS: 5")),
    ("a host's environment", "cuda",
     lambda r: _edit(r / "images.yaml", '"expandable_segments:False"', '"expandable_segments:True"')),
    ("a host's card (the arch verify compiles for)", "cuda",
     lambda r: _edit(r / "images.yaml", 'cuda_arch: "8.6"', 'cuda_arch: "8.0"')),
    ("a target's environment", "cpu",
     lambda r: _edit(r / "images.yaml", 'TORCHDYNAMO_DISABLE: "1"', 'TORCHDYNAMO_DISABLE: "0"')),
    ("a pin", "cuda", lambda r: _edit(r / "images.yaml", 'transformers: "5.15.0"', 'transformers: "5.16.0"')),
    ("the image's description (an OCI label)", "cpu",
     lambda r: _edit(r / "images.yaml", "  description: vLLM with a patch series", "  description: vLLM with a series")),
    ("the launcher", "cuda", lambda r: _edit(r / "servekit/image/launcher.py", '"""The launcher', '"""The  launcher')),
    ("the verify step", "cuda", lambda r: _edit(r / "servekit/image/verify.py", '"""The in-image', '"""The  in-image')),
    ("the code that writes the image's SBOM", "cuda",
     lambda r: _edit(r / "servekit/build/sbom.py", '"""The image\'s software', '"""The  image\'s software')),
    ("a patch of the series", "cpu",
     lambda r: (r / "docker/patches/cpu-cli-version.patch").write_text(
         (r / "docker/patches/cpu-cli-version.patch").read_text() + "\n")),
    ("a component's source appearing", "cuda",
     lambda r: (r / "kvarn/files/vllm").mkdir(parents=True) or (r / "kvarn/files/vllm/x.py").write_text("X = 1\n")),
    ("the base's definition", "cuda",
     lambda r: _edit(r / "images.yaml", "libpython3.11-dev, ca-certificates, libnuma1, patch, g++]",
                     "libpython3.11-dev, ca-certificates, libnuma1, patch, g++, curl]")),
    ("the lock of the base's Python", "cuda",
     lambda r: _edit(r / "docker/locks/cuda-py3.11.txt", "# servekit-lock-inputs:", "# a note\n# servekit-lock-inputs:")),
]


@pytest.mark.parametrize("what,target,change", CHANGES, ids=[c[0] for c in CHANGES])
def test_every_baked_input_moves_the_tag(tmp_path, what, target, change):
    root = tracked_copy(tmp_path)
    before = _tag(root, target)
    change(root)
    assert _tag(root, target) != before, f"changing {what} kept the tag {before}"


def test_what_the_image_does_not_bake_keeps_the_tag(tmp_path):
    root = tracked_copy(tmp_path)
    before = {t: _tag(root, t) for t in ("cpu", "cuda")}
    _edit(root / "README.md", "# servekit", "# servekit (edited)")
    _edit(root / "images.yaml", "  boot_timeout_s: 900", "  boot_timeout_s: 901")  # how long `up` waits
    assert {t: _tag(root, t) for t in ("cpu", "cuda")} == before


def test_the_base_and_the_pins_left_out_move_the_tag_and_say_so(tmp_path):
    """The default is the base made here and FlashInfer compiling at first use, the image the tests build; another
    base, or the prebuilt kernels added as docs/build.md says (and left out again with --without), is another tag."""
    matrix = load_matrix(ROOT / "images.yaml")
    default = plan_targets(matrix, ROOT, ["cuda"])[0]
    devel = plan_targets(matrix, ROOT, ["cuda"], settings=BuildSettings(base="cuda-devel"))[0]
    root = tracked_copy(tmp_path)
    cubins = load_matrix(with_prebuilt_cubins(root))
    prebuilt = plan_targets(cubins, root, ["cuda"])[0]
    jit = plan_targets(cubins, root, ["cuda"], settings=BuildSettings(without=("flashinfer-cubin",)))[0]
    assert len({default.tag, devel.tag, prebuilt.tag, jit.tag}) == 4
    assert (default.base_name, devel.base_name) == ("cuda-local", "cuda-devel")
    assert default.python == "3.11" and devel.python == "3.12"
    assert "flashinfer-cubin" not in default.pins and default.build_info["omitted"] == {}
    assert "flashinfer-cubin" in prebuilt.pins and "flashinfer-cubin" not in jit.pins
    assert jit.build_info["omitted"] == {"flashinfer-cubin": matrix.may_omit["flashinfer-cubin"]}
    assert any("compiles its kernels at first use" in note for note in jit.notes)
    assert default.build_info["cuda_archs"] == ["8.6", "8.9"]
    # --base names a base the cpu target does not list: the cpu target keeps its own.
    assert plan_targets(matrix, ROOT, ["cpu"], settings=BuildSettings(base="cuda-local"))[0].base_name == \
        "bookworm-local"


def test_a_patch_left_out_is_another_tag_staged_without_it_and_never_released(cli, tmp_path):
    """--without NAME of the series builds the image as released vLLM behaves there, to measure what the patch does:
    its own tag, build-info naming it left out, the staged series without its file or line, and release refusing."""
    matrix = load_matrix(ROOT / "images.yaml")
    name = "marlin-int8-signed-scales"
    default = plan_targets(matrix, ROOT, ["cuda"])[0]
    without = plan_targets(matrix, ROOT, ["cuda"], settings=BuildSettings(without=(name,)))[0]
    assert without.tag != default.tag and f"{name}.patch" in default.build_info["series"]
    assert f"{name}.patch" not in without.build_info["series"] and f"{name}.patch" in without.build_info["omitted"]
    staged = tmp_path / "patches"
    left_out = [f"{name}.patch", "marlin-int8-emulated.patch"]
    stage_series(staged, ROOT / matrix.series.dir, left_out)
    assert [p.name for p in read_series(staged)] == [p.name for p in read_series(ROOT / matrix.series.dir)
                                                     if p.name not in left_out]
    assert not (staged / f"{name}.patch").exists() and name not in (staged / "series").read_text()
    pair = f"marlin-int8-emulated,{name}"  # the emulation calls the fold this patch adds (its Requires: trailer)
    code, _, err = cli("--without", name, "plan", "--target", "cuda")
    assert code == 2 and "marlin-int8-emulated.patch requires it (its Requires: trailer)" in err
    assert f"leave that out too: --without {pair}" in err and "Traceback" not in err
    code, _, err = cli("--without", pair, "release", "--dry-run")
    assert code == 2 and f"--without {pair.replace(',', ', ')}: a patch of the series left out" in err
    code, _, err = cli("--without", "no-such-patch", "plan")
    assert code == 2 and "neither a pin listed under may_omit" in err and "Traceback" not in err


def test_the_plan_command_shows_base_and_what_is_left_out(cli, tmp_path):
    code, out, _ = cli("--matrix", str(with_prebuilt_cubins(tracked_copy(tmp_path))), "--base", "cuda-devel",
                       "--without", "flashinfer-cubin", "plan", "--target", "cuda")
    assert code == 0
    assert "cuda-devel" in out and "nvidia/cuda" in out
    assert "flashinfer-cubin left out: FlashInfer compiles its kernels at first use" in " ".join(out.split())
    code, out, _ = cli("--matrix", str(ROOT / "images.yaml"), "plan", "--target", "cuda")
    assert code == 0 and "cuda-local" in out and "made here" in out and "left out" not in out


@pytest.mark.parametrize("argv,words", [
    (["--base", "ubuntu"], ["--base ubuntu", "no such base", "cuda-devel"]),
    (["--without", "torch"], ["--without torch", "may_omit", "flashinfer-cubin"]),
    (["--wheels", "/nonexistent/wheels"], ["--wheels /nonexistent/wheels", "not a folder"]),
])
def test_bad_settings_are_one_line(cli, argv, words):
    code, out, err = cli("--matrix", str(ROOT / "images.yaml"), *argv, "plan")
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and all(w in lines[0] for w in words), err
    assert "Traceback" not in err


def test_settings_come_from_the_environment(monkeypatch, tmp_path):
    matrix = load_matrix(with_prebuilt_cubins(tracked_copy(tmp_path)))
    monkeypatch.setenv("SERVEKIT_BASE", "cuda-devel")
    monkeypatch.setenv("SERVEKIT_WITHOUT", "flashinfer-cubin")
    settings = BuildSettings.resolve(matrix)
    assert settings.base_for(matrix, "cuda") == "cuda-devel" and settings.omitted(matrix, "cuda") == ["flashinfer-cubin"]
    monkeypatch.setenv("SERVEKIT_BASE", "nope")
    with pytest.raises(UserError):
        BuildSettings.resolve(matrix)


def test_a_folder_of_wheels_offers_only_exact_pinned_versions(tmp_path):
    for name in ("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
                 "xgrammar-0.2.6-cp311-cp311-manylinux_2_28_x86_64.whl",
                 "transformers-5.15.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    matrix = load_matrix(ROOT / "images.yaml")
    settings = BuildSettings(wheels=(str(tmp_path),))
    cpu, cuda = plan_targets(matrix, ROOT, ["cpu", "cuda"], settings=settings)
    assert sorted(offered_wheels(cpu, settings)) == ["torch", "transformers"]
    # torch 2.13.0+cpu satisfies `torch==2.13.0` to pip; it must never reach the cuda image.
    assert sorted(offered_wheels(cuda, settings)) == ["transformers"]


def test_pips_own_find_links_are_the_default_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    assert tmp_path in _pip_find_links()
    assert tmp_path in BuildSettings().wheel_dirs


def test_nothing_of_this_machine_is_named_in_the_repository():
    """No absolute path that exists here outside the repository in images.yaml; no wheel folder of this
    machine's pip anywhere in the tracked files."""
    def strings(node):
        if isinstance(node, dict):
            for value in node.values():
                yield from strings(value)
        elif isinstance(node, list):
            for value in node:
                yield from strings(value)
        elif isinstance(node, str):
            yield node
    data = yaml.safe_load((ROOT / "images.yaml").read_text())
    here = [s for s in strings(data) if s.startswith("/") and Path(s).exists() and ROOT not in Path(s).resolve().parents]
    assert here == []
    folders = [str(p) for p in _pip_find_links()]
    if folders:
        hits = subprocess.run(["git", "grep", "-lF", *[x for f in folders for x in ("-e", f)], "--", ".",
                               ":!tests/test_plan.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
        assert hits == [], f"{folders} named in {hits}"


def _python_sources() -> list[Path]:
    return [*sorted((ROOT / "servekit").rglob("*.py")), *sorted((ROOT / "smoke").glob("*.py")),
            *sorted((ROOT / "wsl2").glob("*.py")), ROOT / "build.py"]


def test_targets_are_data_no_target_name_in_the_code():
    """No code decides by a target's name: no comparison with one, no lookup by one. (The word "cpu" as a
    Kubernetes resource or vLLM's device name is not a target.)"""
    targets = set(yaml.safe_load((ROOT / "images.yaml").read_text())["targets"])
    found = []
    for path in _python_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            operands = ([node.left, *node.comparators] if isinstance(node, ast.Compare) else
                        [node.slice] if isinstance(node, ast.Subscript) else [])
            found += [f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}: {o.value!r}" for o in operands
                      if isinstance(o, ast.Constant) and o.value in targets]
    assert found == []


def test_the_dockerfile_takes_one_base_argument():
    text = (ROOT / "docker/Dockerfile").read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)", text, re.M))
    starts = re.findall(r"^FROM (\S+)", text, re.M)
    external = [s for s in starts if s not in stages and not s.startswith("model-")]
    assert external == ["${BASE}"]


@pytest.mark.parametrize("argv", [
    ["--matrix", str(ROOT / "images.yaml"), "--base", "cuda-local", "plan", "--json", "--target", "cuda"],
    ["plan", "--json", "--target", "cuda", "--matrix", str(ROOT / "images.yaml"), "--base", "cuda-local"],
])
def test_shared_options_go_before_or_after_the_command(cli, argv):
    code, out, _ = cli(*argv)
    assert code == 0 and '"base_name": "cuda-local"' in out


def test_an_index_listing_names_a_release_with_its_local_label():
    """PyTorch's CPU index lists torch 2.13.0+cpu (its links encode + as %2B); a JSON listing may lack
    `versions`. Either way the exact release is found, and 2.13.0+cpu is not 2.13.0."""
    from servekit.build.index import _names_release
    files = ["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "torch-2.12.1-cp311-none-macosx_11_0_arm64.whl"]
    assert _names_release(files, "torch", "2.13.0+cpu")
    assert not _names_release(files, "torch", "2.13.0") and not _names_release(files, "torch", "2.12.0")
    assert _names_release(["flashinfer_cubin-0.7.0.post1-py3-none-any.whl"], "flashinfer-cubin", "0.7.0.post1")


def _imports(tree) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:  # relative: a sibling
            out.append((node.lineno, (node.module or "").split(".")[0]))
    return out


def test_the_image_code_is_standard_library_only():
    """Every module of the image's code folder loads with the standard library and its siblings alone: the
    series and components run on the base's bare Python, and the host imports the knob table cheaply. Inside a
    function, a package the targets' own locks install may be used (prepare downloads with huggingface_hub)."""
    from servekit.build.plan import IMAGE_CODE
    folder = ROOT / IMAGE_CODE
    siblings = {p.stem for p in folder.glob("*.py")}
    pinned = {name.replace("-", "_") for lock in (ROOT / "docker/locks").glob("*.txt")
              for name in re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", lock.read_text(), re.M)}
    found = []
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        top = {(n, m) for n, m in _imports(ast.Module(body=[s for s in tree.body if not isinstance(
            s, (ast.FunctionDef, ast.ClassDef))], type_ignores=[]))}
        for line, name in _imports(tree):
            allowed = sys.stdlib_module_names | siblings | (set() if (line, name) in top else pinned)
            if name not in allowed:
                found.append(f"{path.name}:{line}: {name}")
    assert found == []
    assert len(siblings) >= 6  # launcher, knobs, prepare, series, components, verify


def test_the_dockerfile_copies_only_the_image_folder_and_what_the_build_stages():
    """One list: the Dockerfile copies from the repository only the image's code folder (the runtime stage all
    of it) and the staged inputs; .dockerignore admits exactly those; every file of the folder is in the digest."""
    from servekit.build.plan import build_inputs
    from servekit.config.load import load_matrix
    from servekit.layout import IMAGE_CODE, STAGED
    dockerfile = (ROOT / "docker/Dockerfile").read_text().replace("\\\n", " ")
    sources = [src for line in dockerfile.splitlines() if line.startswith("COPY") and "--from=" not in line
               for src in line.split()[1:-1]]
    allowed = (f"{IMAGE_CODE}/", *(f"{path}/" for path in STAGED))
    assert sources and all(src.startswith(allowed) for src in sources), sources
    assert f"COPY {IMAGE_CODE}/ /opt/servekit/{IMAGE_CODE}/" in dockerfile
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")]
    assert sorted(ignore) == sorted(f"!{a}" for a in allowed)
    inputs = build_inputs(load_matrix(ROOT / "images.yaml"), "cpu", ROOT, "3.11")
    assert {p for p in (ROOT / IMAGE_CODE).glob("*.py")} <= set(inputs)


def test_the_dockerfile_copies_exactly_what_the_builder_stages():
    """One staging manifest: what the builder writes per target (STAGED_FILES) is what the Dockerfile copies."""
    from servekit.build.plan import STAGED_FILES
    from servekit.layout import STAGE_DIR
    dockerfile = (ROOT / "docker/Dockerfile").read_text().replace("\\\n", " ")
    staged = {src.removeprefix(f"{STAGE_DIR}/${{TARGET}}/") for line in dockerfile.splitlines()
              if line.startswith("COPY") for src in line.split()[1:-1] if src.startswith(STAGE_DIR)}
    assert staged == set(STAGED_FILES)


def test_the_demo_model_ships_in_the_repository_small():
    """No build trains a model: the generated one is a folder of the repository, a few MB, in the digest."""
    from servekit.build.plan import build_inputs
    from servekit.config.load import load_matrix
    matrix = load_matrix(ROOT / "images.yaml")
    folder = ROOT / (matrix.models["demo"].dir or "")
    files = sorted(folder.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in files}
    assert sum(p.stat().st_size for p in files) < 8 << 20
    assert set(files) <= set(build_inputs(matrix, "cpu", ROOT, "3.11"))


def test_the_dockerfile_installs_the_locks_layers_in_order_before_the_series():
    from servekit.build.locks import LAYERS
    dockerfile = (ROOT / "docker/Dockerfile").read_text()
    installs = [dockerfile.index(f"install_locked.sh /opt/servekit/requirements-{layer}.txt") for layer in LAYERS]
    assert installs == sorted(installs) and installs[-1] < dockerfile.index("servekit.image.series apply")


def test_a_made_base_leaves_out_apts_downloads_and_docs_but_each_copyright(tmp_path):
    from servekit.build.bases import _slim
    for rel in ("var/cache/apt/archives/gcc.deb", "var/lib/apt/lists/deb.debian.org_Packages",
                "usr/share/doc/gcc/copyright", "usr/share/doc/gcc/changelog.gz", "usr/share/man/man1/gcc.1.gz",
                "usr/share/locale/de/LC_MESSAGES/gcc.mo", "usr/bin/gcc"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    _slim(tmp_path)
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["usr/bin/gcc", "usr/share/doc/gcc/copyright"]


def test_a_gpu_boots_needs_are_said_when_pythons_headers_are_missing(tmp_path, monkeypatch):
    import sysconfig

    from servekit.image import bootneeds
    assert bootneeds.problems() == []  # this machine compiles against Python.h
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    [problem] = bootneeds.problems()
    assert problem.startswith(f"Python's headers are missing ({tmp_path}/Python.h): Triton compiles its CUDA driver")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert bootneeds.problems()[0].startswith("no C compiler (gcc): Triton compiles its CUDA driver stub")


def test_the_in_image_verify_names_a_module_a_boot_imports_that_is_gone_and_a_package_outside_the_lock(tmp_path):
    """A wrong exclusion fails the build: a module a boot imports that does not import is named; so is a package
    installed beside the lock's slices, and one a slice names that is not there."""
    from importlib.metadata import version

    from servekit.image import verify
    [problem] = verify.check_imports(["json", "servekit_no_such_module"])
    assert problem.startswith("`import servekit_no_such_module` fails without a GPU: ModuleNotFoundError")
    assert verify.check_imports(["json", "email.message"]) == []
    slice_file = tmp_path / "requirements-serving.txt"
    slice_file.write_text(f"pytest=={version('pytest')} \\\n    --hash=sha256:{'0' * 64}\nservekit-gone==1.0\n")
    found = verify.check_installed_set([slice_file])
    assert "servekit-gone: locked 1.0, installed nothing" in found
    assert any(p.startswith("installed but in no slice of the lock: ") and "pyyaml" in p for p in found)
    assert not any(p.startswith("pytest:") for p in found)


def test_a_failed_verify_is_summed_up_by_its_first_problem_not_by_a_note_before_it(tmp_path):
    from servekit.build.builder import _failure_summary
    log = tmp_path / "build.log"
    log.write_text("------\n > [image runtime 4/5] RUN /opt/venv/bin/python /opt/servekit/verify.py:\n"
                   "21.82 verify: 9 modules a boot imports import without a GPU\n"
                   "37.13 verify: problem: component kvarn: check failed\n"
                   "37.13 verify: 1 problem(s); the image is not tagged\n------\n")
    assert _failure_summary(log) == ("[image runtime 4/5]: verify: component kvarn: check failed "
                                     "(1 problem(s); the image is not tagged)")


def test_build_py_run_by_another_python_runs_the_command_in_the_venv(tmp_path):
    """`python3 build.py plan` from a Python that loads the CLI but lacks a package a command imports only as it runs
    (here tenacity, blocked in a venv that otherwise sees the checkout's packages) runs in the checkout's venv."""
    other = tmp_path / "other"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", other], check=True)
    site = subprocess.run([other / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "checkout.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n")
    (Path(site) / "without.pth").write_text("import sys; sys.modules['tenacity'] = None\n")
    done = subprocess.run([other / "bin" / "python", ROOT / "build.py", "plan"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
