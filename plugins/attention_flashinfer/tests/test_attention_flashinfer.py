"""Attention backends 'flashinfer' and 'trtllm_mha': their metadata on hand-checked batches; both
backends, driving torch stand-ins of the flashinfer entry points (reference.py, which read only
that metadata), against torch_native on random batches mixing prompts, extends over cached
prefixes and decodes (page sizes 1 and 16, GQA and one KV head, a sliding window, fp8 pools with
per-layer scales); the CUDA-graph methods (fixed buffers refilled in place); the keyword
arguments the backends pass, bound against the real flashinfer signatures (when flashinfer
imports); registration and refusals. On a CUDA GPU the real kernels run against torch_native."""

from __future__ import annotations

import importlib.util
import inspect
import json
from itertools import accumulate

import pytest
import torch
from click.testing import CliRunner

import engine_attention_flashinfer as plugin
from engine.attention.torch_native import TorchNativeBackend
from engine.device import DeviceInfo
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.interfaces import AttentionLayerSpec, BackendContext
from engine.memory.kv_pool import KVPool
from engine.plugins import get_registries
from engine.registry import IncompatibleOptions
from engine_testing.attention import (compare_backends_step, refill_batch, run_mixed_steps,
                                      scattered_filler)
from engine_testing.generation import free_requests, greedy_matches_hf
from engine_attention_flashinfer import flashinfer_backend, trtllm_backend
from engine_attention_flashinfer.flashinfer_backend import FlashInferBackend
from engine_attention_flashinfer.metadata import block_tables, paged_cache, paged_kv
from engine_attention_flashinfer.reference import (ReferenceDecodeWrapper,
                                                   ReferencePrefillWrapper,
                                                   ReferenceRaggedWrapper, attend_lse,
                                                   flashinfer_reference_ops,
                                                   reference_merge_state,
                                                   reference_trtllm_context,
                                                   reference_trtllm_decode,
                                                   trtllm_reference_ops)
from engine_attention_flashinfer.trtllm_backend import TrtllmMhaBackend
from engine_cli.main import cli
from recording import recording, recording_function

GPU = torch.cuda.is_available()
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
SPECS = [AttentionLayerSpec(4, 2, 16, 0.25), AttentionLayerSpec(4, 2, 16, 0.3, 5)]


# -- registration ---------------------------------------------------------------------------
def test_plugin_is_installed():
    data = json.loads(CliRunner().invoke(cli, ["plugins", "--json"]).output)
    assert "engine-attention-flashinfer" in {p["dist"] for p in data["plugins"]}


def test_registration_and_check_reasons(monkeypatch):
    regs = get_registries().attention
    fi, trt = regs.get("flashinfer"), regs.get("trtllm_mha")
    assert fi.dist == trt.dist == "engine-attention-flashinfer"
    assert fi.extra["priority"] == 20 and trt.extra["priority"] == 25
    assert "fp8_e5m2" in fi.extra["kv_dtypes"] and "fp8_e5m2" not in trt.extra["kv_dtypes"]
    cpu = DeviceInfo("cpu", "CPU")
    assert "compute capability >= 8.0" in fi.unavailable_reason(cpu)
    assert "Blackwell" in trt.unavailable_reason(cpu)
    turing = DeviceInfo("cuda", "T4", (7, 5))
    assert "found T4 (compute capability 7.5)" in fi.unavailable_reason(turing)
    a100, hopper, b200 = (DeviceInfo("cuda", n, c) for n, c in
                          (("A100", (8, 0)), ("H100", (9, 0)), ("B200", (10, 0))))
    assert "compute capability 10.x" in plugin.check_trtllm(hopper)
    for installed in (False, True):
        spec = object() if installed else None
        monkeypatch.setattr(plugin.importlib.util, "find_spec", lambda name, s=spec: s)
        want = None if installed else plugin.NEEDS_PACKAGE
        assert plugin.check_flashinfer(a100) == plugin.check_flashinfer(b200) == want
        assert plugin.check_trtllm(b200) == want
    assert "pip install 'engine-attention-flashinfer[cuda]'" in plugin.NEEDS_PACKAGE


def test_factories_refuse_what_the_kernels_cannot_run():
    pool = KVPool(2, 2, 16, 64, torch.bfloat16, page_size=1, max_reqs=2, max_context_len=64)
    with pytest.raises(IncompatibleOptions, match="--dtype bfloat16"):
        flashinfer_backend.from_context(BackendContext(pool, SPECS, "cpu", torch.float32))
    with pytest.raises(IncompatibleOptions, match="--page-size 16, 32 or 64"):
        trtllm_backend.from_context(BackendContext(pool, SPECS, "cpu", torch.bfloat16))


# -- metadata on hand-checked batches -------------------------------------------------------
def hand_pool(page_size, rows):
    """A pool whose request rows hold the given slots (positions 0..)."""
    pool = KVPool(1, 1, 8, 256, torch.float32, page_size=page_size, max_reqs=4,
                  max_context_len=64)
    for r, slots in enumerate(rows):
        pool.req_to_token[r, :len(slots)] = torch.tensor(slots)
    return pool


def pages(*ids, page_size=16, last=16):
    return [p * page_size + i for p in ids[:-1] for i in range(page_size)] + \
        [ids[-1] * page_size + i for i in range(last)]


def test_metadata_page_size_16_mixed_batch():
    # request 0: 20 tokens on pages 5, 2 (prefix 17, 3 new); request 1: exactly one full page 7
    # (a decode); request 2: a one-token prompt on page 3
    pool = hand_pool(16, [pages(5, 2, last=4), pages(7), pages(3, last=1)])
    batch = ForwardBatch.build([[0] * 3, [0], [0]], [17, 15, 0], [0, 1, 2], None,
                               pool.req_to_token)
    assert batch.mode == ForwardMode.MIXED
    m = paged_kv(batch, 16)
    assert m.qo_indptr.tolist() == [0, 3, 4, 5]
    assert m.kv_indptr.tolist() == [0, 2, 3, 4]
    assert m.kv_indices.tolist() == [5, 2, 7, 3]
    assert m.kv_last_page_len.tolist() == [4, 16, 1]
    t = block_tables(batch, 16)
    assert t.block_tables.tolist() == [[5, 2], [7, 0], [3, 0]]
    assert t.seq_lens.tolist() == [20, 16, 1]
    assert t.cum_seq_lens_q.tolist() == [0, 3, 4, 5]
    assert t.cum_seq_lens_kv.tolist() == [0, 20, 36, 37]
    assert (t.max_q_len, t.max_kv_len) == (3, 20)
    for x in (m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_last_page_len, t.block_tables,
              t.seq_lens, t.cum_seq_lens_q, t.cum_seq_lens_kv):
        assert x.dtype == torch.int32


def test_metadata_page_size_1_scattered_decode():
    pool = hand_pool(1, [[9, 4, 7], [2]])
    batch = ForwardBatch.build([[0], [0]], [2, 0], [0, 1], None, pool.req_to_token)
    assert batch.mode == ForwardMode.DECODE
    m = paged_kv(batch, 1)
    assert (m.qo_indptr.tolist(), m.kv_indptr.tolist()) == ([0, 1, 2], [0, 3, 4])
    assert m.kv_indices.tolist() == [9, 4, 7, 2]
    assert m.kv_last_page_len.tolist() == [1, 1]
    t = block_tables(batch, 1)
    assert t.block_tables.tolist() == [[9, 4, 7], [2, 0, 0]]
    assert t.cum_seq_lens_q is None and (t.max_q_len, t.max_kv_len) == (1, 3)


def test_paged_cache_is_a_view_with_canonical_strides_for_one_kv_head():
    for kvh in (1, 2):
        pool = KVPool(1, kvh, 8, 64, torch.float32, page_size=16, max_reqs=2, max_context_len=64)
        pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape))
        for read_as_hnd in (False, True):
            k, _ = paged_cache(pool, 0, read_as_hnd)
            assert k.shape == (5, 16, kvh, 8) and k.data_ptr() == pool.k_buffer[0].data_ptr()
            assert torch.equal(k.reshape(-1, kvh, 8), pool.k_buffer[0])
        hnd = k.transpose(-3, -2)  # what the TensorRT-LLM entry points take of it
        assert not any(hnd.shape[i] == 1 and hnd.stride(i) == hnd.stride(i + 1) for i in range(3))


# -- both backends (reference kernels) against torch_native ----------------------------------
def make_backends(specs, page_size, dtype=torch.float32, flashinfer_ops=None, trtllm_ops=None):
    kvh, d = specs[0].num_kv_heads, specs[0].head_dim
    pool = KVPool(len(specs), kvh, d, 1024, dtype, page_size=page_size, max_reqs=8,
                  max_context_len=512, needs_scale=dtype.itemsize == 1)
    ctx = BackendContext(pool, specs, "cpu", torch.float32)
    return pool, (FlashInferBackend(ctx, flashinfer_ops or flashinfer_reference_ops(), 1024),
                  TrtllmMhaBackend(ctx, trtllm_ops or trtllm_reference_ops(), 1024),
                  TorchNativeBackend(ctx))


@pytest.mark.parametrize("heads", [(4, 2), (8, 1)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_both_backends_match_torch_native(heads, page_size):
    H, KVH = heads
    specs = [AttentionLayerSpec(H, KVH, 16, 0.25), AttentionLayerSpec(H, KVH, 16, 0.3, 5)]
    pool, backends = make_backends(specs, page_size)
    filler, held = scattered_filler(pool, page_size)  # the requests' pages interleave
    run_mixed_steps(pool, backends, specs, torch.Generator().manual_seed(0), 1e-5)
    pool.free_pages(held[1::2])
    assert pool.free_slots == pool.size


def new_batch(pool, rows, lens, new_lens):
    locs = [pool.extend_slots(r, n, e) for r, n, e in zip(rows, lens, new_lens)]
    return ForwardBatch.build([[0] * e for e in new_lens], lens, rows, torch.cat(locs),
                              pool.req_to_token)


def run_layers(backends, batch, specs, gen, tol, q_round=None, keep=slice(None)):
    """Every layer's same random q/k/v through each backend (metadata already set); outputs
    (rows ``keep``) equal the last backend's."""
    for layer, spec in enumerate(specs):
        q, k, v = (torch.randn(batch.num_tokens, n, spec.head_dim, generator=gen)
                   for n in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads))
        q = q if q_round is None else q.to(q_round).float()
        *ours, ref = (b.forward(q, k, v, layer, batch) for b in backends)
        for out in ours:
            assert out.dtype == ref.dtype and out.shape == ref.shape
            torch.testing.assert_close(out[keep], ref[keep], atol=tol, rtol=tol)


def test_fp8_pool_with_per_layer_scales():
    specs = [AttentionLayerSpec(4, 2, 16, 0.25), AttentionLayerSpec(4, 2, 16, 0.25, 7)]
    queries = []

    def context(**kw):
        queries.append(kw["query"].dtype)
        return reference_trtllm_context(**kw)

    trt_ops = trtllm_reference_ops()
    trt_ops.context = context
    pool, (fi, trt, native) = make_backends(specs, 16, torch.float8_e4m3fn, trtllm_ops=trt_ops)
    pool.k_scale[:] = [0.5, 0.25]  # stored = real / scale
    pool.v_scale[:] = [2.0, 0.125]
    gen = torch.Generator().manual_seed(2)
    # flashinfer dequantizes the same stored bytes as torch_native: equal to float32 rounding
    run_mixed_steps(pool, (fi, native), specs, gen, 1e-5)

    # trtllm's context kernels take fp8 queries next to fp8 K/V: with queries that e4m3 holds
    # exactly, equal to float32 rounding too (with any queries, within e4m3's rounding of q)
    def step(pool, backends, rows, lens, new, specs, gen, tol):
        batch = new_batch(pool, rows, lens, new)
        for b in backends:
            b.init_forward_metadata(batch)
        run_layers(backends, batch, specs, gen, tol, q_round=torch.float8_e4m3fn)
        return batch

    run_mixed_steps(pool, (trt, native), specs, gen, 1e-5, step=step)
    assert queries and set(queries) == {torch.float8_e4m3fn}


# -- CUDA-graph methods on CPU: fixed buffers, refilled in place before each replay -----------
def graph_batch(pool, rows, lens, bs):
    """The next decode step of ``rows`` (holding ``lens`` tokens) padded to ``bs`` rows as the
    graph runner pads it: scratch row, prefix 0, one token, slot 0."""
    pad = bs - len(rows)
    locs = [pool.extend_slots(r, n, 1) for r, n in zip(rows, lens)]
    return ForwardBatch.build([[0]] * bs, [*lens, *[0] * pad], [*rows, *[pool.scratch_row] * pad],
                              torch.cat([*locs, torch.zeros(pad, dtype=torch.int64)]),
                              pool.req_to_token, device=pool.device)


def graph_buffers(backend):
    if isinstance(backend, FlashInferBackend):
        return [backend.graph_indptr, backend.graph_indices, backend.graph_last_page_len]
    return [backend.graph_tables, backend.graph_seq_lens]


@pytest.mark.parametrize("kind", [0, 1])  # flashinfer, trtllm_mha
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_capture_then_replay_in_place(kind, page_size):
    pool, backends = make_backends(SPECS, page_size)
    ours, native = backends[kind], backends[2]
    assert ours.supports_cuda_graph
    ours.init_cuda_graph_state(4)
    gen = torch.Generator().manual_seed(3)
    rows = [pool.alloc_req() for _ in range(4)]
    compare_backends_step(pool, (native,), rows, [0] * 4, [7, 30, 2, 18], SPECS, gen, 0)
    lens = dict(zip(rows, [7, 30, 2, 18]))

    def decode_step(step_rows, bs):
        batch = graph_batch(pool, step_rows, [lens[r] for r in step_rows], bs)
        for r in step_rows:
            lens[r] += 1
        return batch

    # two sizes sharing the buffers; the replayed step swaps requests and lengths
    for bs, first, then in ((4, rows[:3], [rows[0], rows[3], rows[2]]), (2, rows[:2], rows[2:])):
        batch = decode_step(first, bs)
        ours.init_forward_metadata_capture_cuda_graph(bs, batch)
        kept = ours.active if kind == 0 else ours.meta
        ptrs = [b.data_ptr() for b in graph_buffers(ours)]
        native.init_forward_metadata(batch)
        run_layers((ours, native), batch, SPECS, gen, 1e-5, keep=slice(0, len(first)))
        refill_batch(batch, decode_step(then, bs))
        ours.init_forward_metadata_replay_cuda_graph(bs, batch)
        assert [b.data_ptr() for b in graph_buffers(ours)] == ptrs
        assert (ours.active if kind == 0 else ours.meta) is kept
        native.init_forward_metadata(batch)
        run_layers((ours, native), batch, SPECS, gen, 1e-5, keep=slice(0, len(then)))
    if kind == 0:  # the graph wrappers read the fixed buffers only
        for wrappers in ours.graph_wrappers.values():
            assert all(w.meta[1] is ours.graph_indices for w in wrappers.values())
    else:
        assert ours.meta.block_tables.data_ptr() == ours.graph_tables.data_ptr()
    free_requests(pool, rows, [lens[r] for r in rows])


@pytest.mark.parametrize("kind", [0, 1])  # flashinfer, trtllm_mha
def test_greedy_under_the_graph_runner_matches_hf(tiny_model_factory, registries, kind):
    """Prompts run eagerly, every decode step replays the engine's graph for 4 rows (3 prompts:
    one padding row), here the EagerGraph stand-in re-running the forward on the fixed batch."""
    backend = [lambda ctx: FlashInferBackend(ctx, flashinfer_reference_ops(), 1024),
               lambda ctx: TrtllmMhaBackend(ctx, trtllm_reference_ops(), 1024)][kind]
    greedy_matches_hf(tiny_model_factory("qwen2_bias_window"), registries, backend,
                      cuda_graph=True)


# -- prompts through the ragged wrapper, merged with the cached prefix ------------------------
def test_merge_state_of_two_key_sets_is_attention_over_both():
    """The reference's base-2 log-sum-exps and merge_state: attention over keys A then B
    equals merging attention over A (not causal: all of it precedes) with attention over B
    (causal); an empty A (no cached prefix: lse -inf) leaves B's state as it is."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(5, 4, 16, generator=gen)
    k, v = torch.randn(12, 2, 16, generator=gen), torch.randn(12, 2, 16, generator=gen)
    whole, whole_lse = attend_lse(q, k, v, 0.3, -1)
    a, a_lse = attend_lse(q, k[:7], v[:7], 0.3, -1, causal=False)
    b, b_lse = attend_lse(q, k[7:], v[7:], 0.3, -1)
    merged, merged_lse = reference_merge_state(a, a_lse, b, b_lse)
    torch.testing.assert_close(merged, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(merged_lse, whole_lse, atol=1e-5, rtol=1e-6)
    s = torch.einsum("nhd,lhd->hnl", q[:, :2], k[:, :1].expand(-1, 2, -1)) * 0.3  # heads 0, 1
    causal = torch.arange(12)[None, :] <= torch.arange(7, 12)[:, None]
    ln = torch.logsumexp(s.masked_fill(~causal, float("-inf")), -1).T
    torch.testing.assert_close(whole_lse[:, :2], ln * 1.4426950408889634)  # base 2
    empty, empty_lse = attend_lse(q, k[:0], v[:0], 0.3, -1, causal=False)
    assert empty.abs().max() == 0 and torch.isneginf(empty_lse).all()
    torch.testing.assert_close(reference_merge_state(empty, empty_lse, b, b_lse)[0], b)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prompts_run_ragged_and_merge_the_cached_prefix(page_size):
    """Prompts without a prefix: the ragged wrapper alone; extends over a cached prefix (and
    decodes beside them): ragged + the paged prefix (not causal; a request without prefix has 0
    pages and last-page length 0) + merge_state; the sliding-window layer: the paged wrapper
    over whole sequences. All equal to torch_native, on interleaved pages."""
    calls: dict = {}
    ops = recording_flashinfer_ops(calls)
    pool, (fi, _, native) = make_backends(SPECS, page_size, flashinfer_ops=ops)
    assert set(fi.ragged) == {fi.keys[0]}  # the windowed layer's group stays paged
    scattered_filler(pool, page_size)
    gen = torch.Generator().manual_seed(8)
    rows = [pool.alloc_req() for _ in range(3)]
    compare_backends_step(pool, (fi, native), rows, [0] * 3, [20, 1, 37], SPECS, gen, 1e-5)
    assert len(calls["ragged.run"]) == 1 and "merge_state" not in calls
    assert not fi.with_prefix
    # prefix hits: 20 and 37 cached tokens under new ones, a decode, and one new prompt
    rows.append(pool.alloc_req())
    calls.clear()
    batch = compare_backends_step(pool, (fi, native), rows, [20, 1, 37, 0], [9, 1, 1, 6], SPECS,
                                  gen, 1e-5)
    assert batch.mode == ForwardMode.MIXED and fi.with_prefix
    assert len(calls["ragged.run"]) == len(calls["merge_state"]) == 1
    prefix_plan, window_plan = (kw for _, kw in calls["prefill.plan"])
    assert prefix_plan["causal"] is False and window_plan["causal"] is True
    (qo, kv_indptr, _, last), _ = (a[:4] for a, _ in calls["prefill.plan"])
    assert kv_indptr.tolist() == [0, *accumulate(
        -(-n // page_size) for n in [20, 1, 37, 0])]
    assert last.tolist() == [(n - 1) % page_size + 1 if n else 0 for n in [20, 1, 37, 0]]
    ragged_args, ragged_kw = calls["ragged.plan"][0]
    assert ragged_args[0].tolist() == ragged_args[1].tolist() == qo.tolist() == [0, 9, 10, 11,
                                                                                 17]
    assert ragged_kw["causal"] is True
    free_requests(pool, rows, [29, 2, 38, 6])


def test_mixed_steps_match_torch_native_without_ragged():
    """ragged=False keeps the one paged launch per layer group (the path fp8 pools take)."""
    specs = SPECS
    pool, (_, _, native) = make_backends(specs, 16)
    fi = FlashInferBackend(native.ctx, flashinfer_reference_ops(), 1024, ragged=False)
    assert fi.ragged == {}
    run_mixed_steps(pool, (fi, native), specs, torch.Generator().manual_seed(9), 1e-5)


def test_workspace_and_prefill_backend_options(monkeypatch):
    """384 MiB by default (SGLang's), --flashinfer-workspace-size in MiB; the prefill wrappers
    get backend="fa3" on Hopper where flashinfer's FA3 kernels apply, "fa2" elsewhere."""
    assert flashinfer_backend.WORKSPACE_BYTES == 384 << 20
    flags = {o.flag: (p, o.default) for p, o in get_registries().serve_options}
    assert flags["--flashinfer-workspace-size"] == ("attention_flashinfer", 384)
    assert flags["--flashinfer-prefill-backend"] == ("attention_flashinfer", "auto")
    calls: dict = {}
    monkeypatch.setattr(flashinfer_backend, "flashinfer_ops", lambda: recording_flashinfer_ops(
        calls))
    pool = KVPool(2, 2, 16, 64, torch.bfloat16, page_size=1, max_reqs=2, max_context_len=64)
    ctx = BackendContext(pool, SPECS, "cpu", torch.bfloat16,
                         options={"flashinfer_workspace_size": 3})
    fi = flashinfer_backend.from_context(ctx)
    assert fi.workspace.numel() == 3 << 20 and fi.prefill_backend == "fa2"  # no GPU here
    assert {kw["backend"] for _, kw in calls["prefill.__init__"] + calls["ragged.__init__"]} == {
        "fa2"}
    choose = flashinfer_backend.choose_prefill_backend
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    assert choose("auto", (9, 0), bf16, bf16, [128], True) == "fa3"
    assert choose("auto", (9, 0), bf16, bf16, [128], False) == "fa2"  # CUDA < 12.3 build
    assert choose("auto", (8, 0), bf16, bf16, [128], True) == "fa2"
    assert choose("auto", (9, 0), bf16, fp8, [128], True) == "fa2"  # FA3 wants fp8 queries
    assert choose("auto", (9, 0), bf16, bf16, [96], True) == "fa2"
    assert choose("fa2", (9, 0), bf16, bf16, [128], True) == "fa2"
    with pytest.raises(IncompatibleOptions, match="needs a Hopper GPU"):
        choose("fa3", (8, 0), bf16, bf16, [128], True)
    with pytest.raises(IncompatibleOptions, match="one of auto, fa2, fa3"):
        choose("fa4", (9, 0), bf16, bf16, [128], True)


# -- what the backends pass, against the real flashinfer signatures --------------------------
def recorded_calls():
    """Every call the two backends make into flashinfer over prompts, decodes, a mixed step,
    fp8 scales and a CUDA-graph capture and replay."""
    calls: dict = {}
    fi_ops = recording_flashinfer_ops(calls)
    trt_ops = trtllm_reference_ops()
    for name, fn in (("decode", reference_trtllm_decode), ("context", reference_trtllm_context)):
        setattr(trt_ops, name, recording_function(fn, calls, f"trtllm.{name}"))
    pool, backends = make_backends(SPECS, 16, torch.float8_e4m3fn, fi_ops, trt_ops)
    gen = torch.Generator().manual_seed(4)
    for b in backends[:2]:
        b.init_cuda_graph_state(2)
        rows = [pool.alloc_req() for _ in range(2)]
        compare_backends_step(pool, (b,), rows, [0, 0], [5, 3], SPECS, gen, 0)
        compare_backends_step(pool, (b,), rows, [5, 3], [1, 1], SPECS, gen, 0)
        compare_backends_step(pool, (b,), rows, [6, 4], [1, 4], SPECS, gen, 0)
        batch = graph_batch(pool, rows, [7, 8], 2)
        b.init_forward_metadata_capture_cuda_graph(2, batch)
        b.init_forward_metadata_replay_cuda_graph(2, batch)
        run_layers((b,), batch, SPECS, gen, 0)
        free_requests(pool, rows, [8, 9])
    # a pool in the model's dtype: prompts through the ragged wrapper, merged with the prefix
    pool, backends = make_backends(SPECS, 16, torch.float32, fi_ops, trt_ops)
    rows = [pool.alloc_req() for _ in range(2)]
    compare_backends_step(pool, backends[:1], rows, [0, 0], [5, 3], SPECS, gen, 0)
    compare_backends_step(pool, backends[:1], rows, [5, 3], [2, 4], SPECS, gen, 0)
    free_requests(pool, rows, [7, 7])
    return calls


def recording_flashinfer_ops(calls: dict):
    ops = flashinfer_reference_ops()
    ops.prefill_wrapper = recording(ReferencePrefillWrapper, calls, "prefill")
    ops.ragged_wrapper = recording(ReferenceRaggedWrapper, calls, "ragged")
    ops.decode_wrapper = recording(ReferenceDecodeWrapper, calls, "decode")
    ops.merge_state = recording_function(reference_merge_state, calls, "merge_state")
    return ops


def test_calls_bind_to_the_real_flashinfer_signatures():
    flashinfer = pytest.importorskip(
        "flashinfer", reason="flashinfer-python is not installed: pip install "
        "'engine-attention-flashinfer[cuda]' (any machine can import it for this check)")
    from flashinfer.cascade import merge_state
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache
    from flashinfer.prefill import trtllm_batch_context_with_kv_cache

    prefill, decode, ragged = (flashinfer.BatchPrefillWithPagedKVCacheWrapper,
                               flashinfer.BatchDecodeWithPagedKVCacheWrapper,
                               flashinfer.BatchPrefillWithRaggedKVCacheWrapper)
    real = {"prefill.__init__": [prefill.__init__], "prefill.plan": [prefill.plan],
            "prefill.run": [prefill.run], "ragged.__init__": [ragged.__init__],
            "ragged.plan": [ragged.plan], "ragged.run": [ragged.run],
            "merge_state": [merge_state], "decode.__init__": [decode.__init__],
            # decode.plan takes **kwargs and hands them to _plan_impl, which names them
            "decode.plan": [decode.plan, decode._plan_impl], "decode.run": [decode.run],
            "trtllm.decode": [trtllm_batch_decode_with_kv_cache],
            "trtllm.context": [trtllm_batch_context_with_kv_cache]}
    calls = recorded_calls()
    assert set(calls) == set(real)
    graph_inits = [kw for _, kw in calls["decode.__init__"] if kw.get("use_cuda_graph")]
    assert graph_inits and all(k.endswith("_buffer") or k in ("use_cuda_graph", "kv_layout",
                                                               "use_tensor_cores")
                               for kw in graph_inits for k in kw)
    for name, fns in real.items():
        for fn in fns:
            params = inspect.signature(fn).parameters
            for args, kwargs in calls[name]:
                if "self" in params:
                    args = (None, *args)
                inspect.signature(fn).bind(*args, **kwargs)  # TypeError on a wrong name/arity
                if fn.__name__ == "_plan_impl":
                    assert set(kwargs) <= set(params)


# -- the real kernels on a CUDA GPU ----------------------------------------------------------
def kernels_or_skip(kind):
    if not GPU:
        pytest.skip("needs a CUDA GPU (the real flashinfer kernels)")
    if not HAS_FLASHINFER:
        pytest.skip(plugin.NEEDS_PACKAGE)
    major = torch.cuda.get_device_capability()[0]
    if kind == "flashinfer" and major < 8:
        pytest.skip("flashinfer needs compute capability >= 8.0")
    if kind == "trtllm_mha" and major != 10:
        pytest.skip("trtllm_mha needs compute capability 10.x (Blackwell)")


def gpu_pair(kind, kv_dtype, page_size=16):
    specs = [AttentionLayerSpec(8, 2, 128, 128 ** -0.5),
             AttentionLayerSpec(8, 2, 128, 128 ** -0.5, 64)]
    pool = KVPool(2, 2, 128, 4096, kv_dtype, device="cuda", page_size=page_size, max_reqs=8,
                  max_context_len=1024, needs_scale=kv_dtype.itemsize == 1)
    if pool.needs_scale:
        pool.k_scale[:] = [0.5, 0.25]
        pool.v_scale[:] = [2.0, 0.125]
    ctx = BackendContext(pool, specs, "cuda", torch.bfloat16)
    make = flashinfer_backend.from_context if kind == "flashinfer" else trtllm_backend.from_context
    return pool, specs, make(ctx), TorchNativeBackend(ctx)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["flashinfer", "trtllm_mha"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_real_kernels_match_torch_native(kind, kv_dtype):
    kernels_or_skip(kind)
    pool, specs, ours, native = gpu_pair(kind, kv_dtype)
    gen = torch.Generator().manual_seed(5)
    # bf16 queries against bf16 SDPA; trtllm's prompts take e4m3 queries next to fp8 K/V (that
    # rounding alone reaches 0.12 on the CPU reference with these shapes and scales)
    tol = 0.25 if kind == "trtllm_mha" and kv_dtype != torch.bfloat16 else 3e-2
    run_mixed_steps(pool, (ours, native), specs, gen, tol, "cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["flashinfer", "trtllm_mha"])
def test_real_kernels_in_a_cuda_graph(kind):
    kernels_or_skip(kind)
    pool, specs, ours, native = gpu_pair(kind, torch.bfloat16)
    gen = torch.Generator().manual_seed(6)
    rows = [pool.alloc_req() for _ in range(3)]
    lens = [40, 300, 7]
    compare_backends_step(pool, (native,), rows, [0] * 3, lens, specs, gen, 0, "cuda",
                          torch.bfloat16)
    ours.init_cuda_graph_state(4)
    batch = graph_batch(pool, rows, lens, 4)
    qkv = [[torch.randn(4, n, 128, device="cuda", dtype=torch.bfloat16)
            for n in (s.num_heads, s.num_kv_heads, s.num_kv_heads)] for s in specs]
    ours.init_forward_metadata_capture_cuda_graph(4, batch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (kernel loading, autotuning) outside the capture
        for layer in range(len(specs)):
            ours.forward(*qkv[layer], layer, batch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [ours.forward(*qkv[layer], layer, batch) for layer in range(len(specs))]
    for _ in range(2):  # two replays, each with the next decode step's data written in place
        lens = [n + 1 for n in lens]
        step = graph_batch(pool, rows, lens, 4)
        refill_batch(batch, step)
        for t in (x for layer in qkv for x in layer):
            t.copy_(torch.randn(t.shape, generator=gen).to(t))
        ours.init_forward_metadata_replay_cuda_graph(4, batch)
        graph.replay()
        native.init_forward_metadata(batch)
        for layer in range(len(specs)):
            ref = native.forward(*qkv[layer], layer, batch)
            torch.testing.assert_close(outs[layer][:3].float(), ref[:3].float(), atol=3e-2,
                                       rtol=3e-2)
    free_requests(pool, rows, [n + 1 for n in lens])


@pytest.mark.gpu
def test_graph_memory_estimate_covers_the_real_backend():
    """What flashinfer really allocates for the backend and two captured sizes stays within
    what it reports to the CUDA-graph estimate (graph_memory_bytes)."""
    kernels_or_skip("flashinfer")
    specs = [AttentionLayerSpec(8, 2, 128, 128 ** -0.5),
             AttentionLayerSpec(8, 2, 128, 128 ** -0.5, 64)]
    pool = KVPool(2, 2, 128, 4096, torch.bfloat16, device="cuda", page_size=16, max_reqs=8,
                  max_context_len=1024)
    rows = [pool.alloc_req() for _ in range(2)]
    for r in rows:
        pool.extend_slots(r, 0, 10)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    fi = flashinfer_backend.from_context(BackendContext(pool, specs, "cuda", torch.bfloat16))
    fi.init_cuda_graph_state(2)
    for bs in (2, 1):
        fi.init_forward_metadata_capture_cuda_graph(bs, graph_batch(pool, rows[:bs], [10] * bs,
                                                                    bs))
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated() - before
    assert used <= flashinfer_backend.graph_memory_bytes(2, 2, specs, 16, 1024), used
