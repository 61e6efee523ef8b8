"""A GGUF's quantized linear weights run as they are: Q4_0, Q4_1 and Q8_0 blocks stay in memory
as the file stores them and a linear kernel registered for that block format
(``register_linear_kernels`` with ``weight_dtype="q4_1"``, ...; engine-cpu-kernels has AVX2 and
AVX-512 ones) multiplies by them, instead of oneDNN multiplying by the float32 weights the
loader dequantized. The default model (SmolLM2-135M-Instruct, Q4_1 linears and a Q8_0 tied
head) then reads 90 MB of weights per decode step instead of 540 MB.

Only on a CPU, in float32 (``--dtype auto``/``float32``), without tensor parallelism or
``--quantization``, unless ``ENGINE_LINEAR_KERNEL`` is ``torch`` or ``plain``. A quantization
method whose arithmetic the blocks are (``QuantMethod.gguf_blocks``: e.g. Q8_0 blocks for int8
weights and activations) runs as them instead of converting the model, through kernels taking
its ``block_activations`` (``quant_block_reason``; the weight-only kernels stay the default
without it). A packed module
(q/k/v, gate/up) runs as blocks when all its projections are in one format; a head tied to the
embedding runs the embedding's blocks (the embedding itself keeps its float32 rows for the
lookup). The loader has loaded the dequantized weights first; packing drops them (a tied
head's stay: they are the embedding's)."""

from __future__ import annotations

import os
from collections import defaultdict

import torch
from torch import nn

from engine.layers.linear import LINEAR_KERNEL_ENV, PrepackedWeight, kernel_label
from engine.models.loader import checkpoint_index


def block_reason(ckpt, device: torch.device, dtype: torch.dtype, half_weights: bool,
                 parallel: bool, quantized: bool) -> str | None:
    """None when the checkpoint's block weights may run as they are here, else why not."""
    forced = os.environ.get(LINEAR_KERNEL_ENV, "auto")
    if forced in ("plain", "torch"):
        return f"{LINEAR_KERNEL_ENV}={forced}"
    if not hasattr(ckpt, "blocks") or getattr(ckpt, "format", "") != "gguf":
        return "not a GGUF"
    if torch.device(device).type != "cpu":
        return f"block kernels are CPU kernels, this is {torch.device(device).type}"
    if half_weights or dtype != torch.float32:
        return f"--dtype asks for {'float16' if half_weights else dtype} weights"
    if parallel:
        return "tensor parallelism cuts the weights"
    if quantized:
        return "--quantization repacks the weights"
    return None


def quant_block_reason(method, ckpt, device: torch.device, dtype: torch.dtype,
                       half_weights: bool, parallel: bool, registries) -> str | None:
    """None when the quantization ``method`` runs as the checkpoint's blocks here (its
    ``gguf_blocks`` hold every block format of the GGUF, and a kernel for each with its
    ``block_activations`` is usable: see QuantMethod), else why not (the method then converts
    the model itself). A forced kernel (``ENGINE_LINEAR_KERNEL``) for those blocks with other
    activations is an error."""
    formats = set(getattr(method, "gguf_blocks", ()))
    activations = getattr(method, "block_activations", None)
    if not formats or activations is None:
        return "the method runs no GGUF blocks"
    reason = block_reason(ckpt, device, dtype, half_weights, parallel, quantized=False)
    if reason is not None:
        return reason
    held = ckpt.block_formats()
    if not held:
        return "the GGUF holds no blocks"
    if held - formats:
        return (f"the GGUF holds {', '.join(sorted(held))} blocks and the method runs "
                f"{', '.join(sorted(formats))} ones")
    missing = [f for f in sorted(held) if block_kernel(registries, f, activations) is None]
    if missing:
        return (f"no usable linear kernel for {', '.join(missing)} blocks with {activations} "
                f"activations")
    return None


def block_note(formats: set[str], activations: str) -> str:
    """The start log's words for a quantization method run as the GGUF's blocks."""
    how = " per block of 32 (llama.cpp's arithmetic)" if activations == "int8" else ""
    return (f"on the GGUF's {', '.join(sorted(formats))} blocks as they are: {activations} "
            f"activations{how}")


def block_kernel(registries, fmt: str, activations: str | None = None):
    """The registry entry of the kernel for ``fmt`` blocks (``ENGINE_LINEAR_KERNEL``'s where it
    keeps them; ``activations``: only kernels taking those), or None."""
    from engine.registry import resolve_linear_kernel

    forced = os.environ.get(LINEAR_KERNEL_ENV, "auto")
    entry = registries.linear_kernels.get(forced) if forced != "auto" else None
    if entry is not None and entry.extra.get("weight_dtype") != fmt:
        entry = None  # the forced kernel keeps other weights: that one runs those
    return resolve_linear_kernel(registries, fmt, torch.device("cpu"),
                                 entry.name if entry else None, activations)


def _sources(model: nn.Module) -> dict[nn.Module, list[tuple[int, str]]]:
    """Each packable linear -> its checkpoint tensors as (first row, name), in row order; a
    head tied to the embedding -> the embedding's tensor."""
    index = checkpoint_index(model)
    by_weight = {id(getattr(m, "weight", None)): name for name, (m, local, shard, _)
                 in index.items() if local == "weight" and shard is None}
    sources: dict[nn.Module, list[tuple[int, str]]] = defaultdict(list)
    for name, (module, local, shard, _) in index.items():
        if local != "weight" or not isinstance(module, PrepackedWeight) or module.packed:
            continue
        start = module.shard_rows(shard)[0] if shard is not None else 0
        sources[module].append((start, name))
    for module in model.modules():
        if isinstance(module, PrepackedWeight) and module.tied and module not in sources:
            name = by_weight.get(id(getattr(module, "weight", None)))
            if name is not None:
                sources[module].append((0, name))
    return {m: sorted(s) for m, s in sources.items()}


def _module_blocks(ckpt, names: list[str]) -> tuple[str, torch.Tensor] | None:
    parts = [ckpt.blocks(name) for name in names]
    if any(p is None for p in parts) or len({p[0] for p in parts}) != 1:
        return None
    raw = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])
    return parts[0][0], raw


def pack_block_linears(model: nn.Module, ckpt, registries,
                       activations: str | None = None) -> list[str]:
    """Pack every linear whose checkpoint weights are blocks a usable kernel runs (the
    caller checked ``block_reason``; ``activations``: only kernels taking those, a
    quantization method's ``block_activations``); returns the log parts ("210 q4_1 GGUF
    blocks, avx512_q4_1 kernel (...)"), none when nothing was packed."""
    kernels: dict[str, object] = {}
    counts: dict[str, int] = defaultdict(int)  # per format (one kernel each)
    for module, sources in _sources(model).items():
        found = _module_blocks(ckpt, [name for _, name in sources])
        if found is None:
            continue
        fmt, raw = found
        if fmt not in kernels:
            kernels[fmt] = block_kernel(registries, fmt, activations)
        entry = kernels[fmt]
        if entry is None:
            continue
        if raw.shape[0] != module.weight.shape[0]:
            continue  # not the rows the config implies: the float path's checks report it
        module.prepack("plugin", keep_plain=module.tied, kernel=entry.obj, blocks=(fmt, raw))
        counts[fmt] += 1
    parts = [f"{n} {fmt} GGUF blocks, {kernel_label(kernels[fmt])}" for fmt, n in counts.items()]
    missing = sorted(f for f, e in kernels.items() if e is None)
    if missing:
        parts.append(f"{', '.join(missing)} GGUF blocks dequantized to float32: no usable "
                     f"linear kernel registered for {', '.join(missing)} (engine-cpu-kernels "
                     f"has them for AVX2 and AVX-512 CPUs)")
    return parts
