"""The CUDA-graph memory estimate counts what the attention backend holds beside the KV pool:
its graph wrappers, index buffers and workspaces, as each backend's registration reports it
(``graph_memory_bytes`` on its factory), asked before the backend exists."""

from __future__ import annotations

import os

import pytest

from engine.cuda_graph import backend_graph_bytes, capture_sizes, estimate_graph_bytes
from engine.interfaces import AttentionLayerSpec
from engine.plugins import get_registries

MIB = 1 << 20


class Llama3_8B:
    hidden_size, intermediate_size, vocab_size = 4096, 14336, 128256


LAYERS = [AttentionLayerSpec(32, 8, 128, 128 ** -0.5)] * 32  # one plan group
CONTEXT = 8192


def reported(name, max_bs, page_size=1, options=None, layers=LAYERS, sizes=None):
    entry = get_registries().attention.get(name)
    return backend_graph_bytes(entry.obj, layers, page_size, CONTEXT, options, sizes)(max_bs)


def test_flashinfer_reports_its_workspace_wrappers_and_index_buffers():
    n = len(capture_sizes(160))  # 23 captured sizes: 1, 2, 4, 8, 12, 16, 24, ..., 160
    want = (384 * MIB  # the shared float workspace
            + 8 * MIB * (3 + n)  # int buffers: prefill, ragged, decode, a graph wrapper a size
            + 4 * (161 + 160 * CONTEXT + 160))  # indptr, indices (page size 1), last_page_len
    assert reported("flashinfer", 160) == want
    # --flashinfer-workspace-size, --cuda-graph-bs, a second (windowed) plan group, pages of 16
    windowed = LAYERS[:1] + [AttentionLayerSpec(32, 8, 128, 128 ** -0.5, 4096)]
    assert reported("flashinfer", 8, 16, {"flashinfer_workspace_size": 512}, windowed,
                    [1, 8, 200]) == (512 * MIB + 8 * MIB * 2 * (3 + 2)
                                     + 4 * (9 + 8 * CONTEXT // 16 + 8))


def test_trtllm_and_fa3_and_triton_report_theirs():
    assert reported("trtllm_mha", 64, 64) == 512 * MIB + 4 * (64 * CONTEXT // 64 + 64)
    assert reported("fa3", 64, 16) == 4 * (65 + 64 + 64 * CONTEXT // 16)
    # split-KV decode scratch: one request on 132 SMs splits in 16
    assert reported("triton", 1) >= 32 * 129 * 4 * 16
    assert reported("torch_native", 160) == 0  # reports nothing: no extra


def test_the_estimate_includes_the_backends_bytes():
    backend = backend_graph_bytes(get_registries().attention.get("flashinfer").obj, LAYERS, 1,
                                  CONTEXT)
    without = estimate_graph_bytes(Llama3_8B, 2, 160)
    assert estimate_graph_bytes(Llama3_8B, 2, 160, backend) - without == backend(160)
    assert backend(160) > 384 * MIB  # what the estimate used to leave out


def test_the_engine_sizes_with_its_backends_bytes(tiny_model_factory, monkeypatch):
    """Engine start hands the sizing a graph estimate that asks the resolved backend."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, set by the root conftest)")
    import engine.memory.sizing as sizing
    from engine import Engine

    seen = {}
    real = sizing.plan

    def plan(*args, graph_bytes=None, **kwargs):
        seen["graph_bytes"] = graph_bytes
        return real(*args, graph_bytes=graph_bytes, **kwargs)

    monkeypatch.setattr(sizing, "plan", plan)
    engine = Engine(tiny_model_factory("llama"), device="cpu", attention_backend="triton")
    mc = engine.runner.model_config
    itemsize = 4  # float32 on a CPU
    base = estimate_graph_bytes(mc, itemsize, 4)
    extra = backend_graph_bytes(get_registries().attention.get("triton").obj,
                                engine.runner.layer_specs, 1, engine.sizing.context_length)(4)
    assert extra > 0 and seen["graph_bytes"](4) == base + extra
    engine.close()
