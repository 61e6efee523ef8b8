"""Quantization method 'w8a8_int8' (SGLang's name): int8 weights per output channel, int8
activations per token, an int8 GEMM that torch ships (fbgemm on CPU, torch._int_mm on CUDA)."""

from engine import hookimpl


@hookimpl
def register_quantization_methods(register):
    from engine_quant_int8.method import W8A8Int8Method, kernel_reason

    register("w8a8_int8", W8A8Int8Method(), check=kernel_reason)
