"""Attention backends 'flashinfer' (Ampere and newer; MLA too), 'trtllm_mha' and 'trtllm_mla'
(Blackwell)."""

import importlib.util

from engine import hookimpl
from engine.interfaces import EngineOption
from engine_attention_flashinfer.limits import HALF, TRTLLM_MLA_PAGE_SIZES, TRTLLM_PAGE_SIZES

ENGINE_HOOKS_VERSION = "1.6"  # register_attention_backends(mla="only"), qk_nope_head_dim

NEEDS_PACKAGE = ("needs the flashinfer-python package: "
                 "pip install 'engine-attention-flashinfer[cuda]'")


def check_flashinfer(device):
    if not device.is_cuda:
        return f"needs an NVIDIA GPU with compute capability >= 8.0, found {device.describe()}"
    if device.capability[0] < 8:
        return f"needs compute capability >= 8.0, found {device.describe()}"
    return NEEDS_PACKAGE if importlib.util.find_spec("flashinfer") is None else None


def check_trtllm(device):
    if not device.is_cuda:
        return (f"needs an NVIDIA GPU with compute capability 10.x (Blackwell), "
                f"found {device.describe()}")
    if device.capability[0] != 10:
        return f"needs compute capability 10.x (Blackwell), found {device.describe()}"
    return NEEDS_PACKAGE if importlib.util.find_spec("flashinfer") is None else None


def _flashinfer(ctx):
    from engine_attention_flashinfer import mla_backend
    from engine_attention_flashinfer.flashinfer_backend import from_context

    return mla_backend.from_context(ctx) if mla_backend.is_mla(ctx) else from_context(ctx)


def _trtllm_mla(ctx):
    from engine_attention_flashinfer.mla_backend import trtllm_from_context

    return trtllm_from_context(ctx)


def _flashinfer_graph_memory(max_bs, num_sizes, layers, page_size, max_context_len, options):
    from engine_attention_flashinfer.flashinfer_backend import graph_memory_bytes

    return graph_memory_bytes(max_bs, num_sizes, layers, page_size, max_context_len, options)


def _trtllm(ctx):
    from engine_attention_flashinfer.trtllm_backend import from_context

    return from_context(ctx)


def _trtllm_graph_memory(max_bs, num_sizes, layers, page_size, max_context_len, options):
    from engine_attention_flashinfer.trtllm_backend import graph_memory_bytes

    return graph_memory_bytes(max_bs, num_sizes, layers, page_size, max_context_len, options)


# what each backend holds beside the KV pool, for the CUDA-graph memory estimate
# (engine.cuda_graph.backend_graph_bytes reads a factory's graph_memory_bytes)
_flashinfer.graph_memory_bytes = _flashinfer_graph_memory
_trtllm.graph_memory_bytes = _trtllm_graph_memory


@hookimpl
def register_serve_options(register):
    register(EngineOption("--flashinfer-workspace-size", int, 384,
                          "MiB of float workspace shared by the flashinfer backend's wrappers "
                          "(SGLang's 384: chunked prefills and CUDA-graph decodes fail with "
                          "much less)."))
    register(EngineOption("--flashinfer-prefill-backend", str, "auto",
                          "flashinfer prefill kernels: auto (FlashAttention-3 on Hopper where "
                          "they apply, else FA2), fa2 or fa3."))


@hookimpl
def register_attention_backends(register):
    register("flashinfer", _flashinfer, check=check_flashinfer, dtypes=HALF,
             kv_dtypes=("auto", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"), priority=20, mla=True,
             description="flashinfer paged attention (MLA through its MLA wrapper), Ampere "
                         "and newer")
    register("trtllm_mla", _trtllm_mla, check=check_trtllm, dtypes=HALF,
             kv_dtypes=("auto", "bf16", "fp16"), priority=25, mla="only",
             page_sizes=TRTLLM_MLA_PAGE_SIZES,  # 64 by default, as SGLang's trtllm_mla
             description="TensorRT-LLM MLA decode kernels through flashinfer (DeepSeek), "
                         "Blackwell")
    register("trtllm_mha", _trtllm, check=check_trtllm, dtypes=HALF,
             kv_dtypes=("auto", "bf16", "fp16", "fp8_e4m3"), priority=25,
             page_sizes=TRTLLM_PAGE_SIZES,  # the last (64) is the default, as in SGLang
             description="TensorRT-LLM MHA kernels through flashinfer, Blackwell")
