"""Attention backend 'fa3' (FlashAttention-3 through sgl-kernel), for Hopper GPUs."""

import importlib.util

from engine import hookimpl


def check(device):
    if not device.is_cuda:
        return f"needs an NVIDIA GPU with compute capability 9.0 (Hopper), found {device.describe()}"
    if device.capability[0] != 9:
        return f"needs compute capability 9.0 (Hopper), found {device.describe()}"
    if importlib.util.find_spec("sgl_kernel") is None:
        return "needs the sgl-kernel package: pip install 'engine-attention-fa3[cuda]'"
    return "the fa3 kernel path is not implemented yet"


def _factory(ctx):
    from engine.registry import NotImplementedYet

    raise NotImplementedYet(
        "attention backend 'fa3' is registered but not implemented yet; "
        "use --attention-backend torch_native (or auto) for now.")


@hookimpl
def register_attention_backends(register):
    register("fa3", _factory, check=check, kv_dtypes=("auto", "bf16", "fp16", "fp8_e4m3"),
             priority=30, description="FlashAttention-3 (sgl-kernel), Hopper")
