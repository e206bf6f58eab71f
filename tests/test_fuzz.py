"""The fuzz suite (#63): Hypothesis feeds every reader of a file that comes from a user, a hub, a registry or a
report random and mutated inputs (the shipped matrix, reports and demo checkpoint as seeds) and holds it to one of
exactly two outcomes: it reads the input, or it refuses it in one line of its own error. A traceback of another
exception, a hang, or a write outside the folder it was given is a finding.

`make test` runs each target a fixed, derandomized set of examples (the same inputs every run: a finding is a bug,
never a flake); `make fuzz` runs them with fresh random inputs for as long as it is asked (bench/fuzz.py).
The hostile corpus (test_hostile_inputs.py) runs the real commands on the classes these inputs found."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import ROOT

from servekit.config.load import load_matrix
from servekit.config.profiles import render_profiles
from servekit.config.userenv import users_settings
from servekit.engines.compose import check_models_dir
from servekit.errors import UserError
from servekit.image import boundary, convert, hub, prepare
from servekit.image.launcher import KnobError, build_command
from servekit.image.standin import SMALL, VISION_SMALL, model_config
from servekit.records.models import SCHEMA_VERSION, ReleaseManifest, RunReport, SweepReport, load
from servekit.records.report import compare, load_report, render_markdown
from servekit.release.naming import registry_path
from servekit.serve.deploy import published

MATRIX_TEXT = (ROOT / "images.yaml").read_text()
MATRIX = load_matrix(ROOT / "images.yaml")
PROFILES = {target: render_profiles(MATRIX, target) for target in MATRIX.targets}

settings.register_profile("test", max_examples=int(os.environ.get("FUZZ_EXAMPLES", "30")), derandomize=True,
                          deadline=None, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("fuzz", max_examples=int(os.environ.get("FUZZ_EXAMPLES", "400")), derandomize=False,
                          deadline=None, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("SERVEKIT_FUZZ_PROFILE", "test"))


# --- what may come instead of what was expected -------------------------------------------------------------

TRICKY_TEXT = ["", " ", "0", "-1", "1e309", "NaN", "inf", "true", "off", "9" * 400, "..", "../x", "/etc/passwd",
               "a\nb", "a\rb", "x\u2028y", "\ufeffBOM", "\x00", "\u200b", "$(id)", "${HOME}", "'", '"', "#", "=", "::1",
               "[", "{}", "http://x", "sk-" + "k" * 40, "é" * 3]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=10**30, max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(TRICKY_TEXT), st.text(max_size=20))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def _places(doc: Any, path: tuple = ()) -> list[tuple]:
    """Every place in a JSON/YAML tree, as the path of keys and indices that leads there."""
    found = [path]
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, child in items:
        found += _places(child, (*path, key))
    return found


@st.composite
def mutated(draw, seed: Any, values=JSON_VALUES) -> Any:
    """`seed` with one to three of its places replaced by another value, removed, or wrapped in a list."""
    doc = copy.deepcopy(seed)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_places(doc)))
        if not path:
            return draw(values)
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "remove", "wrap"]))
        if action == "remove":
            del parent[path[-1]]
        elif action == "wrap":
            parent[path[-1]] = [parent[path[-1]]]
        else:
            parent[path[-1]] = draw(values)
    return doc


@st.composite
def damaged_text(draw, text: str) -> str:
    """`text` cut short, or with a random piece put in or taken out somewhere."""
    at = draw(st.integers(0, len(text)))
    action = draw(st.sampled_from(["cut", "insert", "delete"]))
    if action == "cut":
        return text[:at]
    if action == "insert":
        return text[:at] + draw(st.one_of(st.sampled_from(TRICKY_TEXT), st.text(max_size=12))) + text[at:]
    return text[:at] + text[at + draw(st.integers(1, 40)):]


def one_line_or(call: Callable[[], Any], *refusals: type[BaseException]) -> Any:
    """What `call` returns, or None where it raised one of `refusals` in a single line; any other exception is the
    fuzz suite's finding and propagates."""
    try:
        return call()
    except refusals as exc:
        said = str(exc)
        assert said.strip() and "\n" not in said and "Traceback" not in said, repr(said)
        return None


def _json(doc: Any) -> str:
    return json.dumps(doc, allow_nan=True)  # NaN and Infinity as a careless writer leaves them; json.loads takes them


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


# --- images.yaml: the loader, and the launcher's reading of what the loader took -------------------------------

MATRIX_TREE = yaml.safe_load(MATRIX_TEXT)


@given(tree=mutated(MATRIX_TREE))
def test_a_mutated_matrix_is_loaded_whole_or_refused_in_one_line(work, tree):
    """What the loader takes, the launcher takes too: each profile of each target builds its command on every host
    (the loader judges knobs with the launcher's own code, so a value it lets through must not stop a server)."""
    path = work / "images.yaml"
    path.write_text(yaml.safe_dump(tree, allow_unicode=True, sort_keys=False))
    matrix = one_line_or(lambda: load_matrix(path), UserError)
    if matrix is not None:
        for target in matrix.targets:
            profiles = render_profiles(matrix, target)
            for profile in profiles["profiles"]:
                for host in profiles["hosts"]:
                    build_command(profiles, profile, host, {})


@given(text=damaged_text(MATRIX_TEXT))
def test_a_damaged_matrix_file_is_loaded_or_refused_in_one_line(work, text):
    path = work / "images.yaml"
    path.write_text(text)
    one_line_or(lambda: load_matrix(path), UserError)


# --- reports and release manifests: compare, render, the gate's reader -------------------------------------------

SHIPPED_REPORTS = [json.loads(p.read_text()) for p in sorted(ROOT.glob("docs/gpu/*/report.json"))]
RUN_REPORTS = [doc for doc in SHIPPED_REPORTS if doc.get("kind") == "run"]
SWEEP_REPORTS = [doc for doc in SHIPPED_REPORTS if doc.get("kind") == "sweep"]
RELEASE_RECORD = {"target": "cpu", "repository": "127.0.0.1:5000/serve/vllm-serve", "tags": ["v0.31.0-cpu"],
                  "registry_digest": "sha256:" + "ef" * 32, "image_id": "sha256:" + "ab" * 32,
                  "content_digest": "0123456789ab", "pins": {"vllm": "0.31.0"}, "series": {"a.patch": "sha256:" + "0" * 64},
                  "smoke": {}, "models": {"default": {"model": "org/model@main"}}}
MANIFEST = {"schema_version": SCHEMA_VERSION, "kind": "release", "version": "0.31.0",
            "targets": {"cpu": RELEASE_RECORD}}


@given(seed=st.sampled_from(RUN_REPORTS), data=st.data())
def test_a_mutated_run_report_is_read_rendered_and_compared_or_refused_in_one_line(work, seed, data):
    doc = data.draw(mutated(seed))
    path = work / "report.json"
    path.write_text(_json(doc))
    report = one_line_or(lambda: load_report(path), UserError)
    if report is not None:
        render_markdown(report)
        good = RunReport.model_validate(seed)  # the shipped report it was mutated from
        compare(good, report)
        compare(report, good)


@given(seed=st.sampled_from(SWEEP_REPORTS), data=st.data())
def test_a_mutated_sweep_report_is_read_or_refused_in_one_line(work, seed, data):
    path = work / "sweep.json"
    path.write_text(_json(data.draw(mutated(seed))))
    one_line_or(lambda: load(path, SweepReport), UserError)


@given(doc=mutated(MANIFEST))
def test_a_mutated_release_manifest_is_read_or_refused_in_one_line(work, doc):
    path = work / "release.json"
    path.write_text(_json(doc))
    one_line_or(lambda: load(path, ReleaseManifest), UserError)


@given(text=st.one_of(damaged_text(_json(MANIFEST)), st.integers(1, 100_000).map(lambda n: "[" * n),
                      st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
def test_a_damaged_record_file_is_refused_in_one_line(work, text):
    path = work / "damaged.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    one_line_or(lambda: load(path, ReleaseManifest), UserError)


# --- compose/.env: the lines the source's users write, read as Compose reads them ---------------------------------

ENV_NAMES = ["BIND", "PORT", "VLLM_API_KEY", "SERVEKIT_REGISTRY", "MODELS_DIR", "MAX_LEN", "GPU_UTIL", "HF_TOKEN",
             "COMPOSE_FILE", "x", "1BAD"]
ENV_LINES = st.one_of(
    st.builds(lambda export, name, quote, value: f"{export}{name}={quote}{value}{quote}",
              st.sampled_from(["", "export "]), st.sampled_from(ENV_NAMES), st.sampled_from(["", "'", '"']),
              st.one_of(st.sampled_from(TRICKY_TEXT), st.text(max_size=20))),
    st.sampled_from(["# comment", "", "=", "JUST_A_NAME", "A=${B}", "A=${A}"]),
    st.text(max_size=30))


@given(lines=st.lists(ENV_LINES, max_size=6), bom=st.booleans(), crlf=st.booleans())
def test_a_random_env_file_is_read_as_compose_reads_it_or_refused_in_one_line(work, lines, bom, crlf):
    root = work / "checkout"
    (root / "compose").mkdir(parents=True, exist_ok=True)
    text = ("\ufeff" if bom else "") + ("\r\n" if crlf else "\n").join(lines)
    (root / "compose" / ".env").write_text(text, encoding="utf-8", errors="surrogatepass")
    with pytest.MonkeyPatch.context() as shell:  # the file's lines alone, none of this shell's
        for name in ENV_NAMES:
            shell.delenv(name, raising=False)
        _read_env(root)


def _read_env(root: Path) -> None:
    one_line_or(lambda: users_settings(root / "compose" / ".env"), UserError)
    one_line_or(lambda: published(root, "127.0.0.1", 8000, None), UserError)
    one_line_or(lambda: registry_path(MATRIX, None, root), UserError)
    one_line_or(lambda: check_models_dir(root), UserError)


# --- a checkpoint from a hub: prepare's and convert's readers, and nothing written outside the model's folder ------

SHARD = (ROOT / "docker" / "demo-model" / "model.safetensors").read_bytes()
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
CONFIG = model_config(SMALL, VISION_SMALL)
INDEX_DOC = {"metadata": {"total_size": 2 * len(SHARD)}, "weight_map": {
    "lm_head.weight_packed": SHARDS[0], "lm_head.weight_scale": SHARDS[0], "lm_head.weight_shape": SHARDS[0],
    "model.language_model.embed_tokens.weight": SHARDS[0], "mtp.fc.weight": SHARDS[1],
    "mtp.layers.0.mlp.down_proj.weight": SHARDS[1]}}
JOURNAL_DOC = {"step": "mtp", "shards": [SHARDS[1]], "config": json.dumps(CONFIG)}
OFF = {"QUANT_LM_HEAD": "0", "QUANT_EMBED": "0", "QUANT_MTP": "0"}  # the readers only: no step reaches for torch


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@given(config=st.one_of(st.just(CONFIG), mutated(CONFIG)), index=st.one_of(st.just(INDEX_DOC), mutated(INDEX_DOC)),
       journal=st.one_of(st.none(), mutated(JOURNAL_DOC)), settings_=st.fixed_dictionaries(
           {}, optional={name: st.sampled_from(["0", "1", "off", "maybe", " ", ""]) for name in OFF}))
def test_a_mutated_checkpoint_is_converted_or_refused_and_nothing_outside_its_folder_changes(
        work, config, index, journal, settings_):
    root = work / "hub"
    shutil.rmtree(root, ignore_errors=True)
    folder, outside = root / "model", root / "outside"
    folder.mkdir(parents=True)
    outside.mkdir()
    (outside / SHARDS[1]).write_bytes(b"not the model's")
    for name in SHARDS:
        (folder / name).write_bytes(SHARD)
    (folder / "config.json").write_text(_json(config))
    (folder / convert.INDEX).write_text(_json(index))
    if journal is not None:
        (folder / convert.JOURNAL).write_text(_json(journal))
        (folder / f"{SHARDS[1]}.pre").write_bytes(SHARD)
    before = _files(outside)
    one_line_or(lambda: prepare.folder_problem(folder), convert.ConvertError)  # a reason is a str, never a raise
    convert.applies(folder)
    environ = {**OFF, **settings_} if all(settings_.get(n, "0") in ("0", "off") for n in OFF) else {**OFF}
    one_line_or(lambda: convert.convert(folder, environ, say=lambda line: None), convert.ConvertError,
                boundary.Refused)
    assert _files(outside) == before
    assert sorted(p.name for p in root.iterdir()) == ["model", "outside"]


@given(header=st.one_of(st.binary(max_size=64), st.builds(
    lambda cut, junk: SHARD[:cut] + junk, st.integers(0, 400), st.binary(max_size=16))),
    doc=mutated(json.loads(SHARD[8:8 + int.from_bytes(SHARD[:8], "little")])))
def test_a_damaged_shard_is_named_as_damaged_never_raised(work, header, doc):
    """hub.shard_problem judges every downloaded shard: a reason or None, whatever the bytes."""
    path = work / "shard.safetensors"
    for data in (header, _header(doc) + SHARD[8 + int.from_bytes(SHARD[:8], "little"):]):
        path.write_bytes(data)
        problem = hub.shard_problem(path)
        assert problem is None or ("\n" not in problem and problem.strip())


def _header(doc: Any) -> bytes:
    text = _json(doc).encode()
    return len(text).to_bytes(8, "little") + text


@given(index=st.one_of(mutated(INDEX_DOC), st.text(max_size=40)))
def test_a_mutated_shard_index_is_read_or_named_as_unreadable(work, index):
    folder = work / "indexed"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / hub.INDEX).write_text(index if isinstance(index, str) else _json(index))
    problem = prepare.folder_problem(folder)
    assert problem is None or "\n" not in problem


# --- secrets and settings: the launcher's and prepare's readers of what a user sets -----------------------------

@given(data=st.binary(max_size=300))
def test_a_random_key_file_is_a_key_or_refused_in_one_line(work, data):
    path = work / "api_key"
    path.write_bytes(data)
    key = one_line_or(lambda: boundary.read_secret(path), boundary.Refused)
    if key:
        assert boundary.header_unsafe(key) is None and key == key.strip()


KNOB_NAMES = ["MAX_LEN", "GPU_UTIL", "MAX_SEQS", "KV_DTYPE", "SPEC", "SPEC_K", "MODE", "EXTRA_ARGS", "KV_OFFLOAD_GB",
              "TOOL_PARSER", "INT8_ACT", "HOST", "PORT", "KV_MEM", "QUANT_EMBED", "PREFIX_CACHE"]


@given(target=st.sampled_from(sorted(PROFILES)), data=st.data(), environ=st.dictionaries(
    st.sampled_from(KNOB_NAMES), st.one_of(st.sampled_from(TRICKY_TEXT), st.text(max_size=16),
                                           st.sampled_from(["0.9", "65536", "fp8", "mtp", "--max-model-le 9"])),
    max_size=3))
def test_random_knob_values_give_the_launcher_a_command_or_one_line_refusal(target, data, environ):
    profiles = PROFILES[target]
    profile = data.draw(st.sampled_from(sorted(profiles["profiles"])))
    host = data.draw(st.sampled_from(sorted(profiles["hosts"])))
    built = one_line_or(lambda: build_command(profiles, profile, host, environ), KnobError, boundary.Refused)
    if built is not None:
        argv, env = built
        assert all(isinstance(a, str) and boundary.control_character(a) is None for a in argv), argv
    one_line_or(lambda: convert.wanted(environ), boundary.Refused)


@given(value=st.one_of(st.sampled_from(TRICKY_TEXT), st.text(max_size=12)))
def test_a_number_setting_is_a_finite_number_in_its_range_or_refused(value):
    got = one_line_or(lambda: boundary.number_setting({"X": value}, "X", 10.0, 1, 100, "seconds"), boundary.Refused)
    assert got is None or (math.isfinite(got) and 1 <= got <= 100)
