"""DeepSeek-V2/V3 on the engine's whole path: greedy tokens equal to HF transformers' through
chunked prefill (prompt chunks attending earlier chunks' latent rows), radix-cache hits
(latent rows reused across requests) and retraction, the scheduler's slots all free after;
fp8 KV end to end; the attention backend that ``auto`` picks and the ones refused."""

from __future__ import annotations

import pytest
from engine import Engine
from engine.registry import EngineError
from engine_testing.checkpoints import DEEPSEEK_CASES
from engine_testing.engine_paths import (
    PROMPTS,
    check_chunked_prefill_and_radix_hits,
    check_retraction,
    run_greedy,
)
from engine_testing.invariants import assert_all_free

pytestmark = pytest.mark.usefixtures("single_torch_thread")

NEW_TOKENS = 20
ENGINE_CASES = ("v2_lite_greedy", "v3_noaux_tc")  # no q LoRA + softmax; q LoRA + sigmoid


@pytest.fixture(scope="module", params=ENGINE_CASES)
def ds_dir(request, tiny_model_factory):
    arch, overrides = DEEPSEEK_CASES[request.param]
    return tiny_model_factory(arch, **overrides)


def test_chunked_prefill_and_radix_hits_equal_hf(ds_dir):
    engine = Engine(ds_dir, max_total_tokens=2000, chunked_prefill_size=16)
    assert engine.attention_backend == "torch_native"  # auto: the backend with MLA
    assert engine.cpu_graph == ("cpu graph: off (MLA attention and MoE layers have no CPU "
                                "graph nodes yet)")
    check_chunked_prefill_and_radix_hits(engine, ds_dir, NEW_TOKENS)


def test_retraction_gives_hf_tokens(ds_dir, caplog):
    check_retraction(ds_dir, NEW_TOKENS, caplog)


def test_fp8_kv_end_to_end(tiny_model_factory):
    """The fp8 latent through the scheduler (radix hits read fp8 rows written by another
    request); the sizing report counts 1 byte a value and compares with bfloat16's."""
    arch, overrides = DEEPSEEK_CASES["v2_lite_greedy"]
    engine = Engine(tiny_model_factory(arch, **overrides), max_total_tokens=1000,
                    kv_cache_dtype="fp8_e4m3", chunked_prefill_size=16)
    assert engine.sizing.kv_bytes_per_token == (32 + 16) * 3  # 3 layers
    assert "2.00x the 500 tokens of a bfloat16 KV cache" in "\n".join(engine.sizing.lines())
    outs, _ = run_greedy(engine, PROMPTS[:2], NEW_TOKENS)
    assert all(len(o) == NEW_TOKENS for o in outs)
    assert_all_free(engine)


def test_a_backend_without_mla_is_refused_before_loading(ds_dir):
    with pytest.raises(EngineError, match="'cpu' .*has no multi-head latent attention.*"
                                          "--attention-backend torch_native"):
        Engine(ds_dir, attention_backend="cpu")
