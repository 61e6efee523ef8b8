"""Attention backend 'triton': paged attention kernels written in Triton (CUDA GPUs; on a CPU
only under Triton's interpreter, TRITON_INTERPRET=1, which is how its tests run there)."""

import importlib.util
import os

from engine import hookimpl

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


@hookimpl
def register_attention_backends(register):
    # above torch_native (0), below flashinfer (20), trtllm_mha (25) and fa3 (30): auto takes
    # it on a CUDA GPU where none of those can run
    register("triton", _factory, check=check, kv_dtypes=KV_DTYPES, priority=5,
             description="paged prefill/decode attention in Triton; CUDA GPUs")
