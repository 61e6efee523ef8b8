"""The prompt-chunk kernel (prompt_attention.c) against SDPA with an explicit causal mask, on
scattered pool slots: query tiles and key blocks cut at awkward places, cached prefixes,
sliding windows, GQA ratios, half-precision and scaled pools; and when the backend uses it."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from engine.interfaces import AttentionLayerSpec, BackendContext
from engine.memory.kv_pool import KVPool
from engine_attention_cpu import kernel
from engine_attention_cpu.backend import PROMPT_ENV, CPUBackend

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def reference(q, k_pool, v_pool, table, starts, ext, prefix, rows, window, scale, ks, vs):
    out = torch.zeros(q.shape)
    H, D = q.shape[1:]
    for s, e, p, r in zip(starts, ext, prefix, rows):
        L = p + e
        slots = table[r, :L].long()
        k = (k_pool[slots].float() * ks).transpose(0, 1)  # [KVH, L, D]
        v = (v_pool[slots].float() * vs).transpose(0, 1)
        qpos, kpos = torch.arange(p, L), torch.arange(L)
        mask = kpos[None, :] <= qpos[:, None]
        if window:
            mask &= kpos[None, :] > qpos[:, None] - window
        o = F.scaled_dot_product_attention(q[s:s + e].transpose(0, 1), k, v, attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[s:s + e] = o.transpose(0, 1)
    return out


# (heads, kv heads, head dim, [(new tokens, cached prefix)], window, pool dtype, k/v scales)
CASES = [
    (9, 3, 64, [(128, 0), (128, 0), (33, 0), (1, 0)], None, torch.float32, (1.0, 1.0)),
    (4, 4, 16, [(31, 5), (32, 0), (65, 17)], None, torch.float32, (1.0, 1.0)),
    (8, 1, 128, [(40, 100), (7, 3)], 19, torch.float32, (1.0, 1.0)),
    (16, 2, 32, [(70, 0), (2, 60)], 40, torch.bfloat16, (1.0, 1.0)),
    (6, 3, 48, [(50, 13)], None, torch.float16, (0.5, 2.0)),
    (4, 2, 80, [(17, 0), (49, 1)], 16, torch.float32, (0.25, 1.0)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}-KVH{c[1]}-D{c[2]}")
def test_matches_masked_sdpa(case):
    H, KVH, D, reqs, window, dtype, (ks, vs) = case
    gen = torch.Generator().manual_seed(H * D)
    lens = [e + p for e, p in reqs]
    slots = sum(lens) + 1
    perm = torch.randperm(slots - 1, generator=gen) + 1  # every request's slots scattered
    table = torch.zeros(len(reqs) + 1, 256, dtype=torch.int32)
    at = 0
    for i, n in enumerate(lens):
        table[i + 1, :n] = perm[at:at + n].int()
        at += n
    k_pool = torch.randn(slots, KVH, D, generator=gen).to(dtype)
    v_pool = torch.randn(slots, KVH, D, generator=gen).to(dtype)
    ext = [e for e, _ in reqs]
    starts = [sum(ext[:i]) for i in range(len(ext))]
    # q as the model hands it over: a view of a wider row (q heads, then k's)
    q = torch.randn(sum(ext), H + KVH, D, generator=gen)[:, :H]
    out = torch.full((sum(ext), H, D), float("nan"))
    i64 = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    rows = list(range(1, len(reqs) + 1))
    kernel.prompt_attention(q, out, i64(starts), i64(ext), i64([p for _, p in reqs]), i64(rows),
                            k_pool, v_pool, table, window, D ** -0.5, ks, vs)
    ref = reference(q, k_pool, v_pool, table, starts, ext, [p for _, p in reqs], rows, window,
                    D ** -0.5, ks, vs)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_shapes_it_does_not_take_are_refused():
    assert not kernel.prompt_shape_ok(4, 2, 8) and not kernel.prompt_shape_ok(4, 2, 144)
    assert not kernel.prompt_shape_ok(6, 4, 64) and kernel.prompt_shape_ok(6, 3, 112)
    q = torch.zeros(2, 4, 8)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="cannot take H=4, KVH=2, D=8"):
        kernel.prompt_attention(q, torch.empty_like(q), one, torch.tensor([2]), one, one,
                                torch.zeros(3, 2, 8), torch.zeros(3, 2, 8),
                                torch.zeros(1, 4, dtype=torch.int32), None, 1.0)


def backend(specs, kvh, d):
    pool = KVPool(len(specs), kvh, d, 64, torch.float32, max_reqs=2, max_context_len=32)
    return CPUBackend(BackendContext(pool, specs, "cpu", torch.float32))


def test_the_backend_says_when_prompts_run_sdpa(monkeypatch, caplog):
    spec = AttentionLayerSpec(4, 2, 16, 0.25)
    assert backend([spec], 2, 16).prompt_kernel
    with caplog.at_level(logging.INFO, logger="engine"):
        assert not backend([spec, AttentionLayerSpec(4, 2, 8, 0.3)], 2, 16).prompt_kernel
    assert "prompt chunks run torch SDPA" in caplog.text and "layer 1 has 4 heads of 8" in \
        caplog.text
    monkeypatch.setenv(PROMPT_ENV, "sdpa")
    assert not backend([spec], 2, 16).prompt_kernel


def test_a_prompt_kernel_that_cannot_build_leaves_prompts_to_sdpa(tmp_path, monkeypatch,
                                                                   caplog):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel, "PROMPT_SOURCE", broken)
    kernel.load_prompt.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="engine"):
            assert not backend([AttentionLayerSpec(4, 2, 16, 0.25)], 2, 16).prompt_kernel
    finally:
        kernel.load_prompt.cache_clear()
    assert "prompt chunks run torch SDPA: its prompt kernel failed to build" in caplog.text
