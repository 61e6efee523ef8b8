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
a kernel are grouped as they are. Elsewhere the loop runs, and the start log's ``MoE layers``
line says why (``ENGINE_MOE_KERNEL=per_expert`` keeps it on purpose)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import LINEAR_KERNEL_ENV, PrepackedWeight, kernel_label, \
    plugin_weight_dtype
from engine.layers.moe import AbsentExpert, SparseMoE
from engine.layers.moe_fused import MOE_KERNEL_ENV, layer_reason


class GroupedExperts:
    """A layer's experts as two groups of one kernel (gate_up, down): ``(rows, counts) ->
    [rows, hidden]``, rows sorted by expert, ``counts`` int64 [experts]."""

    def __init__(self, kernel, gate_up, down, intermediate: int):
        self.kernel, self.gate_up, self.down = kernel, gate_up, down
        self.intermediate = intermediate

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = counts.new_zeros(counts.numel() + 1)
        torch.cumsum(counts, 0, out=offsets[1:])
        h = self.kernel.grouped_linear(rows, self.gate_up, offsets)
        gate, up = h.split(self.intermediate, dim=-1)
        return self.kernel.grouped_linear(F.silu(gate).mul_(up), self.down, offsets)


def _projections(moe: SparseMoE) -> list[list[nn.Module | None]]:
    """[gate_up per expert, down per expert] (None for an absent expert)."""
    return [[None if isinstance(e, AbsentExpert) else getattr(e, name) for e in moe.experts]
            for name in ("gate_up_proj", "down")]


def _packed_kernel(moe: SparseMoE):
    """The kernel every held expert projection is packed for ("plugin"), or None: not all
    packed, or packed otherwise."""
    kernels = {id(m.kernel): m.kernel for ms in _projections(moe) for m in ms if m is not None
               and isinstance(m, PrepackedWeight) and m.packed_kind == "plugin"}
    held = [m for ms in _projections(moe) for m in ms if m is not None]
    if len(kernels) != 1 or any(not getattr(m, "packed", False) for m in held):
        return None
    return next(iter(kernels.values()))


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
    weight_dtype = plugin_weight_dtype(device, dtype, half_weights) or (
        "float32" if dtype == torch.float32 else None)
    if weight_dtype is None:
        return None, f"no plugin kernel keeps {dtype} weights"
    from engine.registry import resolve_linear_kernel

    entry = resolve_linear_kernel(registries, weight_dtype, torch.device(device),
                                  None if forced == "auto" else forced)
    if entry is None:
        return None, (f"no usable linear kernel registered for {weight_dtype} weights on this "
                      f"CPU (engine-cpu-kernels has grouped GEMMs for AVX2 and AVX-512)")
    if not entry.obj.has_grouped:
        return None, f"the {entry.name} kernel ({entry.dist}) has no grouped GEMM"
    return entry, None


def group_layer(moe: SparseMoE, kernel) -> GroupedExperts:
    """Pack ``moe``'s held experts for ``kernel`` (unless they are already) and set
    ``moe.grouped``."""
    gate_up, down = _projections(moe)
    groups = []
    for modules in (gate_up, down):
        for m in modules:
            if m is not None and not m.packed:
                m.prepack("plugin", kernel=kernel)
        groups.append(kernel.group([None if m is None else m.packed_weight for m in modules]))
    first = next(m for m in gate_up if m is not None)
    intermediate = first.out_features // 2
    moe.grouped = GroupedExperts(kernel, groups[0], groups[1], intermediate)
    return moe.grouped


def group_moe_layers(model: nn.Module, device: torch.device, dtype: torch.dtype,
                     half_weights: bool, registries) -> str:
    """Put ``model``'s sparse layers on grouped GEMMs where they run (a CPU; see the module's
    docstring); the start log's ``MoE layers`` line, or "" (not a CPU, no sparse layers: the
    GPU's fused kernel decides there, layers/moe_fused.py)."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers or torch.device(device).type != "cpu":
        return ""
    entry, reason = grouped_kernel(registries, device, dtype, half_weights)
    plans = []
    for moe in layers:
        packed = _packed_kernel(moe)
        if packed is not None:
            if not packed.has_grouped:
                reason = f"its experts' kernel {type(packed).__name__} has no grouped GEMM"
                break
            plans.append((moe, packed))
            continue
        if entry is None:
            break
        problem = layer_reason(moe)
        if problem is not None:
            reason = problem
            break
        plans.append((moe, entry.obj))
    else:
        reason = None
    if reason is not None:
        return f"MoE layers: per-expert GEMMs, {len(layers)} layers ({reason})"
    for moe, kernel in plans:
        group_layer(moe, kernel)
    first = plans[0][0]
    held = sum(not isinstance(e, AbsentExpert) for e in first.experts)
    experts = (f"{first.num_experts} experts" if held == first.num_experts else
               f"this rank's {held} of {first.num_experts} experts")
    label = kernel_label(entry) if entry is not None else type(plans[0][1]).__name__
    return (f"MoE layers: grouped GEMMs (gate_up, then down, every expert in one call), "
            f"{len(layers)} layers, {experts}, {label}")
