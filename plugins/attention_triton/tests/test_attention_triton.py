"""Attention backend 'triton': its kernel against torch_native on the same pool and metadata
(random batches mixing prompts, extends over a cached prefix and decodes; page sizes 1 and 16;
GQA/MHA/MQA; sliding windows; float32, float16 and fp8 pools with scales), run on the CPU under
Triton's interpreter; greedy decoding of a tiny model against HF; how it is picked and refused.
On a CUDA machine the same tests run on the GPU."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs the triton package (pip install triton)", allow_module_level=True)
GPU = torch.cuda.is_available()
if not GPU:  # before triton is imported: its jit (tl.zeros too) reads it when decorating
    os.environ["TRITON_INTERPRET"] = "1"

from engine.attention.torch_native import TorchNativeBackend  # noqa: E402
from engine.device import DeviceInfo  # noqa: E402
from engine.interfaces import AttentionLayerSpec, BackendContext  # noqa: E402
from engine.memory.kv_pool import KVPool  # noqa: E402
from engine_testing.attention import (backend_matches_torch_native,  # noqa: E402
                                      compare_backends_step, scattered_filler)
from engine_testing.attention import run_mixed_steps as shared_mixed_steps  # noqa: E402
from engine_testing.generation import free_requests, greedy_matches_hf  # noqa: E402
from engine_attention_triton import check  # noqa: E402
from engine_attention_triton.backend import TritonBackend  # noqa: E402
from engine_attention_triton.kernels import (GRID_X_MAX, GRID_YZ_MAX, block_sizes,  # noqa: E402
                                             decode_grids, num_kv_splits, prefill_grid)

DEVICE = "cuda" if GPU else "cpu"


def make_pair(specs, kvh, d, dtype=torch.float32, page_size=1, size=1024):
    pool = KVPool(len(specs), kvh, d, size, dtype, device=DEVICE, page_size=page_size,
                  max_reqs=8, max_context_len=512, needs_scale=dtype.itemsize == 1)
    ctx = BackendContext(pool, specs, DEVICE, torch.float32)
    return pool, TritonBackend(ctx), TorchNativeBackend(ctx)


def run_mixed_steps(pool, backends, specs, gen, tol, q_dtype=torch.float32):
    shared_mixed_steps(pool, backends, specs, gen, tol, DEVICE, q_dtype)


# (heads, kv heads, head dim): GQA, MHA, MQA (a group wider than a block of rows), odd dim
SHAPES = [(4, 2, 16), (2, 2, 32), (40, 1, 16), (3, 1, 24)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_matches_torch_native_in_every_mode(shape, page_size):
    backend_matches_torch_native(TritonBackend, shape, page_size, device=DEVICE)


def test_float16_queries_and_pool():
    specs = [AttentionLayerSpec(4, 2, 32, 32 ** -0.5)]
    pool, triton_backend, native = make_pair(specs, 2, 32, dtype=torch.float16)
    gen = torch.Generator().manual_seed(1)
    # both read the same float16 K/V; float32 softmax and sums here, SDPA's own in float16
    run_mixed_steps(pool, (triton_backend, native), specs, gen, 2e-3, torch.float16)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pool_with_per_layer_scales(kv_dtype):
    specs = [AttentionLayerSpec(4, 2, 16, 0.25), AttentionLayerSpec(4, 2, 16, 0.25, 7)]
    pool, triton_backend, native = make_pair(specs, 2, 16, dtype=kv_dtype, page_size=16)
    pool.k_scale[:] = [0.5, 0.25]  # stored = real / scale, as the fp8 KV dtypes set them
    pool.v_scale[:] = [2.0, 0.125]
    gen = torch.Generator().manual_seed(2)
    # torch_native dequantizes the same stored bytes: equal up to float32 rounding
    run_mixed_steps(pool, (triton_backend, native), specs, gen, 1e-5)


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_greedy_matches_hf_generate(tiny_model_factory, registries, cuda_graph):
    """With cuda_graph, every decode step replays a graph captured for 1, 2 or 4 requests (3
    prompts: one padding row): a real CUDA graph on a GPU, on a CPU the EagerGraph stand-in
    re-running the forward over the same fixed buffers, whose tensors must never move."""
    device = DeviceInfo("cuda", "GPU", (9, 0)) if GPU else DeviceInfo("cpu", "CPU")
    runner = greedy_matches_hf(tiny_model_factory("qwen2_bias_window"), registries,
                               TritonBackend, cuda_graph, device)
    if cuda_graph:
        fixed = runner.cuda_graphs.batches[4]
        assert runner.backend.req_rows.data_ptr() == fixed.req_pool_indices.data_ptr()
        assert fixed.req_pool_indices.data_ptr() == runner.cuda_graphs.req_pool_indices.data_ptr()
        assert runner.kv_pool.req_to_token[runner.kv_pool.scratch_row].eq(0).all()


def test_refused_on_a_cpu_without_the_interpreter(monkeypatch):
    cpu = DeviceInfo("cpu", "CPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "needs a CUDA GPU" in check(cpu) and "TRITON_INTERPRET=1" in check(cpu)
    assert check(DeviceInfo("cuda", "H100", (9, 0))) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert check(cpu) is None


# -- TF32: what tl.dot does to float32 operands on a GPU, emulated under the interpreter -------
@pytest.fixture
def tf32_dots(monkeypatch):
    """Triton's interpreter multiplies float32 operands exactly; a GPU's tl.dot rounds them to
    TF32 (10 mantissa bits) unless input_precision="ieee". This rounds them the same way (the
    interpreter's own TF32 rounding, round to nearest even) for every dot that does not ask
    for "ieee", so the kernels' float32 comparisons see what a GPU would do."""
    if GPU:
        yield  # the real thing
        return
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    import triton.language as tl

    real = interpreter.InterpreterBuilder.create_dot
    rounded = []

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if input_precision != ir.INPUT_PRECISION.IEEE:
            a, b = (interpreter.TensorHandle(interpreter._round_f32_to_tf32(x.data), x.dtype.scalar)
                    if x.dtype.scalar == tl.float32 else x for x in (a, b))
            rounded.append(True)
        return real(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    yield rounded


def test_the_tf32_emulation_rounds_default_dots(tf32_dots):
    """The emulation bites: a float32 tl.dot with the default precision loses bits, the same
    dot with input_precision="ieee" does not."""
    if GPU:
        pytest.skip("emulates a GPU under the interpreter")
    import triton
    import triton.language as tl

    @triton.jit
    def dots(A, B, O1, O2):
        r = tl.arange(0, 16)
        a = tl.load(A + r[:, None] * 16 + r[None, :])
        b = tl.load(B + r[:, None] * 16 + r[None, :])
        tl.store(O1 + r[:, None] * 16 + r[None, :], tl.dot(a, b))
        tl.store(O2 + r[:, None] * 16 + r[None, :], tl.dot(a, b, input_precision="ieee"))

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 16, generator=gen), torch.randn(16, 16, generator=gen)
    tf32, ieee = torch.empty(16, 16), torch.empty(16, 16)
    dots[(1,)](a, b, tf32, ieee)
    exact = a.double() @ b.double()
    assert (tf32.double() - exact).abs().max() > 1e-4  # TF32: about 2^-11 relative per operand
    assert (ieee.double() - exact).abs().max() < 1e-5


@pytest.mark.parametrize("page_size", [1, 16])
def test_float32_kernels_hold_under_tf32(tf32_dots, page_size):
    """Under TF32 the one-pass kernel (prompts, extends, decodes) and the split decode keep
    float32 accuracy: every float32 dot asks for "ieee" (before, 10 of this file's 14 tests
    failed under this emulation)."""
    backend_matches_torch_native(TritonBackend, (4, 2, 16), page_size, device=DEVICE)
    backend_matches_torch_native(lambda ctx: TritonBackend(ctx, num_kv_splits=3), (8, 1, 32),
                                 page_size, device=DEVICE)


def test_fp8_pool_holds_under_tf32(tf32_dots):
    test_fp8_pool_with_per_layer_scales(torch.float8_e4m3fn)


# -- split-KV decode ---------------------------------------------------------------------------
def decode_steps(pool, backends, specs, gen, lens, steps=2, tol=1e-5, q_dtype=torch.float32):
    """Prompts of ``lens`` tokens (the last backend fills the pool), then ``steps`` decode
    steps of them all through every backend."""
    rows = [pool.alloc_req() for _ in lens]
    compare_backends_step(pool, backends[-1:], rows, [0] * len(lens), list(lens), specs, gen, 0,
                          DEVICE)
    lens = list(lens)
    for _ in range(steps):
        compare_backends_step(pool, backends, rows, lens, [1] * len(lens), specs, gen, tol,
                              DEVICE, q_dtype)
        lens = [n + 1 for n in lens]
    free_requests(pool, rows, lens)


WINDOWED = [AttentionLayerSpec(4, 2, 16, 0.25), AttentionLayerSpec(4, 2, 16, 0.3, 7),
            AttentionLayerSpec(4, 2, 16, 0.3, 100)]


@pytest.mark.parametrize("splits", [1, 2, 3, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_split_decode_matches_torch_native(splits, page_size):
    """Each request's keys in ``splits`` chunks of whole 64-key blocks (a 300-key request in 4
    splits: 128 + 128 + 44 + an empty one), windows of 7 and 100 keys, GQA."""
    pool, _, native = make_pair(WINDOWED, 2, 16, page_size=page_size)
    ours = TritonBackend(native.ctx, num_kv_splits=splits)
    scattered_filler(pool, page_size)
    decode_steps(pool, (ours, native), WINDOWED, torch.Generator().manual_seed(10),
                 [300, 1, 64, 129])


@pytest.mark.parametrize("shape", [(40, 1, 16), (80, 1, 16), (3, 1, 24), (2, 2, 32)])
def test_split_decode_head_groups(shape):
    """MQA groups of 40 (one block of 64 heads) and 80 (two head blocks), odd head dims, MHA."""
    H, KVH, D = shape
    specs = [AttentionLayerSpec(H, KVH, D, D ** -0.5)]
    pool, _, native = make_pair(specs, KVH, D, page_size=16)
    decode_steps(pool, (TritonBackend(native.ctx, num_kv_splits=2), native), specs,
                 torch.Generator().manual_seed(11), [150, 20], steps=1)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_split_decode_fp8_pool(kv_dtype):
    specs = WINDOWED[:2]
    pool, _, native = make_pair(specs, 2, 16, dtype=kv_dtype, page_size=16)
    pool.k_scale[:] = [0.5, 0.25]
    pool.v_scale[:] = [2.0, 0.125]
    decode_steps(pool, (TritonBackend(native.ctx, num_kv_splits=3), native), specs,
                 torch.Generator().manual_seed(12), [200, 9], steps=1)


def test_split_decode_float16():
    specs = [AttentionLayerSpec(4, 2, 32, 32 ** -0.5)]
    pool, _, native = make_pair(specs, 2, 32, dtype=torch.float16)
    decode_steps(pool, (TritonBackend(native.ctx, num_kv_splits=4), native), specs,
                 torch.Generator().manual_seed(13), [250, 70], steps=1, tol=2e-3,
                 q_dtype=torch.float16)


def test_split_count_from_batch_size_and_sm_count():
    # one request of Llama-3-8B (8 KV heads, 4 query heads each) on 132 SMs: 8 programs
    # without splits; 16 splits give 128. A batch of 32 fills the GPU alone
    assert num_kv_splits(1, 8, 4, 132) == 16
    assert num_kv_splits(4, 8, 4, 132) == 8
    assert num_kv_splits(32, 8, 4, 132) == 1
    assert num_kv_splits(1, 8, 4, 132, max_seq_len=300) == 2  # chunks of >= 256 keys
    assert num_kv_splits(1, 8, 4, 1) == 1  # no GPU: 1 SM unless told
    specs = [AttentionLayerSpec(32, 8, 16, 0.25)]
    pool, _, native = make_pair(specs, 8, 16)
    ours = TritonBackend(native.ctx, sm_count=132)
    rows = [pool.alloc_req()]
    batch = compare_backends_step(pool, (native,), rows, [0], [400], specs,
                                  torch.Generator().manual_seed(14), 0, DEVICE)
    ours.init_forward_metadata(batch)
    assert ours.splits(0) == 1  # a prompt: the one-pass kernel
    decode = compare_backends_step(pool, (ours, native), rows, [400], [1], specs,
                                   torch.Generator().manual_seed(15), 1e-5, DEVICE)
    assert ours.splits(0) == 2  # 401 keys: 2 chunks of >= 256
    ours.init_cuda_graph_state(4)
    ours.init_forward_metadata_capture_cuda_graph(1, decode)
    assert ours.splits(0) == 16  # in a graph: from the batch size alone
    free_requests(pool, rows, [401])


def test_greedy_with_split_decode_under_the_graph_runner(tiny_model_factory, registries):
    """Every decode step splits its keys in two inside the captured graphs (the EagerGraph
    stand-in on a CPU), and greedy decoding still equals HF's."""
    device = DeviceInfo("cuda", "GPU", (9, 0)) if GPU else DeviceInfo("cpu", "CPU")
    greedy_matches_hf(tiny_model_factory("qwen2_bias_window"), registries,
                      lambda ctx: TritonBackend(ctx, num_kv_splits=2), True, device)


@pytest.mark.parametrize("case,splits", [("v2_group_limited", None),
                                         ("v3_no_lora_halves", 2)])
def test_mla_greedy_matches_hf_generate(tiny_model_factory, registries, case, splits):
    """DeepSeek's latent rows through the same kernel as multi-query attention (K = V = the
    rows, the first kv_lora_rank output columns kept): prompts prefilled together, then
    absorbed decode steps (split in two for the V3 case), greedy equal to HF's."""
    from engine_testing.checkpoints import DEEPSEEK_CASES

    arch, overrides = DEEPSEEK_CASES[case]
    device = DeviceInfo("cuda", "GPU", (9, 0)) if GPU else DeviceInfo("cpu", "CPU")
    runner = greedy_matches_hf(tiny_model_factory(arch, **overrides), registries,
                               lambda ctx: TritonBackend(ctx, num_kv_splits=splits), False,
                               device, max_new_tokens=6)
    assert runner.kv_pool.latent


# -- grid shapes and tiles -----------------------------------------------------------------------
def test_grids_fit_cuda_limits_for_a_40k_token_chunk():
    """CUDA bounds a grid's y and z to 65535: the old (request, KV head, row block) grid put
    cdiv(40000 x 64 / 32) = 80000 row blocks in z for 64 query heads per KV head. The grid is
    now one dimension (x, up to 2^31 - 1); computed here, not launched."""
    for heads, kv_heads, d in [(64, 1, 128), (32, 8, 128), (8, 8, 256)]:
        g = heads // kv_heads
        block_m, _, _ = block_sizes(40000, g, d)
        grid = prefill_grid(3, kv_heads, g, 40000, block_m)
        assert len(grid) == 1 and grid[0] <= GRID_X_MAX
        assert all(x <= GRID_YZ_MAX for x in grid)  # these fit even in 65535
        for bs in (1, 512):
            s1, s2 = decode_grids(bs, heads, kv_heads, num_kv_splits(bs, kv_heads, g, 132))
            assert all(x <= GRID_YZ_MAX for x in (*s1[1:], *s2[1:]))
    assert -(-40000 * 64 // 32) > GRID_YZ_MAX  # the old z dimension


def test_prompt_tiles_cover_more_tokens_per_kv_read():
    # a prompt chunk: 128 rows = 32 tokens of a 4-head group per K/V read (was 32 rows = 8)
    assert block_sizes(4096, 4, 128) == (128, 64, 8)
    assert block_sizes(4096, 4, 256)[0] == 64  # registers: half the rows past head dim 128
    assert block_sizes(1, 4, 128)[0] == 16  # decode rows: tl.dot's minimum, no wasted rows
    assert block_sizes(1, 40, 128)[0] == 64
