"""A minimal greedy loop over a ModelRunner, and its agreement with Hugging Face transformers'."""

from __future__ import annotations

import torch

from engine_testing.graphs import EagerGraph


def free_requests(pool, rows: list[int], lens: list[int]) -> None:
    """Free request ``rows`` of ``pool`` holding ``lens`` tokens each."""
    for r, n in zip(rows, lens):
        pool.free_request(r, n)


def greedy_generate(runner, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Prefill all prompts in one EXTEND batch, then decode them together; ignores EOS.
    Needs ``runner.init_kv_pool`` first; frees everything it allocated."""
    from engine.forward_batch import ForwardBatch

    pool = runner.kv_pool
    rows = [pool.alloc_req() for _ in prompts]
    assert None not in rows, "not enough request rows"
    lens = [0] * len(prompts)
    new = [list(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        locs = [pool.extend_slots(r, n, len(x)) for r, n, x in zip(rows, lens, new)]
        assert all(loc is not None for loc in locs), "KV pool too small"
        batch = ForwardBatch.build(new, lens, rows, torch.cat(locs), pool.req_to_token,
                                   device=pool.device)
        next_ids = runner.forward(batch).argmax(-1).tolist()
        lens = [n + len(x) for n, x in zip(lens, new)]
        for out, t in zip(outs, next_ids):
            out.append(t)
        new = [[t] for t in next_ids]
    free_requests(pool, rows, lens)
    return outs


ZEN = ("Now is better than never.", "Flat is better", "Errors should never pass")


def greedy_matches_hf(path: str, registries, attention_factory, cuda_graph: bool = False,
                      device=None, max_new_tokens: int = 12):
    """Greedy decoding of the tiny checkpoint ``path`` through ``attention_factory`` equals HF
    transformers' (float32, eager attention) for three prompts prefilled together, page size
    16. With ``cuda_graph`` every decode step replays the graph runner's size-4 graph (one row
    padding): a real CUDA graph on a CUDA ``device``, else the EagerGraph stand-in. Returns the
    runner."""
    import transformers
    from engine.device import DeviceInfo
    from engine.runner import ModelRunner

    device = device or DeviceInfo("cpu", "CPU")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompts = [tok(t).input_ids for t in ZEN]
    runner = ModelRunner(path, registries=registries, device=device, dtype="float32",
                         attention_factory=attention_factory)
    runner.init_kv_pool(1024, page_size=16)
    if cuda_graph:
        runner.init_cuda_graphs([1, 2, 4], graph_cls=None if device.is_cuda else EagerGraph)
    ours = greedy_generate(runner, prompts, max_new_tokens)
    for p, out in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=2)
        assert out == ref[0, len(p):].tolist()
    if cuda_graph:
        assert runner.cuda_graphs.replays == max_new_tokens - 1 and runner.last_cuda_graph
    return runner


def run_requests(engine, prompts, params, every_step=None, max_steps: int = 3000) -> list:
    """Add ``prompts`` (``params``: one dict for all, or one each) to ``engine`` and step it
    until they finish (``every_step(engine)`` after each step); returns per request its output
    ids, finish reason and output logprobs rounded to 3 places: what two runs compare."""
    reqs = []
    for i, p in enumerate(prompts):
        reqs += engine.add_request(p, params[i] if isinstance(params, list) else params)
    for _ in range(max_steps):
        if all(r.finished for r in reqs):
            break
        engine.step()
        if every_step:
            every_step(engine)
    return [(r.output_ids, r.finish_reason, [round(x, 3) for x in r.output_logprobs])
            for r in reqs]


def verify_every_draft(engine):
    """Speculative decoding with the policy's choice taken out: every draft proposed is
    verified (tests of the verify path want drafts, whatever they would cost)."""
    engine.scheduler.spec.policy.lengths = lambda reqs, drafts: [len(d.tokens) for d in drafts]
    return engine


def record_proposals(drafter) -> list:
    """Wrap ``drafter.propose`` to keep every proposal: a list of (the request's sequence,
    its Draft), filled as the engine runs."""
    proposals, propose = [], drafter.propose

    def recording(reqs, max_tokens):
        out = propose(reqs, max_tokens)
        proposals.extend((r.prompt_ids + r.output_ids, d) for r, d in zip(reqs, out))
        return out

    drafter.propose = recording
    return proposals
