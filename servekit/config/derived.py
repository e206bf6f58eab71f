"""The parts of the docs and Compose files that are derived from images.yaml and the knob table.

Each derived part sits between a `BEGIN name` and an `END name` comment line in a hand-written
file, so the prose, anchors and comments around it stay readable. `python3 build.py derive`
rewrites them (adding a profile is one edit to images.yaml, then `make derived`); `verify` and a
test fail while a committed file differs from what this renders.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import shlex
from pathlib import Path

from servekit.config.matrix import Matrix
from servekit.config.profiles import HOST_LAYERS, layers, render_profiles
from servekit.errors import UserError
from servekit.image import recipe
from servekit.image.boundary import write_text_atomic
from servekit.image.knobs import KNOBS, RENAMED, SAME_AS_SOURCE, SOURCE_NAMES, Knob
from servekit.image.launcher import build_command
from servekit.layout import IMAGE_CODE, STAGED

MARK = re.compile(r"^(?P<indent>[ \t]*)(?P<open>#|<!--) BEGIN (?P<name>[\w-]+)(?P<rest>[^\n]*)\n(?P<body>.*?)"
                  r"^(?P=indent)(?P=open) END (?P=name)[^\n]*\n", re.M | re.S)


# --- Compose -----------------------------------------------------------------------------------

def _compose_knobs(matrix: Matrix) -> list[str]:
    # and the source's old names, so that the launcher can refuse them naming the new one
    return [f"- {name}" for name, knob in KNOBS.items() if knob.passthrough] + [f"- {name}" for name in RENAMED]


def _released(matrix: Matrix, target: str) -> str:
    """The image a plain `docker compose up` runs where servekit wrote no compose/.env: the release's moving tag,
    at SERVEKIT_REGISTRY when set, else images.yaml's release.registry (compose/.env's SERVEKIT_IMAGE wins)."""
    return (f"${{SERVEKIT_IMAGE:-${{SERVEKIT_REGISTRY:-{matrix.release.registry}}}/{matrix.image.name}:"
            f"v{matrix.vllm}-{target}}}")


def _compose_image(matrix: Matrix) -> list[str]:
    gpu = next((name for name, t in matrix.targets.items() if t.gpu), next(iter(matrix.targets)))
    return [f"x-image: &image {_released(matrix, gpu)}"]


def _compose_cpu_image(matrix: Matrix) -> list[str]:
    cpu = next((name for name, t in matrix.targets.items() if not t.gpu), next(iter(matrix.targets)))
    return [f"x-image-{cpu}: &image {_released(matrix, cpu)}"]


def _compose_services(matrix: Matrix) -> list[str]:
    out = []
    for name in matrix.profiles:
        out += [f"{name}:", "  <<: *serve", f"  profiles: [{name}]", f'  command: ["serve", "{name}"]']
    return out


def _compose_wsl2_services(matrix: Matrix) -> list[str]:
    return [f"{name}: *wsl2" for name in matrix.profiles]


def _compose_model_dir_services(matrix: Matrix) -> list[str]:
    # prepare checks the folder and fetches only what the profile being started serves (`up` names it), not every
    # drafter of the matrix's model: a folder of your own usually means no hub to fetch them from.
    return ["prepare:", "  <<: *model-dir", '  command: ["prepare", "${SERVEKIT_PROFILE:-default}"]',
            *(f"{name}: *model-dir" for name in matrix.profiles)]


def _compose_drafter_dir_services(matrix: Matrix) -> list[str]:
    return [f"{name}: *drafter-dir" for name in ("prepare", *matrix.profiles)]


def _gpu_profiles(matrix: Matrix) -> list[str]:
    return [name for name, profile in matrix.profiles.items() if any(matrix.targets[t].gpu for t in profile.targets)]


def _compose_gpu_device_services(matrix: Matrix) -> list[str]:
    # Compose drops a `!reset` that arrives through a YAML alias, so each service resets the reservation itself.
    return [line for name in _gpu_profiles(matrix) for line in (f"{name}:", "  <<: *gpu-devices", "  deploy: !reset null")]


def _compose_card_services(matrix: Matrix) -> list[str]:
    return [f"{name}: *card" for name in _gpu_profiles(matrix)]


# --- docs/profiles.md ----------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _knobs(table: dict[str, str]) -> str:
    return " ".join(f"`{k}={v}`" for k, v in table.items())


def _host_knobs(matrix: Matrix, profile: str) -> str:
    parts = []
    for host in matrix.hosts:
        table: dict[str, str] = {}
        for name, layer in layers(matrix, profile, host):
            if name in HOST_LAYERS:
                table.update(layer)
        if table:
            parts.append(f"{host}: {_knobs(table)}")
    return "; ".join(parts)


def _allowed(knob: Knob) -> str:
    if knob.kind == "enum":
        return ", ".join(f"`{c}`" for c in knob.choices)
    if knob.kind == "bool":
        return "1/0, true/false, yes/no, on/off (any case; vLLM is given 1 or 0)"
    bounds = [f"≥ {knob.minimum:g}" if knob.minimum is not None else "",
              f"≤ {knob.maximum:g}" if knob.maximum is not None else ""]
    return " ".join([{"int": "integer", "float": "number", "str": "text", "address": "an IP address"}[knob.kind], *filter(None, bounds)])


def _profile_table(matrix: Matrix) -> list[str]:
    rows = ["", "| profile | targets | knobs | on a host | checks | what for |", "|---|---|---|---|---|---|"]
    for name, p in matrix.profiles.items():
        needs = f" (needs {', '.join(p.components)})" if p.components else ""
        rows.append(f"| `{name}` | {', '.join(p.targets)} | {_knobs(p.knobs) or '(defaults)'} | "
                    f"{_host_knobs(matrix, name)} | {', '.join(p.checks)} | {_cell(p.description)}{needs} |")
    return rows + [""]


def _check_table(matrix: Matrix) -> list[str]:
    """Each check, what it judges, its parameters, and where a target does not require it (with why)."""
    rows = ["", "| check | judges | parameters | not required |", "|---|---|---|---|"]
    for name, c in matrix.checks.items():
        exempt = [f"{profile} on {target}: {_cell(why)}" for profile in matrix.profiles for target in matrix.targets
                  if target in matrix.profiles[profile].targets
                  for check, why in matrix.not_required(profile, target).items() if check == name]
        params = " ".join(f"`{k}={v}`" for k, v in c.params.items())
        hosts = f" ({', '.join(c.hosts)} only)" if c.hosts else ""
        rows.append(f"| `{name}` | {_cell(c.description)}{hosts} | {params} | {'; '.join(exempt)} |")
    return rows + [""]


def _profile_flags(matrix: Matrix) -> list[str]:
    """What each profile runs, per target and host: the launcher's own argv and environment (after --model, --host
    and --port), with no knob set in the environment."""

    out = [""]
    for target in matrix.targets:
        rendered = render_profiles(matrix, target)
        for profile in rendered["profiles"]:
            for host in matrix.hosts:
                argv, env = build_command(rendered, profile, host, {})
                out.append(f"- `{profile}` on {target}, {host}: `vllm serve {shlex.join(argv[8:])}`"
                           + (f"; environment `{' '.join(f'{k}={v}' for k, v in sorted(env.items()))}`" if env else ""))
    return out + [""]


def _source_table(matrix: Matrix) -> list[str]:
    """The source's names: the same knob here, or what became of it. A knob all of whose variables nothing in the
    shipped cuda image reads (docker/env-readers.cuda.json) is the same name, and says it does nothing here yet."""
    read = json.loads(SHIPPED_READERS.read_text())["read"]
    sets: dict[str, set[str]] = {}
    for variable, knobs in _setting_knobs().items():
        for knob in knobs:
            sets.setdefault(knob, set()).add(variable)

    def same(name: str) -> str:
        inert = sorted(v for v in sets.get(name, ()) if v not in read and v != ARGV)
        if inert and len(inert) == len(sets[name]):  # no flag, and no variable anything reads
            return ("the same name and values; **inert** in the shipped image: nothing there reads "
                    + ", ".join(f"`{v}`" for v in inert))
        return "the same as here"
    rows = ["", "| the source's name | what it did there | here |", "|---|---|---|"]
    rows += [f"| `{name}` | {same(name)} | {_cell(KNOBS[name].help)} |" for name in SAME_AS_SOURCE]
    for name, n in SOURCE_NAMES.items():
        here = f"{n.here}: set `{n.renamed_to}`; the launcher refuses `{name}` naming it" if n.renamed_to else n.here
        rows.append(f"| `{name}` | {_cell(n.there)} | {_cell(here)} |")
    return rows + [""]


def _knob_table(matrix: Matrix) -> list[str]:
    rows = ["", "| knob | values | sets |", "|---|---|---|"]
    return rows + [f"| `{k.name}` | {_allowed(k)} | {_cell(k.help)} |" for k in KNOBS.values()] + [""]


# What the shipped cuda image's build found its packages read (readers.py), committed so that the docs can say it;
# tests/test_cuda.py holds it to the image main builds.
SHIPPED_READERS = Path(__file__).resolve().parent.parent.parent / "docker" / "env-readers.cuda.json"


ARGV = "vllm serve's flags"  # a key of _setting_knobs beside the variables: the knobs that change the flags


@functools.cache  # two tables read it; the recipe is run over every knob and row once
def _setting_knobs() -> dict[str, set[str]]:
    """variable (or ARGV) -> the knobs whose value sets it or changes it, found by running the recipe over each
    mode's rows (alone, and with the draft count and prefix caching that CTX=huge's DFlash2 rules need) with and
    without each knob at each of a few values."""
    samples = {name: list(k.choices) if k.kind == "enum" else ["0", "1"] if k.kind == "bool" else ["15", "4"]
               for name, k in KNOBS.items() if name != "MODE"}
    model = {"drafters": {"dflash": {"path": "/drafter"}}}
    found: dict[str, set[str]] = {}
    for mode in ("single", "batch", "alternative"):
        for row in ({"SPEC": s, "CTX": c, "KV": kv, **more} for s in ("off", "mtp", "dflash2")
                    for c in ("fast", "long", "huge") for kv in recipe.BATCH
                    for more in ({}, {"DRAFT_TOKENS": "15", "PREFIX_CACHE": "1"})):
            for host in ("native", "wsl2"):
                try:
                    plain_argv, plain = recipe.command({"MODE": mode, **row}, host, model)
                except recipe.RecipeError:
                    continue
                for name, values in samples.items():
                    for value in values:
                        try:
                            argv, env = recipe.command({"MODE": mode, **row, name: value}, host, model)
                        except recipe.RecipeError:
                            continue
                        if argv != plain_argv:
                            found.setdefault(ARGV, set()).add(name)
                        for variable in set(env) | set(plain):
                            if env.get(variable) != plain.get(variable):
                                found.setdefault(variable, set()).add(name)
    return found


def _variable_table(matrix: Matrix) -> list[str]:
    """Each variable the launcher can export, the knobs that set it, and whether the shipped cuda image reads it."""
    shipped = json.loads(SHIPPED_READERS.read_text())
    knobs = _setting_knobs()
    rows = ["", "| variable | set by | in the shipped cuda image |", "|---|---|---|"]
    for name in recipe.every_variable():
        by = ", ".join(f"`{k}`" for k in sorted(knobs.get(name, ()))) or "every launch"
        read = (f"live: `{shipped['read'][name]}` reads it" if name in shipped["read"] else
                "**inert**: nothing in the image reads it; a series of yours that does makes it live")
        rows.append(f"| `{name}` | {by} | {read} |")
    return rows + [""]


# --- docs/build.md -------------------------------------------------------------------------------

def _exclusion_table(matrix: Matrix) -> list[str]:
    rows = ["", "| target | left out of the lock | why |", "|---|---|---|"]
    rows += [f"| {target} | `{name}` | {_cell(why)} |" for target, spec in matrix.targets.items()
             for name, why in spec.exclude.items()]
    return rows + [""]


# --- docs/architecture.md ------------------------------------------------------------------------

CODE = Path(__file__).resolve().parent.parent.parent  # the tree these modules are in
PACKAGES = ("servekit", "smoke", "wsl2")


def _first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ").split(". ")[0].rstrip(".")


def _module_table(matrix: Matrix) -> list[str]:
    """Every module of the orchestrator and what its docstring's first sentence says it does, package by package."""
    rows = ["", "| module | its one job |", "|---|---|"]
    for package in PACKAGES:
        for path in sorted((CODE / package).rglob("*.py")):
            rel = path.relative_to(CODE).as_posix()
            rows.append(f"| `{rel}` | {_cell(_first_line(path))} |")
    return rows + [""]


# --- .dockerignore ------------------------------------------------------------------------------

def _context(matrix: Matrix) -> list[str]:
    """The build context admits the image's code folder and what the build stages, nothing else."""
    return ["*", f"!{IMAGE_CODE}/", *(f"!{path}/" for path in STAGED), "**/__pycache__"]


# --- compose/.env.example ------------------------------------------------------------------------

# What a user may set in compose/.env besides the knobs, and what each does; tests/test_source_compat.py holds the
# names to the ${VARIABLES} the Compose files read (less those servekit's own block writes).
USER_SETTINGS: dict[str, str] = {
    "VLLM_API_KEY": "the key clients send, as the source's users set it: the container takes it first; "
                    "`python3 build.py up` also writes it into compose/secrets/api_key, its own key file",
    "HF_TOKEN": "a Hugging Face token for prepare's download (a gated model); compose/secrets/hf_token wins when "
                "it holds one",
    "HF_ENDPOINT": "the hub prepare downloads from, in place of huggingface.co (a mirror)",
    "BIND": "the address the server is published on (the source's name; default 127.0.0.1)",
    "PORT": "the port the server is published on (the source's name)",
    "SERVEKIT_REGISTRY": "where releases come from and go (e.g. registry.example:5000/team): `pull`, `release` and a "
                         "plain `docker compose up` of a release read it",
    "MODELS_DIR": "the models folder (the source's): prepare fetches into it, the server reads from it",
    "MODEL_DIR": "a model folder of yours, served as it is (with compose.model-dir.yaml in COMPOSE_FILE)",
    "DRAFTER_DIR": "a DFlash2 drafter folder of yours (with compose.drafter-dir.yaml in COMPOSE_FILE)",
    "HF_HUB_OFFLINE": "1: prepare never asks the hub; every file must be in the models folder already",
    "QUANT_LM_HEAD": "off (0, false, no or off) leaves lm_head as published (prepare converts it to int8 otherwise)",
    "QUANT_EMBED": "off leaves the token embeddings as published (prepare converts them to int8 otherwise)",
    "QUANT_MTP": "off leaves the MTP head's linears as published (prepare converts them to int8 otherwise)",
    "GPU_COUNT": "how many GPUs Compose gives the server (the source's; default 1)",
    "SERVEKIT_API_KEY_FILE": "the key's file, instead of compose/secrets/api_key",
    "SERVEKIT_HF_TOKEN_FILE": "the hub token's file, instead of compose/secrets/hf_token",
    "SERVEKIT_DRIVER_DIR": "the host's NVIDIA driver folder, where a container gets the GPU by its device nodes "
                           "(no NVIDIA container toolkit: compose.gpu-devices.yaml; default /usr/local/nvidia)",
    "SERVEKIT_GPU_DEVICE": "the GPU's device node on that route (default /dev/nvidia0)",
}


def _env_settings(matrix: Matrix) -> list[str]:
    return [f"# {name}=   # {what}" for name, what in USER_SETTINGS.items()]


def _env_knobs(matrix: Matrix) -> list[str]:
    return [f"# {name}=   # {_cell(knob.help)}" for name, knob in KNOBS.items() if knob.passthrough]


# file -> block name -> lines of the block (indented as its markers)
PARTS = {
    ".dockerignore": {"context": _context},
    "compose/compose.yaml": {"image": _compose_image, "knobs": _compose_knobs, "profiles": _compose_services},
    "compose/compose.cpu.yaml": {"image": _compose_cpu_image},
    "compose/compose.wsl2.yaml": {"profiles": _compose_wsl2_services},
    "compose/compose.gpu-devices.yaml": {"profiles": _compose_gpu_device_services},
    "compose/compose.model-dir.yaml": {"profiles": _compose_model_dir_services},
    "compose/compose.drafter-dir.yaml": {"profiles": _compose_drafter_dir_services},
    "compose/compose.card.yaml": {"profiles": _compose_card_services},
    "compose/.env.example": {"settings": _env_settings, "knobs": _env_knobs},
    "docs/profiles.md": {"profile-table": _profile_table, "check-table": _check_table, "profile-flags": _profile_flags,
                         "knob-table": _knob_table, "source-table": _source_table,
                         "variable-table": _variable_table},
    "docs/architecture.md": {"modules": _module_table},
    "docs/build.md": {"exclusions": _exclusion_table},
}


def render(text: str, blocks: dict, matrix: Matrix, where: str) -> str:
    found = [m["name"] for m in MARK.finditer(text)]
    missing = [name for name in blocks if found.count(name) != 1]
    if missing:
        raise ValueError(f"{where}: needs one `BEGIN {missing[0]}` ... `END {missing[0]}` block")

    def fill(m: re.Match) -> str:
        if m["name"] not in blocks:
            return m[0]
        body = "".join(f"{m['indent']}{line}".rstrip() + "\n" for line in blocks[m["name"]](matrix))
        close = " -->" if m["open"] == "<!--" else ""
        return f"{m['indent']}{m['open']} BEGIN {m['name']}{m['rest']}\n{body}{m['indent']}{m['open']} END {m['name']}{close}\n"
    return MARK.sub(fill, text)


def derive(matrix: Matrix, root: Path) -> dict[str, tuple[str, str]]:
    """Each derived file: (as it is, as it should be)."""
    out = {}
    for rel, blocks in PARTS.items():
        text = (root / rel).read_text()
        out[rel] = (text, render(text, blocks, matrix, rel))
    return out


def stale(matrix: Matrix, root: Path) -> list[str]:
    missing = [rel for rel in PARTS if not (root / rel).is_file()]
    if missing:
        return [f"{rel} is missing" for rel in missing]
    try:
        files = derive(matrix, root)
    except ValueError as exc:
        return [str(exc)]
    return [f"{rel} is not what images.yaml and the knob table give: run `make derived`"
            for rel, (now, wanted) in files.items() if now != wanted]


def derive_files(matrix: Matrix, root: Path, check: bool = False) -> tuple[int, list[str]]:
    """`derive`: rewrite each stale derived file (only name them when `check`); (files derived, stale ones)."""
    try:
        files = derive(matrix, root)
    except (OSError, ValueError) as exc:
        raise UserError(str(exc)) from None
    changed = [rel for rel, (now, wanted) in files.items() if now != wanted]
    if not check:
        for rel in changed:
            write_text_atomic(root / rel, files[rel][1])
    return len(files), changed
