"""An MoE model's sparse layers on a CPU: every expert's GEMM in one call into a plugin's linear
kernel (``LinearKernel.group`` / ``grouped_linear``, contract 1.6) instead of one call per
expert.

The per-expert loop (layers/moe.py) runs, at 256 tokens of a fine-grained MoE (Qwen3-MoE: 128
experts, top-8), 128 small GEMMs of a few rows each, both threads on each one; a grouped GEMM
splits all experts' weight tiles over the threads, so both stream weights all the time. Per
expert the arithmetic is the loop's: the same kernel, packing and rows.

``group_moe_layers`` (before ``prepack_linears``) packs each sparse layer's experts for the
kernel that runs the model's weight dtype here (float32: a kernel registered for "float32"
weights, e.g. engine-cpu-kernels' ``avx512_f32``; float16 / bfloat16: the one the dense linears
get) when it has a grouped GEMM, and sets ``SparseMoE.grouped``; experts already packed for such
a kernel are grouped as they are (a GGUF's Q4_0 / Q4_1 / Q8_0 expert blocks, which
models/block_weights.py packed as they are in the file; gate_up and down may be in different
formats, each projection its own kernel). Elsewhere the loop runs, and the start log's ``MoE layers``
line says why (``ENGINE_MOE_KERNEL=per_expert`` keeps it on purpose)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import LINEAR_KERNEL_ENV, PrepackedWeight, kernel_label, \
    plugin_kernel, plugin_weight_dtype
from engine.layers.moe import AbsentExpert, SparseMoE
from engine.layers.moe_fused import MOE_KERNEL_ENV, plain_reason


class GroupedExperts:
    """A layer's experts as two groups, each of one kernel ((kernel, group) for gate_up and for
    down): ``(rows, counts) -> [rows, hidden]``, rows sorted by expert, ``counts`` int64
    [experts]."""

    def __init__(self, gate_up: tuple, down: tuple, intermediate: int):
        self.gate_up, self.down, self.intermediate = gate_up, down, intermediate

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = counts.new_zeros(counts.numel() + 1)
        torch.cumsum(counts, 0, out=offsets[1:])
        (k1, g1), (k2, g2) = self.gate_up, self.down
        gate, up = k1.grouped_linear(rows, g1, offsets).split(self.intermediate, dim=-1)
        return k2.grouped_linear(F.silu(gate).mul_(up), g2, offsets)


def _projections(moe: SparseMoE) -> list[list[nn.Module | None]]:
    """[gate_up per expert, down per expert] (None for an absent expert)."""
    return [[None if isinstance(e, AbsentExpert) else getattr(e, name) for e in moe.experts]
            for name in ("gate_up_proj", "down")]


def _packed(modules: list) -> tuple[str, object]:
    """How one projection's held experts are packed: ("none", None), ("plugin", kernel) when
    all are for one plugin kernel, else ("mixed", why)."""
    held = [m for m in modules if m is not None]
    if not any(getattr(m, "packed", False) for m in held):
        return "none", None
    kernels = {id(m.kernel): m.kernel for m in held
               if isinstance(m, PrepackedWeight) and m.packed_kind == "plugin"}
    if len(kernels) == 1 and all(getattr(m, "packed", False) for m in held):
        kernel = next(iter(kernels.values()))
        if kernel.has_grouped:
            return "plugin", kernel
        return "mixed", f"its experts' kernel {type(kernel).__name__} has no grouped GEMM"
    return "mixed", ("its experts' weights are packed for different kernels (blocks in "
                     "several formats?)")


def grouped_kernel(registries, device: torch.device, dtype: torch.dtype, half_weights: bool):
    """(registry entry, None) of the kernel that runs the experts' weights grouped here, or
    (None, why not)."""
    if os.environ.get(MOE_KERNEL_ENV, "auto") == "per_expert":
        return None, f"{MOE_KERNEL_ENV}=per_expert"
    forced = os.environ.get(LINEAR_KERNEL_ENV, "auto")
    if forced in ("plain", "torch"):
        return None, f"{LINEAR_KERNEL_ENV}={forced} keeps the core's own kernels"
    if registries is None:
        return None, "no plugin registries"
    weight_dtype = plugin_weight_dtype(device, dtype, half_weights)
    if weight_dtype is None:
        return None, f"no plugin kernel keeps {dtype} weights"
    entry = plugin_kernel(registries, device, dtype, half_weights)  # the dense linears' kernel
    if entry is None:
        return None, (f"no usable linear kernel registered for {weight_dtype} weights on this "
                      f"CPU (engine-cpu-kernels has grouped GEMMs for AVX2 and AVX-512)")
    if not entry.obj.has_grouped:
        return None, f"the {entry.name} kernel ({entry.dist}) has no grouped GEMM"
    return entry, None


def _plan(moe: SparseMoE, entry, why_not: str | None) -> tuple[list | None, str | None]:
    """(gate_up's kernel, down's kernel) for ``moe``'s experts, or (None, why not): a
    projection packed for a grouped kernel keeps it, one not packed takes ``entry``'s."""
    if all(isinstance(e, AbsentExpert) for e in moe.experts):
        return None, "a layer holds none of its experts"
    kernels = []
    for modules in _projections(moe):
        how, what = _packed(modules)
        if how == "mixed":
            return None, what
        if how == "plugin":
            kernels.append(what)
            continue
        if entry is None:
            return None, why_not
        problem = next(filter(None, (plain_reason(m) for m in modules if m is not None)), None)
        if problem is not None:
            return None, problem
        kernels.append(entry.obj)
    return kernels, None


def group_layer(moe: SparseMoE, kernels: list) -> GroupedExperts:
    """Pack ``moe``'s held experts for ``kernels`` (gate_up's, down's; unless they are
    packed already) and set ``moe.grouped``."""
    groups = []
    for modules, kernel in zip(_projections(moe), kernels):
        for m in modules:
            if m is not None and not m.packed:
                m.prepack("plugin", kernel=kernel)
        groups.append((kernel, kernel.group([None if m is None else m.packed_weight
                                             for m in modules])))
    first = next(m for m in _projections(moe)[0] if m is not None)
    moe.grouped = GroupedExperts(groups[0], groups[1], first.out_features // 2)
    return moe.grouped


def group_moe_layers(model: nn.Module, device: torch.device, dtype: torch.dtype,
                     half_weights: bool, registries) -> str:
    """Put ``model``'s sparse layers on grouped GEMMs where they run (a CPU; see the module's
    docstring); the start log's ``MoE layers`` line, or "" (not a CPU, no sparse layers: the
    GPU's fused kernel decides there, layers/moe_fused.py)."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers or torch.device(device).type != "cpu":
        return ""
    entry, why_not = grouped_kernel(registries, device, dtype, half_weights)
    plans, reason = [], None
    for moe in layers:
        kernels, reason = _plan(moe, entry, why_not)
        if reason is not None:
            break
        plans.append((moe, kernels))
    if reason is not None:
        return f"MoE layers: per-expert GEMMs, {len(layers)} layers ({reason})"
    for moe, kernels in plans:
        group_layer(moe, kernels)
    first = plans[0][0]
    held = sum(not isinstance(e, AbsentExpert) for e in first.experts)
    experts = (f"{first.num_experts} experts" if held == first.num_experts else
               f"this rank's {held} of {first.num_experts} experts")
    names = {id(k): k for _, ks in plans for k in ks}
    labels = [kernel_label(entry) if entry is not None and k is entry.obj else
              getattr(k, "name", type(k).__name__) + " kernel" for k in names.values()]
    return (f"MoE layers: grouped GEMMs (gate_up, then down, every expert in one call), "
            f"{len(layers)} layers, {experts}, {'; '.join(labels)}")
