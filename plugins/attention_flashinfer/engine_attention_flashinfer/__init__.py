"""Attention backends 'flashinfer' (Ampere and newer) and 'trtllm_mha' (Blackwell)."""

import importlib.util

from engine import hookimpl

NEEDS_PACKAGE = "needs the flashinfer-python package: pip install 'engine-attention-flashinfer[cuda]'"


def check_flashinfer(device):
    if not device.is_cuda:
        return f"needs an NVIDIA GPU with compute capability >= 8.0, found {device.describe()}"
    if device.capability[0] < 8:
        return f"needs compute capability >= 8.0, found {device.describe()}"
    if importlib.util.find_spec("flashinfer") is None:
        return NEEDS_PACKAGE
    return "the kernel path is not implemented yet"


def check_trtllm(device):
    if not device.is_cuda:
        return f"needs an NVIDIA GPU with compute capability 10.x (Blackwell), found {device.describe()}"
    if device.capability[0] != 10:
        return f"needs compute capability 10.x (Blackwell), found {device.describe()}"
    if importlib.util.find_spec("flashinfer") is None:
        return NEEDS_PACKAGE
    return "the kernel path is not implemented yet"


def _not_yet(name):
    def factory(ctx):
        from engine.registry import NotImplementedYet

        raise NotImplementedYet(
            f"attention backend '{name}' is registered but not implemented yet; "
            "use --attention-backend torch_native (or auto) for now.")

    return factory


@hookimpl
def register_attention_backends(register):
    register("flashinfer", _not_yet("flashinfer"), check=check_flashinfer,
             kv_dtypes=("auto", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"), priority=20,
             description="flashinfer paged attention, Ampere and newer")
    register("trtllm_mha", _not_yet("trtllm_mha"), check=check_trtllm,
             kv_dtypes=("auto", "bf16", "fp16", "fp8_e4m3"), priority=25,
             description="TensorRT-LLM MHA kernels through flashinfer, Blackwell")
