"""Attention backend 'fa3' (FlashAttention-3 through sgl-kernel), for Hopper GPUs."""

import importlib
import importlib.util

from engine import hookimpl

KERNEL_MODULE = "sgl_kernel.flash_attn"  # what backend.load_kernel imports
INSTALL = "pip install 'engine-attention-fa3[cuda]'"


def kernel_problem() -> str | None:
    """None when sgl-kernel's FA3 module imports here, else why not. Finding the package is not
    enough: sgl-kernel's wheels are built against one torch, and on another its extension fails
    to load (an ImportError or OSError naming an undefined symbol), which would otherwise surface
    only when the backend is built, after the weights are loaded. A failed import is not cached
    by Python, so this is asked again on each call (cheap next to a model load)."""
    if importlib.util.find_spec("sgl_kernel") is None:
        return f"needs the sgl-kernel package: {INSTALL}"
    try:
        importlib.import_module(KERNEL_MODULE)
    except (ImportError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (f"sgl-kernel is installed but its FA3 kernels do not load ({first}); its wheels "
                f"are built for one torch version, so install the sgl-kernel built for this "
                f"torch, or pick another --attention-backend")
    return None


def check(device):
    if not device.is_cuda:
        return (f"needs an NVIDIA GPU with compute capability 9.0 (Hopper), "
                f"found {device.describe()}")
    if device.capability[0] != 9:
        return f"needs compute capability 9.0 (Hopper), found {device.describe()}"
    return kernel_problem()


def _factory(ctx):
    from engine_attention_fa3.backend import FA3Backend, check_context, load_kernel

    check_context(ctx)  # before the kernel import: a wrong dtype is named even without it
    return FA3Backend(ctx, load_kernel())


def graph_memory_bytes(max_bs, num_sizes, layers, page_size, max_context_len, options):
    """What the backend holds beside the KV pool for CUDA graphs (the CUDA-graph memory
    estimate): FA3GraphBuffers' query offsets, sequence lengths and page table, all int32."""
    return 4 * ((max_bs + 1) + max_bs + max_bs * -(-max_context_len // page_size))


_factory.graph_memory_bytes = graph_memory_bytes


@hookimpl
def register_attention_backends(register):
    register("fa3", _factory, check=check, kv_dtypes=("auto", "bf16", "fp16", "fp8_e4m3"),
             dtypes=("float16", "bfloat16"),  # auto skips it for a float32 model
             priority=30, description="FlashAttention-3 (sgl-kernel), Hopper")
