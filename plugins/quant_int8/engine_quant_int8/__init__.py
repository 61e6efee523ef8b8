"""Quantization method 'w8a8_int8' (SGLang's name): int8 weights per output channel, int8
activations per token, an int8 GEMM that torch ships (fbgemm on CPU, torch._int_mm on CUDA)."""

from engine import hookimpl

# No ENGINE_HOOKS_VERSION on purpose (taken as "1.0"): the plugin uses only 1.0's hook.
# W8A8Int8Method's gguf_blocks / block_activations (contract 1.3: a Q8_0 GGUF runs as its
# blocks) are class attributes an older engine never reads: there it quantizes such a GGUF
# per channel as before, which is also this method's own path wherever the blocks cannot run
# (--dtype float16, a GPU, other block formats). Declaring "1.3" would only keep the plugin
# (and --quantization w8a8_int8) out of a 1.1/1.2 engine altogether.


@hookimpl
def register_quantization_methods(register):
    from engine_quant_int8.method import W8A8Int8Method, kernel_reason

    register("w8a8_int8", W8A8Int8Method(), check=kernel_reason)
