"""Make the demo model: a tiny Qwen3, made offline and deterministically.

A byte-level BPE tokenizer trained on local text, a Hermes/Qwen-style chat template with tools,
and random weights trained for a few CPU minutes on synthetic chats, so that the model stops,
answers plainly without tools, and answers a forced tool call with exactly one call and `{}`.
The model ships in the repository (images.yaml `models.demo.dir`), so no build trains it;
`make demo-model` runs it inside the cpu image (`python -m servekit.image.demomodel`, with the image's torch,
transformers and tokenizers; servekit/build/retrain.py drives it) and replaces the shipped copy with the result.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Say = Callable[[str], None]

SEED = 20261129
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
REPLY = "Hello from the servekit demo model."
TOOL_NAMES = ["get_time", "get_weather", "lookup", "search", "list_files", "read_file", "now", "ping", "echo_text",
              "get_date", "calculator", "get_status"]

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages and messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags.<|im_end|>\n"
    "{%- elif messages and messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}\n<tool_call>\n"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{%- if call.function.arguments is string %}{{ call.function.arguments }}"
    "{%- else %}{{ call.function.arguments | tojson }}{%- endif %}}\n</tool_call>{%- endfor %}{%- endif %}"
    "<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)

COLOURS = ["red", "green", "blue"]
JSON_QUESTIONS = ["Pick a colour as JSON.", "Give one colour as JSON.", "Answer in JSON: a colour."]
QUESTIONS = ["What time is it?", "Say hello.", "What is the weather like?", "List the files.", "Who are you?",
             "Tell me a story.", "Count to five.", "What can you do?", "Summarise this text.", "Help me.",
             "Translate this sentence.", "How are you today?", "Explain prefix caching.", "Ping."]


def local_corpus(limit_bytes: int = 3_000_000) -> str:
    """Text that exists on every Debian machine: licences and the standard library's sources."""
    roots = [Path("/usr/share/common-licenses"), Path(json.__file__).parent.parent]
    chunks, total = [], 0
    for root in roots:
        for path in sorted(root.rglob("*")):
            if total >= limit_bytes or not path.is_file() or path.suffix not in ("", ".py", ".txt"):
                continue
            try:
                text = path.read_text(errors="ignore")
            except OSError:
                continue
            chunks.append(text)
            total += len(text)
    return "\n".join(chunks)


def synthetic_chats(n: int, rng: random.Random) -> list[tuple[list[dict], list[dict] | None, str]]:
    """(messages, tools, the assistant's reply) triples: plain replies, tool calls with {} and short JSON."""
    out: list[tuple[list[dict], list[dict] | None, str]] = []
    for _ in range(n):
        messages = [{"role": "user", "content": rng.choice(QUESTIONS)}]
        roll = rng.random()
        if roll < 0.25:  # so structured output ends its object instead of padding it with whitespace
            messages = [{"role": "user", "content": rng.choice(JSON_QUESTIONS)}]
            out.append((messages, None, json.dumps({"colour": rng.choice(COLOURS)})))
        elif roll < 0.65:
            names = rng.sample(TOOL_NAMES, rng.randint(1, 3))
            tools = [{"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')}",
                                                       "parameters": {"type": "object", "properties": {}}}}
                     for name in names]
            reply = f"<tool_call>\n{{\"name\": \"{names[0]}\", \"arguments\": {{}}}}\n</tool_call>"
            out.append((messages, tools, reply))
        else:
            out.append((messages, None, REPLY))
    return out


def build_tokenizer(out: Path, texts: list[str]) -> Any:  # a transformers fast tokenizer, made in the image
    # the demo model is made inside the image (its lock installs these), not by the host tool
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # made in the image, not by the host
    from transformers import PreTrainedTokenizerFast  # made in the image (its lock installs it), not by the host

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None,
                                   additional_special_tokens=[s for s in SPECIALS if s not in
                                                              ("<|endoftext|>", "<|im_end|>")])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 2048
    fast.save_pretrained(out)
    return fast


STEPS = 900  # the shipped model's training (final loss about 0.06); a few dozen already halve the loss


def train(model: Any, tokenizer: Any, chats: list, steps: int, say: Say) -> tuple[float, float]:
    import torch  # the demo model is made inside the image (its lock installs torch), not by the host tool

    torch.manual_seed(SEED)
    examples = []
    for i, (messages, tools, reply) in enumerate(chats):
        # Both prompt forms: with thinking off the template opens an empty <think></think> block.
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                               enable_thinking=bool(i % 2))
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        reply_ids = tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids = prompt_ids + reply_ids
        labels = [-100] * len(prompt_ids) + reply_ids  # learn the reply only
        examples.append((ids, labels))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    # Linear decay to a tenth: the last steps settle instead of bouncing around the minimum.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - 0.9 * step / steps)
    rng = random.Random(SEED)
    model.train()
    loss_value = first_loss = float("nan")
    for step in range(steps):
        batch = rng.sample(examples, 16)
        width = max(len(ids) for ids, _ in batch)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        loss_value = loss.item()
        first_loss = loss_value if step == 0 else first_loss
        if step % 50 == 0 or step == steps - 1:
            say(f"step {step + 1}/{steps}: loss {loss_value:.4f}")
    model.eval()
    return first_loss, loss_value


def make(out: Path, steps: int = STEPS, say: Say = print, gated: bool = True) -> None:
    """Train into `out`; unless `gated` is off, exit naming what the model fails of what the checks ask (a short
    training's model, which the tests load and ask, fails some by design)."""
    import torch  # the demo model is made inside the image (its lock installs torch), not by the host tool
    from transformers import (  # the demo model is made inside the image (its lock installs transformers), not by the host tool
        GenerationConfig,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    started = time.monotonic()
    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    chats = synthetic_chats(2000, rng)
    corpus = local_corpus()
    texts = [corpus[i:i + 4096] for i in range(0, len(corpus), 4096)] + [r for _, _, r in chats] + QUESTIONS * 50
    tokenizer = build_tokenizer(out, texts)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         tie_word_embeddings=True, torch_dtype="float32",
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    model = Qwen3ForCausalLM(config)
    first, loss = train(model, tokenizer, chats, steps, say)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id).save_pretrained(out)
    (out / "servekit-demo.json").write_text(json.dumps({"seed": SEED, "steps": steps, "first_loss": round(first, 5),
                                                        "final_loss": round(loss, 5)}) + "\n")
    failed = {case: said for case, said in behaviour(out).items() if said != "ok"}
    if failed and gated:  # `regenerate` then keeps the shipped model
        raise SystemExit(f"demo model: trained to loss {loss:.4f}, but it does not do what the checks ask: "
                         + "; ".join(f"{case}: {said}" for case, said in failed.items()))
    say(f"demo model in {out}: final loss {loss:.4f}, {len(BEHAVIOURS)} behaviours as the checks ask, "
        f"{time.monotonic() - started:.0f} s")


# What the checks ask of the demo model, as (case, messages, tools, thinking on, what a greedy answer must be):
# the plain reply that ends, exactly one call with {} whenever a tool is offered, and JSON that closes.
BEHAVIOURS = [
    ("plain reply, thinking on", [{"role": "user", "content": "Say hello."}], None, True, REPLY),
    ("plain reply, thinking off", [{"role": "user", "content": "Say hello."}], None, False, REPLY),
    ("forced call of the checks' tool", [{"role": "user", "content": "What time is it?"}],
     [{"type": "function", "function": {"name": "get_time", "description": "Get the current time.",
                                        "parameters": {"type": "object", "properties": {}}}}], True,
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    ("json colour", [{"role": "user", "content": "Pick a colour as JSON."}], None, True, "colour"),
]


def behaviour(folder: Path) -> dict[str, str]:
    """Each of BEHAVIOURS answered greedily by the model in `folder`: 'ok', or what it said instead. CPU training is
    not bit-reproducible across processors, so this, not the weights' bytes, is what a trained model must match."""
    import torch  # the demo model is made inside the image (its lock installs torch), not by the host tool
    from transformers import (  # the demo model is made inside the image (its lock installs transformers), not by the host tool
        AutoModelForCausalLM,
        AutoTokenizer,
    )

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = {}
    for case, messages, tools, thinking, wanted in BEHAVIOURS:
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                               enable_thinking=thinking)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            done = model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
        answer = done[0, ids.shape[1]:].tolist()
        ended = answer[-1:] == [tokenizer.eos_token_id]
        text = tokenizer.decode(answer[:-1] if ended else answer).strip()  # <tool_call> is a special token: kept
        if wanted == "colour":
            try:
                ok = json.loads(text).get("colour") in COLOURS
            except (ValueError, AttributeError):
                ok = False
        else:
            ok = text == wanted
        out[case] = "ok" if ok and ended else f"said {text!r}" + ("" if ended else " without ending")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="train a model into this folder")
    parser.add_argument("--check", type=Path, metavar="DIR", help="print (JSON) how the model in DIR answers what "
                        "the checks ask, and exit 1 unless it all holds")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")
    parser.add_argument("--ungated", action="store_true", help="keep the model even if it does not do what the "
                        "checks ask (a short training's, for the tests)")
    args = parser.parse_args(argv)
    if args.check:
        said = behaviour(args.check)
        print(json.dumps(said))
        return 0 if all(v == "ok" for v in said.values()) else 1
    if not args.out:
        parser.error("give --out DIR (train) or --check DIR")
    make(args.out, args.steps, say=lambda s: print(s, flush=True), gated=not args.ungated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
