"""SGLang's memory lines of the start log, each with the memory still available then, so that
the tuning guide's rule for --mem-fraction-static can be applied to what the log says:
``Load weight end. ...``, ``KV Cache is allocated. ...``, ``Memory pool end. ...`` (the CUDA
graphs' ``Capture cuda graph begin/end`` lines are cuda_graph.py's) and, once ready, the memory
left for the server's own use (``available_gpu_mem`` on a GPU)."""

from __future__ import annotations

GB = 1 << 30


def weights_line(architecture: str, dtype, available: int, weight_bytes: int) -> str:
    return (f"Load weight end. type={architecture}, dtype={dtype}, "
            f"avail mem={available / GB:.2f} GB, mem usage={weight_bytes / GB:.2f} GB.")


def pool_lines(pool, available: int) -> list[str]:
    """The KV pool's sizes (K and V, or an MLA pool's latent rows as K) and what is left."""
    k = sum(b.numel() * b.element_size() for b in pool.k_buffer)
    v = sum(b.numel() * b.element_size() for b in pool.v_buffer)
    return [f"KV Cache is allocated. #tokens: {pool.size}, K size: {k / GB:.2f} GB, "
            f"V size: {v / GB:.2f} GB",
            f"Memory pool end. avail mem={available / GB:.2f} GB"]


def ready_line(device, available: int) -> str:
    """What is left once the weights, the pools and the graphs are in place."""
    key = "available_gpu_mem" if device.is_cuda else "available_mem"
    where = "GPU memory" if device.is_cuda else "RAM"
    return (f"memory at start: {key}={available / GB:.2f} GB ({where} free after the weights, "
            f"KV pool and graphs)")
