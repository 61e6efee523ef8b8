"""How much a cheaper weight format (``--dtype float16`` on a CPU, ``--quantization w8a8_int8``)
changes a model: perplexity on a fixed English text, next-token agreement with float32 over it,
and greedy agreement on a few prompts (benchmarks/weight_quality.py prints them; tests bound
them on SmolLM2). ``prefill_logits`` scores prompts: their logits from one extend batch."""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch

TEXT = (
    "The river starts high in the mountains, where snow melts in the spring and runs down "
    "through narrow valleys. In the summer the water is cold and clear, and children from the "
    "villages swim in the deep pools below the waterfalls. Farther down, the valley opens into "
    "wide fields of wheat and barley, and the river slows as it passes the old stone bridge "
    "that was built more than three hundred years ago. Travelers used to stop at the inn beside "
    "the bridge to rest their horses and eat bread, cheese and soup before the long road to the "
    "city. Today the inn is a small museum, and its rooms hold maps, letters and tools that tell "
    "the story of the people who lived and worked along the river. Every autumn the town holds a "
    "market on the square, where farmers sell apples, honey and fresh vegetables, and musicians "
    "play until late in the evening. When winter comes, the fields are covered with snow, the "
    "river freezes at its edges, and the valley grows quiet until the spring returns. "
    "A computer program is a list of instructions that tells a machine what to do. The first "
    "programs were written by hand as numbers, one instruction at a time, and a single mistake "
    "could take days to find. Later, people invented languages that read more like English, and "
    "special programs called compilers translated them into the numbers the machine "
    "understands. Today a programmer writes functions that take inputs and return outputs, "
    "groups them into modules, and tests each part before putting the whole system together. "
    "Good programs are easy to read, because the next person to change them may be someone "
    "else, or the same person a year later who has forgotten every detail.")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colors are", "Water boils at", "A good breakfast includes"]
GREEDY_TOKENS = 32


def prefill_logits(runner, prompts: list[list[int]], return_all_logits: bool = False):
    """Logits of one EXTEND batch over ``prompts`` (at each last token, or at every token);
    frees what it allocated. Needs ``runner.init_kv_pool`` first."""
    pool = runner.kv_pool
    rows = [pool.alloc_req() for _ in prompts]
    locs = torch.cat([pool.extend_slots(r, 0, len(p)) for r, p in zip(rows, prompts)])
    batch = ForwardBatch.build(prompts, [0] * len(prompts), rows, locs, pool.req_to_token,
                               device=pool.req_to_token.device)
    logits = runner.forward(batch, return_all_logits)
    for row, prompt in zip(rows, prompts):
        pool.free_request(row, len(prompt))
    return logits


def evaluate(engine, ids: list[int]) -> tuple[torch.Tensor, float]:
    """Next-token logits [T - 1, V] over ``ids`` (one prefill) and the perplexity of ``ids``."""
    logits = prefill_logits(engine.runner, [ids], return_all_logits=True)  # [T, V]
    logp = logits[:-1].log_softmax(-1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()
    return logits[:-1], float(nll.exp())


def greedy(engine) -> list[list[int]]:
    out = engine.generate(PROMPTS, {"max_new_tokens": GREEDY_TOKENS, "temperature": 0.0,
                                     "ignore_eos": True})
    return [o["output_ids"] for o in out]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
