"""The cuda target, the product, built as `make image TARGET=cuda` builds it (no flags: the base made here,
FlashInfer compiling at first use) and proven by its own verify step; a base without what a GPU boot compiles
is refused untagged; without a GPU it refuses to start in one line, before anything runs.

The image is built in a copy of the repository (its logs and caches stay there); the engine's
BuildKit cache makes the second run of the suite a no-op build.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import pytest
from support import ROOT, TEST_PROJECT, docker, project_containers, run_build_py, tracked_copy

pytestmark = [pytest.mark.engine, pytest.mark.network]



def _reachable(url: str) -> bool:
    from servekit.build.builder import _reachable as reachable
    return reachable(url)


def _engine_has_gpu() -> bool:
    from servekit.engines import resolve
    try:
        return resolve(None).gpu_problem() is None
    except Exception:  # no engine: the engine tests fail on their own
        return False


# What holds only where something is missing: skipped, with the reason, where it is there.
@pytest.fixture
def without_gpu():
    if _engine_has_gpu():
        pytest.skip("this engine can give containers a GPU")


def _in_image(tag: str, *argv: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    return docker("run", "--rm", "--entrypoint", "/opt/venv/bin/python", tag, *argv, timeout=timeout)


@pytest.fixture(scope="module")
def cuda_image(tmp_path_factory):
    root = tracked_copy(tmp_path_factory.mktemp("cuda-repo"))
    result = run_build_py("image", "--target", "cuda", "--json", cwd=root, timeout=3600)
    assert result.returncode == 0, result.stderr[-4000:]
    yield json.loads(result.stdout)["images"][0]["tag"]
    shutil.rmtree(root / ".cache", ignore_errors=True)  # the CUDA toolchain wheels the base was made from: GBs


@pytest.mark.slow
def test_the_cuda_image_holds_the_pinned_stack(cuda_image):
    pins = json.loads(run_build_py("plan", "--json", "--target", "cuda").stdout)["targets"][0]["pins"]
    script = ("import json, sys, torch, vllm, flashinfer, transformers, xgrammar, huggingface_hub\n"
              "from importlib.metadata import version\n"
              "print(json.dumps({'cuda': torch.version.cuda, **{d: version(d) for d in sys.argv[1:]}}))")
    probe = _in_image(cuda_image, "-c", script, *pins)
    assert probe.returncode == 0, probe.stderr[-2000:]
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert found.pop("cuda").startswith("13.")
    assert found == pins and len(pins) == 6
    assert "flashinfer-cubin" not in pins


@pytest.mark.slow
def test_the_cuda_image_sends_no_usage_statistics(cuda_image):
    from servekit.image.recipe import PRIVACY_ENV
    env = dict(e.split("=", 1) for e in json.loads(docker("image", "inspect", cuda_image).stdout)[0]["Config"]["Env"])
    assert PRIVACY_ENV.items() <= env.items()


@pytest.mark.slow
def test_the_cuda_image_is_the_default_build_and_compiles_flashinfers_kernels_at_first_use(cuda_image):
    labels = json.loads(docker("image", "inspect", cuda_image).stdout)[0]["Config"]["Labels"]
    assert labels["io.servekit.base"] == "cuda-local"
    assert not [name for name in labels if "flashinfer-cubin" in name]
    info = json.loads(docker("run", "--rm", "--entrypoint", "cat", cuda_image,
                              "/opt/servekit/build-info.json").stdout)
    assert info["omitted"] == {} and info["cuda_archs"] == ["8.6", "8.9"] and info["base"]["name"] == "cuda-local"
    # the kernels FlashInfer compiles land in the cache volume (HOME), so a second boot finds them
    probe = _in_image(cuda_image, "-c", "import importlib.util, flashinfer.jit.env as e; "
                      "print(importlib.util.find_spec('flashinfer_cubin'), e.FLASHINFER_WORKSPACE_DIR)")
    assert probe.returncode == 0, probe.stderr[-2000:]
    cubin, workspace = probe.stdout.split()[-2:]
    assert cubin == "None" and workspace.startswith("/cache/")


@pytest.mark.slow
def test_the_cuda_images_verify_passes_again_with_the_jit_compile(cuda_image):
    """The verify step the build ran, run once more in the image: every check, the JIT compile for sm_86
    and sm_89 included, as the image's own user."""
    done = _in_image(cuda_image, "-m", "servekit.image.verify", "--build-info", "/opt/servekit/build-info.json",
                     "--profiles", "/opt/servekit/profiles.json", "--series-dir", "/opt/servekit/patches")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "compiled and linked a curand kernel for sm 8.6, 8.9" in done.stdout
    assert "Triton's CUDA driver stub compiles against Python.h" in done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith("verify: ok")


@pytest.mark.slow
def test_the_cuda_image_installs_its_lock_in_layers_torch_first_then_vllm(cuda_image):
    """Two layers of wheels, the torch slice (the CUDA libraries, torch, Triton) under the serving one (vLLM,
    FlashInfer and what they need), each holding its own packages; the series and the code above them."""
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}\t{{.Size}}", cuda_image).stdout
    steps = [line.split("\t") for line in reversed(history.strip().splitlines())]
    index = {marker: next(i for i, (step, _) in enumerate(steps) if marker in step)
             for marker in ("requirements-torch.txt", "requirements-serving.txt", "servekit.image.series apply",
                           "servekit.image.verify")}
    assert list(index.values()) == sorted(index.values())
    probe = _in_image(cuda_image, "-c", "import torch, vllm, triton; print(torch.__file__, vllm.__file__)")
    assert probe.returncode == 0, probe.stderr[-2000:]
    torch_slice = docker("run", "--rm", "--entrypoint", "cat", cuda_image,
                         "/opt/servekit/requirements-torch.txt").stdout
    assert "\ntorch==2.13.0 \\" in "\n" + torch_slice and "vllm==" not in torch_slice


@pytest.mark.slow
def test_the_cuda_toolkit_sits_where_nvidias_devel_image_keeps_it(cuda_image):
    probe = docker("run", "--rm", "--entrypoint", "sh", cuda_image, "-c",
                    "command -v nvcc; nvcc --version | tail -2; ls /usr/local/cuda/include/curand.h "
                    "/usr/local/cuda/lib64/libcudart.so /usr/local/cuda/lib64/stubs/libcuda.so")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.startswith("/usr/local/cuda/bin/nvcc") and "release 13.0" in probe.stdout


# Each flag of the argvs vLLM's parser reads as its own default, with that default (vLLM's "non-default args" log
# line leaves such flags out, as get_non_default_args compares against parse_args([])).
PASSED_AT_DEFAULT = r"""
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
defaults = vars(parser.parse_args([]))
found = {}
for argv in json.load(sys.stdin):
    parsed = vars(parser.parse_args(argv))
    for token in argv:
        action = parser._option_string_actions.get(token.split("=")[0])
        if action and parsed[action.dest] == defaults[action.dest]:
            found[action.dest] = defaults[action.dest]
print(json.dumps(found, default=str))
"""


@pytest.mark.slow
def test_the_knobs_check_knows_every_flag_a_profile_passes_at_vllms_default(cuda_image):
    from servekit.build.plan import unavailable_profiles
    from servekit.config.load import load_matrix
    from servekit.config.profiles import render_profiles
    from servekit.image.launcher import build_command
    from servekit.smoke.logs import AT_VLLM_DEFAULT
    matrix = load_matrix(ROOT / "images.yaml")
    profiles = render_profiles(matrix, "cuda")
    info = json.loads(docker("run", "--rm", "--entrypoint", "cat", cuda_image, "/opt/servekit/build-info.json").stdout)
    unavailable = unavailable_profiles(matrix, "cuda", info["components"])
    argvs = [build_command(profiles, name, host, {})[0] for name, hosts in profiles["profiles"].items()
             if name not in unavailable for host in hosts]
    asked = subprocess.run(["docker", "run", "--rm", "-i", "-e", "VLLM_TARGET_DEVICE=cpu", "--entrypoint",
                            "/opt/venv/bin/python", cuda_image, "-c", PASSED_AT_DEFAULT],
                           input=json.dumps(argvs), capture_output=True, text=True, timeout=600)
    assert asked.returncode == 0, asked.stderr[-2000:]
    assert json.loads(asked.stdout.splitlines()[-1]) == AT_VLLM_DEFAULT


@pytest.mark.slow
def test_a_second_cuda_build_starts_nothing(cuda_image):
    started = time.monotonic()
    again = run_build_py("image", "--target", "cuda", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["images"][0] == {"target": "cuda", "tag": cuda_image, "built": False,
                                                     "seconds": 0.0, "log": None}
    assert time.monotonic() - started < 60  # a bound on a hang, not a speed target (bench/build_cuda.py)


@pytest.mark.slow
def test_a_base_without_what_a_gpu_boot_compiles_is_refused_and_nothing_is_tagged(tmp_path):
    """Python's headers left out of the base made here: the build stops at the base stage, before any wheel,
    naming them; no image is tagged. (The base gets a name of its own, so the suite's base is left alone.)"""
    root = tracked_copy(tmp_path)
    matrix = root / "images.yaml"
    text = matrix.read_text()
    base = f"servekit/{TEST_PROJECT}-noheaders:13.0"
    for old, new in (("libpython3.11-dev, ", ""), ("image: servekit/bookworm-cuda:13.0", f"image: {base}")):
        assert old in text
        text = text.replace(old, new)
    matrix.write_text(text)
    tag = json.loads(run_build_py("plan", "--json", "--target", "cuda", cwd=root).stdout)["targets"][0]["tag"]
    try:
        result = run_build_py("image", "--target", "cuda", cwd=root, timeout=1800)
        assert result.returncode != 0
        assert "Python's headers are missing" in result.stderr and "Triton compiles" in result.stderr, \
            result.stderr[-2000:]
        assert "requirements-torch" not in result.stderr.split("Python's headers are missing")[0]  # before the wheels
        assert docker("image", "inspect", tag).returncode != 0
    finally:
        docker("image", "rm", "-f", base)
        shutil.rmtree(root / ".cache", ignore_errors=True)


@pytest.mark.skipif(_reachable("https://registry-1.docker.io/v2/"), reason="Docker Hub is reachable here")
def test_an_unreachable_cuda_base_names_the_base_made_here():
    result = run_build_py("--base", "cuda-devel", "image", "--target", "cuda", timeout=300)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert "nvidia/cuda:13.0.2-devel-ubuntu24.04" in lines[0] and "cannot be reached" in lines[0]
    assert "--base cuda-local" in lines[0]
    assert "component kvarn is absent" in result.stderr  # said, never skipped silently


def test_up_of_a_gpu_profile_without_a_gpu_fails_fast_and_starts_nothing(without_gpu, tmp_path):
    root = tracked_copy(tmp_path)
    before = project_containers()
    started = time.monotonic()
    result = run_build_py("up", "default", "--target", "cuda", cwd=root, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert "needs a GPU (target cuda)" in lines[0] and "no NVIDIA runtime" in lines[0]
    assert "--target cpu" in lines[0]
    assert elapsed < 60, elapsed
    assert project_containers() == before
    assert not (root / "compose" / ".env").exists()  # it stopped before writing anything


def test_doctor_says_the_same_before_you_try(without_gpu):
    result = run_build_py("doctor", "--json")
    findings = {f["name"]: f for f in json.loads(result.stdout)}
    assert findings["gpu access"]["status"] == "warn"
    assert "no NVIDIA runtime" in findings["gpu access"]["detail"]
    assert findings["base cuda-local"]["status"] == "ok"


@pytest.mark.slow
def test_the_shell_examples_of_docs_profiles_run_as_printed(cuda_image, tmp_path):
    """Each ```bash block of docs/profiles.md, as printed, against the cuda image users build (PRINT_ARGV: no GPU,
    no key, no engine of its own): it runs and prints the command line; the wsl2 host's knobs reach it."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "profiles.md").read_text(), re.S)
    assert blocks
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG")}
    for block in blocks:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], env={**env, "SERVEKIT_IMAGE": cuda_image},
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{block}\n{done.stderr[-2000:]}"
        assert done.stdout.startswith("vllm serve "), done.stdout[:500]
        if "SERVEKIT_HOST=wsl2" in block and "serve alternative" in block:
            assert "--max-num-seqs 4 " in done.stdout and "VLLM_WSL2_ENABLE_PIN_MEMORY=1" in done.stdout


@pytest.mark.slow
def test_the_shipped_record_of_what_the_cuda_image_reads_is_the_one_it_built(cuda_image):
    """docs/profiles.md says which variables the shipped cuda image reads from docker/env-readers.cuda.json: that
    file must be what the build of the tag main names found (with the record, its verify step notes the inert)."""
    from servekit.config.derived import SHIPPED_READERS
    done = docker("run", "--rm", "--entrypoint", "cat", cuda_image, "/opt/servekit/env-readers.json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads(SHIPPED_READERS.read_text()), (
        f"the series or the pins changed what the image reads: `docker run --rm --entrypoint cat {cuda_image} "
        f"/opt/servekit/env-readers.json > {SHIPPED_READERS.relative_to(ROOT)}`, then `make derived`")
