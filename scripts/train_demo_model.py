#!/usr/bin/env python3
"""Train the bundled demo model of `engine` (core/engine/demo_model/).

A ~5.8M-parameter Llama-architecture causal LM with its own 4096-token byte-level BPE
tokenizer, trained from scratch on the English fortune-cookie texts that Debian's
`fortunes` package ships (/usr/share/games/fortunes; BSD licence, see the model card).
The result is a real Hugging Face checkpoint directory (model.safetensors, config.json,
generation_config.json, tokenizer.json, tokenizer_config.json with a chat template) that
`transformers.AutoModelForCausalLM` / `AutoTokenizer` and `engine.Engine` load offline.

It is a demo: it writes readable, English-like fortune-cookie text (real words, punctuation,
"-- Author" attributions), not facts and not instruction following.

Reproducible: fixed seeds (Python `random`, `torch.manual_seed`), documents read in sorted
order, a seeded shuffle of the packed sequences, a fixed number of optimizer steps and
`torch.set_num_threads(2)`. (Float summation order can still differ across CPUs and
library versions, so bit-identical weights are only expected on the same machine/stack.)

Runtime: about 20 minutes wall time on a 2-core AVX2 CPU (float32); the measured time of
the committed run is in core/engine/demo_model/README.md. `--time-budget-minutes` is only a
safety net: if a (much slower or busy) machine hits it, training stops early, the LR
schedule still being the one planned for `--steps`, and the model card says so.

Usage (from the repository root):
    apt-get install fortunes                                   # the corpus
    .venv/bin/python scripts/train_demo_model.py               # full run -> core/engine/demo_model
    .venv/bin/python scripts/train_demo_model.py --quick       # 5-step smoke test -> /tmp
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "core", "engine", "demo_model")
QUICK_OUT = "/tmp/engine_demo_model_quick"
FORTUNES_DIR = "/usr/share/games/fortunes"
COPYRIGHT_FILE = "/usr/share/doc/fortunes/copyright"

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_TOKENS]  # ids 0..5
# each message: role marker, newline, content, </s>, newline; the generation prompt is the
# assistant marker. It starts with <s> itself, so encode its output with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
OUTPUT_FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                "README.md")
SKIP_FILES = {"ascii-art"}  # pictures, not text
# user turns of the chat view that ask for a fortune of a category (the fortune file's name)
TOPIC_PROMPTS = [
    "Tell me something about {topic}.",
    "Give me a fortune about {topic}.",
    "Do you know a quote about {topic}?",
    "Say something funny about {topic}.",
    "What do you think about {topic}?",
]
GENERIC_PROMPTS = [
    "Tell me a fortune.",
    "Give me some wisdom.",
    "Say something clever.",
    "Tell me a joke.",
    "Hello! What is my fortune today?",
    "Do you have a quote for me?",
    "What should I know?",
    "Cheer me up.",
]
TOPIC_NAMES = {
    "men-women": "men and women", "songs-poems": "songs and poems", "startrek": "Star Trek",
    "linuxcookie": "Linux", "knghtbrd": "life", "zippy": "Zippy the Pinhead", "tao": "the Tao",
    "goedel": "logic", "paradoxum": "paradoxes", "miscellaneous": "anything", "cookie": "life",
    "fortunes": "fortune", "pratchett": "Terry Pratchett", "translate-me": "language",
    "humorists": "humor", "kids": "children", "pets": "pets", "riddles": "riddles",
    "debian": "Debian", "perl": "Perl", "law": "the law", "news": "the news",
}
SAMPLE_PROMPTS = ["The meaning of life is", "A computer", "Love is", "Q: Why did the chicken"]
SAMPLE_CHAT = ["Tell me a fortune about computers.", "Give me some wisdom."]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help=f"output directory (default {DEFAULT_OUT}; "
                                               f"{QUICK_OUT} with --quick)")
    p.add_argument("--fortunes-dir", default=FORTUNES_DIR)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=560,
                   help="optimizer steps (fixed for reproducibility; chosen so that the run "
                        "takes ~20 min on 2 cores)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many steps (the LR schedule stays the one of --steps)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--chat-fraction", type=float, default=0.4,
                   help="fraction of fortunes also trained on in chat-template form")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--time-budget-minutes", type=float, default=27.0,
                   help="safety net: stop training once this much wall time has passed")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: 5 steps, small tokenizer corpus, writes {QUICK_OUT}")
    args = p.parse_args(argv)
    if args.quick:
        args.max_steps = args.max_steps or 5
        args.log_every = 1
    if args.out is None:
        args.out = QUICK_OUT if args.quick else DEFAULT_OUT
    return args


# ----------------------------------------------------------------------------------- corpus

def clean_fortune(raw: str) -> str:
    """Normalize one fortune: drop overstrike (x\\bx), expand tabs, and unwrap hard-wrapped
    prose lines (a long line followed by an unindented one), keeping the line structure of
    poems, dialogues and "-- Author" attributions."""
    raw = re.sub(r".\x08", "", raw).replace("\r", "")
    out: list[str] = []
    prev_long = False
    for line in raw.split("\n"):
        expanded = line.expandtabs(8)
        indented = expanded[:1] == " "
        text = re.sub(r"\s+", " ", expanded).strip()
        if not text:
            if out and out[-1] != "":
                out.append("")
            prev_long = False
            continue
        if out and out[-1] and prev_long and not indented and not text.startswith("--"):
            out[-1] += " " + text
        else:
            out.append(text)
        prev_long = len(expanded.rstrip()) >= 55
    return "\n".join(out).strip()


def looks_like_text(doc: str) -> bool:
    chars = [c for c in doc if not c.isspace()]
    if not (10 <= len(doc) <= 2000) or not chars:
        return False
    letters = sum(c.isalpha() for c in chars)
    return letters / len(chars) >= 0.7


def load_fortunes(directory: str) -> list[tuple[str, str]]:
    """[(category, fortune)] from every fortune file (no extension: `.dat` are indexes and
    `.u8` duplicates), in sorted file order, deduplicated."""
    if not os.path.isdir(directory):
        sys.exit(f"error: the corpus directory {directory} does not exist.\n"
                 f"Install Debian's fortunes data first:  sudo apt-get install fortunes")
    docs, seen = [], set()
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if "." in name or name in SKIP_FILES or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read().decode("utf-8", errors="replace")
        for raw in re.split(r"^%[ \t]*$", data, flags=re.M):
            doc = clean_fortune(raw)
            if looks_like_text(doc) and doc not in seen:
                seen.add(doc)
                docs.append((name, doc))
    if not docs:
        sys.exit(f"error: no fortunes found in {directory}; reinstall them with "
                 f"`sudo apt-get install --reinstall fortunes`")
    return docs


def split_first_sentence(doc: str) -> tuple[str, str] | None:
    """(first line or sentence, rest) for the chat view, or None when it doesn't split well."""
    m = re.match(r"(.{12,160}?[.?!:])\s+(\S.*)", doc, flags=re.S)
    if m and "\n" not in m.group(1):
        first, rest = m.group(1), m.group(2)
    elif "\n" in doc:
        first, rest = doc.split("\n", 1)
    else:
        return None
    first, rest = first.strip(), rest.strip()
    if len(first) < 8 or len(rest) < 12 or rest.startswith("--"):
        return None
    return first, rest


def chat_messages(category: str, doc: str, rng: random.Random) -> list[dict]:
    r = rng.random()
    if r < 0.5:
        split = split_first_sentence(doc)
        if split:
            return [{"role": "user", "content": split[0]},
                    {"role": "assistant", "content": split[1]}]
    if r < 0.8:
        topic = TOPIC_NAMES.get(category, category)
        user = rng.choice(TOPIC_PROMPTS).format(topic=topic)
    else:
        user = rng.choice(GENERIC_PROMPTS)
    return [{"role": "user", "content": user}, {"role": "assistant", "content": doc}]


# -------------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: list[str], vocab_size: int, out_dir: str, model_max_length: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    # plain text is encoded as "<s> text" (what the model was trained on)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "additional_special_tokens": ROLE_TOKENS,
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                   "additional_special_tokens": ROLE_TOKENS}, f, indent=2)
        f.write("\n")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out_dir)


# ------------------------------------------------------------------------------------ model

def lr_at(step: int, args) -> float:
    """Linear warmup to --lr, then cosine decay to --lr * --min-lr-ratio at --steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    ratio = args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * ratio


def pack(streams: list[list[int]], seq_len: int):
    import torch

    flat = [t for s in streams for t in s]
    n = len(flat) // seq_len
    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


def generate_samples(model, tok, args) -> list[dict]:
    import torch

    model.eval()
    samples = []
    with torch.no_grad():
        for i, prompt in enumerate(SAMPLE_PROMPTS):
            ids = tok(prompt, return_tensors="pt").input_ids
            for mode in ("greedy", "sampled"):
                torch.manual_seed(args.seed + i)
                kw = (dict(do_sample=False) if mode == "greedy"
                      else dict(do_sample=True, temperature=0.8, top_p=0.95))
                out = model.generate(ids, max_new_tokens=60, pad_token_id=tok.pad_token_id,
                                     eos_token_id=tok.eos_token_id, **kw)
                text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
                samples.append({"kind": "completion", "prompt": prompt, "mode": mode,
                                "params": kw, "seed": args.seed + i, "text": text})
        for i, user in enumerate(SAMPLE_CHAT):
            ids = tok.apply_chat_template([{"role": "user", "content": user}],
                                          add_generation_prompt=True, tokenize=False)
            ids = tok(ids, add_special_tokens=False, return_tensors="pt").input_ids
            torch.manual_seed(args.seed + 100 + i)
            kw = dict(do_sample=True, temperature=0.8, top_p=0.95)
            out = model.generate(ids, max_new_tokens=80, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id, **kw)
            text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            samples.append({"kind": "chat", "prompt": user, "mode": "sampled", "params": kw,
                            "seed": args.seed + 100 + i, "text": text})
    return samples


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    # OpenMP threads that sleep instead of spinning: on a shared CPU, spinning workers make
    # every op wait for a descheduled thread (measured 3-5x slower steps under load).
    # libgomp reads it when torch is imported.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    # ---- corpus
    docs = load_fortunes(args.fortunes_dir)
    rng = random.Random(args.seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    n_val = max(1, len(docs) // 100)
    val_docs = [docs[i] for i in sorted(order[:n_val])]
    train_docs = [docs[i] for i in sorted(order[n_val:])]
    n_chars = sum(len(d) for _, d in docs)
    print(f"corpus: {len(docs)} fortunes ({n_chars / 1e6:.2f}M chars) from {args.fortunes_dir}; "
          f"{len(train_docs)} train / {len(val_docs)} validation", flush=True)

    # ---- tokenizer (staged in the output dir; the model files join it at the end)
    for name in OUTPUT_FILES:  # start clean (only the files this script writes)
        path = os.path.join(args.out, name)
        if os.path.isfile(path):
            os.remove(path)
    tok_texts = [d for _, d in train_docs]
    if args.quick:
        tok_texts = tok_texts[:2000]
    tok = train_tokenizer(tok_texts, args.vocab_size, args.out, model_max_length=512)
    print(f"tokenizer: {len(tok)} tokens, trained in {time.time() - t0:.1f}s", flush=True)

    # ---- token streams: every fortune as "<s> text </s>", some also in chat form
    bos, eos = tok.bos_token_id, tok.eos_token_id

    def plain(doc):
        return [bos, *tok(doc, add_special_tokens=False).input_ids, eos]

    def chat(msgs):
        text = tok.apply_chat_template(msgs, tokenize=False)
        return tok(text, add_special_tokens=False).input_ids

    chat_rng = random.Random(args.seed + 1)
    streams, n_chat, n_plain_tokens = [], 0, 0
    for category, doc in train_docs:
        streams.append(plain(doc))
        n_plain_tokens += len(streams[-1])
        if chat_rng.random() < args.chat_fraction:
            streams.append(chat(chat_messages(category, doc, chat_rng)))
            n_chat += 1
    random.Random(args.seed + 2).shuffle(streams)  # mix plain and chat documents
    data = pack(streams, args.seq_len)
    val = pack([plain(d) for _, d in val_docs], args.seq_len)
    n_train_tokens = data.numel()
    print(f"tokens: {n_plain_tokens} plain-text + chat view of {n_chat} fortunes = "
          f"{n_train_tokens} training tokens ({len(data)} sequences of {args.seq_len}); "
          f"{val.numel()} validation tokens; {n_chars / n_plain_tokens:.2f} chars/token",
          flush=True)

    # ---- model
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_theta=10000.0, initializer_range=0.02, tie_word_embeddings=True,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: LlamaForCausalLM, {n_params:,} parameters "
          f"(hidden {args.hidden_size}, {args.layers} layers, {args.heads} heads / "
          f"{args.kv_heads} kv heads, intermediate {args.intermediate_size})", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    steps = args.steps if args.max_steps is None else min(args.steps, args.max_steps)
    tokens_per_step = args.batch_size * args.seq_len
    print(f"training: {steps} steps x {args.batch_size} x {args.seq_len} tokens "
          f"({steps * tokens_per_step / n_train_tokens:.2f} epochs), AdamW lr {args.lr} "
          f"warmup {args.warmup} cosine to {args.lr * args.min_lr_ratio:g}, "
          f"{torch.get_num_threads()} threads", flush=True)

    gen = torch.Generator().manual_seed(args.seed + 3)
    perm, pos = torch.randperm(len(data), generator=gen), 0
    model.train()
    t_train = time.time()
    loss_ema, done, stopped_early = None, 0, False
    losses = []
    for step in range(steps):
        if pos + args.batch_size > len(perm):  # new epoch: a fresh seeded shuffle
            perm, pos = torch.randperm(len(data), generator=gen), 0
        batch = data[perm[pos: pos + args.batch_size]]
        pos += args.batch_size
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done = step + 1
        value = loss.item()
        losses.append(value)
        loss_ema = value if loss_ema is None else 0.9 * loss_ema + 0.1 * value
        elapsed = time.time() - t0
        if done % args.log_every == 0 or done == steps:
            tps = done * tokens_per_step / (time.time() - t_train)
            print(f"step {done:5d}/{steps}  loss {value:.3f} (ema {loss_ema:.3f})  "
                  f"lr {lr_at(step, args):.2e}  {tps:,.0f} tok/s  elapsed {elapsed / 60:.1f} min",
                  flush=True)
        if elapsed > args.time_budget_minutes * 60 and done < steps:
            stopped_early = True
            print(f"time budget of {args.time_budget_minutes} min reached: stopping after "
                  f"{done}/{steps} steps (result is NOT the reproducible one)", flush=True)
            break
    train_time = time.time() - t_train
    final_loss = sum(losses[-20:]) / len(losses[-20:])

    # ---- validation loss
    model.eval()
    with torch.no_grad():
        vl = [model(input_ids=val[i: i + 8], labels=val[i: i + 8]).loss.item()
              for i in range(0, len(val), 8)] if len(val) else [float("nan")]
    val_loss = sum(vl) / len(vl)
    print(f"final train loss (mean of last {len(losses[-20:])} steps) {final_loss:.3f}; "
          f"validation loss {val_loss:.3f} (perplexity {math.exp(val_loss):.1f})", flush=True)

    # ---- save
    model.generation_config.bos_token_id = bos
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(args.out, safe_serialization=True)
    os.chmod(os.path.join(args.out, "model.safetensors"), 0o644)

    samples = generate_samples(model, tok, args)
    wall = time.time() - t0
    for s in samples:
        print(f"--- [{s['kind']}, {s['mode']}] {s['prompt']!r} {s['params']}\n{s['text']}\n",
              flush=True)
    stats = dict(n_docs=len(docs), n_train_docs=len(train_docs), n_val_docs=len(val_docs),
                 n_chars=n_chars, n_plain_tokens=n_plain_tokens, n_chat=n_chat,
                 n_train_tokens=n_train_tokens, n_params=n_params, steps=done,
                 planned_steps=args.steps, stopped_early=stopped_early,
                 final_loss=final_loss, val_loss=val_loss, train_time=train_time, wall=wall,
                 tokens_per_step=tokens_per_step)
    write_model_card(args, stats, samples, argv)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"saved to {args.out} ({size / 1e6:.1f} MB)", flush=True)
    print(f"wall time {wall / 60:.1f} min (training {train_time / 60:.1f} min, "
          f"{done * tokens_per_step / train_time:,.0f} tok/s)", flush=True)


def licence_summary() -> str:
    return (
        "The fortune files are distributed with the BSD fortune program (fortune-mod, "
        "Debian source package `fortune-mod`, binary package `fortunes`). "
        "`/usr/share/doc/fortunes/copyright` states that the program \"falls under the BSD "
        "copyright\": Copyright (c) 1991 The Regents of the University of California, "
        "BSD licence with the advertising clause deleted (i.e. 3-clause BSD: redistribution "
        "in source and binary form is allowed if the copyright notice, the conditions and "
        "the disclaimer are retained, and the University's name is not used to endorse "
        "derived products; no warranty). The file also credits the collection's authors "
        "(Ken Arnold; the `cookie` file from Karl Lehenbauer's alt.sources postings; "
        "Amy A. Lewis and others) and carries a notice for the atheism cookie file "
        "(Wayne Aiken). Individual fortunes are short quotations attributed to their "
        "authors in the text itself.")


def write_model_card(args, st, samples, argv):
    cmd_args = sys.argv[1:] if argv is None else list(argv)
    command = " ".join([".venv/bin/python scripts/train_demo_model.py", *cmd_args])
    version = "unknown"
    try:
        import subprocess

        version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "fortunes"],
                                 capture_output=True, text=True, timeout=10).stdout or version
    except Exception:  # noqa: BLE001 - not Debian: leave it unknown
        pass
    sample_md = []
    for s in samples:
        params = ", ".join(f"{k}={v}" for k, v in s["params"].items())
        head = ("Prompt" if s["kind"] == "completion" else "Chat, user message")
        seed = f"; `torch.manual_seed({s['seed']})`" if s["mode"] == "sampled" else ""
        sample_md.append(f"**{head}:** `{s['prompt']}` ({s['mode']}; {params}{seed}; "
                         f"`transformers` `generate`)\n\n```\n{s['text'].strip()}\n```\n")
    early = (f"\n**Note:** this run hit `--time-budget-minutes` and stopped after {st['steps']} "
             f"of {st['planned_steps']} steps.\n" if st["stopped_early"] else "")
    head_dim = args.hidden_size // args.heads
    card = f"""---
license: bsd-3-clause
language: en
library_name: transformers
pipeline_tag: text-generation
tags: [llama, demo, tiny]
---

# engine demo model: a tiny Llama trained on fortune cookies

The default model of the `engine` CLI: a {st['n_params'] / 1e6:.1f}M-parameter
`LlamaForCausalLM` with its own {args.vocab_size}-token byte-level BPE tokenizer, trained from
scratch on a CPU in about {st['wall'] / 60:.0f} minutes. It exists so that `engine` runs out of
the box, offline, on any machine, and produces readable English-like text (fortune-cookie
quotes, jokes and "-- Author" lines). It knows nothing useful: do not rely on what it says.

## Architecture

| | |
|---|---|
| architecture | `LlamaForCausalLM` (RMSNorm, RoPE, SwiGLU, grouped-query attention) |
| parameters | {st['n_params']:,} (word embeddings tied with the LM head) |
| hidden size / layers | {args.hidden_size} / {args.layers} |
| attention heads / KV heads | {args.heads} / {args.kv_heads} (head dim {head_dim}) |
| MLP intermediate size | {args.intermediate_size} |
| vocabulary | {args.vocab_size} (byte-level BPE, `tokenizers`) |
| context | 512 positions (trained on {args.seq_len}-token sequences) |
| weights | float32 safetensors |

Special tokens: `<s>` (0, BOS), `</s>` (1, EOS), `<pad>` (2), `<|system|>`, `<|user|>`,
`<|assistant|>`. The tokenizer prepends `<s>` to plain text. Chat template (each message is
its role marker, a newline, the content and `</s>`; the generation prompt is `<|assistant|>`):

```jinja
{CHAT_TEMPLATE}
```

## Training data

- Source: Debian's `fortunes` package (version {version}; source package `fortune-mod`),
  the text files in `/usr/share/games/fortunes/` (every file without an extension; `.dat`
  indexes and `.u8` duplicates skipped, `ascii-art` skipped). Install with
  `apt-get install fortunes`.
- Licence: {licence_summary()}
- Preprocessing: fortunes split at `%` lines, overstrike removed, tabs/whitespace normalized,
  hard-wrapped prose lines rejoined; fortunes under 10 or over 2000 characters or under 70%
  letters dropped; exact duplicates removed. {st['n_docs']:,} fortunes
  ({st['n_chars'] / 1e6:.2f}M characters), of which {st['n_val_docs']} were held out for
  validation.
- Each training fortune is one document `<s> text </s>` ({st['n_plain_tokens']:,} tokens).
  In addition, {st['n_chat']:,} fortunes ({args.chat_fraction:.0%}) appear once more as a chat,
  rendered with the chat template: either the first sentence/line as the user turn and the
  rest as the assistant turn, or a request such as "Give me a fortune about computers." (the
  fortune file's name) answered with the fortune. Documents are shuffled (seeded) and packed
  into {args.seq_len}-token sequences: {st['n_train_tokens']:,} training tokens.

## Training

- Command (repository root): `{command}`
- Seed {args.seed} (Python `random`, `torch.manual_seed`), deterministic data order,
  {args.threads} CPU threads, float32.
- {st['steps']} steps of {args.batch_size} x {args.seq_len} tokens
  ({st['steps'] * st['tokens_per_step'] / st['n_train_tokens']:.2f} epochs), AdamW
  (betas 0.9/0.95, weight decay {args.weight_decay}, gradient clipping 1.0), peak LR {args.lr},
  {args.warmup} warmup steps, cosine decay to {args.lr * args.min_lr_ratio:g}.
- Final training loss (mean of the last 20 steps): {st['final_loss']:.3f};
  held-out validation loss {st['val_loss']:.3f} (perplexity {math.exp(st['val_loss']):.1f}).
- Measured wall time of the whole script (tokenizer, training, saving, samples):
  {st['wall'] / 60:.1f} minutes (training {st['train_time'] / 60:.1f} min) on a shared 2-core
  AVX2 x86-64 CPU, PyTorch {__import__('torch').__version__}, transformers
  {__import__('transformers').__version__}.
{early}
## Samples

Generated at the end of the training run:

{chr(10).join(sample_md)}
## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("core/engine/demo_model")
model = AutoModelForCausalLM.from_pretrained("core/engine/demo_model")
ids = tok("The meaning of life is", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=40, do_sample=True, temperature=0.8)[0]))
```

or with `engine`: `Engine("core/engine/demo_model").generate("The meaning of life is", ...)`.

## Limitations

A toy: tiny, trained for minutes on ~{st['n_plain_tokens'] / 1e6:.1f}M tokens of quotations. Its
text is grammatical-looking but mostly nonsense; it follows no instructions beyond answering
a chat turn with something fortune-like. The fortunes collection is old (1970s-2000s) and
contains humour some readers will find dated or offensive; the model may reproduce it.
"""
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(card)


if __name__ == "__main__":
    main()
