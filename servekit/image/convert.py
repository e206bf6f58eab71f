"""prepare's conversions of a fetched compressed-tensors checkpoint: `lm_head`, the embeddings and the MTP head to
int8, and the BF16 MTP linears added to `ignore`.

Ours, from the source's description of its prepare/quant_lm_head.py, quant_embed.py and quant_mtp.py: symmetric
int8 in groups of 128 along the input, scales fp16 for linears and the model's dtype for the embeddings, packed as
compressed-tensors packs them, a config group each. While the MTP linears are still BF16 their names go into
`ignore`, which the published checkpoint leaves them out of (speculative decoding does not load it without).

Each step is done when the index names no target of it as a plain `.weight`, so it is idempotent; it refuses
when the round trip loses 1% or more (the source measured 0.64% for `lm_head`). A step writes in this order: a
journal naming it (with the config as it was), a hard link to each shard it rewrites as it is (`<shard>.pre`) and,
once, as published (`<shard>.bak`, as the source keeps them; the config's and index's first state as
`.bak-quant`), each rewritten shard (a new file renamed over the old), the config, then the index, the commit
point; then the journal and the `.pre` links go. Links cost no space until the shard is replaced. A folder with
a journal is not whole (prepare.folder_problem says so): the next run puts back the shards and the config as they
were before the step and does it again. Standard library at import (the host reads STEPS); torch, safetensors and compressed-tensors inside
the steps, from the image's lock.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .boundary import Missing, Refused, read_text, switch_setting, write_text_atomic
from .errors import ServekitError
from .hub import shard_name_problem

INDEX = "model.safetensors.index.json"
JOURNAL = ".servekit-convert.json"
GROUP = 128
QMAX = 127
MAX_ROUND_TRIP_ERROR = 0.01
MAX_JSON_BYTES = 64 << 20  # a 27B's index is about 150 KB, its config a few KB
ROWS_AT_ONCE = 16384  # rows quantized at once: a 248K x 5120 lm_head in float32 would be 5 GB
MTP_LINEAR = re.compile(r"^mtp\.(fc|layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj))\.weight$")
# step -> (the setting that skips it when 0, what it converts, the config group's target)
STEPS: dict[str, tuple[str, str, str]] = {
    "lm_head": ("QUANT_LM_HEAD", "lm_head", r"re:.*lm_head$"),
    "embed": ("QUANT_EMBED", "the token embeddings", r"re:.*embed_tokens$"),
    "mtp": ("QUANT_MTP", "the MTP head's linears", r"re:.*mtp\.(fc|layers\..*)$"),
}


class ConvertError(ServekitError):
    """A conversion cannot be done; the message says which step, what and how to go on."""


def targets(step: str, weight_map: dict[str, str]) -> list[str]:
    """The plain `.weight` tensors `step` converts that the index still names."""
    if step == "lm_head":
        return [k for k in weight_map if k == "lm_head.weight"]
    if step == "embed":
        return [k for k in weight_map if k.endswith("embed_tokens.weight") and not k.startswith("mtp.")]
    return [k for k in weight_map if MTP_LINEAR.match(k)]


def applies(folder: Path) -> bool:
    """A compressed-tensors checkpoint with an index: what the conversions are for (a generated model is not)."""
    try:
        config = json.loads(read_text(folder / "config.json", MAX_JSON_BYTES))
    except (ValueError, RecursionError):  # Refused (missing, a FIFO, too large) is a ValueError
        return False
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return (folder / INDEX).is_file() and isinstance(quant, dict) and quant.get("quant_method") == "compressed-tensors"


def interrupted(folder: Path) -> str | None:
    """The step a crash left half done in `folder`, or None."""
    try:
        step = json.loads(read_text(folder / JOURNAL, MAX_JSON_BYTES)).get("step", "?")
    except Missing:
        return None
    except (ValueError, RecursionError, AttributeError):
        return "?"
    return step if isinstance(step, str) and step in STEPS else "?"


def wanted(environ: Mapping[str, str]) -> dict[str, bool]:
    """Each step on or off as its setting says (on unless set off, in the words every switch takes); Refused names a
    setting that is neither."""
    return {step: switch_setting(environ, setting, True) for step, (setting, _, _) in STEPS.items()}


def convert(folder: Path, environ: dict[str, str], say: Callable[[str], None] = print) -> None:
    """Every step not set off, each resumed or done as the module says."""
    try:
        steps = wanted(environ)
    except Refused as exc:
        raise ConvertError(str(exc)) from None
    if interrupted(folder):
        _restore(folder, say)
    _read_config(folder)  # a malformed config refused before any step writes
    _sweep(folder)
    for step, (setting, what, _) in STEPS.items():
        if steps[step]:
            _step(folder, step, say)
        else:
            say(f"prepare: {what} left as published ({setting}={environ.get(setting, '').strip()})")
    _ignore_bf16_mtp(folder, say)


def _step(folder: Path, step: str, say: Callable[[str], None]) -> None:
    index = _read_index(folder)
    pending = targets(step, index["weight_map"])
    if not pending:
        return
    started = time.monotonic()
    config_text = read_text(folder / "config.json", MAX_JSON_BYTES)
    shards = sorted({index["weight_map"][k] for k in pending})
    _write_json(folder / JOURNAL, {"step": step, "shards": shards, "config": config_text})
    for name in ("config.json", INDEX):
        if not (folder / f"{name}.bak-quant").exists():
            write_text_atomic(folder / f"{name}.bak-quant", (folder / name).read_text())
    for shard in shards:
        _link(folder / shard, folder / f"{shard}.bak")  # the shard as published, kept
        _link(folder / shard, folder / f"{shard}.pre", replace=True)  # the shard before this step
    freed = sum(_rewrite_shard(folder / shard, [k for k in pending if index["weight_map"][k] == shard], step)
                for shard in shards)
    config = json.loads(config_text)  # the text read above: convert() checked its shape, and steps keep it
    _add_group(config, step)
    if step == "mtp":
        names = {k[:-len(".weight")] for k in pending}
        quant = config["quantization_config"]
        quant["ignore"] = [n for n in quant.get("ignore") or [] if n not in names]
    _write_json(folder / "config.json", config)
    for key in pending:
        stem, shard = key[:-len(".weight")], index["weight_map"].pop(key)
        index["weight_map"].update({f"{stem}.{part}": shard for part in ("weight_packed", "weight_scale", "weight_shape")})
    _write_json(folder / INDEX, index)  # the commit point
    _forget(folder, shards)
    say(f"prepare: {STEPS[step][1]} to int8 in {time.monotonic() - started:.1f} s, {freed / 2**20:,.1f} MiB freed "
        f"(the published shards kept as {', '.join(f'{s}.bak' for s in shards)})")


def _rewrite_shard(path: Path, keys: list[str], step: str) -> int:
    """`path` again with each of `keys` as its int8 triplet, read from the shard as it was before the step
    (`.pre`); the bytes it frees."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    tensors, freed = {}, 0
    with safe_open(str(path.with_name(path.name + ".pre")), framework="pt") as shard:
        metadata, names = shard.metadata(), shard.keys()  # a safetensors handle: keys() is how it lists
        for key in names:
            tensor = shard.get_tensor(key)
            if key not in keys:
                tensors[key] = tensor
                continue
            scale_dtype = tensor.dtype if step == "embed" else torch.float16
            try:
                packed, scale, error = quantize(tensor, scale_dtype)
            except ConvertError as exc:
                raise ConvertError(f"{key}: {exc}") from None
            if not error < MAX_ROUND_TRIP_ERROR:  # (a NaN error passes a >= test)
                raise ConvertError(f"{key}: the int8 round trip loses {error:.2%} (at most {MAX_ROUND_TRIP_ERROR:.0%}); "
                                   f"the checkpoint is left as it was: skip the step with {STEPS[step][0]}=0")
            stem = key[:-len(".weight")]
            tensors.update({f"{stem}.weight_packed": packed, f"{stem}.weight_scale": scale,
                            f"{stem}.weight_shape": torch.tensor(list(tensor.shape), dtype=torch.int64)})
            freed += tensor.numel() * tensor.element_size() - sum(
                t.numel() * t.element_size() for t in (packed, scale))
    fresh = path.with_name(path.name + ".new")
    save_file(tensors, str(fresh), metadata=metadata or {"format": "pt"})
    with open(fresh, "rb") as done:
        os.fsync(done.fileno())
    os.replace(fresh, path)
    return freed


def quantize(weight: Any, scale_dtype: Any) -> tuple[Any, Any, float]:  # torch's, imported where it is used
    """(int32 packed along the input, scales [rows, columns / 128], the round trip's relative error) of a 2-D weight:
    symmetric int8 in groups of 128, packed with compressed-tensors' own pack_to_int32, as vLLM reads it."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    if weight.dim() != 2:
        raise ConvertError(f"a weight of shape {list(weight.shape)} is no matrix (rows x columns); the checkpoint is "
                           "left as it was")
    if not bool(torch.isfinite(weight).all()):
        raise ConvertError("a weight holds NaN or infinity, which no int8 scale represents; the checkpoint is left as "
                           "it was (fetch the model again)")
    rows, columns = weight.shape
    if columns % GROUP:
        raise ConvertError(f"a weight of {columns} columns does not split into groups of {GROUP}")
    packed, scales, lost, total = [], [], 0.0, 0.0
    for start in range(0, rows, ROWS_AT_ONCE):
        w = weight[start:start + ROWS_AT_ONCE].float().view(-1, columns // GROUP, GROUP)
        scale = (w.abs().amax(dim=-1, keepdim=True) / QMAX).clamp(min=1e-10).to(scale_dtype)
        q = torch.round(w / scale.float()).clamp(-QMAX - 1, QMAX)
        lost += float(((q * scale.float() - w) ** 2).sum())
        total += float((w ** 2).sum())
        packed.append(pack_to_int32(q.to(torch.int8).view(-1, columns), 8))
        scales.append(scale.view(-1, columns // GROUP))
    return torch.cat(packed), torch.cat(scales).contiguous(), (lost / total) ** 0.5 if total else 0.0


def _add_group(config: dict, step: str) -> None:
    """The step's config group (the first group's weights at 8 bits), once; `lm_head` out of `ignore`."""
    quant = config["quantization_config"]
    groups = quant.setdefault("config_groups", {})
    target = STEPS[step][2]
    if any(target in (g.get("targets") or []) for g in groups.values()):
        return
    first: dict = next(iter(groups.values()), {})
    weights = {**(first.get("weights") or {}), "num_bits": 8, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": GROUP, "dynamic": False}
    name = next(f"group_{i}" for i in range(1, len(groups) + 2) if f"group_{i}" not in groups)
    groups[name] = {"targets": [target], "weights": weights, "input_activations": None, "output_activations": None,
                    "format": "pack-quantized"}
    if step == "lm_head":
        quant["ignore"] = [n for n in quant.get("ignore") or [] if n != "lm_head"]


def _ignore_bf16_mtp(folder: Path, say: Callable[[str], None]) -> None:
    """The MTP linears that are still BF16 in `ignore` (config only, atomic), so that speculative decoding loads them."""
    bf16 = sorted(k[:-len(".weight")] for k in targets("mtp", _read_index(folder)["weight_map"]))
    config = _read_config(folder)
    quant = config["quantization_config"]
    missing = [n for n in bf16 if n not in (quant.get("ignore") or [])]
    if missing:
        quant["ignore"] = [*(quant.get("ignore") or []), *missing]
        _write_json(folder / "config.json", config)
        say(f"prepare: {len(missing)} BF16 MTP linears added to the config's ignore list (the published one lacks them)")


def _restore(folder: Path, say: Callable[[str], None]) -> None:
    """Undo what a crash left of a step: the index never moved unless the step committed."""
    step, shards, config_text = _read_journal(folder)
    if not targets(step, _read_index(folder)["weight_map"]):
        _forget(folder, shards)  # it committed; only the journal and the links were left
        return
    for shard in shards:
        if (folder / f"{shard}.pre").exists():
            _link(folder / f"{shard}.pre", folder / shard, replace=True)
    write_text_atomic(folder / "config.json", config_text)
    _forget(folder, shards)
    say(f"prepare: the {step} conversion a crash interrupted is undone; doing it again")


def _sweep(folder: Path) -> None:
    """What a crash left half written beside the files (staging names, a shard rewrite cut short): never read, so
    only removed."""
    for leftover in [*folder.glob(".*.tmp"), *folder.glob("*.safetensors.new")]:
        leftover.unlink(missing_ok=True)


def _link(source: Path, link: Path, replace: bool = False) -> None:
    """`link` a hard link to `source` (kept where it is there unless `replace`), made beside it and renamed in."""
    if link.exists() and (not replace or os.path.samefile(source, link)):
        return  # (rename() of two links to one file does nothing and would leave the staging link behind)
    staging = link.with_name(f".{link.name}.tmp")
    staging.unlink(missing_ok=True)
    os.link(source, staging)
    os.replace(staging, link)


def _forget(folder: Path, shards: list[str]) -> None:
    """A step's journal and its `.pre` links gone: the journal last, so a crash here is resumed again."""
    for shard in shards:
        (folder / f"{shard}.pre").unlink(missing_ok=True)
    (folder / JOURNAL).unlink()


def _read_json(path: Path) -> dict:
    """A JSON object from a regular file of at most MAX_JSON_BYTES (a FIFO is refused, never waited on)."""
    try:
        doc = json.loads(read_text(path, MAX_JSON_BYTES))
    except Refused as exc:
        raise ConvertError(f"{exc}; nothing was converted") from None
    except (ValueError, RecursionError) as exc:
        raise ConvertError(f"{path}: not readable JSON ({str(exc)[:200]}); nothing was converted") from None
    if not isinstance(doc, dict):
        raise ConvertError(f"{path}: not a JSON object; nothing was converted")
    return doc


def _read_config(folder: Path) -> dict:
    """config.json with its quantization_config as the steps read it: config_groups a mapping of groups (each a
    mapping whose targets are names), ignore a list of names (a string would be taken letter by letter)."""
    config = _read_json(folder / "config.json")
    quant = config.get("quantization_config")
    groups = quant.get("config_groups", {}) if isinstance(quant, dict) else None
    ignore = quant.get("ignore") if isinstance(quant, dict) else None
    problem = ("it has no quantization_config mapping" if not isinstance(quant, dict) else
               "its config_groups is not a mapping of groups" if not isinstance(groups, dict) or not all(
                   isinstance(g, dict) and isinstance(g.get("targets") or [], list) for g in groups.values()) else
               "its ignore is not a list of module names" if ignore is not None and (
                   not isinstance(ignore, list) or not all(isinstance(n, str) for n in ignore)) else None)
    if problem:
        raise ConvertError(f"{folder / 'config.json'}: not a compressed-tensors config ({problem}); nothing was "
                           "converted (fetch the model again)")
    return config


def _read_index(folder: Path) -> dict:
    """The index, its weight_map tensor names to shard files that are plain files of `folder` (a name that leads out
    of it, or a link, would have a conversion write elsewhere)."""
    index = _read_json(folder / INDEX)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise ConvertError(f"{folder / INDEX}: no weight_map of tensor names to shard file names; nothing was "
                           "converted (fetch the model again)")
    for name in sorted(set(weight_map.values())):
        if problem := _shard_problem(folder, name):
            raise ConvertError(f"{folder / INDEX}: {problem}; nothing was converted (fetch the model again)")
    return index


def _read_journal(folder: Path) -> tuple[str, list[str], str]:
    """(step, shards, the config before it) from a crash's journal, each as convert wrote it: a known step, plain
    shard files of `folder`, the config's text."""
    journal = _read_json(folder / JOURNAL)
    step, shards, config = journal.get("step"), journal.get("shards"), journal.get("config")
    known = isinstance(step, str) and step in STEPS
    problem = (f"its step {str(step)[:40]!r} is none of {', '.join(STEPS)}" if not known else
               "its shards are not a list of file names" if not isinstance(shards, list) or not all(
                   isinstance(n, str) for n in shards) else
               "its config is not text" if not isinstance(config, str) else
               next(filter(None, (_shard_problem(folder, n) for n in shards)), None))
    if problem:
        raise ConvertError(f"{folder / JOURNAL}: not a journal convert wrote ({problem}); the folder is left as it "
                           "is: remove it and fetch the model again")
    return str(step), [str(n) for n in shards or []], str(config)


def _shard_problem(folder: Path, name: str) -> str | None:
    """Why `name` is not a shard file of `folder` a conversion may replace, or None."""
    if problem := shard_name_problem(name):
        return problem
    if (folder / name).is_symlink():
        return f"{name} is a link (a conversion replaces only files of the model's folder)"
    return None


def _write_json(path: Path, doc: dict) -> None:
    write_text_atomic(path, json.dumps(doc, indent=2) + "\n")




if __name__ == "__main__":  # python -m servekit.image.convert FOLDER: the steps on one folder, as prepare runs them
    try:
        convert(Path(sys.argv[1]), dict(os.environ))
    except ConvertError as exc:
        print(f"prepare: error: {exc}", file=sys.stderr)
        sys.exit(1)
