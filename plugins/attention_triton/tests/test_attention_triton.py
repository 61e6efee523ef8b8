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
from engine.testing import backend_matches_torch_native, greedy_matches_hf  # noqa: E402
from engine.testing import run_mixed_steps as shared_mixed_steps  # noqa: E402
from engine_attention_triton import check  # noqa: E402
from engine_attention_triton.backend import TritonBackend  # noqa: E402

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
