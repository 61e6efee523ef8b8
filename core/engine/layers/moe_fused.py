"""Whether a model's ``SparseMoE`` layers run the fused Triton kernel (layers/moe_triton.py)
and, where they do, their experts' weights stacked once at load.

On CUDA with triton importable, every sparse layer whose experts are plain float16, bfloat16
or float32 linears (not quantized, not packed for a CPU kernel) takes the fused path: the
experts this rank holds (all of them in one process; with ``--tp-size`` their intermediate
slices, with ``--ep-size`` its own whole experts, the others ``AbsentExpert``, whose pairs the
kernel leaves zero) are stacked into ``w13`` [E', 2I, H] and ``w2`` [E', H, I], and each
expert's ``Linear`` weight becomes a view of its slice of them (one copy in memory; the
per-expert path still reads them). Elsewhere the layers keep the per-expert GEMMs: the CPU
path, or on CUDA with the reason in the start log's ``MoE layers`` line (never silently).
``ENGINE_MOE_KERNEL=per_expert`` keeps the per-expert loop on CUDA too (for comparisons)."""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import nn

from engine.layers.linear import Linear, PrepackedWeight
from engine.layers.moe import AbsentExpert, SparseMoE

MOE_KERNEL_ENV = "ENGINE_MOE_KERNEL"
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FUSED_LABEL = ("fused Triton kernel (moe_align_block_size, grouped GEMMs gate_up and down "
               "with the top-k weights applied in the kernel)")


class FusedExperts:
    """A layer's held experts stacked for the kernel, and the global -> local expert map."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, num_experts: int,
                 local: torch.Tensor | None):
        self.w13, self.w2, self.num_experts, self.local = w13, w2, num_experts, local

    def __call__(self, x: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
        from engine.layers.moe_triton import fused_moe

        return fused_moe(x, self.w13, self.w2, weights, ids, self.num_experts, self.local)


def device_reason(device: torch.device) -> str | None:
    """None when the fused kernel may run on ``device``, else why not."""
    if os.environ.get(MOE_KERNEL_ENV, "auto") == "per_expert":
        return f"{MOE_KERNEL_ENV}=per_expert"
    if device.type != "cuda":
        return f"the {device.type} path; the fused Triton kernel is for CUDA"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton) for the fused kernel"
    try:
        import engine.layers.moe_triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 (a broken triton install: said in the log)
        return f"the fused kernel did not import ({type(exc).__name__}: {exc})"
    return None


def plain_reason(module: nn.Module) -> str | None:
    """None when ``module`` is a plain, unpacked, bias-free float Linear, else why not."""
    if not isinstance(module, Linear):
        return f"its expert projections are {type(module).__name__} (quantized?), not Linear"
    if isinstance(module, PrepackedWeight) and module.packed:
        return "its expert weights are packed for a CPU kernel"
    if module.bias is not None:
        return "its expert projections have a bias"
    if module.weight.dtype not in FUSED_DTYPES:
        return f"its expert weights are {module.weight.dtype}, not float16/bfloat16/float32"
    return None


def layer_reason(moe: SparseMoE) -> str | None:
    """None when ``moe``'s held experts can be stacked for the kernel, else why not."""
    held = [e for e in moe.experts if not isinstance(e, AbsentExpert)]
    if not held:
        return "a layer holds none of its experts"
    shapes = set()
    for expert in held:
        for proj in (expert.gate_up_proj, expert.down):
            problem = plain_reason(proj)
            if problem:
                return problem
        shapes.add((expert.gate_up_proj.weight.shape, expert.down.weight.shape,
                    expert.gate_up_proj.weight.dtype))
    if len(shapes) > 1:
        return "its experts differ in shape or dtype"
    return None


def fuse_layer(moe: SparseMoE) -> FusedExperts:
    """Stack ``moe``'s held experts into the kernel's weights (their ``Linear`` weights become
    views of them) and set ``moe.fused``."""
    held = [(i, e) for i, e in enumerate(moe.experts) if not isinstance(e, AbsentExpert)]
    with torch.no_grad():
        w13 = torch.stack([e.gate_up_proj.weight for _, e in held])
        w2 = torch.stack([e.down.weight for _, e in held])
    for j, (_, e) in enumerate(held):
        e.gate_up_proj.weight = nn.Parameter(w13[j], requires_grad=False)
        e.down.weight = nn.Parameter(w2[j], requires_grad=False)
    local = None
    if len(held) < moe.num_experts:
        local = torch.full((moe.num_experts,), -1, dtype=torch.int64, device=w13.device)
        local[torch.tensor([i for i, _ in held], device=w13.device)] = torch.arange(
            len(held), device=w13.device)
    moe.fused = FusedExperts(w13, w2, moe.num_experts, local)
    return moe.fused


def fuse_moe_layers(model: nn.Module, device: torch.device) -> str:
    """Put ``model``'s sparse layers on the fused kernel where it runs; the start log's line
    saying which MoE path runs and why ("" for a model without sparse layers)."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers:
        return ""
    reason = device_reason(torch.device(device))
    if reason is None:
        reason = next(filter(None, map(layer_reason, layers)), None)
    if reason is not None:
        return f"MoE layers: per-expert GEMMs, {len(layers)} layers ({reason})"
    fused = [fuse_layer(m) for m in layers]
    first = fused[0]
    held = first.w13.shape[0]
    experts = (f"{first.num_experts} experts" if held == first.num_experts else
               f"this rank's {held} of {first.num_experts} experts")
    return (f"MoE layers: {FUSED_LABEL}, {len(layers)} layers, {experts}, "
            f"{str(first.w13.dtype).removeprefix('torch.')} weights stacked "
            f"[E, 2I, H] {list(first.w13.shape)} / [E, H, I] {list(first.w2.shape)}")
