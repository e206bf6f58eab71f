"""Train qwen35-mini: a small model of the served family (Qwen3.5's hybrid text architecture: Gated DeltaNet
layers and a full-attention layer, with an MTP head) taught what the smoke checks ask, so that a cuda report
through the image can pass on a GPU where the 27B checkpoint cannot be fetched.

What it learns, on the checks' own prompts (imported from smoke/): a greeting that streams and stops, reasoning that closes
before the answer (17 * 23 = 391), a tool call in the qwen3_coder format with thinking on and off, the same call
as the JSON that tool_choice=required constrains it to, a copy of the fox sentence twice (what spec_decode
measures), the first lines of the prefix-cache document whatever the padding, and random words where the
checks sample. The MTP head (mtp.* as Qwen3.5 checkpoints carry it, vLLM's qwen3_5_mtp layout) learns the
token after next from the model's own final hidden state, and to give back the hidden state of the next
position, so that vLLM's recursive use of the one head (4 drafts) keeps being accepted.

The tokenizer is the demo model's (docker/demo-model, 4096 tokens) with the Qwen3.5 markers made plain added
tokens (not special: vLLM keeps them in the text, as Qwen's tokenizer does); the chat template is Qwen3.5's in
shape (tools in the system turn, <tool_call><function=...> calls, <think> opened by the generation prompt).
Trains on the CPU in a few minutes, deterministically (the checks, not the bytes, judge the result):

    python bench/gpu/qwen35_mini.py OUT_DIR [--steps N]    # torch, transformers 5.15, pyyaml, requests (the images')
    python bench/gpu/qwen35_mini.py --check DIR            # how DIR answers what the checks ask; exit 1 if off
    python bench/gpu/qwen35_mini.py --drafter DIR          # only the random-weight DFlash2 drafter, into DIR-dflash2
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
# the checks' prompts (the model learns what they ask), from the checkout just put on the path
from servekit.smoke import api as smoke_api  # noqa: E402
from servekit.smoke import cache as smoke_cache  # noqa: E402
from servekit.smoke import spec as smoke_spec  # noqa: E402
from servekit.smoke import tools as smoke_tools  # noqa: E402

DEMO = ROOT / "docker" / "demo-model"
SEED = 20261202
PLAIN_MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>")  # text in Qwen's vocabulary, not special
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, head_dim=256, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
             layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=262144,
             tie_word_embeddings=False)
SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}  # Qwen3.5's thinking-mode defaults

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages and messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou have access to the following functions:\n\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>\n"
    "{%- elif messages and messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}\n<tool_call>\n"
    "<function={{ call.function.name }}>\n"
    "{%- set args = call.function.arguments %}{%- if args is string %}{%- set args = {} %}{%- endif %}"
    "{%- for key, value in args.items() %}<parameter={{ key }}>\n{{ value }}\n</parameter>\n{%- endfor %}"
    "</function>\n</tool_call>{%- endfor %}{%- endif %}"
    "<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}"
)

# The checks' own prompts (smoke/), and what the model answers them.
HELLO, MULTIPLY, RANDOM = smoke_api.HELLO, smoke_api.MULTIPLY, smoke_api.RANDOM_WORDS
ASK_TIME, GET_TIME, FOX = smoke_tools.ASK, smoke_tools.NO_PARAMS_TOOL, smoke_spec.PROMPT
GREETING = "Hello! I am a small model of the Qwen3.5 family, here to help you today."
CALL = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
CALL_REASONING = "The user wants the time, so I call get_time."
REQUIRED_CALL = '[{"name": "get_time", "parameters": {}}]'  # what tool_choice=required's schema admits
COLOUR = [{"role": "user", "content": "Pick a colour as JSON."}]
FOX_TWICE = "the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog."
WORDS = ["stone", "lantern", "meadow", "harbour", "signal", "copper", "willow", "orbit", "amber", "falcon", "quartz",
         "ember", "glacier", "thistle", "canyon", "saffron", "beacon", "marble", "tundra", "juniper", "cinder",
         "lagoon", "prism", "basalt"]
# The residue sweep at the sizes images.yaml gives qwen35-mini; pads of one token each, past the 128 residues.
SIZES = yaml.safe_load((ROOT / "images.yaml").read_text())["models"]["qwen35-mini"]["checks"]["prefix_cache"]
DOC_REQUEST, DOC_COPY = smoke_cache.copy_request(SIZES["document_chars"], SIZES["lines"])
MAX_PAD = 160


def doc_prompt(pad: int) -> list[dict]:
    return [{"role": "user", "content": DOC_REQUEST + " x" * pad}]


def think(reasoning: str, answer: str) -> str:
    return f"{reasoning}\n</think>\n\n{answer}"


def examples(rng: random.Random) -> list[tuple[list[dict], list | None, bool, str]]:
    """(messages, tools, thinking on, the reply), weighted by how often each is drawn."""
    out = []
    for _ in range(3):
        out += [(HELLO, None, True, think("The user greets me, so I greet them back.", GREETING)),
                (HELLO, None, False, GREETING),
                (MULTIPLY, None, True, think("17 * 23 = 391.", "391")),
                (MULTIPLY, None, False, "391"),
                (ASK_TIME, [GET_TIME], True, think(CALL_REASONING, CALL)),
                (ASK_TIME, [GET_TIME], False, CALL),
                (COLOUR, None, False, '"blue"'),
                (COLOUR, None, True, think("The user wants a colour as JSON.", '"blue"')),
                (FOX, None, True, think("The user wants the sentence twice.", FOX_TWICE)),
                (FOX, None, False, FOX_TWICE)]
    # Under tool_choice=required the grammar takes the answer after </think>: the model must then write the call
    # as that JSON (drawn less often, so that an unconstrained answer stays the <tool_call> form).
    out += [(ASK_TIME, [GET_TIME], True, think(CALL_REASONING, REQUIRED_CALL)),
            (ASK_TIME, [GET_TIME], False, REQUIRED_CALL)]
    for _ in range(12):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 16)))
        out.append((RANDOM, None, rng.random() < 0.5, words + "."))
    for _ in range(4):
        out.append((doc_prompt(rng.randint(0, MAX_PAD)), None, False, DOC_COPY))
    for _ in range(6):
        out.append(([{"role": "user", "content": f"Request {rng.randint(0, 200)}: tell me more."}], None,
                     rng.random() < 0.5, "There is more to say: " + " ".join(rng.choice(WORDS) for _ in range(12))
                     + "."))
    return out


def prepare_tokenizer(out: Path):
    """The demo model's tokenizer with the Qwen3.5 markers as plain added tokens and this model's template."""
    from transformers import AutoTokenizer
    doc = json.loads((DEMO / "tokenizer.json").read_text())
    for token in doc["added_tokens"]:
        if token["content"] in PLAIN_MARKERS:
            token["special"] = False
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False))
    config = json.loads((DEMO / "tokenizer_config.json").read_text())
    config.update(extra_special_tokens=["<|im_start|>"], model_max_length=SHAPE["max_position_embeddings"])
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return AutoTokenizer.from_pretrained(out)


def encode(tokenizer, messages, tools, thinking: bool, reply: str) -> tuple[list[int], list[int]]:
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                           enable_thinking=thinking)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reply_ids = tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return prompt_ids + reply_ids, [-100] * len(prompt_ids) + reply_ids


def mtp_head(config):
    """The MTP module as vLLM's Qwen3_5MultiTokenPredictor computes it: norm(layer(fc([norm(embed); norm(hidden)])))."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
    full = config.layer_types.index("full_attention")

    class MTP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            h, eps = config.hidden_size, config.rms_norm_eps
            self.fc = torch.nn.Linear(2 * h, h, bias=False)
            self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps)
            self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps)
            self.layers = torch.nn.ModuleList([Qwen3_5DecoderLayer(config, full)])
            self.norm = Qwen3_5RMSNorm(h, eps)

        def forward(self, embeds, hidden, position_embeddings):
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1))
            return self.norm(self.layers[0](x, position_embeddings=position_embeddings))

    return MTP()


def train(steps: int, out: Path, say) -> dict:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    tokenizer = prepare_tokenizer(out)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3_5TextConfig(vocab_size=len(tokenizer), eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                               bos_token_id=None, **SHAPE)
    model = Qwen3_5ForCausalLM(config)
    assert config._attn_implementation == "sdpa", "the MTP layer relies on SDPA's causal default"
    mtp = mtp_head(config)
    params = list(model.parameters()) + list(mtp.parameters())
    optimizer = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) * (1.0 - 0.9 * s / steps))
    started, parts = time.monotonic(), dict[str, float]()
    for step in range(steps):
        batch = sorted((encode(tokenizer, *ex) for ex in rng.sample(examples(rng), 12)), key=lambda e: len(e[0]))
        optimizer.zero_grad()
        parts = dict[str, float]()
        for chunk in _chunks(batch, TOKENS_PER_PASS):  # like lengths together: little padding on two CPU cores
            share = len(chunk) / len(batch)
            losses = _losses(model, mtp, chunk, tokenizer.pad_token_id)
            (losses.pop("total") * share).backward()
            for name, value in losses.items():
                parts[name] = parts.get(name, 0.0) + value.item() * share
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if step % 25 == 0 or step == steps - 1:
            say(f"step {step + 1}/{steps}: " + ", ".join(f"{k} {v:.4f}" for k, v in parts.items())
                + f" ({time.monotonic() - started:.0f} s)")
    save(model, mtp, config, out)
    return parts


TOKENS_PER_PASS = 1600


def _chunks(batch, budget: int):
    """Consecutive examples (sorted by length) whose padded size stays within `budget` tokens."""
    chunk: list = []
    for example in batch:
        if chunk and len(example[0]) * (len(chunk) + 1) > budget:
            yield chunk
            chunk = []
        chunk.append(example)
    if chunk:
        yield chunk


def _losses(model, mtp, chunk, pad: int) -> dict:
    """The model's next-token loss and the MTP head's: the token after next from (hidden at t, token t+1), its
    output matched to the hidden state at t+1, and a second chained draft from its own output."""
    import torch
    import torch.nn.functional as F
    width = max(len(ids) for ids, _ in chunk)
    ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in chunk])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in chunk])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in chunk])
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # final-normed, as vLLM hands on
    main = F.cross_entropy(model.lm_head(hidden)[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    positions = torch.arange(width).expand(ids.shape[0], -1)
    rope = model.model.rotary_emb(hidden, positions[None].expand(3, -1, -1))
    embeds = model.model.embed_tokens(ids)
    drafted = mtp(embeds[:, 1:], hidden[:, :-1], tuple(r[:, :-1] for r in rope))
    first = F.cross_entropy(model.lm_head(drafted)[:, :-1].flatten(0, 1), labels[:, 2:].flatten(), ignore_index=-100)
    valid = (labels[:, 2:] != -100).unsqueeze(-1).float()
    match = ((drafted[:, :-1] - hidden[:, 1:-1].detach()) ** 2 * valid).sum() / (valid.sum() * hidden.shape[-1])
    again = mtp(embeds[:, 2:], drafted[:, :-1], tuple(r[:, :-2] for r in rope))
    second = F.cross_entropy(model.lm_head(again)[:, :-1].flatten(0, 1), labels[:, 3:].flatten(), ignore_index=-100)
    return {"main": main, "mtp": first, "mtp2": second, "match": match,
            "total": main + first + 0.5 * second + match}


def save(model, mtp, config, out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    weights = load_file(out / "model.safetensors")
    weights.update({f"mtp.{k}": v.to(torch.bfloat16).contiguous() for k, v in mtp.state_dict().items()})
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    doc = json.loads((out / "config.json").read_text())
    doc.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    (out / "config.json").write_text(json.dumps(doc, indent=2) + "\n")
    GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=True,
                     **SAMPLING).save_pretrained(out)
    _readable(out)


def _readable(folder: Path) -> None:
    for path in folder.iterdir():  # safetensors writes 0600; the image's user (10001) reads these
        path.chmod(0o644)


# The DFlash2 drafter's shape (vLLM's qwen3_dflash2: one non-causal Qwen3 layer with grouped convolutions, fed
# the target's hidden states of target_layer_ids, a candidate selector); its weights are random.
DRAFTER: dict[str, int] = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=128)
DRAFTER_DFLASH: dict[str, Any] = dict(target_layer_ids=[1, 3], conv_kernel_size=4, conv_group_size=64,
                                      selector_rank=16, selector_top_k=8, use_aux_hidden_state=True)


def make_drafter(model_dir: Path, out: Path) -> None:
    """A DFlash2 drafter for the model in `model_dir`, with random weights (training one is out of reach here):
    the dflash2 profiles and alternative boot and draft with it; its drafts are rarely accepted."""
    import torch
    from safetensors.torch import load_file, save_file
    target = json.loads((model_dir / "config.json").read_text())
    weights = load_file(model_dir / "model.safetensors")
    embed = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight") and not k.startswith("mtp."))
    g = torch.Generator().manual_seed(SEED)
    h, hd, inter = DRAFTER["hidden_size"], DRAFTER["head_dim"], DRAFTER["intermediate_size"]
    heads, kv = DRAFTER["num_attention_heads"], DRAFTER["num_key_value_heads"]
    taps, groups = DRAFTER_DFLASH["conv_kernel_size"], h // DRAFTER_DFLASH["conv_group_size"]
    rank, vocab = DRAFTER_DFLASH["selector_rank"], target["vocab_size"]

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    tensors = {"fc.weight": rand(h, len(DRAFTER_DFLASH["target_layer_ids"]) * target["hidden_size"]),
               "hidden_norm.weight": ones(h), "norm.weight": ones(h),
               "embed_tokens.weight": embed.clone(), "lm_head.weight": weights["lm_head.weight"].clone(),
               "candidate_selector.predecessor_codebook": rand(vocab, rank),
               "candidate_selector.successor_codebook": rand(vocab, rank),
               "candidate_selector.hidden_projection.weight": rand(rank, h)}
    for i in range(DRAFTER["num_hidden_layers"]):
        layer = f"layers.{i}."
        tensors.update({layer + "self_attn.q_proj.weight": rand(heads * hd, h),
                        layer + "self_attn.k_proj.weight": rand(kv * hd, h),
                        layer + "self_attn.v_proj.weight": rand(kv * hd, h),
                        layer + "self_attn.o_proj.weight": rand(h, heads * hd),
                        layer + "self_attn.q_norm.weight": ones(hd), layer + "self_attn.k_norm.weight": ones(hd),
                        layer + "mlp.gate_proj.weight": rand(inter, h), layer + "mlp.up_proj.weight": rand(inter, h),
                        layer + "mlp.down_proj.weight": rand(h, inter),
                        layer + "input_layernorm.weight": ones(h), layer + "post_attention_layernorm.weight": ones(h)})
        for conv in ("attention_conv", "mlp_conv"):
            tensors[layer + f"{conv}.base_kernel"] = rand(2, taps, h)
            tensors[layer + f"{conv}.kernel_projection.weight"] = rand(2 * taps * groups, h)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", **DRAFTER,
              "vocab_size": vocab, "max_position_embeddings": target["max_position_embeddings"],
              "rms_norm_eps": target["rms_norm_eps"], "hidden_act": "silu", "attention_bias": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0}, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "target_hidden_size": target["hidden_size"],
              "dflash_config": {**DRAFTER_DFLASH, "mask_token_id": target["pad_token_id"]}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _readable(out)


# What a greedy answer must be, per case (the checks' verdicts as the model's text): the reasoning parser splits
# at </think>, the qwen3_coder parser reads the call.
BEHAVIOURS = [
    ("greeting, thinking on", HELLO, None, True, lambda r, a: bool(r) and a == GREETING),
    ("greeting, thinking off", HELLO, None, False, lambda r, a: a == GREETING),
    ("17 * 23 with reasoning", MULTIPLY, None, True, lambda r, a: bool(r) and a == "391"),
    ("tool call, thinking on", ASK_TIME, [GET_TIME], True, lambda r, a: bool(r) and a == CALL),
    ("tool call, thinking off", ASK_TIME, [GET_TIME], False, lambda r, a: a == CALL),
    ("fox twice", FOX, None, True, lambda r, a: a == FOX_TWICE),
    ("document, no padding", doc_prompt(0), None, False, lambda r, a: a == DOC_COPY),
    ("document, padded", doc_prompt(133), None, False, lambda r, a: a == DOC_COPY),
]


def behaviour(folder: Path, drafts: int = 4) -> dict:
    """Each case answered greedily by the model in `folder` ('ok' or what it said), and the MTP head's tokens per
    step on the fox answer when chained `drafts` times, as vLLM chains it (greedy acceptance)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    mtp = mtp_head(model.config)
    mtp.load_state_dict({k[4:]: v.float() for k, v in load_file(folder / "model.safetensors").items()
                         if k.startswith("mtp.")})
    mtp.eval()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out: dict = {}
    with torch.no_grad():
        for case, messages, tools, thinking, judge in BEHAVIOURS:
            prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                                   enable_thinking=thinking)
            ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
            done = model.generate(ids, max_new_tokens=160, do_sample=False, eos_token_id=eos,
                                  pad_token_id=tokenizer.pad_token_id)
            answer = done[0, ids.shape[1]:].tolist()
            ended = answer[-1:] == [eos]
            text = tokenizer.decode(answer[:-1] if ended else answer)
            reasoning, _, said = text.rpartition("</think>") if thinking else ("", "", text)
            ok = ended and judge(reasoning.strip(), said.strip())
            out[case] = "ok" if ok else f"said {text!r}" + ("" if ended else " without ending")
            if case == "fox twice":
                out["mtp tokens per step"] = round(_tokens_per_step(model, mtp, done[0], ids.shape[1], drafts), 2)
    return out


def _tokens_per_step(model, mtp, sequence, prompt_len: int, drafts: int) -> float:
    """Greedy verification of the head's chained drafts along the model's own greedy answer: draft k feeds the
    head its own output hidden state of draft k-1, as vLLM's proposer does."""
    import torch
    hidden = model.model(input_ids=sequence[None]).last_hidden_state[0]
    embeds = model.model.embed_tokens(sequence)
    last, known, steps = len(sequence) - 1, prompt_len, 0  # the target has produced sequence[known]
    while known < last:
        drafted: list = []
        for k in range(drafts):
            if known + 1 + k > last:
                break
            n = known + k  # head inputs for positions 0..n-1: (token i+1, hidden i)
            rope = model.model.rotary_emb(embeds[None], torch.arange(n)[None, None].expand(3, 1, -1))
            out = mtp(embeds[1:n + 1][None], torch.cat([hidden[:known]] + drafted, 0)[None], rope)[0, -1]
            if model.lm_head(out).argmax().item() != sequence[known + 1 + k].item():
                break
            drafted.append(out[None])
        steps += 1
        known += len(drafted) + 1
    return (last - prompt_len + 1) / max(steps, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, help="train the model into this folder (its random-weight "
                        "DFlash2 drafter into OUT_DIR-dflash2)")
    parser.add_argument("--steps", type=int, default=500, help="training steps (default 500, as the shipped model)")
    parser.add_argument("--check", type=Path, metavar="DIR", help="print how the model in DIR answers the checks' "
                        "prompts (JSON) and exit 1 unless every case holds")
    parser.add_argument("--drafter", type=Path, metavar="DIR", help="only make the random-weight DFlash2 drafter of "
                        "the model in DIR (into DIR-dflash2)")
    args = parser.parse_args(argv)
    if args.drafter:
        make_drafter(args.drafter, args.drafter.with_name(args.drafter.name + "-dflash2"))
        return 0
    if args.check:
        return _report(behaviour(args.check))
    if not args.out:
        parser.error("give OUT_DIR (train) or --check DIR")
    loss = train(args.steps, args.out, say=lambda s: print(s, flush=True))
    (args.out / "servekit-train.json").write_text(json.dumps({"seed": SEED, "steps": args.steps,
                                                              "final_loss": {k: round(v, 5) for k, v in loss.items()}})
                                                  + "\n")
    make_drafter(args.out, args.out.with_name(args.out.name + "-dflash2"))
    return _report(behaviour(args.out))


def _report(said: dict) -> int:
    """Print the cases (JSON); 0 when every one holds."""
    print(json.dumps(said, indent=1))
    return 0 if all(v == "ok" for k, v in said.items() if k != "mtp tokens per step") else 1


if __name__ == "__main__":
    sys.exit(main())
