"""The whole engine on a CUDA GPU against HF transformers: greedy tokens equal, with and without
CUDA graphs, for the backends that run float32 (triton, torch_native); HiCache with its storage
tier (the copy stream) and tree drafts give the tokens of the plain engine. Skipped without a
GPU (the same bodies pass on a CPU with torch_native)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TEXTS = ["Beautiful is better than ugly.", "Simple is better", "In the face of ambiguity,"]


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
@pytest.mark.parametrize("graphs", [False, True])
def test_engine_on_cuda_equals_hf_greedy(tiny_model_factory, backend, graphs):
    import transformers

    from engine import Engine

    if backend == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    path = tiny_model_factory("qwen2_bias_window")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval().cuda()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    engine = Engine(path, device="cuda", dtype="float32", attention_backend=backend,
                    disable_cuda_graph=not graphs, cuda_graph_max_bs=4, max_total_tokens=4096)
    assert (engine.runner.cuda_graphs is not None) == (graphs and backend == "triton")
    prompts = [tok(t).input_ids for t in TEXTS]
    outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16,
                                                               "temperature": 0.0,
                                                               "ignore_eos": True})
    for p, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]).cuda(), max_new_tokens=16, do_sample=False,
                          pad_token_id=2)
        assert out["output_ids"] == ref[0, len(p):].tolist()
    if engine.runner.cuda_graphs is not None:
        assert engine.runner.cuda_graphs.replays > 0


def _run(engine, prompts, params):
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


@pytest.mark.parametrize("overlap", [False, True])
def test_hicache_on_cuda_with_storage_gives_the_same_tokens(tiny_model_factory, tmp_path,
                                                            overlap):
    """HiCache on a GPU (pinned host tier, the copy stream, events), the storage tier staged
    through the host tier, the overlap scheduler launching ahead: prefixes evicted from the
    device, then from host memory too, come back and the tokens are those without tiers."""
    import random

    from engine import Engine

    rng = random.Random(0)
    prompts = [[rng.randrange(5, 250) for _ in range(140)] for _ in range(4)]
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    path = tiny_model_factory("llama")
    common = dict(device="cuda", dtype="float32", attention_backend="triton",
                  max_total_tokens=320, enable_overlap_schedule=overlap)
    ref = [_run(Engine(path, **common), [p], params)[0] for p in prompts]
    engine = Engine(path, enable_hierarchical_cache=True, hicache_storage_backend="file",
                    hicache_storage_dir=str(tmp_path),
                    hicache_storage_prefetch_policy="wait_complete", **common)
    tree, stats = engine.scheduler.kv.cache, engine.scheduler.kv.stats
    assert [_run(engine, [p], params)[0] for p in prompts] == ref  # each evicts the last
    tree.drain()
    tree.storage.flush_writes()
    tree.evict(tree.total_size)
    tree.evict_host(tree.host_size)  # only the disk has them now
    assert [_run(engine, [p], params)[0] for p in prompts] == ref
    assert stats.hits["storage"] > 0 and stats.bytes["host->device"] > 0
    engine.close()


def test_tree_drafts_on_cuda_give_the_same_tokens(tiny_model_factory):
    """A draft model proposing trees (--speculative-eagle-topk 2) on a GPU: every node a
    borrowed request-table row in the triton backend, with and without CUDA graphs for the
    plain steps; the target's greedy tokens unchanged."""
    import random

    from engine import Engine

    rng = random.Random(1)
    prompts = [[rng.randrange(5, 250) for _ in range(12)] * 3 for _ in range(3)]
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    path = tiny_model_factory("llama")
    common = dict(device="cuda", dtype="float32", attention_backend="triton",
                  max_total_tokens=4096, cuda_graph_max_bs=4)
    ref = _run(Engine(path, **common), prompts, params)
    engine = Engine(path, speculative_algorithm="STANDALONE", speculative_draft_model_path=path,
                    speculative_eagle_topk=2, speculative_num_steps=3,
                    speculative_num_draft_tokens=5, **common)
    assert _run(engine, prompts, params) == ref
    assert engine.scheduler.spec.stats.accept_length > 1.5  # the target drafting for itself
