"""A prompt's own logprobs (echo + logprobs) come from the scheduler's batches: from the first
token (no cached prefix), in chunks capped at PROMPT_LOGPROBS_TOKENS, next to other requests,
with and without the overlap scheduler, equal to HF's log-softmax."""

from __future__ import annotations

import random

import pytest
import torch

from engine import Engine
from engine.scheduler.prompt_logprobs import PROMPT_LOGPROBS_TOKENS
from engine_testing.invariants import assert_all_free


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def hf_logprobs(model):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, attn_implementation="eager").eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    return run


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def run(engine, jobs) -> list:
    reqs = [r for prompt, params, top in jobs
            for r in engine.add_request(prompt, params, prompt_logprobs=top)]
    for _ in range(2000):
        if all(r.finished for r in reqs):
            break
        engine.step()
    assert all(r.finished for r in reqs)
    return reqs


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_equal_hf_next_to_other_requests(model, hf_logprobs, overlap):
    system = ids(0, 40)
    long = ids(1, PROMPT_LOGPROBS_TOKENS + 200)  # scored over several capped chunks
    greedy = {"temperature": 0, "ignore_eos": True}
    engine = Engine(model, max_total_tokens=4000, chunked_prefill_size=256,
                    enable_overlap_schedule=overlap)
    # the shared prefix is cached first: a scored prompt must not take it from the cache
    run(engine, [(system + ids(2, 5), {**greedy, "max_new_tokens": 2}, None)])
    jobs = [(system + ids(3, 9), {**greedy, "max_new_tokens": 0}, 3),
            (long, {**greedy, "max_new_tokens": 3}, 1),
            (system + ids(4, 7), {**greedy, "max_new_tokens": 5}, None),
            (ids(5, 1), {**greedy, "max_new_tokens": 0}, 0)]
    reqs = run(engine, jobs)
    for (prompt, params, top), r in zip(jobs, reqs):
        if top is None:
            assert r.input_logprobs == []
            continue
        assert len(r.input_logprobs) == len(prompt) and r.input_logprobs[0] is None
        assert r.finish_reason == "length" and len(r.output_ids) == params["max_new_tokens"]
        ref = hf_logprobs(prompt)
        expected = [ref[i, t].item() for i, t in enumerate(prompt[1:])]
        assert r.input_logprobs[1:] == pytest.approx(expected, abs=2e-4)
        for i, row in enumerate(r.input_top_logprobs[1:]):
            assert [t for t, _ in row] == ref[i].topk(top).indices.tolist()
    # the scored request's output is what it is without scoring
    plain = Engine(model, max_total_tokens=4000).generate(input_ids=long, sampling_params={
        **greedy, "max_new_tokens": 3})
    assert reqs[1].output_ids == plain["output_ids"]
    meta = engine.output(reqs[0])["meta_info"]
    assert meta["input_token_logprobs"][0] == (None, jobs[0][0][0])
    engine.step()  # an overlapped engine collects its last in-flight batch
    engine.scheduler.check_invariants()
    assert_all_free(engine)
    engine.close()


def test_a_step_scoring_a_prompt_keeps_every_positions_logits_under_the_cap(model):
    engine = Engine(model, max_total_tokens=4000, chunked_prefill_size=2048)
    seen = []
    forward = engine.runner.forward

    def spy(batch, return_all_logits=False, **kw):
        seen.append((batch.num_tokens, return_all_logits))
        return forward(batch, return_all_logits, **kw)

    engine.runner.forward = spy
    run(engine, [(ids(7, 300), {"max_new_tokens": 1}, None),
                 (ids(8, 1200), {"max_new_tokens": 0}, 2),
                 (ids(9, 300), {"max_new_tokens": 1}, None)])
    assert any(all_logits for _, all_logits in seen)
    assert all(n <= PROMPT_LOGPROBS_TOKENS for n, all_logits in seen if all_logits)
    assert_all_free(engine)
