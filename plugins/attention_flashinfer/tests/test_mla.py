"""Multi-head latent attention through flashinfer: the 'flashinfer' backend's MLA path
(BatchMLAPagedAttentionWrapper) and 'trtllm_mla' (trtllm-gen MLA decode), driving torch
stand-ins of the flashinfer entry points (reference.py: they read only the metadata the kernels
would get) against torch_native on random latent batches (prompts, decodes, extends over cached
prefixes beside decodes; pages interleaved), a tiny DeepSeek's greedy tokens against HF, the
keyword arguments bound against the real flashinfer signatures (when flashinfer imports),
registration, the `auto` pick for MLA models, and the refusals."""

from __future__ import annotations

import inspect

import pytest
import torch

import engine_attention_flashinfer as plugin
from engine.attention.torch_native import TorchNativeBackend
from engine.builtins.select import select_attention_backend
from engine.device import DeviceInfo
from engine.forward_batch import ForwardBatch
from engine.interfaces import AttentionLayerSpec, BackendContext
from engine.memory.kv_pool import KVPool
from engine.plugins import get_registries
from engine.registry import IncompatibleOptions, takes_model
from engine_testing.attention import run_mixed_steps, scattered_filler
from engine_testing.generation import free_requests, greedy_matches_hf
from engine_attention_flashinfer import mla_backend
from engine_attention_flashinfer.mla_backend import FlashInferMLABackend, TrtllmMLABackend
from recording import recording, recording_function
from engine_attention_flashinfer.reference import (ReferenceMLAWrapper, mla_reference_ops,
                                                   reference_trtllm_mla_decode)

LORA, ROPE, HEADS = 32, 16, 4
SPECS = [AttentionLayerSpec(HEADS, 1, LORA + ROPE, 0.2, kv_lora_rank=LORA, qk_nope_head_dim=24)
         for _ in range(2)]


def make_backends(page_size, ops=None, dtype=torch.float32):
    pool = KVPool(len(SPECS), 1, LORA + ROPE, 1024, dtype, page_size=page_size, max_reqs=8,
                  max_context_len=512, latent=True)
    ctx = BackendContext(pool, SPECS, "cpu", torch.float32)
    ops = ops or mla_reference_ops()
    return pool, (FlashInferMLABackend(ctx, ops, 1024), TrtllmMLABackend(ctx, ops, 1024),
                  TorchNativeBackend(ctx))


def latent_step(pool, backends, rows, lens, new_lens, specs, gen, tol):
    """One step: random absorbed queries and latent rows through every backend's
    forward_latent; each output equals the last backend's (torch_native)."""
    locs = [pool.extend_slots(r, n, e) for r, n, e in zip(rows, lens, new_lens)]
    batch = ForwardBatch.build([[0] * e for e in new_lens], lens, rows, torch.cat(locs),
                               pool.req_to_token)
    for b in backends:
        b.init_forward_metadata(batch)
    for layer, spec in enumerate(specs):
        q = torch.randn(batch.num_tokens, spec.num_heads, spec.head_dim, generator=gen)
        latent = torch.randn(batch.num_tokens, 1, spec.head_dim, generator=gen)
        *ours, ref = (b.forward_latent(q, latent, layer, batch) for b in backends)
        assert ref.shape == (batch.num_tokens, spec.num_heads, spec.kv_lora_rank)
        for out in ours:
            assert out.shape == ref.shape and out.dtype == ref.dtype
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    return batch


@pytest.mark.parametrize("page_size", [1, 16, 32])
def test_mla_backends_match_torch_native(page_size):
    pool, backends = make_backends(page_size)
    # the requests' pages interleave with a filler's
    filler, held = scattered_filler(pool, page_size, 24 if page_size < 32 else 8)
    run_mixed_steps(pool, backends, SPECS, torch.Generator().manual_seed(0), 1e-5,
                    step=latent_step)
    pool.free_pages(held[1::2])
    assert pool.free_slots == pool.size


def test_trtllm_mla_decodes_through_its_kernel_and_the_rest_through_the_wrapper():
    calls = recorded_calls()
    assert len(calls["trtllm.mla_decode"]) == len(SPECS) * 2  # two decode steps, every layer
    plans = calls["mla.plan"]
    # flashinfer's backend plans every step (causal except decodes); trtllm_mla the others
    assert [a[8] for a, _ in plans] == [True, False, False, True, True, True]


@pytest.mark.parametrize("backend", ["flashinfer", "trtllm_mla"])
def test_deepseek_greedy_matches_hf(tiny_model_factory, registries, backend):
    """A tiny DeepSeek-V3 (q LoRA, noaux_tc, yarn, interleaved rope) through the backend on
    the reference ops: prompts prefilled together, then absorbed decode steps, greedy equal
    to HF's."""
    from engine_testing.checkpoints import DEEPSEEK_CASES

    arch, overrides = DEEPSEEK_CASES["v3_noaux_tc"]
    cls = FlashInferMLABackend if backend == "flashinfer" else TrtllmMLABackend
    runner = greedy_matches_hf(tiny_model_factory(arch, **overrides), registries,
                               lambda ctx: cls(ctx, mla_reference_ops(), 1024),
                               max_new_tokens=6)
    assert runner.kv_pool.latent


# -- the calls against the real signatures ---------------------------------------------------
def recorded_calls() -> dict:
    """Every call the two backends make into flashinfer over prompts, decodes and a mixed
    step with cached prefixes."""
    calls: dict = {}
    ops = mla_reference_ops()
    ops.mla_wrapper = recording(ReferenceMLAWrapper, calls, "mla")

    ops.mla_decode = recording_function(reference_trtllm_mla_decode, calls, "trtllm.mla_decode")
    pool, backends = make_backends(32, ops)
    gen = torch.Generator().manual_seed(3)
    for b in backends[:2]:
        rows = [pool.alloc_req() for _ in range(2)]
        lens = [0, 0]
        for new in ([5, 3], [1, 1], [1, 1], [4, 2]):
            latent_step(pool, (b,), rows, lens, new, SPECS, gen, 0)
            lens = [n + e for n, e in zip(lens, new)]
        free_requests(pool, rows, lens)
    return calls


def test_calls_bind_to_the_real_flashinfer_signatures():
    pytest.importorskip("flashinfer", reason="flashinfer-python is not installed: pip install "
                        "'engine-attention-flashinfer[cuda]' (any machine can import it for "
                        "this check)")
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla
    from flashinfer.mla import BatchMLAPagedAttentionWrapper as W

    real = {"mla.__init__": W.__init__, "mla.plan": W.plan, "mla.run": W.run,
            "trtllm.mla_decode": trtllm_batch_decode_with_kv_cache_mla}
    calls = recorded_calls()
    assert set(calls) == set(real)
    for name, fn in real.items():
        sig = inspect.signature(fn)
        for args, kwargs in calls[name]:
            if "self" in sig.parameters:
                args = (None, *args)
            sig.bind(*args, **kwargs)  # TypeError on a wrong name or arity


# -- registration, auto, refusals ------------------------------------------------------------
class _MLA:
    kv_lora_rank = 512


class _Model:
    def __init__(self, mla):
        self.mla, self.architecture = (_MLA() if mla else None), "Deepseek"


def test_registration_and_auto_pick_for_mla_models(monkeypatch):
    regs = get_registries()
    fi, trt = regs.attention.get("flashinfer"), regs.attention.get("trtllm_mla")
    assert fi.extra["mla"] is True and trt.extra["mla"] == "only"
    assert trt.extra["page_sizes"] == (32, 64) and trt.extra["priority"] == 25
    assert takes_model(trt, _Model(True)) and not takes_model(trt, _Model(False))
    assert takes_model(fi, _Model(True)) and takes_model(fi, _Model(False))
    monkeypatch.setattr(plugin.importlib.util, "find_spec", lambda name: object())
    pick = {}
    for name, cap in (("B200", (10, 0)), ("H100", (9, 0)), ("A100", (8, 0))):
        dev = DeviceInfo("cuda", name, cap)
        pick[name] = [select_attention_backend(dev, _Model(m), "auto", None, regs, "bfloat16")
                      for m in (True, False)]
    assert pick["B200"] == ["trtllm_mla", "trtllm_mha"]
    assert pick["H100"][0] == "flashinfer" and pick["A100"] == ["flashinfer", "flashinfer"]


def ctx_for(dtype=torch.bfloat16, pool_dtype=None, lora=512, rope=64, page_size=64,
            mla=True):
    spec = AttentionLayerSpec(8, 1, lora + rope, 0.1, kv_lora_rank=lora if mla else 0,
                              qk_nope_head_dim=128)
    if not mla:
        spec = AttentionLayerSpec(8, 2, 64, 0.1)
    pool = KVPool(1, 1 if mla else 2, spec.head_dim, 256, pool_dtype or dtype,
                  page_size=page_size, max_reqs=2, max_context_len=128, latent=mla)
    return BackendContext(pool, [spec], "cpu", dtype)


def test_factories_refuse_what_the_mla_kernels_cannot_run():
    with pytest.raises(IncompatibleOptions, match="runs float16 or bfloat16 models"):
        mla_backend.from_context(ctx_for(torch.float32))
    with pytest.raises(IncompatibleOptions, match="reads MLA latent caches in the model's dtype"):
        mla_backend.from_context(ctx_for(pool_dtype=torch.float8_e4m3fn))
    with pytest.raises(IncompatibleOptions, match=r"built for kv_lora_rank 512 and "
                                                  r"qk_rope_head_dim 64"):
        mla_backend.from_context(ctx_for(lora=32, rope=16))
    with pytest.raises(IncompatibleOptions, match="needs --page-size 32 or 64"):
        mla_backend.trtllm_from_context(ctx_for(page_size=16))
    with pytest.raises(IncompatibleOptions, match="use trtllm_mha for this model"):
        mla_backend.trtllm_from_context(ctx_for(mla=False))
