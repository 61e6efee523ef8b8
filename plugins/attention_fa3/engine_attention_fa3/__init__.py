"""Attention backend 'fa3' (FlashAttention-3 through sgl-kernel), for Hopper GPUs."""

import importlib.util

from engine import hookimpl


def check(device):
    if not device.is_cuda:
        return (f"needs an NVIDIA GPU with compute capability 9.0 (Hopper), "
                f"found {device.describe()}")
    if device.capability[0] != 9:
        return f"needs compute capability 9.0 (Hopper), found {device.describe()}"
    if importlib.util.find_spec("sgl_kernel") is None:
        return "needs the sgl-kernel package: pip install 'engine-attention-fa3[cuda]'"
    return None


def _factory(ctx):
    from engine_attention_fa3.backend import FA3Backend, check_context, load_kernel

    check_context(ctx)  # before the kernel import: a wrong dtype is named even without it
    return FA3Backend(ctx, load_kernel())


@hookimpl
def register_attention_backends(register):
    register("fa3", _factory, check=check, kv_dtypes=("auto", "bf16", "fp16", "fp8_e4m3"),
             dtypes=("float16", "bfloat16"),  # auto skips it for a float32 model
             priority=30, description="FlashAttention-3 (sgl-kernel), Hopper")
