"""Attention backend 'fa3': its metadata checked by hand; the backend driving a torch model of
flash_attn_with_kvcache (engine_attention_fa3.reference, same keywords, same metadata) against
torch_native on one pool (random batches mixing prompts, extends over a cached prefix and
decodes; page sizes 1 and 16, scattered pages; GQA/MHA/MQA; a sliding window; float16 and fp8
pools with per-layer scales); the CUDA-graph methods (capture, in-place replay) on the CPU; the
call's keywords bound to the real kernel's signature; greedy decoding of a tiny model against
HF; how it is picked and refused. Under @pytest.mark.gpu: the real kernel on a Hopper GPU."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys

import pytest
import torch
from click.testing import CliRunner

from engine.attention.torch_native import TorchNativeBackend
from engine.device import DeviceInfo, detect_device
from engine.forward_batch import ForwardBatch
from engine.interfaces import AttentionBackend, AttentionLayerSpec, BackendContext
from engine.memory.kv_pool import KVPool
from engine.plugins import get_registries
from engine.registry import BackendUnavailable, IncompatibleOptions, resolve_attention_backend
from engine_testing.attention import (backend_matches_torch_native, compare_backends_step,
                                      refill_batch, run_mixed_steps, scattered_filler)
from engine_testing.generation import free_requests, greedy_matches_hf
from engine_attention_fa3 import _factory, check
from engine_attention_fa3.backend import FA3Backend
from engine_attention_fa3.metadata import FA3GraphBuffers, FA3Metadata
from engine_attention_fa3.reference import flash_attn_with_kvcache_reference as reference
from engine_cli.main import cli

FP8 = torch.float8_e4m3fn
# bfloat16 rounding of the kernel's output for fp8 queries: relative error <= 2^-9; 2^-8 leaves
# room for float32 summation-order noise, and a wrong scale or mask is off by far more
BF16_OUT_TOL = 2 ** -8


def kernel_importable() -> str | None:
    """None when sgl-kernel's FA3 loads here, else why not."""
    if importlib.util.find_spec("sgl_kernel") is None:
        return "needs sgl-kernel (pip install 'engine-attention-fa3[cuda]'); not installed here"
    try:
        import sgl_kernel.flash_attn  # noqa: F401
    except ImportError as e:
        return f"sgl-kernel is installed but its FA3 module does not load here: {e}"
    return None


def make_pair(specs, kvh, d, dtype=torch.float32, page_size=1, device="cpu", attn_fn=reference):
    pool = KVPool(len(specs), kvh, d, 1024, dtype, device=device, page_size=page_size,
                  max_reqs=8, max_context_len=512, needs_scale=dtype.itemsize == 1)
    ctx = BackendContext(pool, specs, device, torch.float32)
    return pool, FA3Backend(ctx, attn_fn), TorchNativeBackend(ctx)


class RoundedQueries(AttentionBackend):
    """torch_native fed the queries fa3 hands an fp8 kernel: rounded to the pool's dtype."""

    def __init__(self, inner: AttentionBackend, dtype: torch.dtype):
        super().__init__(inner.ctx)
        self.inner, self.dtype = inner, dtype

    def init_forward_metadata(self, batch):
        self.inner.init_forward_metadata(batch)

    def forward(self, q, k, v, layer_id, batch):
        return self.inner.forward(q.to(self.dtype).to(q.dtype), k, v, layer_id, batch)


# -- registration and refusal -----------------------------------------------------------------
def test_plugin_is_installed():
    data = json.loads(CliRunner().invoke(cli, ["plugins", "--json"]).output)
    assert "engine-attention-fa3" in {p["dist"] for p in data["plugins"]}


def test_registration_and_check_reasons(monkeypatch):
    entry = get_registries().attention.get("fa3")
    assert entry.dist == "engine-attention-fa3"
    assert entry.extra["kv_dtypes"] == ("auto", "bf16", "fp16", "fp8_e4m3")
    assert "compute capability 9.0" in entry.unavailable_reason(DeviceInfo("cpu", "CPU"))
    assert "found NVIDIA A100 (compute capability 8.0)" in entry.unavailable_reason(
        DeviceInfo("cuda", "NVIDIA A100", (8, 0)))
    hopper = DeviceInfo("cuda", "NVIDIA H100", (9, 0))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "pip install 'engine-attention-fa3[cuda]'" in check(hopper)


HOPPER = DeviceInfo("cuda", "NVIDIA H100", (9, 0))


def fake_sgl_kernel(tmp_path, monkeypatch, flash_attn_source: str):
    """An ``sgl_kernel`` package on sys.path whose ``flash_attn`` module runs the given source
    (an sgl-kernel wheel built for another torch fails in its extension's import)."""
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "flash_attn.py").write_text(flash_attn_source)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("sgl_kernel", "sgl_kernel.flash_attn"):
        # recorded as absent (setitem, then delitem), so that the fake modules imported during
        # the test are dropped again afterwards
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    importlib.invalidate_caches()


BROKEN = ("raise ImportError('/site-packages/sgl_kernel/sm90/common_ops.abi3.so: undefined "
          "symbol: _ZN3c1017RegisterOperatorsD1Ev')")


@pytest.mark.parametrize("error", ["ImportError", "OSError"])
def test_a_kernel_built_for_another_torch_is_unavailable_with_the_reason(tmp_path, monkeypatch,
                                                                         error):
    """The package is found but its kernel module does not import: check() says so (this is
    what `engine plugins` prints), and auto on a Hopper GPU falls through to the next backend
    instead of picking fa3 and failing after the weights are loaded."""
    fake_sgl_kernel(tmp_path, monkeypatch, BROKEN.replace("ImportError", error))
    assert importlib.util.find_spec("sgl_kernel") is not None  # the old check passed here
    reason = check(HOPPER)
    assert reason and "undefined symbol" in reason and "for this torch" in reason
    entry = get_registries().attention.get("fa3")
    assert entry.unavailable_reason(HOPPER) == reason
    from engine.plugins import pm

    picked = resolve_attention_backend(get_registries(), "auto", HOPPER, pm=pm,
                                       dtype="bfloat16")
    assert picked.name != "fa3"
    with pytest.raises(BackendUnavailable, match="undefined symbol"):
        resolve_attention_backend(get_registries(), "fa3", HOPPER, pm=pm, dtype="bfloat16")
    from engine_cli.plugins_cmd import collect  # what `engine plugins` lists for a device

    row = next(r for r in collect(HOPPER)["attention"] if r["name"] == "fa3")
    assert row["available"] is False and row["reason"] == reason


def test_a_kernel_that_imports_is_available(tmp_path, monkeypatch):
    fake_sgl_kernel(tmp_path, monkeypatch, "def flash_attn_with_kvcache(**kwargs):\n    pass\n")
    assert check(HOPPER) is None
    from engine.plugins import pm

    assert resolve_attention_backend(get_registries(), "auto", HOPPER, pm=pm,
                                     dtype="bfloat16").name == "fa3"


def test_factory_refuses_what_the_kernel_cannot_run():
    spec = AttentionLayerSpec(4, 2, 16, 0.25)
    for dtype in (torch.float32, torch.float8_e5m2):
        pool = KVPool(1, 2, 16, 64, dtype, needs_scale=dtype.itemsize == 1)
        with pytest.raises(IncompatibleOptions, match="float16, bfloat16 or fp8_e4m3"):
            _factory(BackendContext(pool, [spec], "cpu", torch.float32))
    pool = KVPool(1, 2, 12, 64, torch.bfloat16)
    with pytest.raises(IncompatibleOptions, match="multiple of 8"):
        _factory(BackendContext(pool, [AttentionLayerSpec(4, 2, 12, 0.3)], "cpu", torch.bfloat16))


@pytest.mark.skipif(kernel_importable() is None, reason="sgl-kernel's FA3 loads here")
def test_factory_names_the_missing_kernel():
    pool = KVPool(1, 2, 16, 64, torch.bfloat16)
    with pytest.raises(BackendUnavailable, match=r"pip install 'engine-attention-fa3\[cuda\]'"):
        _factory(BackendContext(pool, [AttentionLayerSpec(4, 2, 16, 0.25)], "cpu",
                                torch.bfloat16))


# -- metadata ----------------------------------------------------------------------------------
def test_metadata_page_size_1_by_hand():
    r2t = torch.zeros(3, 16, dtype=torch.int64)
    r2t[2, :5] = torch.tensor([5, 9, 2, 11, 7])
    r2t[0, :3] = torch.tensor([4, 3, 8])
    r2t[0, 3:9] = 99  # stale slots past the sequence: never in the table
    batch = ForwardBatch.build([[0, 0], [0], [0, 0, 0]], [3, 0, 2], [2, 1, 0], None, r2t)
    m = FA3Metadata.build(batch, 1)
    assert m.cu_seqlens_q.tolist() == [0, 2, 3, 6] and m.max_seqlen_q == 3
    assert m.cache_seqlens.tolist() == [5, 1, 5] and m.max_seqlen_k == 5
    assert m.page_table.tolist() == [[5, 9, 2, 11, 7], [0, 0, 0, 0, 0], [4, 3, 8, 99, 99]]
    assert {t.dtype for t in (m.cu_seqlens_q, m.cache_seqlens, m.page_table)} == {torch.int32}


def test_metadata_page_size_16_by_hand():
    r2t = torch.zeros(2, 64, dtype=torch.int64)
    for i, page in enumerate([7, 3, 12]):  # row 0: 40 tokens on pages 7, 3, 12
        r2t[0, 16 * i: 16 * i + 16] = torch.arange(16) + 16 * page
    r2t[1, :16] = torch.arange(16) + 16 * 5  # row 1: 9 tokens on page 5
    r2t[1, 16:48] = 16 * 30  # stale: past row 1's sequence
    batch = ForwardBatch.build([[0] * 10, [0]], [30, 8], [0, 1], None, r2t)
    m = FA3Metadata.build(batch, 16)
    assert m.cu_seqlens_q.tolist() == [0, 10, 11] and m.max_seqlen_q == 10
    assert m.cache_seqlens.tolist() == [40, 9] and m.max_seqlen_k == 40
    assert m.page_table.tolist() == [[7, 3, 12], [5, 0, 0]]


def test_metadata_on_scattered_pages():
    pool = KVPool(1, 1, 8, 1024, torch.float32, page_size=16, max_reqs=4, max_context_len=512)
    filler, pages = scattered_filler(pool, 16)
    rows = [pool.alloc_req() for _ in range(3)]
    lens = [33, 16, 100]
    for r, n in zip(rows, lens):
        pool.extend_slots(r, 0, n)
    batch = ForwardBatch.build([[0]] * 3, [n - 1 for n in lens], rows, None, pool.req_to_token)
    m = FA3Metadata.build(batch, 16)
    for i, (r, n) in enumerate(zip(rows, lens)):
        own = [int(pool.req_to_token[r, p]) // 16 for p in range(0, n, 16)]
        assert m.page_table[i].tolist() == own + [0] * (7 - len(own))
        assert sorted(own) == sorted(set(own)) and 0 not in own
    assert m.cu_seqlens_q.tolist() == [0, 1, 2, 3] and m.max_seqlen_q == 1


def test_graph_buffers_are_filled_in_place():
    r2t = torch.zeros(5, 64, dtype=torch.int64)
    r2t[0, :40] = torch.arange(40) + 16 * 6  # pages 6, 7, 8
    r2t[1, :5] = torch.arange(5) + 16 * 2
    bufs = FA3GraphBuffers(max_bs=4, max_context_len=64, page_size=16, device="cpu")
    first = bufs.fill(3, ForwardBatch.build([[0]] * 3, [39, 4, 0], [0, 1, 4], None, r2t))
    assert first.page_table.tolist() == [[6, 7, 8, 0], [2, 0, 0, 0], [0, 0, 0, 0]]
    assert first.cu_seqlens_q.tolist() == [0, 1, 2, 3] and first.cache_seqlens.tolist() == [
        40, 5, 1]
    again = bufs.fill(3, ForwardBatch.build([[0]] * 3, [4, 2, 0], [1, 0, 4], None, r2t))
    assert again.page_table.tolist() == [[2, 0, 0, 0], [6, 0, 0, 0], [0, 0, 0, 0]]
    assert again.max_seqlen_k == 5 and again.cache_seqlens.tolist() == [5, 3, 1]
    for a, b in zip((first.cu_seqlens_q, first.cache_seqlens, first.page_table),
                    (again.cu_seqlens_q, again.cache_seqlens, again.page_table)):
        assert a.data_ptr() == b.data_ptr()


# -- the backend against torch_native ----------------------------------------------------------
# (heads, kv heads, head dim): GQA, MHA, MQA
SHAPES = [(4, 2, 16), (2, 2, 32), (8, 1, 16)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_matches_torch_native_in_every_mode(shape, page_size):
    backend_matches_torch_native(lambda ctx: FA3Backend(ctx, reference), shape, page_size)


def test_float16_queries_and_pool():
    specs = [AttentionLayerSpec(4, 2, 32, 32 ** -0.5), AttentionLayerSpec(4, 2, 32, 0.2, 7)]
    pool, fa3, native = make_pair(specs, 2, 32, dtype=torch.float16, page_size=16)
    # the same float16 K/V; float32 softmax and sums here, SDPA's own in float16
    run_mixed_steps(pool, (fa3, native), specs, torch.Generator().manual_seed(1), 2e-3,
                    q_dtype=torch.float16)


SCALED = [AttentionLayerSpec(4, 2, 16, 0.25), AttentionLayerSpec(4, 2, 16, 0.25, 7)]


def fp8_pair(page_size=16):
    pool, fa3, native = make_pair(SCALED, 2, 16, dtype=FP8, page_size=page_size)
    pool.k_scale[:] = [0.5, 0.25]  # stored = real / scale, as the fp8 KV dtypes set them
    pool.v_scale[:] = [2.0, 0.125]
    return pool, fa3, native


@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_pool_with_per_layer_scales(page_size):
    pool, fa3, native = fp8_pair(page_size)
    # q goes to the kernel in fp8: torch_native gets the same rounded q, so the only difference
    # left is the bfloat16 output of an fp8 kernel call
    run_mixed_steps(pool, (fa3, RoundedQueries(native, FP8)), SCALED,
                    torch.Generator().manual_seed(2), BF16_OUT_TOL)


def test_fp8_query_rounding_stays_small():
    pool, fa3, native = fp8_pair()
    # against float32 queries: e4m3 keeps 3 mantissa bits (relative error <= 2^-4 per query
    # element); on these outputs (|out| up to about 3) that moved none by more than 0.072, about
    # half of what 0.1 + 0.1 |ref| allows. The exact comparison is the test above
    run_mixed_steps(pool, (fa3, native), SCALED, torch.Generator().manual_seed(3), 0.1)


# -- CUDA graphs, on the CPU: capture, then replay other requests through the same tensors -----
def fixed_decode_batch(pool, rows, lens, bs, device="cpu"):
    """A decode batch of ``bs`` rows: ``rows`` bring one token each, the rest are padding."""
    pad = bs - len(rows)
    locs = [pool.extend_slots(r, n, 1) for r, n in zip(rows, lens)]
    return ForwardBatch.build([[0]] * bs, [*lens, *[0] * pad], [*rows, *[pool.scratch_row] * pad],
                              torch.cat([*locs, torch.zeros(pad, dtype=torch.int64)]),
                              pool.req_to_token, device=device)


def compare_layers(fa3, ref, batch, specs, gen, tol, device="cpu", q_dtype=torch.float32):
    ref.init_forward_metadata(batch)
    for layer, spec in enumerate(specs):
        q, k, v = (torch.randn(batch.num_tokens, n, spec.head_dim, generator=gen)
                   .to(device, q_dtype)
                   for n in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads))
        ours = fa3.forward(q, k, v, layer, batch)
        torch.testing.assert_close(ours.float(), ref.forward(q, k, v, layer, batch).float(),
                                   atol=tol, rtol=tol)


def graph_tensors(fa3, layer):
    m = fa3.meta
    return [m.cu_seqlens_q, m.cache_seqlens, m.page_table,
            *fa3.descales(layer, m.cache_seqlens.shape[0], 2).values()]


@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8])
def test_cuda_graph_capture_then_replay_in_place(kv_dtype):
    if kv_dtype == FP8:
        pool, fa3, native = fp8_pair()
        ref, tol = RoundedQueries(native, FP8), BF16_OUT_TOL
    else:
        pool, fa3, native = make_pair(SCALED, 2, 16, page_size=16)
        ref, tol = native, 1e-5
    assert fa3.supports_cuda_graph
    gen = torch.Generator().manual_seed(4)
    fa3.init_cuda_graph_state(max_bs=4)
    rows = [pool.alloc_req() for _ in range(5)]
    lens = [40, 7, 20, 3, 70]
    compare_backends_step(pool, (fa3, ref), rows, [0] * 5, lens, SCALED, gen, tol)

    fixed = fixed_decode_batch(pool, rows[:3], lens[:3], bs=4)  # one padding row
    fa3.init_forward_metadata_capture_cuda_graph(4, fixed)
    captured = [t.data_ptr() for t in graph_tensors(fa3, 1)]
    compare_layers(fa3, ref, fixed, SCALED, gen, tol)
    lens[:3] = [n + 1 for n in lens[:3]]

    # other requests (a longer one); then shorter ones and two padding rows, so stale pages
    # of the previous replay would show
    for idx in ([2, 3, 4], [0, 1]):
        refill_batch(fixed, fixed_decode_batch(pool, [rows[i] for i in idx], [lens[i] for i in idx],
                                         bs=4))
        fa3.init_forward_metadata_replay_cuda_graph(4, fixed)
        assert [t.data_ptr() for t in graph_tensors(fa3, 1)] == captured
        table = fa3.meta.page_table.tolist()
        for i, row in zip(idx, table):
            pages = -(-(lens[i] + 1) // 16)
            assert 0 not in row[:pages] and row[pages:] == [0] * (len(row) - pages)
        assert all(row == [0] * len(row) for row in table[len(idx):])  # padding: scratch page
        compare_layers(fa3, ref, fixed, SCALED, gen, tol)
        for i in idx:
            lens[i] += 1
    free_requests(pool, rows, lens)


# -- the call, bound to the real kernel's signature --------------------------------------------
# flash_attn_with_kvcache's parameters in sgl-kernel 0.3.21 (sgl_kernel/flash_attn.py), so a
# misspelled keyword fails here too; test_call_binds_to_the_installed_kernel checks the real one
SGL_KERNEL_PARAMS = (
    "q", "k_cache", "v_cache", "k", "v", "qv", "rotary_cos", "rotary_sin", "cache_seqlens",
    "cache_batch_idx", "cache_leftpad", "page_table", "cu_seqlens_q", "cu_seqlens_k_new",
    "max_seqlen_q", "rotary_seqlens", "q_descale", "k_descale", "v_descale", "softmax_scale",
    "causal", "window_size", "attention_chunk", "softcap", "rotary_interleaved",
    "scheduler_metadata", "num_splits", "pack_gqa", "sm_margin", "return_softmax_lse", "sinks",
    "score_mod", "aux_tensors", "ver")


def recorded_calls(kv_dtype):
    calls = []

    def recording(**kwargs):
        calls.append(kwargs)
        return reference(**kwargs)

    pool = KVPool(2, 2, 16, 256, kv_dtype, page_size=16, max_reqs=4, max_context_len=128,
                  needs_scale=kv_dtype.itemsize == 1)
    fa3 = FA3Backend(BackendContext(pool, SCALED, "cpu", torch.float32), recording)
    native = TorchNativeBackend(fa3.ctx)
    rows = [pool.alloc_req() for _ in range(2)]
    compare_backends_step(pool, (fa3, RoundedQueries(native, kv_dtype)), rows, [0, 0], [5, 9],
                          SCALED, torch.Generator().manual_seed(5), BF16_OUT_TOL)
    return calls


def test_call_uses_only_the_kernels_keywords():
    assert set(inspect.signature(reference).parameters) <= set(SGL_KERNEL_PARAMS)
    plain, scaled = recorded_calls(torch.bfloat16), recorded_calls(FP8)
    assert [c["window_size"] for c in plain] == [(-1, -1), (6, 0)]
    assert "k_descale" not in plain[0] and scaled[1]["k_descale"].shape == (2, 2)
    assert scaled[0]["q"].dtype == FP8 and plain[0]["q"].dtype == torch.bfloat16
    for kwargs in plain + scaled:
        assert set(kwargs) <= set(SGL_KERNEL_PARAMS)
        inspect.signature(reference).bind(**kwargs)


@pytest.mark.skipif(kernel_importable() is not None, reason=str(kernel_importable()))
def test_call_binds_to_the_installed_kernel():
    from sgl_kernel.flash_attn import flash_attn_with_kvcache

    for kwargs in recorded_calls(torch.bfloat16) + recorded_calls(FP8):
        inspect.signature(flash_attn_with_kvcache).bind(**kwargs)


# -- through a model ----------------------------------------------------------------------------
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_greedy_matches_hf_generate(tiny_model_factory, registries, cuda_graph):
    """With cuda_graph: the engine's graph runner (the CPU's EagerGraph stand-in) replays the
    decode steps at size 4 with one padding row."""
    greedy_matches_hf(tiny_model_factory("qwen2_bias_window"), registries,
                      lambda ctx: FA3Backend(ctx, reference), cuda_graph)


# -- on a Hopper GPU with sgl-kernel: the real kernel -------------------------------------------
def hopper_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none here)"
    if torch.cuda.get_device_capability()[0] != 9:
        return f"needs a Hopper GPU (compute capability 9.x), found {torch.cuda.get_device_name()}"
    return kernel_importable()


needs_hopper = pytest.mark.skipif(hopper_reason() is not None, reason=str(hopper_reason()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_check_on_this_gpu_matches_its_capability_and_kernel():
    entry = get_registries().attention.get("fa3")
    assert (entry.unavailable_reason(detect_device()) is None) == (hopper_reason() is None)


def real_kernel():
    from sgl_kernel.flash_attn import flash_attn_with_kvcache

    return flash_attn_with_kvcache


GPU_SPECS = [AttentionLayerSpec(8, 2, 128, 128 ** -0.5), AttentionLayerSpec(8, 2, 128, 0.1, 9)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("page_size", [1, 16])
def test_real_kernel_matches_torch_native_bf16(page_size):
    pool, fa3, native = make_pair(GPU_SPECS, 2, 128, torch.bfloat16, page_size, "cuda",
                                  real_kernel())
    scattered_filler(pool, page_size)
    # bfloat16 inputs and output on both sides, different summation orders
    run_mixed_steps(pool, (fa3, native), GPU_SPECS, torch.Generator().manual_seed(6), 2e-2,
                    "cuda", torch.bfloat16)


@pytest.mark.gpu
@needs_hopper
def test_real_kernel_fp8_pool_matches_torch_native():
    pool, fa3, native = make_pair(GPU_SPECS, 2, 128, FP8, 16, "cuda", real_kernel())
    pool.k_scale[:] = [0.5, 0.25]
    pool.v_scale[:] = [2.0, 0.125]
    # FA3 also rounds the softmax probabilities to fp8 for P @ V: a few percent, hence 5e-2
    run_mixed_steps(pool, (fa3, RoundedQueries(native, FP8)), GPU_SPECS,
                    torch.Generator().manual_seed(7), 5e-2, "cuda", torch.bfloat16)


@pytest.mark.gpu
@needs_hopper
def test_real_kernel_in_a_captured_cuda_graph():
    pool, fa3, native = make_pair(GPU_SPECS, 2, 128, torch.bfloat16, 16, "cuda", real_kernel())
    gen = torch.Generator().manual_seed(8)
    rows = [pool.alloc_req() for _ in range(4)]
    lens = [40, 7, 100, 3]
    compare_backends_step(pool, (fa3, native), rows, [0] * 4, lens, GPU_SPECS, gen, 2e-2,
                          "cuda", torch.bfloat16)
    fa3.init_cuda_graph_state(max_bs=4)
    fixed = fixed_decode_batch(pool, rows[:2], lens[:2], bs=4, device="cuda")
    layer = 1  # the sliding-window layer
    q, k, v = (torch.randn(4, n, 128, device="cuda", dtype=torch.bfloat16) for n in (8, 2, 2))
    fa3.init_forward_metadata_capture_cuda_graph(4, fixed)
    fa3.forward(q, k, v, layer, fixed)  # warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa3.forward(q, k, v, layer, fixed)
    lens[:2] = [n + 1 for n in lens[:2]]
    refill_batch(fixed, fixed_decode_batch(pool, rows[1:], lens[1:], bs=4, device="cuda"))
    fa3.init_forward_metadata_replay_cuda_graph(4, fixed)
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    graph.replay()
    native.init_forward_metadata(fixed)
    torch.testing.assert_close(out.float(), native.forward(q, k, v, layer, fixed).float(),
                               atol=2e-2, rtol=2e-2)
