"""DeepSeek-V2/V3 on the engine's whole path: greedy tokens equal to HF transformers' through
chunked prefill (prompt chunks attending earlier chunks' latent rows), radix-cache hits
(latent rows reused across requests) and retraction, the scheduler's slots all free after;
fp8 KV end to end; the attention backend that ``auto`` picks and the ones refused."""

from __future__ import annotations

import functools
import logging
import random

import pytest
import torch
from engine import Engine
from engine.registry import EngineError
from engine_testing.checkpoints import DEEPSEEK_CASES
from engine_testing.invariants import assert_all_free

pytestmark = pytest.mark.usefixtures("single_torch_thread")

GREEDY = {"temperature": 0, "ignore_eos": True}
NEW_TOKENS = 20
ENGINE_CASES = ("v2_lite_greedy", "v3_noaux_tc")  # no q LoRA + softmax; q LoRA + sigmoid


@pytest.fixture(scope="module", params=ENGINE_CASES)
def ds_dir(request, tiny_model_factory):
    arch, overrides = DEEPSEEK_CASES[request.param]
    return tiny_model_factory(arch, **overrides)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


# two pairs of prompts sharing a 40-token prefix (radix hits), chunked at 16 tokens
SYSTEM = ids(99, 40)
PROMPTS = [SYSTEM + ids(1, 9), SYSTEM + ids(2, 3), ids(3, 30), ids(4, 5), SYSTEM + ids(5, 17)]


@functools.cache
def hf_greedy(model_dir: str) -> tuple:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None
    outs = []
    for p in PROMPTS:  # one at a time: no padding on the HF side
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=2)
        outs.append(out[0, len(p):].tolist())
    return tuple(outs)


def run(engine, prompts):
    outs = engine.generate(input_ids=prompts,
                           sampling_params={**GREEDY, "max_new_tokens": NEW_TOKENS})
    return [o["output_ids"] for o in outs], outs


def test_chunked_prefill_and_radix_hits_equal_hf(ds_dir):
    engine = Engine(ds_dir, max_total_tokens=2000, chunked_prefill_size=16)
    assert engine.attention_backend == "torch_native"  # auto: the backend with MLA
    assert engine.cpu_graph == ("cpu graph: off (MLA attention and MoE layers have no CPU "
                                "graph nodes yet)")
    expected = list(hf_greedy(ds_dir))
    first, _ = run(engine, PROMPTS[:1])  # its prefix is then in the radix cache
    rest, outs = run(engine, PROMPTS[1:])
    assert first + rest == expected
    assert outs[0]["meta_info"]["cached_tokens"] >= len(SYSTEM)
    assert outs[3]["meta_info"]["cached_tokens"] >= len(SYSTEM)
    again, outs = run(engine, PROMPTS)  # everything cached now
    assert again == expected and all(o["meta_info"]["cached_tokens"] > 0 for o in outs)
    assert_all_free(engine)


def test_retraction_gives_hf_tokens(ds_dir, caplog):
    small = Engine(ds_dir, max_total_tokens=150, schedule_conservativeness=0.1,
                   chunked_prefill_size=32)
    with caplog.at_level(logging.WARNING, logger="engine"):
        outs, _ = run(small, PROMPTS)
    assert any("decode out of memory" in r.getMessage() for r in caplog.records)
    assert small.scheduler.counters.retracted_reqs >= 1
    assert outs == list(hf_greedy(ds_dir))
    assert_all_free(small)


def test_fp8_kv_end_to_end(tiny_model_factory):
    """The fp8 latent through the scheduler (radix hits read fp8 rows written by another
    request); the sizing report counts 1 byte a value and compares with bfloat16's."""
    arch, overrides = DEEPSEEK_CASES["v2_lite_greedy"]
    engine = Engine(tiny_model_factory(arch, **overrides), max_total_tokens=1000,
                    kv_cache_dtype="fp8_e4m3", chunked_prefill_size=16)
    assert engine.sizing.kv_bytes_per_token == (32 + 16) * 3  # 3 layers
    assert "2.00x the 500 tokens of a bfloat16 KV cache" in "\n".join(engine.sizing.lines())
    outs, _ = run(engine, PROMPTS[:2])
    assert all(len(o) == NEW_TOKENS for o in outs)
    assert_all_free(engine)


def test_a_backend_without_mla_is_refused_before_loading(ds_dir):
    with pytest.raises(EngineError, match="'cpu' .*has no multi-head latent attention.*"
                                          "--attention-backend torch_native"):
        Engine(ds_dir, attention_backend="cpu")
