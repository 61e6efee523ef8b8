"""Engine.generate end to end: equal to HF transformers, and the sampling parameters at work."""

import pytest
import torch

from engine import Engine
from engine.engine import RequestError
from engine.sampling import SamplingParamsError
from engine_testing.checkpoints import TINY_CASES

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    return Engine(tiny_model_factory("llama"), max_total_tokens=4000)


def hf_greedy(model_dir, prompts, n):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos (min_new_tokens would ban EOS)
    outs = []
    for p in prompts:  # one at a time: no padding artefacts on the HF side
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                              pad_token_id=2)
        outs.append(out[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_engine_greedy_equals_hf_generate(tiny_model_factory, case):
    model_dir = tiny_model_factory(case)
    prompts = [[5 + (i * 7 + j * 3) % 400 for j in range(3 + 11 * i)] for i in range(4)]
    engine = Engine(model_dir, max_total_tokens=2000, chunked_prefill_size=16)
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 32})
    assert [o["output_ids"] for o in outs] == hf_greedy(model_dir, prompts, 32)
    # the same prompts again: now served from the radix cache, same tokens
    again = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 32})
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in again[1:])
    engine.scheduler.check_invariants()
    assert engine.flush_cache()
    assert engine.scheduler.kv.pool.free_slots == engine.scheduler.kv.pool.size


def test_seed_reproducible_across_batches_and_order(engine):
    params = {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_new_tokens": 16,
              "ignore_eos": True}
    target = "the quick brown fox"
    alone = engine.generate(target, params)["output_ids"]
    others = ["a b c", "import sys", "one two three four five"]
    mixed = engine.generate(others[:2] + [target] + others[2:],
                            [{"temperature": 0.7, "max_new_tokens": 9}] * 2 + [params]
                            + [{"temperature": 1.3, "max_new_tokens": 20}])
    assert mixed[2]["output_ids"] == alone
    reordered = engine.generate([target] + others, [params] + [{"max_new_tokens": 5}] * 3)
    assert reordered[0]["output_ids"] == alone


def test_top_k_one_equals_greedy(engine):
    greedy = engine.generate("hello there", {**GREEDY, "max_new_tokens": 10})
    top1 = engine.generate("hello there", {"temperature": 1.5, "top_k": 1, "max_new_tokens": 10,
                                           "ignore_eos": True})
    assert top1["output_ids"] == greedy["output_ids"]


def test_stop_string_across_tokens_is_cut_from_the_text(engine):
    free = engine.generate("def main", {**GREEDY, "max_new_tokens": 24})
    text = free["text"]
    stop = text[5:9]  # a piece of what greedy will produce, likely spanning token boundaries
    assert len(stop) == 4
    out = engine.generate("def main", {**GREEDY, "max_new_tokens": 24, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]


def test_stop_token_ids_and_min_new_tokens(engine):
    free = engine.generate("stop here", {**GREEDY, "max_new_tokens": 12})["output_ids"]
    stop_id = free[3]
    out = engine.generate("stop here", {**GREEDY, "max_new_tokens": 12,
                                        "stop_token_ids": [stop_id]})
    assert out["output_ids"] == free[: free.index(stop_id) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    later = engine.generate("stop here", {"temperature": 0, "max_new_tokens": 12,
                                          "stop_token_ids": [stop_id], "min_new_tokens": 8})
    assert stop_id not in later["output_ids"][:8]


def test_logprobs_are_returned(engine):
    out = engine.generate("log probs", {**GREEDY, "max_new_tokens": 5, "logprobs": True,
                                        "top_logprobs": 3})
    pairs = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t in pairs] == out["output_ids"]
    assert all(lp <= 0 for lp, _ in pairs)
    tops = out["meta_info"]["output_top_logprobs"]
    assert len(tops) == 5 and all(len(t) == 3 for t in tops)
    assert all(top[0][0] == tok for top, tok in zip(tops, out["output_ids"]))  # greedy = top-1


def test_bad_requests_are_refused_clearly(engine):
    with pytest.raises(SamplingParamsError, match="temperature"):
        engine.generate("x", {"temperature": -1})
    with pytest.raises(SamplingParamsError, match="top_p"):
        engine.generate("x", {"top_p": 1.5})
    with pytest.raises(SamplingParamsError, match="unknown"):
        engine.generate("x", {"temprature": 1})
    with pytest.raises(RequestError, match="empty"):
        engine.generate(input_ids=[[]])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.generate(input_ids=[10**6])
    assert not engine.scheduler.has_work


def test_token_id_prompts_one_or_many(engine):
    """A list of ints is one prompt (as ``prompt`` or ``input_ids``); a list of lists is many;
    text and token ids of the same prompt give the same tokens."""
    greedy = {"max_new_tokens": 4, "temperature": 0.0}
    ids = engine.tokenize("Hello there")
    one = engine.generate(ids, greedy)
    assert isinstance(one, dict) and len(one["output_ids"]) == 4
    assert engine.generate(input_ids=ids, sampling_params=greedy)["output_ids"] == one["output_ids"]
    assert engine.generate("Hello there", greedy)["output_ids"] == one["output_ids"]
    many = engine.generate([ids, ids[:2]], greedy)
    assert isinstance(many, list) and len(many) == 2 and many[0]["output_ids"] == one["output_ids"]
    assert len(engine.generate(["Hello there", "Hi"], greedy)) == 2
    with pytest.raises(RequestError, match="got none"):
        engine.generate([])
    with pytest.raises(RequestError, match="not both"):
        engine.generate("x", input_ids=[1])
    # one sampling-params entry per prompt, or one for all: never a prompt silently dropped
    with pytest.raises(RequestError, match="3 prompt.*2 sampling_params"):
        engine.generate(["a", "b", "c"], [greedy, greedy])
    with pytest.raises(RequestError, match="1 prompt.*2 sampling_params"):
        engine.generate("a", [greedy, greedy])
    assert len(engine.generate(["a", "b"], [greedy, {**greedy, "max_new_tokens": 2}])) == 2
    assert not engine.scheduler.has_work


def test_engine_seed_makes_unseeded_sampling_repeatable(tiny_model_factory):
    def sample(seed):
        engine = Engine(tiny_model_factory("llama"), max_total_tokens=500, seed=seed)
        return engine.generate("abc", {"temperature": 1.0, "max_new_tokens": 12,
                                       "ignore_eos": True})["output_ids"]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_zero_new_tokens_finishes_without_output(engine):
    out = engine.generate("nothing to do", {"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert not engine.scheduler.has_work


def test_torch_compile_serves_the_same_greedy_tokens(tiny_model_factory, caplog):
    """--enable-torch-compile: compiled at start (logged), small forwards compiled, larger ones
    eager, same greedy output as the eager engine; a bad --torch-compile-max-bs is refused."""
    import logging

    path = tiny_model_factory("llama")
    prompts = [[5 + i, 17, 99, 4 + i] * (3 + 4 * i) for i in range(3)]  # 12, 28, 44 tokens
    params = {"max_new_tokens": 12, "temperature": 0}
    eager = Engine(path, max_total_tokens=2048).generate(input_ids=prompts,
                                                         sampling_params=params)
    with caplog.at_level(logging.INFO, logger="engine"):
        engine = Engine(path, max_total_tokens=2048, enable_torch_compile=True,
                        torch_compile_max_bs=16)
    assert "torch.compile: decoder compiled for forwards of up to 16 tokens" in caplog.text
    # the graph calls the packed linears as opaque ops (engine-cpu-kernels' float32 kernel
    # where it runs, else oneDNN's)
    assert "float32 weights, avx" in caplog.text or "prepacked for oneDNN" in caplog.text
    graphs = dict(torch._dynamo.utils.counters["stats"])
    compiled = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in compiled] == [o["output_ids"] for o in eager]
    alone = engine.generate(input_ids=prompts[:1], sampling_params=params)  # 1-row decodes
    assert alone[0]["output_ids"] == eager[0]["output_ids"]
    # nothing recompiled while serving (a recompile is a stall of seconds to minutes)
    assert dict(torch._dynamo.utils.counters["stats"]) == graphs
    calls = engine.runner.compiled.calls
    assert calls["compiled"] >= 11 and calls["eager"] >= 1  # decodes; the 28/44-token prefills
    with pytest.raises(ValueError, match="--torch-compile-max-bs must be >= 1, got 0"):
        Engine(path, enable_torch_compile=True, torch_compile_max_bs=0)
