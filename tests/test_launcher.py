"""The launcher's knob mapping, without an engine: what each knob sets, and what it refuses."""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest
from support import LAUNCHER, ROOT

from servekit.config.load import load_matrix
from servekit.config.profiles import render_profiles, resolve_knobs
from servekit.image.launcher import KnobError, build_command

MATRIX = load_matrix(ROOT / "images.yaml")
CUDA = render_profiles(MATRIX, "cuda")
CPU = render_profiles(MATRIX, "cpu")


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_host_defaults_reach_batch():
    native, _ = build_command(CUDA, "batch", "native", {})
    wsl2, env = build_command(CUDA, "batch", "wsl2", {})
    assert _flag(native, "--gpu-memory-utilization") == "0.94"
    assert _flag(wsl2, "--gpu-memory-utilization") == "0.91"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"


def test_kvarn_profiles_get_the_wsl2_component_default():
    assert resolve_knobs(MATRIX, "huge", "cuda", "wsl2")["GPU_UTIL"] == "0.88"
    assert "GPU_UTIL" not in resolve_knobs(MATRIX, "huge", "cuda", "native")


def test_alternative_on_wsl2_and_dflash2_pinned_memory():
    argv, env = build_command(CUDA, "alternative", "wsl2", {})
    assert json.loads(_flag(argv, "--speculative-config") or "") == {
        "method": "dflash", "model": "/app/models/qwen38-27b-dflash", "num_speculative_tokens": 7,
        "draft_sample_method": "probabilistic"}
    assert "--enable-prefix-caching" in argv
    assert _flag(argv, "--max-num-seqs") == "4" and _flag(argv, "--max-model-len") == "160000"
    assert env["VLLM_WSL2_ENABLE_PIN_MEMORY"] == "1"
    _, native_env = build_command(CUDA, "alternative", "native", {})
    assert "VLLM_WSL2_ENABLE_PIN_MEMORY" not in native_env


def test_tool_strict_defaults_to_parameter_and_auto_restores_upstream():
    argv, _ = build_command(CUDA, "default", "native", {})
    assert _flag(argv, "--tool-strict-level") == "parameter"
    assert _flag(argv, "--tool-call-parser") == "qwen3_coder"
    argv, _ = build_command(CUDA, "default", "native", {"TOOL_STRICT": "auto"})
    assert _flag(argv, "--tool-strict-level") == "auto"


def test_extra_args_win_over_knobs():
    argv, _ = build_command(CUDA, "batch", "native", {"EXTRA_ARGS": "--gpu-memory-utilization 0.5 --tool-strict-level=auto"})
    assert argv.count("--gpu-memory-utilization") == 1 and _flag(argv, "--gpu-memory-utilization") == "0.5"
    assert "--tool-strict-level" not in argv and argv[-1] == "--tool-strict-level=auto"


@pytest.mark.parametrize("value,expected", [("1", True), ("TRUE", True), ("yes", True), ("On", True),
                                            ("0", False), ("false", False), ("NO", False), ("off", False)])
def test_boolean_knobs_accept_the_documented_words(value, expected):
    argv, env = build_command(CUDA, "dflash2", "native", {"PREFIX_CACHE": value, "LOOKUP": value})
    # as the source's launcher: PREFIX_CACHE=1 adds align mode; off leaves vLLM's own default (no flag)
    assert ("--enable-prefix-caching" in argv) is expected and ("--mamba-cache-mode" in argv) is expected
    assert env["VLLM_DFLASH2_LOOKUP"] == ("1" if expected else "0")
    plain, _ = build_command(CPU, "default", "native", {"PREFIX_CACHE": value})
    assert ("--enable-prefix-caching" in plain) is expected and ("--no-enable-prefix-caching" in plain) is not expected


@pytest.mark.parametrize("env,fragment", [
    ({"PREFIX_CACHE": "maybe"}, "PREFIX_CACHE='maybe'"),
    ({"LOOKUP": "true-ish"}, "LOOKUP='true-ish'"),
    ({"SPEC": "eagle"}, "SPEC='eagle'"),
    ({"CTX": "enormous"}, "CTX='enormous'"),
    ({"GPU_UTIL": "95"}, "GPU_UTIL='95'"),
    ({"MAX_SEQS": "four"}, "MAX_SEQS='four'"),
])
def test_a_bad_value_is_refused_naming_knob_and_value(env, fragment):
    with pytest.raises(KnobError, match=fragment.replace("(", r"\(")):
        build_command(CUDA, "default", "native", env)


def test_cpu_target_knobs_override_the_profile():
    argv, _ = build_command(CPU, "default", "native", {})
    assert "--enforce-eager" in argv and _flag(argv, "--dtype") == "float32"
    assert _flag(argv, "--max-model-len") == "2048" and "--speculative-config" not in argv
    assert _flag(argv, "--model") == "/app/models/demo" and _flag(argv, "--tool-call-parser") == "hermes"


@pytest.mark.parametrize("release, environ, host", [
    ("5.15.167.4-microsoft-standard-WSL2\n", {}, "wsl2"),  # Docker Desktop's containers run on WSL2's kernel
    ("4.4.0-19041-Microsoft\n", {}, "wsl2"),  # WSL1's spelling, the source's rule matches it too
    ("6.1.0-28-amd64\n", {"WSL_DISTRO_NAME": "Ubuntu"}, "wsl2"),
    ("6.1.0-28-amd64\n", {}, "native"),
    ("5.15.167.4-microsoft-standard-WSL2\n", {"SERVEKIT_HOST": "native"}, "native"),  # an explicit one wins
    ("6.1.0-28-amd64\n", {"SERVEKIT_HOST": "wsl2"}, "wsl2"),
], ids=["wsl2-kernel", "wsl1-kernel", "wsl-distro-name", "linux", "explicit-native", "explicit-wsl2"])
def test_the_launcher_tells_wsl2_by_its_kernel_unless_told(tmp_path, release, environ, host):
    """The source's launchers looked at the kernel they ran on; so does this one, run as the image runs it, so that a
    plain `docker compose up alternative` under Docker Desktop takes the WSL2 defaults with no override file."""
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps(CUDA))
    osrelease = tmp_path / "osrelease"
    osrelease.write_text(release)
    env = {"SERVEKIT_PROFILES": str(profiles), "PRINT_ARGV": "1", "SERVEKIT_OSRELEASE": str(osrelease),
           "PATH": "/usr/bin:/bin", **environ}
    done = subprocess.run([*LAUNCHER, "serve", "batch"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    expected_argv, expected_env = build_command(CUDA, "batch", host, {})
    assert done.stdout.splitlines()[0] == shlex.join(["vllm", "serve", *expected_argv])
    assert f"PYTORCH_CUDA_ALLOC_CONF={expected_env['PYTORCH_CUDA_ALLOC_CONF']}" in done.stdout
    told = "the wsl2 host's defaults" in done.stderr
    assert told is (host == "wsl2" and "SERVEKIT_HOST" not in environ)


@pytest.mark.parametrize("extra, owner", [("--kv-cache-dtyp fp8", "--kv-cache-dtype, which a knob sets"),
                                          ("--speculative-conf {}", "--speculative-config, which a knob sets"),
                                          ("--kv-offloading-si 8", "--kv-offloading-size, which a knob sets"),
                                          ("--max-model-le 1000", "--max-model-len, which the profile sets")])
def test_an_abbreviated_flag_in_extra_args_is_refused_naming_the_flag_vllm_would_read(extra, owner):
    """vLLM's parser takes an unambiguous prefix for the flag: an abbreviation would slip past the refusals and the
    shadowing above, which match full names."""
    with pytest.raises(KnobError, match=f"vLLM would read it as {owner}; spell the flag out"):
        build_command(CUDA, "default", "native", {"EXTRA_ARGS": extra})
    spelled, _ = build_command(CUDA, "default", "native", {"EXTRA_ARGS": "--max-model-len 1000 --enforce-eager"})
    assert spelled[-3:] == ["--max-model-len", "1000", "--enforce-eager"]


def test_print_argv_masks_the_key_and_exits(tmp_path):
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps(CPU))
    key = tmp_path / "key"
    key.write_text("sk-secret-value-0123\n")
    env = {"SERVEKIT_PROFILES": str(profiles), "PRINT_ARGV": "1", "API_KEY_FILE": str(key), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([*LAUNCHER], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--enforce-eager" in done.stdout and "VLLM_API_KEY=***" in done.stdout
    assert "sk-secret-value-0123" not in done.stdout + done.stderr
    env["PREFIX_CACHE"] = "maybe"
    done = subprocess.run([*LAUNCHER], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "PREFIX_CACHE='maybe'" in done.stderr


@pytest.mark.parametrize("key_text, why", [(None, "API_KEY_FILE is not set"), ("", "holds 0 characters"),
                                           ("sk-short", "holds 8 characters"), ("missing", "no such file")])
def test_no_key_no_server(tmp_path, key_text, why):
    """vLLM serves an open API when its key is empty: the launcher refuses before it starts, in one line."""
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps(CPU))
    env = {"SERVEKIT_PROFILES": str(profiles), "PATH": "/usr/bin:/bin"}
    if key_text is not None:
        key = tmp_path / "key"
        if key_text != "missing":
            key.write_text(key_text)
        env["API_KEY_FILE"] = str(key)
    done = subprocess.run([*LAUNCHER], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "refusing to start: no API key" in done.stderr
    assert why in done.stderr


def test_print_argv_needs_no_key_and_says_that_serve_would_refuse(tmp_path):
    """PRINT_ARGV serves nothing, so it prints without a key, as the source's did (docs/profiles.md's first example
    is a plain `docker run` with no key mounted); serve itself still refuses."""
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps(CPU))
    env = {"SERVEKIT_PROFILES": str(profiles), "PRINT_ARGV": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([*LAUNCHER], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0 and done.stdout.startswith("vllm serve ") and "VLLM_API_KEY" not in done.stdout
    assert "no API key: API_KEY_FILE is not set; serve would refuse to start without one" in done.stderr


def test_a_profile_that_says_auth_none_serves_without_a_key_and_says_so(tmp_path):
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps({**CPU, "without_key": ["default"]}))
    env = {"SERVEKIT_PROFILES": str(profiles), "PRINT_ARGV": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([*LAUNCHER], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0 and "VLLM_API_KEY" not in done.stdout
    assert "serves WITHOUT an API key" in done.stderr


def test_a_cpu_kv_tier_boots_with_expandable_segments_off():
    """vLLM 0.31 refuses its OffloadingConnector beside expandable segments (seen on the H200: mtp-long with
    KV_OFFLOAD_GB=12 failed its boot with that ValidationError); the launcher turns them off for a tier alone."""
    _, plain = build_command(CUDA, "mtp-long", "native", {})
    argv, tiered = build_command(CUDA, "mtp-long", "native", {"KV_OFFLOAD_GB": "12"})
    assert plain["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert tiered["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False" and _flag(argv, "--kv-offloading-size") == "12"


def _a_value(knob, rng) -> str:
    if knob.kind == "enum":
        return rng.choice(knob.choices)
    if knob.kind == "bool":
        return rng.choice(["1", "0"])
    if knob.kind == "int":
        return str(rng.randint(int(knob.minimum or 1), int(knob.maximum or 64)))
    if knob.kind == "float":
        return str(round(rng.uniform(knob.minimum or 0.1, knob.maximum or 1.0), 2))
    return ""


def test_every_flag_the_launcher_emits_is_in_the_list_verify_checks():
    """The flag list is derived from the recipe's tables; any knob combination stays inside it (the image's verify
    asks vLLM for exactly that list)."""
    import random

    from servekit.image.knobs import KNOBS
    from servekit.image.launcher import flags
    allowed, seen = set(flags()), set()
    rng = random.Random(20261201)
    free = [k for k in KNOBS.values() if k.name not in ("MODE", "PORT", "HOST", "EXTRA_ARGS", "TOOL_PARSER",
                                                          "PREFIX_RETENTION")]
    for _ in range(600):
        profiles = rng.choice([CUDA, CPU])
        environ = {k.name: _a_value(k, rng) for k in rng.sample(free, 6)}
        try:
            argv, _ = build_command(profiles, rng.choice(list(profiles["profiles"])), rng.choice(["native", "wsl2"]),
                                    environ)
        except KnobError:
            continue  # a combination the source's launchers refuse
        seen |= {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    assert seen <= allowed, seen - allowed
    assert len(seen) > len(allowed) * 0.8  # the draw reached most of them: the test would see a new one


def test_batch_takes_its_host_defaults_per_kv_from_images_yaml():
    argv, _ = build_command(CUDA, "batch", "wsl2", {"KV": "kvarn"})
    assert (_flag(argv, "--gpu-memory-utilization"), _flag(argv, "--max-model-len")) == ("0.88", "131072")
    argv, _ = build_command(CUDA, "batch", "native", {"KV": "kvarn"})
    assert (_flag(argv, "--gpu-memory-utilization"), _flag(argv, "--max-model-len")) == ("0.93", "262144")
    argv, _ = build_command(CUDA, "batch", "wsl2", {"KV": "kvarn", "GPU_UTIL": "0.8", "MAX_LEN": "1000"})
    assert (_flag(argv, "--gpu-memory-utilization"), _flag(argv, "--max-model-len")) == ("0.8", "1000")
    assert MATRIX.hosts["wsl2"].batch["kvarn"] == {"GPU_UTIL": "0.88", "MAX_LEN": "131072"}


def test_int8_activations_with_an_int8_lm_head_are_refused_where_nothing_keeps_them_to_the_mlp(tmp_path):
    """Measured at full size on a GPU: batch (INT8_ACT=int8) with prepare's int8 lm_head dies in vLLM's Marlin with
    "W8A8 is not supported by marlin kernel"; the launcher says so before vLLM starts, and only then."""
    from servekit.image.launcher import int8_activation_problem
    groups = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4}},
              "servekit_lm_head": {"targets": ["re:.*lm_head$"], "weights": {"num_bits": 8}}}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"config_groups": groups}}))
    env = {"VLLM_MARLIN_INPUT_DTYPE": "int8", "VLLM_MARLIN_INT8_INCLUDE_RE": "mlp"}
    inert = {"inert": ["VLLM_MARLIN_INT8_INCLUDE_RE"], "read": []}
    said = int8_activation_problem(env, tmp_path, inert)
    assert said and "INT8_ACT=off" in said and "VLLM_MARLIN_INT8_INCLUDE_RE" in said
    assert int8_activation_problem(env, tmp_path, {"inert": [], "read": ["VLLM_MARLIN_INT8_INCLUDE_RE"]}) is None
    assert int8_activation_problem({**env, "VLLM_MARLIN_INPUT_DTYPE": "bf16"}, tmp_path, inert) is None
    assert int8_activation_problem(env, tmp_path, None) is None  # no record: the image cannot say
    del groups["servekit_lm_head"]
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"config_groups": groups}}))
    assert int8_activation_problem(env, tmp_path, inert) is None  # the published BF16 lm_head: no clash


@pytest.mark.parametrize("target", ["cuda", "cpu"])
def test_plain_mode_refuses_a_speculator_it_would_never_pass(target):
    """MODE=plain builds no speculative config: SPEC=mtp there was taken and nothing passed (#63)."""
    profiles = CUDA if target == "cuda" else CPU
    with pytest.raises(KnobError, match="SPEC=mtp: MODE=plain serves without speculation"):
        build_command(profiles, "default", "native", {"MODE": "plain", "SPEC": "mtp"})
    argv, _ = build_command(profiles, "default", "native", {"MODE": "plain", "SPEC": "off"})
    assert "--speculative-config" not in argv
