"""What the source repository's users know keeps working here: its port, its BIND/PORT/HOST, its key (VLLM_API_KEY
or api_key.txt) and its knobs in .env (#30)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import LAUNCHER, ROOT, tracked_copy

from servekit.engines.compose import write_env
from servekit.engines.deployment import Deployment
from servekit.errors import UserError
from servekit.serve.deploy import ensure_secrets, published


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("PORT", "BIND", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)


def _root(tmp_path, env_lines: str = ""):
    (tmp_path / "compose").mkdir()
    if env_lines:
        (tmp_path / "compose" / ".env").write_text(env_lines)
    return tmp_path


def test_the_default_port_is_the_sources():
    from servekit.config.load import load_matrix
    assert load_matrix(ROOT / "images.yaml").serve.port == 18020


def test_port_and_bind_in_env_mean_what_they_meant_there(tmp_path, clean_env, monkeypatch):
    root = _root(tmp_path, "PORT=18021\nBIND=0.0.0.0\n")
    assert published(root, "127.0.0.1", 18020, None) == ("0.0.0.0", 18021)
    assert published(root, "127.0.0.1", 18020, 9000) == ("0.0.0.0", 9000)  # --port wins
    monkeypatch.setenv("PORT", "18030")  # the shell wins over the file, as in Compose
    assert published(root, "127.0.0.1", 18020, None) == ("0.0.0.0", 18030)


@pytest.mark.parametrize("line, says", [("PORT=eighty\n", "PORT='eighty'"), ("PORT=0\n", "at least 1"),
                                        ("BIND=localhost\n", "BIND='localhost'")])
def test_a_bad_port_or_bind_is_refused_naming_it(tmp_path, clean_env, line, says):
    with pytest.raises(UserError, match=says):
        published(_root(tmp_path, line), "127.0.0.1", 18020, None)


@pytest.mark.engine
def test_compose_publishes_on_the_sources_bind_and_port(tmp_path, clean_env):
    root = tracked_copy(tmp_path)
    env_file = root / "compose" / ".env"
    env_file.write_text("PORT=18021\n")
    write_env(Deployment(root, "cuda", "native", "vllm-serve:x", "127.0.0.1", 18020))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SERVEKIT_"))
             and k not in ("PORT", "BIND")}

    def ports(**env) -> list[dict]:
        done = subprocess.run(["docker", "compose", "--profile", "default", "config", "--format", "json"],
                              cwd=env_file.parent, env={**clean, **env}, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["services"]["default"]["ports"]
    [port] = ports()
    assert (port["host_ip"], port["published"], port["target"]) == ("127.0.0.1", "18021", 8000)
    [port] = ports(BIND="0.0.0.0", PORT="18030")
    assert (port["host_ip"], port["published"]) == ("0.0.0.0", "18030")


@pytest.mark.engine
def test_models_dir_puts_your_folder_where_the_models_volume_was(tmp_path, clean_env):
    """The source's Compose file bind-mounted ${MODELS_DIR:-./models} at /app/models: set, the folder is mounted
    there for prepare and every profile; unset, the models volume is."""
    root = tracked_copy(tmp_path)
    write_env(Deployment(root, "cuda", "native", "vllm-serve:x", "127.0.0.1", 18020))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SERVEKIT_")) and k != "MODELS_DIR"}

    def models_mounts(**env) -> dict[str, tuple[str, str]]:
        done = subprocess.run(["docker", "compose", "--profile", "default", "config", "--format", "json"],
                              cwd=root / "compose", env={**clean, **env}, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        services = json.loads(done.stdout)["services"]
        return {name: next((v["type"], v["source"]) for v in services[name]["volumes"] if v["target"] == "/app/models")
                for name in ("prepare", "default")}
    assert {kind for kind, _ in models_mounts().values()} == {"volume"}
    assert set(models_mounts(MODELS_DIR="/data/models").values()) == {("bind", "/data/models")}


def test_vllm_api_key_or_api_key_txt_becomes_the_key_file(tmp_path, clean_env, monkeypatch):
    root = _root(tmp_path)
    dep = Deployment(root, "cuda", "native", "x", "127.0.0.1", 18020)
    (root / "api_key.txt").write_text("sk-from-the-source-repo-0123456789\n")
    assert ensure_secrets(dep).read_text() == "sk-from-the-source-repo-0123456789\n"
    (root / "compose" / ".env").write_text("VLLM_API_KEY=sk-from-dot-env-0123456789\n")
    assert ensure_secrets(dep).read_text() == "sk-from-dot-env-0123456789\n"
    monkeypatch.setenv("VLLM_API_KEY", "sk-exported-wins-0123456789")
    assert ensure_secrets(dep).read_text() == "sk-exported-wins-0123456789\n"
    assert oct(dep.api_key_file.stat().st_mode & 0o777) == "0o600"


def test_a_key_too_short_is_refused_not_served(tmp_path, clean_env, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "short")
    with pytest.raises(UserError, match="VLLM_API_KEY holds 5 characters"):
        ensure_secrets(Deployment(_root(tmp_path), "cuda", "native", "x", "127.0.0.1", 18020))


def test_the_launcher_takes_an_exported_vllm_api_key_first(tmp_path):
    from servekit.image.launcher import given_key
    key_file = tmp_path / "key"
    key_file.write_text("sk-in-the-file-0123456789")
    assert given_key({"API_KEY_FILE": str(key_file)}) == ("sk-in-the-file-0123456789", "")
    assert given_key({"API_KEY_FILE": str(key_file), "VLLM_API_KEY": "sk-exported-0123456789"}) == \
        ("sk-exported-0123456789", "")
    key, why = given_key({"API_KEY_FILE": str(key_file), "VLLM_API_KEY": "short"})
    assert key is None and "VLLM_API_KEY holds 5 characters" in why


def test_host_is_the_address_vllm_listens_on_and_the_host_kind_has_its_own_name(tmp_path):
    """HOST=127.0.0.1 (the source's bind address) reaches --host; SERVEKIT_HOST picks the host of images.yaml."""
    from servekit.config.load import load_matrix
    from servekit.config.profiles import render_profiles
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps(render_profiles(load_matrix(ROOT / "images.yaml"), "cuda")))
    env = {"SERVEKIT_PROFILES": str(profiles), "PRINT_ARGV": "1", "PATH": "/usr/bin:/bin", "HOST": "127.0.0.1",
           "SERVEKIT_HOST": "wsl2", "VLLM_API_KEY": "sk-" + "k" * 30}
    done = subprocess.run([*LAUNCHER, "serve", "alternative"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    argv = done.stdout.splitlines()[0]
    assert "--host 127.0.0.1" in argv and "--max-num-seqs 4" in argv  # the wsl2 host's MAX_SEQS=4


@pytest.mark.parametrize("old, new", [("DFLASH_TOKENS", "DRAFT_TOKENS"), ("DRAFT_METHOD", "SPEC"),
                                      ("DFLASH_MAX_LEN", "MAX_LEN")])
def test_a_renamed_knob_is_refused_naming_the_new_one(old, new):
    from servekit.config.load import load_matrix
    from servekit.config.profiles import render_profiles
    from servekit.image.launcher import KnobError, build_command
    rendered = render_profiles(load_matrix(ROOT / "images.yaml"), "cuda")
    with pytest.raises(KnobError, match=f"{old}='15' is the source repository's name; set {new} instead"):
        build_command(rendered, "default", "native", {old: "15"})


def test_every_name_the_source_shares_is_a_knob_and_the_old_names_reach_the_launcher():
    from servekit.image.knobs import KNOBS, RENAMED, SAME_AS_SOURCE, SOURCE_NAMES
    assert set(SAME_AS_SOURCE) <= set(KNOBS) and not set(SOURCE_NAMES) & set(KNOBS)
    compose = (ROOT / "compose" / "compose.yaml").read_text()
    assert all(f"    - {old}\n" in compose for old in RENAMED)  # passed through, so that the refusal can happen
    table = (ROOT / "docs" / "profiles.md").read_text()
    assert all(f"| `{name}` |" in table for name in [*SAME_AS_SOURCE, *SOURCE_NAMES])


@pytest.mark.slow
def test_the_wheel_holds_the_whole_tree_and_its_console_script_runs_from_any_folder(tmp_path):
    """pip install of the wheel: the image's code and the WSL2 sampler's script are in it, `servekit --version`
    answers from any folder, and `plan` says what it needs (a checkout's images.yaml) instead of failing."""
    import zipfile
    root = tracked_copy(tmp_path / "src")
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(root)], check=True, capture_output=True, timeout=300)
    [wheel] = wheels.glob("servekit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "servekit/image/launcher.py" in names and "servekit/wsl2/shared_usage.ps1" in names
    assert "servekit/smoke/api.py" in names
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"servekit"}, top  # nothing else lands in site-packages under a name of its own
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target)}
    script = str(target / "bin" / "servekit")
    done = subprocess.run([sys.executable, script, "--version"], cwd=elsewhere, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("servekit 0."), done.stderr
    done = subprocess.run([sys.executable, script, "plan"], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("error: images.yaml: no such file; run from a servekit checkout "
                                                    "(the folder that holds images.yaml) or pass --matrix PATH")
    done = subprocess.run([sys.executable, script, "--matrix", str(root / "images.yaml"), "plan", "--json"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert {p["target"] for p in json.loads(done.stdout)["targets"]} == {"cpu", "cuda"}
    done = subprocess.run([sys.executable, "-c", "import servekit.smoke.api, servekit.wsl2.shared_usage as s; "
                           "print(servekit.smoke.api.__file__, s.SCRIPT.is_file())"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == [str(target / "servekit/smoke/api.py"), "True"], \
        done.stderr


# --- the user's .env, hostile or merely unusual: read as Compose reads it, and never a line of theirs lost ---------

KEY = "sk-source-key-0123456789abcdef"
# How the source's users write VLLM_API_KEY, each a form Compose reads as KEY.
KEY_LINES = {
    "plain": f"VLLM_API_KEY={KEY}",
    "double-quoted-with-a-comment": f'VLLM_API_KEY="{KEY}" # my key',
    "single-quoted-with-a-comment": f"VLLM_API_KEY='{KEY}'  # my key",
    "unquoted-with-a-comment": f"VLLM_API_KEY={KEY} # my key",
    "exported": f"export VLLM_API_KEY={KEY}",
    "spaces-around-the-equals": f"VLLM_API_KEY = {KEY}",
    "after-a-byte-order-mark": f"\ufeffVLLM_API_KEY={KEY}",
    "from-another-line": f"MINE={KEY}\nVLLM_API_KEY=${{MINE}}",
}


def _compose_reads(env_file, name: str) -> str:
    """What Compose itself reads `name` as from `env_file`: the value it interpolates into a service."""
    folder = env_file.parent
    (folder / "probe.yaml").write_text(f'services:\n  probe:\n    image: busybox\n    environment:\n'
                                       f'      SEEN: "${{{name}:-unset}}"\n')
    clean = {k: v for k, v in os.environ.items() if k != name and not k.startswith(("COMPOSE_", "SERVEKIT_"))}
    done = subprocess.run(["docker", "compose", "-f", "probe.yaml", "--env-file", env_file.name, "config", "--format",
                           "json"], cwd=folder, env=clean, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["services"]["probe"]["environment"]["SEEN"].replace("$$", "$")


@pytest.mark.engine  # Compose's own reading is the reference: the plugin `make engine` installs
@pytest.mark.parametrize("form", KEY_LINES)
def test_the_sources_key_in_env_is_read_as_compose_reads_it(tmp_path, clean_env, form):
    root = _root(tmp_path, KEY_LINES[form] + "\n")
    env_file = root / "compose" / ".env"
    assert _compose_reads(env_file, "VLLM_API_KEY") == KEY
    dep = Deployment(root, "cuda", "native", "x", "127.0.0.1", 18020)
    assert ensure_secrets(dep).read_text() == KEY + "\n"
    write_env(dep)  # and the rewrite keeps the line as the user wrote it (a byte-order mark aside)
    assert KEY_LINES[form].lstrip("\ufeff").splitlines()[-1] in env_file.read_text().splitlines()


def test_a_block_that_lost_its_end_line_keeps_the_lines_after_it(tmp_path):
    from servekit.config.userenv import ENV_BEGIN, ENV_BEGIN_2, ENV_END
    root = _root(tmp_path, f"MAX_SEQS=4\n{ENV_BEGIN}\n{ENV_BEGIN_2}\nSERVEKIT_IMAGE=old\nSERVEKIT_PORT=8000\n"
                           "PREFIX_CACHE=0\n# my note\nSPEC=dflash2\n")
    write_env(Deployment(root, "cuda", "native", "vllm-serve:new", "127.0.0.1", 8000))
    lines = (root / "compose" / ".env").read_text().splitlines()
    assert lines[:4] == ["MAX_SEQS=4", "PREFIX_CACHE=0", "# my note", "SPEC=dflash2"]
    assert lines.count(ENV_BEGIN) == 1 and lines[-1] == ENV_END and "SERVEKIT_IMAGE=old" not in lines


def test_a_users_own_servekit_setting_outside_the_block_is_theirs(tmp_path):
    """servekit's block writes the image, host, address and Compose's files; SERVEKIT_REGISTRY and the like are the
    user's, kept in a file from before the block as in one with it."""
    mine = ["SERVEKIT_REGISTRY=ghcr.io/me", "export SERVEKIT_IMAGE_EXTRA=1"]
    root = _root(tmp_path, "\n".join(["SERVEKIT_IMAGE=old", *mine]) + "\n")  # no block: an older servekit's file
    for port in (8000, 9000):
        write_env(Deployment(root, "cuda", "native", "vllm-serve:new", "127.0.0.1", port))
        lines = (root / "compose" / ".env").read_text().splitlines()
        assert lines[:2] == mine and "SERVEKIT_IMAGE=old" not in lines and f"SERVEKIT_PORT={port}" in lines


def test_every_key_the_block_writes_is_one_it_knows_as_its_own(tmp_path):
    from servekit.config.userenv import OWN_KEYS
    root = _root(tmp_path)
    env_file = write_env(Deployment(root, "cuda", "wsl2", "vllm-serve:new", "127.0.0.1", 8000))
    assert env_file is not None
    settings = [line for line in env_file.read_text().splitlines() if "=" in line and not line.startswith("#")]
    assert settings and all(OWN_KEYS.match(line) for line in settings)


@pytest.mark.parametrize("hidden", ["\ufeff", "\u200b", "\u00e9", " "])
def test_a_key_no_http_header_can_carry_is_refused_without_showing_it(tmp_path, clean_env, monkeypatch, hidden):
    """A byte-order mark, a zero-width space, an accented letter, a space inside: a client sends another key than
    the server compares, and every request is a 401. Refused where the key is given, by the launcher as by `up`."""
    from servekit.image.launcher import read_key
    secret = "sk-" + "k" * 12 + hidden + "k" * 12
    monkeypatch.setenv("VLLM_API_KEY", secret)
    with pytest.raises(UserError, match=f"U\\+{ord(hidden):04X}") as refused:
        ensure_secrets(Deployment(_root(tmp_path), "cuda", "native", "x", "127.0.0.1", 18020))
    assert "k" * 12 not in str(refused.value)
    key_file = tmp_path / "key"
    key_file.write_text(secret + "\n")
    key, why = read_key(str(key_file))
    assert key is None and f"U+{ord(hidden):04X}" in why and "k" * 12 not in why
    from servekit.image.launcher import given_key  # the container's: VLLM_API_KEY exported, as the source's users do
    key, why = given_key({"VLLM_API_KEY": secret})
    assert key is None and f"U+{ord(hidden):04X}" in why and "k" * 12 not in why, why


def test_the_registry_comes_from_compose_env_as_compose_reads_it(tmp_path, monkeypatch):
    """`pull` and `release` find SERVEKIT_REGISTRY where the README says to put it, compose/.env; the shell wins
    over the file and --registry over both."""
    from servekit.config.load import load_matrix
    from servekit.release.naming import registry_path
    matrix = load_matrix(ROOT / "images.yaml")
    (tmp_path / "compose").mkdir()
    (tmp_path / "compose" / ".env").write_text("export SERVEKIT_REGISTRY='127.0.0.1:5999/team'  # ours\n")
    monkeypatch.delenv("SERVEKIT_REGISTRY", raising=False)
    assert registry_path(matrix, None, tmp_path) == "127.0.0.1:5999/team"
    assert registry_path(matrix, None) == matrix.release.registry.rstrip("/")  # no checkout named: the matrix's
    monkeypatch.setenv("SERVEKIT_REGISTRY", "127.0.0.1:6000/shell")
    assert registry_path(matrix, None, tmp_path) == "127.0.0.1:6000/shell"
    assert registry_path(matrix, "127.0.0.1:7000/given", tmp_path) == "127.0.0.1:7000/given"


@pytest.mark.parametrize("value", ["https://registry.example:5000/team", "registry.example:5000/team\nimage: evil",
                                   "registry.example:5000/Team Name"])
@pytest.mark.parametrize("where", ["the shell", "compose/.env"])
def test_a_registry_that_is_no_registry_path_is_refused_where_it_is_set(tmp_path, monkeypatch, value, where):
    """SERVEKIT_REGISTRY becomes the image's reference, and `pull --moving` writes that into compose/.env: a scheme,
    a space or a line break there would be a wrong image or a YAML key of its own; refused in one line naming where."""
    from servekit.config.load import load_matrix
    from servekit.release.naming import registry_path
    matrix = load_matrix(ROOT / "images.yaml")
    (tmp_path / "compose").mkdir()
    monkeypatch.delenv("SERVEKIT_REGISTRY", raising=False)
    if where == "the shell":
        monkeypatch.setenv("SERVEKIT_REGISTRY", value)
    else:
        (tmp_path / "compose" / ".env").write_text(f"SERVEKIT_REGISTRY={json.dumps(value)}\n")
    with pytest.raises(UserError) as refused:
        registry_path(matrix, None, tmp_path)
    said = str(refused.value)
    assert said.startswith("SERVEKIT_REGISTRY=") and f"({where})" in said and "HOST[:PORT][/NAMESPACE]" in said, said
    assert "\n" not in said
    assert registry_path(matrix, "127.0.0.1:7000/given", tmp_path) == "127.0.0.1:7000/given"  # --registry wins


def test_env_example_names_every_setting_the_compose_files_read():
    """compose/.env.example lists what a user may set: every ${VARIABLE} of compose/*.yaml is there, or a knob, or
    one servekit writes itself (its block of compose/.env, or the profile of the command it runs)."""
    import re

    from servekit.config.derived import USER_SETTINGS
    from servekit.config.userenv import OWN_KEYS
    from servekit.image.knobs import KNOBS
    read = {m for path in (ROOT / "compose").glob("*.yaml") for m in re.findall(r"\$\{([A-Z_]+)", path.read_text())}
    ours = {name for name in read if OWN_KEYS.match(f"{name}=")} | {"SERVEKIT_PROFILE"}
    assert read - ours - set(KNOBS) - set(USER_SETTINGS) == set()
    example = (ROOT / "compose" / ".env.example").read_text()
    assert all(f"# {name}=" in example for name in USER_SETTINGS)
    assert all(f"# {name}=" in example for name, knob in KNOBS.items() if knob.passthrough)
