"""Attention backend 'triton': paged attention kernels written in Triton (CUDA GPUs; on a CPU
only under Triton's interpreter, TRITON_INTERPRET=1, which is how its tests run there)."""

import importlib.util
import os

from engine import hookimpl

ENGINE_HOOKS_VERSION = "1.5"  # register_attention_backends(mla=), forward_latent

KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2")


def check(device):
    if importlib.util.find_spec("triton") is None:
        return "needs the triton package (CUDA builds of torch ship it): pip install triton"
    if device.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (f"needs a CUDA GPU, found {device.describe()} (on a CPU it runs only under "
            f"Triton's interpreter, TRITON_INTERPRET=1, which is for tests: very slow)")


def _factory(ctx):
    from engine_attention_triton.backend import TritonBackend

    return TritonBackend(ctx)


def graph_memory_bytes(max_bs, num_sizes, layers, page_size, max_context_len, options):
    """What the backend holds beside the KV pool for CUDA graphs (the CUDA-graph memory
    estimate): the fixed query offsets and lengths, and the largest split-KV decode scratch
    (partial outputs and log-sum-exps, float32) a captured size allocates."""
    import torch

    from engine_attention_triton.geometry import num_kv_splits

    sms = (torch.cuda.get_device_properties(0).multi_processor_count
           if torch.cuda.is_available() else 132)
    scratch = max((bs * s.num_heads * (s.head_dim + 1) * 4
                   * num_kv_splits(bs, s.num_kv_heads, s.num_heads // s.num_kv_heads, sms)
                   for bs in range(1, max_bs + 1) for s in layers), default=0)
    return 16 * max_bs + scratch


_factory.graph_memory_bytes = graph_memory_bytes


@hookimpl
def register_attention_backends(register):
    # above torch_native (0), below flashinfer (20), trtllm_mha (25) and fa3 (30): auto takes
    # it on a CUDA GPU where none of those can run
    register("triton", _factory, check=check, kv_dtypes=KV_DTYPES, priority=5, mla=True,
             description="paged prefill/decode attention in Triton (MLA's latent rows as "
                         "multi-query attention); CUDA GPUs")
