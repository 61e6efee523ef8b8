"""Linear layers; MergedLinear packs several checkpoint projections (q/k/v, gate/up) into one
matmul, which is what makes small-batch CPU decode fast.

On a CPU a kernel a plugin registered through ``register_linear_kernels`` for the weight dtype
the model runs with (float32; float16 weights with float32 arithmetic for ``--dtype float16``;
bfloat16) runs the linears when one is usable on this CPU (the highest priority; e.g.
engine-cpu-kernels' AVX-512 or AVX2 GEMMs, chosen at run time by cpuid: for SmolLM2's float32
linears 1.8x oneDNN's speed at one row, 1.3x at 16, equal at 512). Without one, float32 weights
are prepacked for oneDNN (the weight becomes an opaque blocked mkldnn tensor and the forward is
``torch.ops.mkldnn._linear_pointwise``, 1.2-1.5x ``F.linear``), float16 ones for fbgemm's fp16
GEMM, bfloat16 ones run ``F.linear``. Elsewhere (CUDA) the forward stays ``F.linear``.

These are the layers a quantization method may swap (see interfaces.QuantMethod): they say so
with ``quantizable = True`` and expose ``in_features``, ``out_features``, ``bias`` and, when
packed, ``shards`` (projection name -> output rows, in order)."""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn


# the batch size oneDNN picks its weight blocking for; 1 to 256 rows all run near their best
PREPACK_BATCH_HINT = 64
# "plain": keep F.linear (for comparisons); "torch": the core's own kernels (oneDNN, fbgemm,
# F.linear), no plugin's; a registered linear kernel's name: that one (an error if it cannot run)
LINEAR_KERNEL_ENV = "ENGINE_LINEAR_KERNEL"

KERNEL_LOG = {
    "onednn": "float32 weights prepacked for oneDNN (torch.ops.mkldnn._linear_pointwise)",
    "fp16": "float16 weights packed for fbgemm's fp16 GEMM, float32 activations and "
            "accumulation (torch.ops.quantized.linear_dynamic_fp16)",
}


def prepack_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when oneDNN prepacked linears run here, else why not."""
    if os.environ.get(LINEAR_KERNEL_ENV, "auto") == "plain":
        return f"{LINEAR_KERNEL_ENV}=plain"
    if device.type != "cpu":
        return f"{device.type} runs F.linear"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if dtype != torch.float32:
        return f"oneDNN prepacking is used for float32 only, not {dtype}"
    return None


def fbgemm_available() -> bool:
    """Whether this torch build has fbgemm's CPU kernels (its x86 engine includes them)."""
    engines = torch.backends.quantized.supported_engines
    return "fbgemm" in engines or "x86" in engines


def half_weight_reason(device: torch.device) -> str | None:
    """None when float16 linear weights with float32 arithmetic (fbgemm) run here, else why not."""
    if os.environ.get(LINEAR_KERNEL_ENV, "auto") == "plain":
        return f"{LINEAR_KERNEL_ENV}=plain asks for plain float32 F.linear"
    if device.type != "cpu":
        return f"it is a CPU path ({device.type} computes in float16 itself)"
    if not fbgemm_available():
        return (f"this torch build has no fbgemm (torch.backends.quantized.supported_engines = "
                f"{torch.backends.quantized.supported_engines})")
    return None


class PrepackedWeight:
    """Mixin: a module whose ``weight`` [out, in] can be packed once for a faster CPU kernel:
    ``"onednn"`` (float32, reordered for oneDNN), ``"fp16"`` (float16 for fbgemm's GEMM,
    which converts it on the fly and computes in float32) or ``"plugin"`` (a registered
    :class:`engine.interfaces.LinearKernel`'s own packing).

    With ``keep_plain`` (a head tied to the embedding, which still reads the plain weight) the
    packed copy is kept beside it; otherwise it replaces it (no second copy)."""

    packed = False
    packed_kind = ""  # "onednn", "fp16" or "plugin" once packed
    kernel = None  # the LinearKernel of a "plugin" packing
    tied = False  # the weight is shared (a head tied to the embedding): keep it beside the copy
    packed_id = -1  # index in PACKED, how the compiled graph's custom op finds the weight
    opaque_bytes = 0  # bytes of a packed weight that is no tensor (fbgemm's), for weight_bytes

    def prepack(self, kind: str = "onednn", keep_plain: bool = False, kernel=None,
                blocks: tuple[str, torch.Tensor] | None = None) -> None:
        """``blocks``: (format, raw bytes [out, bytes per row]) the checkpoint stores this
        weight in (a GGUF's Q4_1, ...), which a "plugin" kernel packs as they are
        (``pack_blocks``) instead of packing the float weight."""
        weight = self.weight.detach()
        self.out_features = weight.shape[0]
        self.packed_id = len(PACKED)
        PACKED.append(weakref.ref(self))
        if kind == "plugin":  # the kernel's own object: an attribute, like fbgemm's
            self.packed_weight = kernel.pack(weight) if blocks is None else \
                kernel.pack_blocks(blocks[1], blocks[0], weight.shape[0], weight.shape[1])
            self.kernel = kernel
            self.opaque_bytes = kernel.packed_bytes(self.packed_weight)
            if not keep_plain:
                del self.weight
        elif kind == "fp16":  # an opaque fbgemm object, not a tensor: an attribute, not a buffer
            self.packed_weight = torch.ops.quantized.linear_prepack_fp16(weight, None)
            self.opaque_bytes = weight.numel() * 2
            if not keep_plain:
                del self.weight
        elif kind == "onednn":
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PREPACK_BATCH_HINT)
            if keep_plain:
                self.register_buffer("packed_weight", packed, persistent=False)
            else:
                del self.weight
                self.register_buffer("weight", packed)
                self.packed_weight = self.weight
        else:
            raise ValueError(f"unknown linear kernel {kind!r}")
        self.packed, self.packed_kind = True, kind

    def packed_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.linear(x, self.packed_weight, bias)
        if self.packed_kind == "fp16":
            y = torch.ops.quantized.linear_dynamic_fp16(x, self.packed_weight)
            return y if bias is None else y.add_(bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed:
            if torch.compiler.is_compiling():
                return prepacked_linear(x, self.packed_id, bias, self.out_features)
            return self.packed_linear(x, bias)
        return F.linear(x, self.weight, bias)


# every prepacked module of the process (weakly), by packed_id: a packed weight (an opaque
# oneDNN tensor, an fbgemm object) cannot enter a traced graph, so the compiled graph calls
# prepacked_linear with the index instead
PACKED: list[weakref.ref] = []


@torch.library.custom_op("engine::prepacked_linear", mutates_args=())
def prepacked_linear(x: torch.Tensor, packed_id: int, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor:
    return PACKED[packed_id]().packed_linear(x, bias)


@prepacked_linear.register_fake
def _(x, packed_id, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def plugin_weight_dtype(device: torch.device, dtype: torch.dtype,
                        half_weights: bool) -> str | None:
    """The weight dtype a registered linear kernel would keep here: "float16" for
    ``--dtype float16`` on a CPU, "bfloat16" for a bfloat16 model on a CPU, "float32" for a
    float32 one there (contract 1.6; oneDNN runs them where no such kernel is usable); else
    None."""
    if torch.device(device).type != "cpu":
        return None
    if half_weights:
        return "float16"
    return {torch.bfloat16: "bfloat16", torch.float32: "float32"}.get(dtype)


def kernel_label(entry) -> str:
    """How the start log names a registered linear kernel: "NAME kernel (DIST: what it is)"."""
    what = entry.extra.get("description")
    return f"{entry.name} kernel ({entry.dist}{': ' + what if what else ''})"


def plugin_kernel(registries, device: torch.device, dtype: torch.dtype, half_weights: bool):
    """The registry entry of the plugin kernel that runs the linears here, or None (the
    core's own kernels run): see ``register_linear_kernels``."""
    forced = os.environ.get(LINEAR_KERNEL_ENV, "auto")
    if registries is None or forced in ("plain", "torch"):
        return None
    from engine.registry import EngineError, resolve_linear_kernel

    weight_dtype = plugin_weight_dtype(device, dtype, half_weights)
    if weight_dtype is None:
        if forced != "auto":
            raise EngineError(f"{LINEAR_KERNEL_ENV}={forced} asks for a plugin's linear kernel, "
                              f"and the model's linears run in {dtype} on {device}: plugin "
                              f"kernels take --dtype float16 or bfloat16 on a CPU.")
        return None
    return resolve_linear_kernel(registries, weight_dtype, torch.device(device),
                                 None if forced == "auto" else forced)


def prepack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype,
                    half_weights: bool = False, registries=None) -> str:
    """Pack every plain linear weight of ``model`` for the CPU kernel that runs here: a
    plugin's kernel registered for the weight dtype (float16 with ``half_weights``, bfloat16
    for a bfloat16 model; ``registries`` given, see ``plugin_kernel``), else float16 for
    fbgemm with ``half_weights`` (``--dtype float16`` on a CPU; the caller checked
    ``half_weight_reason``), else float32 for oneDNN where it runs. Returns the log line that
    says which kernel the linear layers use."""
    if not any(isinstance(m, PrepackedWeight) and not m.packed for m in model.modules()):
        return ""  # all packed already (as their checkpoint's blocks: see block_weights.py)
    entry = plugin_kernel(registries, device, dtype, half_weights)
    if entry is not None:
        n = 0
        for module in model.modules():
            if isinstance(module, PrepackedWeight) and not module.packed:
                module.prepack("plugin", keep_plain=module.tied, kernel=entry.obj)
                n += 1
        weight_dtype = entry.extra.get("weight_dtype")
        return f"linear layers: {n} {weight_dtype} weights, {kernel_label(entry)}"
    if half_weights:
        kind = "fp16"
    else:
        reason = prepack_reason(torch.device(device), dtype)
        if reason is not None:
            return f"linear layers: F.linear ({reason})"
        kind = "onednn"
    n = 0
    for module in model.modules():
        if isinstance(module, PrepackedWeight) and not module.packed:
            module.prepack(kind, keep_plain=module.tied)
            n += 1
    return f"linear layers: {n} {KERNEL_LOG[kind]}"


class Linear(PrepackedWeight, nn.Module):
    quantizable = True
    shards: dict[str, int] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


class MergedLinear(Linear):
    """Output rows are the named shards, in order: ``shards={"q_proj": 512, "k_proj": 128, ...}``.
    The loader copies checkpoint tensor ``...q_proj.weight`` into rows ``shard_rows("q_proj")``."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias)
        self.shards = dict(shards)
        self.shard_sizes = list(shards.values())
        self._offsets, start = {}, 0
        for name, size in shards.items():
            self._offsets[name] = (start, size)
            start += size

    @property
    def shard_names(self) -> list[str]:
        return list(self._offsets)

    def shard_rows(self, shard: str) -> tuple[int, int]:
        """(first row, number of rows) of ``shard`` in the weight and bias."""
        return self._offsets[shard]

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.forward(x).split(self.shard_sizes, dim=-1)
