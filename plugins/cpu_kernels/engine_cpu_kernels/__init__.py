"""Small-batch CPU GEMMs for the linear layers (``register_linear_kernels``): float16,
bfloat16, and GGUF Q8_0 / Q4_0 / Q4_1 blocks (run as they are in the file), an AVX2+FMA+F16C
path and an AVX-512 one (vdpbf16ps, vpdpbusd), chosen at run time by cpuid. The C library is
built on first use with the system compiler."""

from engine import hookimpl

ENGINE_HOOKS_VERSION = "1.6"  # register_linear_kernels; 1.3: CPU graph nodes, activations=;
# 1.6: grouped GEMMs (LinearKernel.group / grouped_linear) and float32 kernels for MoE experts


def _checker(kernel):
    return lambda device=None: kernel.check(device)


@hookimpl
def register_linear_kernels(register):
    from engine_cpu_kernels.ops import KERNELS

    # AVX-512 before AVX2; for bfloat16 vdpbf16ps before widening + FMA (measured faster at
    # every row count: benchmarks/linear_kernels.py)
    priority = {"avx512_bf16": 30, "avx512_bf16_fma": 20, "avx512_fp16": 30,
                "avx512_q8_0": 30, "avx2_bf16": 10, "avx2_fp16": 10, "avx2_q8_0": 10,
                "avx512_q4_0": 30, "avx512_q4_1": 30, "avx2_q4_0": 10, "avx2_q4_1": 10,
                # float32 weights: a float32 model's linears (oneDNN's below), MoE experts grouped
                "avx512_f32": 30, "avx2_f32": 10,
                # GGUF blocks: weight-only (float32 activations) before int8 activations, so
                # that a GGUF model answers as its dequantized float32 weights do; the int8
                # ones by name (ENGINE_LINEAR_KERNEL=avx512_q4_1) or for a quantization method
                # whose block_activations are "int8" (--quantization w8a8_int8 on Q8_0 blocks)
                "avx512_q4_1_f32": 40, "avx512_q4_0_f32": 40, "avx512_q8_0_f32": 40,
                "avx2_q4_1_f32": 35, "avx2_q4_0_f32": 35, "avx2_q8_0_f32": 35}
    for k in KERNELS:
        register(k.name, k, weight_dtype=k.weight_dtype, check=_checker(k),
                 priority=priority[k.name], description=k.description,
                 activations=k.activations)
