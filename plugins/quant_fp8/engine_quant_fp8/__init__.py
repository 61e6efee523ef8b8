"""Quantization method 'fp8' and KV-cache dtypes 'fp8_e4m3' / 'fp8_e5m2'."""

from engine import hookimpl


@hookimpl
def register_quantization_methods(register):
    from engine_quant_fp8.method import FP8Method

    # no check: the dequantize path runs wherever torch does; CUDA >= 8.9 adds the
    # torch._scaled_mm fast path, chosen per layer at load (and logged)
    register("fp8", FP8Method())


@hookimpl
def register_kv_cache_dtypes(register):
    import torch

    from engine_quant_fp8.kv import FP8KVDtype

    # per-layer K/V scales (1.0, or the checkpoint's k_scale / v_scale); the pool stores and
    # loads through these objects (kv.py)
    register("fp8_e4m3", FP8KVDtype(torch.float8_e4m3fn, description="float8 e4m3"))
    register("fp8_e5m2", FP8KVDtype(torch.float8_e5m2, description="float8 e5m2"))
