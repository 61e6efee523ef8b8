"""The benchmark workloads, as SGLang's bench_serving names them: ``random`` (length ranges),
``generated-shared-prefix`` (groups of prompts behind one system prompt), ``sharegpt`` (a local
file in ShareGPT's format), ``trace`` (a recorded JSONL of arrivals and lengths, the format
``engine serve --record-trace`` writes) and ``multi-turn`` (conversations whose every turn
appends to the last: what HiCache is for).

Synthetic prompts are random token ids of the tokenizer's non-special vocabulary, sent as token
ids so every prompt has exactly its length (SGLang decodes them to text, which re-encodes to
about that many). Arrival times: the trace's own, else Poisson at ``request_rate`` (inf: all at
once), seeded.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass

from engine.errors import EngineError

DATASETS = ("random", "generated-shared-prefix", "sharegpt", "trace", "multi-turn")
ALIASES = {"shared-prefix": "generated-shared-prefix"}
# SGLang's pruning of ShareGPT conversations
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 2, 1024, 2048


@dataclass
class BenchRequest:
    prompt: str | list[int]  # token ids (synthetic) or text (sharegpt)
    input_len: int
    output_len: int
    arrival: float = 0.0  # seconds after the start of the run
    group: int | None = None  # shared-prefix group


@dataclass
class Workload:
    """What to send: SGLang's dataset flags. ``build(tokenizer)`` makes the requests."""

    dataset_name: str = "random"
    num_prompts: int = 100
    random_input_len: int = 256
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    gsp_num_groups: int = 8
    gsp_prompts_per_group: int = 8
    gsp_system_prompt_len: int = 256
    gsp_question_len: int = 32
    gsp_output_len: int = 64
    mt_num_conversations: int = 8
    mt_num_turns: int = 4
    mt_turn_len: int = 128
    mt_output_len: int = 64
    dataset_path: str | None = None
    request_rate: float = math.inf
    seed: int = 1
    # synthetic prompts as text (SGLang's way: random ids decoded, re-encoded and trimmed or
    # padded to the length) instead of ids: for servers that take no token-id prompts
    text_prompts: bool = False

    def validate(self) -> "Workload":
        self.dataset_name = ALIASES.get(self.dataset_name, self.dataset_name)
        if self.dataset_name not in DATASETS:
            raise EngineError(f"unknown --dataset-name {self.dataset_name!r}; choose one of "
                              f"{', '.join(DATASETS)}.")
        if self.dataset_name in ("sharegpt", "trace") and not self.dataset_path:
            raise EngineError(f"--dataset-name {self.dataset_name} reads --dataset-path FILE; "
                              f"give one.")
        if self.dataset_name == "trace" and self.request_rate != math.inf:
            raise EngineError("--request-rate does not apply to --dataset-name trace: it "
                              "replays the trace's own arrival times; drop --request-rate.")
        if not 0.0 <= self.random_range_ratio <= 1.0:
            raise EngineError(f"--random-range-ratio {self.random_range_ratio}: give a value "
                              f"in [0, 1] (the shortest length as a share of the longest).")
        if self.request_rate <= 0:
            raise EngineError(f"--request-rate {self.request_rate}: give requests per second "
                              f"> 0, or inf to send every request at once.")
        for name in ("num_prompts", "random_input_len", "random_output_len", "gsp_num_groups",
                     "gsp_prompts_per_group", "gsp_question_len", "gsp_output_len"):
            if getattr(self, name) < 1:
                raise EngineError(f"--{name.replace('_', '-')} {getattr(self, name)}: give 1 "
                                  f"or more.")
        if self.gsp_system_prompt_len < 0:
            raise EngineError("--gsp-system-prompt-len: give 0 or more.")
        return self

    def build(self, tokenizer) -> list[BenchRequest]:
        self.validate()
        rng = random.Random(self.seed)
        vocab = token_pool(tokenizer)
        if self.dataset_name == "random":
            reqs = random_requests(vocab, self.num_prompts, self.random_input_len,
                                   self.random_output_len, self.random_range_ratio, rng)
        elif self.dataset_name == "generated-shared-prefix":
            reqs = shared_prefix_requests(vocab, self.gsp_num_groups, self.gsp_prompts_per_group,
                                          self.gsp_system_prompt_len, self.gsp_question_len,
                                          self.gsp_output_len, rng)
        elif self.dataset_name == "multi-turn":
            reqs = multi_turn_requests(vocab, self.mt_num_conversations, self.mt_num_turns,
                                       self.mt_turn_len, self.mt_output_len, rng)
        elif self.dataset_name == "sharegpt":
            reqs = sharegpt_requests(self.dataset_path, self.num_prompts, tokenizer, rng)
        else:
            reqs = trace_requests(self.dataset_path, vocab, rng)
        if self.text_prompts:
            for r in reqs:
                if not isinstance(r.prompt, str):
                    r.prompt = as_text(tokenizer, r.prompt, vocab, rng)
        if self.dataset_name == "trace":
            return reqs
        for r, t in zip(reqs, poisson_arrivals(len(reqs), self.request_rate, self.seed)):
            r.arrival = t
        return reqs


def as_text(tokenizer, ids: list[int], vocab: list[int], rng: random.Random) -> str:
    """``ids`` as text that encodes to as many tokens (decoding and encoding again changes the
    count a little: trimmed or padded with more random tokens)."""
    n = len(ids)
    ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:n]
    while len(ids) < n:
        ids.append(rng.choice(vocab))
    return tokenizer.decode(ids)


def token_pool(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def _lengths(rng: random.Random, n: int, longest: int, ratio: float) -> list[int]:
    lo = max(1, int(longest * ratio))
    return [rng.randint(lo, longest) for _ in range(n)]


def random_requests(vocab: list[int], n: int, input_len: int, output_len: int,
                    range_ratio: float, rng: random.Random) -> list[BenchRequest]:
    """Input lengths in [input_len * range_ratio, input_len], output likewise (SGLang's)."""
    ins = _lengths(rng, n, input_len, range_ratio)
    outs = _lengths(rng, n, output_len, range_ratio)
    return [BenchRequest([rng.choice(vocab) for _ in range(i)], i, o) for i, o in zip(ins, outs)]


def shared_prefix_requests(vocab: list[int], groups: int, per_group: int, system_len: int,
                           question_len: int, output_len: int,
                           rng: random.Random) -> list[BenchRequest]:
    """``groups`` system prompts of ``system_len`` tokens, each followed by ``per_group``
    questions of ``question_len`` tokens: what a prefix cache is for. Group-major order."""
    out = []
    for g in range(groups):
        system = [rng.choice(vocab) for _ in range(system_len)]
        for _ in range(per_group):
            ids = system + [rng.choice(vocab) for _ in range(question_len)]
            out.append(BenchRequest(ids, len(ids), output_len, group=g))
    return out


def multi_turn_requests(vocab: list[int], conversations: int, turns: int, turn_len: int,
                        output_len: int, rng: random.Random) -> list[BenchRequest]:
    """``conversations`` x ``turns`` requests: turn t's prompt is turn t-1's prompt, an answer
    of ``output_len`` tokens (random ids standing for the model's: every prompt is known up
    front) and ``turn_len`` new tokens. Turn-major order (every conversation's first turn, then
    every second turn, ...), so with --max-concurrency up to the number of conversations a turn
    is sent after the earlier turns of its conversation were."""
    history = [[] for _ in range(conversations)]
    out = []
    for t in range(turns):
        for c in range(conversations):
            if t:
                history[c] += [rng.choice(vocab) for _ in range(output_len)]
            history[c] += [rng.choice(vocab) for _ in range(turn_len)]
            out.append(BenchRequest(list(history[c]), len(history[c]), output_len, group=c))
    return out


def sharegpt_requests(path: str, n: int, tokenizer, rng: random.Random) -> list[BenchRequest]:
    """The first human turn as the prompt, the first gpt turn's token count as the output
    length; SGLang's pruning (prompt or output under 2 tokens, prompt over 1024, both over
    2048); conversations shuffled with the seed, the first ``n`` that fit kept."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise EngineError(f"--dataset-path {path}: cannot read it as ShareGPT JSON ({e}).")
    if not isinstance(data, list):
        raise EngineError(f"--dataset-path {path}: ShareGPT's format is a JSON list of "
                          f"{{\"conversations\": [{{\"from\": \"human\", \"value\": ...}}, ...]}}.")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            continue
        human = next((t.get("value") for t in turns if isinstance(t, dict)
                      and t.get("from") == "human"), None)
        gpt = next((t.get("value") for t in turns if isinstance(t, dict)
                    and t.get("from") == "gpt"), None)
        if isinstance(human, str) and isinstance(gpt, str):
            pairs.append((human, gpt))
    rng.shuffle(pairs)
    out = []
    for human, gpt in pairs:
        if len(out) == n:
            break
        i, o = len(tokenizer.encode(human)), len(tokenizer.encode(gpt, add_special_tokens=False))
        if min(i, o) < SHAREGPT_MIN_LEN or i > SHAREGPT_MAX_PROMPT or i + o > SHAREGPT_MAX_TOTAL:
            continue
        out.append(BenchRequest(human, i, o))
    if len(out) < n:
        raise EngineError(f"--dataset-path {path}: only {len(out)} conversations fit (a human "
                          f"turn then a gpt turn, each at least {SHAREGPT_MIN_LEN} tokens, "
                          f"prompt at most {SHAREGPT_MAX_PROMPT}, both at most "
                          f"{SHAREGPT_MAX_TOTAL}); lower --num-prompts to {len(out)} or less.")
    return out


def read_trace(path: str) -> list[tuple[float, int, int]]:
    """(timestamp, input_len, output_len) per line of a JSONL trace, sorted by timestamp."""
    rows = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise EngineError(f"--dataset-path {path}: cannot read the trace ({e}).")
    with f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ts, i, o = row["timestamp"], row["input_len"], row["output_len"]
            except (json.JSONDecodeError, TypeError, KeyError) as e:
                raise EngineError(f"{path}:{no}: a trace line is {{\"timestamp\": seconds, "
                                  f"\"input_len\": n, \"output_len\": m}} ({type(e).__name__}: "
                                  f"{e}).")
            if not (isinstance(ts, (int, float)) and ts >= 0 and isinstance(i, int) and i >= 1
                    and isinstance(o, int) and o >= 1):
                raise EngineError(f"{path}:{no}: timestamp must be seconds >= 0 and input_len, "
                                  f"output_len integers >= 1; got {line.strip()}.")
            rows.append((float(ts), i, o))
    if not rows:
        raise EngineError(f"--dataset-path {path}: the trace has no requests.")
    return sorted(rows)


def trace_requests(path: str, vocab: list[int], rng: random.Random) -> list[BenchRequest]:
    """The trace replayed from its first arrival: random prompts of the recorded lengths."""
    rows = read_trace(path)
    t0 = rows[0][0]
    return [BenchRequest([rng.choice(vocab) for _ in range(i)], i, o, arrival=ts - t0)
            for ts, i, o in rows]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times of ``n`` requests: exponential gaps of mean 1/rate (SGLang's), the first
    at 0; all at 0 for rate inf."""
    if rate == math.inf:
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def load_tokenizer(source: str | None):
    """The tokenizer of an HF directory (or tokenizer directory) or a GGUF; the default
    model's when ``source`` is None."""
    from engine.models.checkpoint import load_tokenizer_dir, open_checkpoint
    from engine.models.default import default_model_path

    if source and os.path.isdir(source) and not any(f.endswith(".gguf")
                                                    for f in os.listdir(source)):
        return load_tokenizer_dir(source)
    return open_checkpoint(source or default_model_path()).load_tokenizer()
