"""Which dtype the weights and activations run in (``--dtype``).

On a CPU ``--dtype float16`` keeps the linear layers' weights in float16 and computes in float32
(fbgemm's fp16 GEMM converts them on the fly; the rest of the model, activations and the KV cache
are float32): what llama.cpp does with an F16 GGUF. CPUs have no fast float16 arithmetic, and
at decode batch sizes the linears are bound by reading their weights, which this halves."""

from __future__ import annotations

import torch

from engine.errors import EngineError

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
CHOICES = ("auto", "float32", "bfloat16", "float16")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_half_weights(requested: str, device) -> bool:
    """True when ``--dtype requested`` on ``device`` means float16 linear weights with float32
    arithmetic (a CPU); raises when this torch build cannot run that."""
    if requested == "auto" or DTYPES.get(requested) != torch.float16 or device.is_cuda:
        return False
    from engine.layers.linear import half_weight_reason

    reason = half_weight_reason(torch.device(device.torch_device))
    if reason is not None:
        raise EngineError(f"--dtype {requested} on a CPU stores the linear weights in float16 for "
                          f"fbgemm's fp16 GEMM, which cannot run here: {reason}. Use --dtype "
                          f"float32.")
    return True


def resolve_dtype(requested: str, hf_config_dtype, device) -> tuple[torch.dtype, str]:
    """``requested``: auto|float32|bfloat16|float16; ``hf_config_dtype``: the checkpoint's
    dtype (a name like "bfloat16", a torch.dtype, or None). Returns (dtype, reason)."""
    if requested != "auto":
        if requested not in DTYPES:
            raise EngineError(f"Unknown --dtype '{requested}' (choose from {', '.join(CHOICES)}).")
        dtype = DTYPES[requested]
        if cpu_half_weights(requested, device):
            return torch.float32, (f"dtype float32 arithmetic with float16 linear weights "
                                   f"(--dtype {requested} on a CPU, which has no fast float16 "
                                   f"arithmetic)")
        return dtype, f"dtype {_name(dtype)} (forced by --dtype {requested})"
    if hf_config_dtype is None:
        # transformers loads a config without a dtype in float32, so we do too
        return torch.float32, "dtype float32 (auto: the checkpoint does not say its dtype)"
    ckpt = hf_config_dtype if isinstance(hf_config_dtype, torch.dtype) else \
        DTYPES.get(str(hf_config_dtype).removeprefix("torch."))
    if ckpt is None:
        raise EngineError(f"The checkpoint's dtype '{hf_config_dtype}' is not supported "
                          f"(supported: float32, bfloat16, float16); pass --dtype explicitly.")
    if ckpt == torch.float32:
        return ckpt, "dtype float32 (auto: the checkpoint's dtype)"
    if device.is_cuda:
        return ckpt, f"dtype {_name(ckpt)} (auto: the checkpoint's dtype, on {device.describe()})"
    if ckpt == torch.bfloat16 and device.native_bf16:
        return ckpt, ("dtype bfloat16 (auto: the checkpoint's dtype; this CPU has native bf16 "
                      "matmul)")
    if ckpt == torch.bfloat16:
        return torch.float32, ("dtype float32 (auto: checkpoint is bfloat16 but this CPU has no "
                               "native bf16 matmul; bf16 runs ~50x slower here)")
    # CPUs' float16 matmuls are emulated even where bf16 is native
    return torch.float32, ("dtype float32 (auto: checkpoint is float16, which CPUs run much "
                           "slower than float32)")
