"""Attention backend 'cpu': a paged decode-attention kernel in C for CPUs (built on first use
with the system compiler), and torch SDPA for prompt chunks."""

from engine import hookimpl

ENGINE_HOOKS_VERSION = "1.3"  # the decode node of CPU graphs (cpu_graph_nodes, graph.h)

KV_DTYPES = ("auto", "fp32", "bf16", "fp16")


def check(device):
    if device.is_cuda:
        return f"runs on CPUs only, found {device.describe()}"
    from engine_attention_cpu.kernel import KernelUnavailable, load

    try:
        load()
    except KernelUnavailable as e:
        return str(e)
    return None


def _factory(ctx):
    from engine_attention_cpu.backend import CPUBackend

    return CPUBackend(ctx)


@hookimpl
def register_attention_backends(register):
    register("cpu", _factory, check=check, kv_dtypes=KV_DTYPES, priority=10,
             description="paged decode attention in C (OpenMP) + torch SDPA for prompts; CPU")


@hookimpl
def select_attention_backend(device, model_config, kv_dtype):
    """On a CPU, 'cpu' when its kernel builds and takes the KV dtype and the model has no
    multi-head latent attention (DeepSeek's MLA, which it lacks); otherwise leave it to the
    next answer (the core's: torch_native)."""
    if getattr(model_config, "mla", None) is not None:
        return None
    if kv_dtype in KV_DTYPES and check(device) is None:
        return "cpu"
    return None
