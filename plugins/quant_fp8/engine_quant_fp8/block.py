"""Block-wise FP8 checkpoints (DeepSeek-V3's layout: ``quantization_config.weight_block_size``
[bn, bk], each linear ``weight`` float8_e4m3fn with a float32 ``weight_scale_inv`` of
[ceil(out / bn), ceil(in / bk)], one dequantization factor per block: ``w ≈ q * scale``).

``FP8BlockLinear``: the weight stays e4m3; each row keeps its blocks' factors along K
(``row_scales`` [out, ceil(in / bk)] float32, expanded from the block rows at load, so that
packed projections whose row counts are not multiples of bn, as MLA's kv_a_proj_with_mqa,
keep their own blocks). The forward widens the weight, multiplies each K block by its factor
and runs the matmul in the activation dtype (W8A16; no FP8 GEMM: DeepSeek's block-scaled GEMMs
are a GPU kernel this plugin does not have yet).

``FP8Latent``: MLA's ``kv_b_proj`` (a plain weight the attention folds into its query and
output, never a matmul of its own) loads FP8 with its scales (block-wise, per channel or per
tensor) and is dequantized once at load to the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.mla import LatentProjection
from engine.layers.quantized import RowQuantLinear, scale_expected
from engine.registry import EngineError
from engine_quant_fp8.quant import E4M3, WIDEN_FACTOR, widen_e4m3

FP8_MAX = torch.finfo(E4M3).max
SCALE_NAMES = ("weight_scale_inv", "weight_scale")  # DeepSeek's; llm-compressor's


def block_grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-rows // block[0]), -(-cols // block[1])


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [rows, cols] -> (e4m3 q, scales [ceil(rows / bn), ceil(cols / bk)]) with
    each block's largest magnitude on e4m3's largest finite value."""
    rows, cols = w.shape
    gr, gc = block_grid(rows, cols, block)
    padded = F.pad(w.float(), (0, gc * block[1] - cols, 0, gr * block[0] - rows))
    blocks = padded.view(gr, block[0], gc, block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return q.view(gr * block[0], gc * block[1])[:rows, :cols].contiguous(), scale


def check_scale(name: str, scale: torch.Tensor, rows: int, cols: int,
                block: tuple[int, int]) -> None:
    want = block_grid(rows, cols, block)
    if tuple(scale.shape) != want:
        raise EngineError(f"'{name}' has shape {tuple(scale.shape)}; a {rows} x {cols} weight "
                          f"in blocks of {list(block)} (weight_block_size) needs {want}.")
    if not torch.isfinite(scale).all():
        raise EngineError(f"'{name}' holds a scale that is not finite.")


class FP8BlockLinear(RowQuantLinear):
    """A linear layer with an e4m3 weight in blocks of ``block`` (bn rows x bk columns)."""

    storage_dtype = E4M3
    method = "block-wise FP8"
    scale_names = SCALE_NAMES

    def __init__(self, *args, block: tuple[int, int], **kwargs):
        super().__init__(*args, **kwargs)
        self.block = tuple(block)
        self.weight_scale = None  # the row-wise scale of RowQuantLinear: blocks here instead
        self.row_scales = nn.Parameter(torch.empty(
            self.out_features, block_grid(1, self.in_features, self.block)[1],
            dtype=torch.float32), requires_grad=False)
        self.fast = False

    @classmethod
    def like(cls, layer, prefix: str, block: tuple[int, int]):
        bias = layer.bias.dtype if layer.bias is not None else None
        return cls(layer.in_features, layer.out_features, bias, layer.shards, prefix,
                   block=block)

    def store_quantized(self, start: int, rows: int, w: torch.Tensor) -> None:
        q, scale = quantize_blocks(w, self.block)
        self.weight[start: start + rows].copy_(q)
        self._expand(start, rows, scale)

    def _expand(self, start: int, rows: int, scale: torch.Tensor) -> None:
        """Each of rows [start, start + rows) gets its block row's factors."""
        per_row = scale.repeat_interleave(self.block[0], dim=0)[:rows]
        self.row_scales[start: start + rows].copy_(per_row.to(self.row_scales.device))

    def place_scale(self, name: str, start: int, rows: int, scale: torch.Tensor) -> None:
        check_scale(name, scale, rows, self.in_features, self.block)
        self._expand(start, rows, scale)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in ``dtype``: q times its block's factor."""
        w = widen_e4m3(self.weight, dtype)  # q * WIDEN_FACTOR, exactly
        s = (self.row_scales / WIDEN_FACTOR).to(dtype)
        bk, cols = self.block[1], self.in_features
        if cols % bk == 0:
            return (w.view(self.out_features, -1, bk) * s[:, :, None]).view_as(w)
        return w * s.repeat_interleave(bk, dim=1)[:, :cols]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.dequantized(x.dtype))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block={list(self.block)}"


class FP8Latent(LatentProjection):
    """MLA's ``kv_b_proj`` from an FP8 checkpoint: dequantized once at load (see the module
    docstring); a float weight is taken as it is."""

    def __init__(self, kv_lora_rank: int, out_features: int, dtype: torch.dtype,
                 block: tuple[int, int] | None, prefix: str):
        super().__init__(kv_lora_rank, out_features)
        self.weight = nn.Parameter(torch.empty(out_features, kv_lora_rank, dtype=dtype),
                                   requires_grad=False)
        self.out_dtype, self.block, self.prefix = dtype, block, prefix
        self._stored: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None
        self._scale_name = SCALE_NAMES[0]  # what the checkpoint called it

    @classmethod
    def like(cls, layer: LatentProjection, prefix: str, block: tuple[int, int] | None):
        out, rank = layer.weight.shape
        return cls(rank, out, layer.weight.dtype, block, prefix)

    def checkpoint_tensors(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("weight",), SCALE_NAMES

    def load_tensor(self, name: str, tensor: torch.Tensor, shard: str | None) -> None:
        if name in SCALE_NAMES:
            self._scale, self._scale_name = tensor.float(), name
            return
        if tuple(tensor.shape) != tuple(self.weight.shape):
            raise EngineError(f"Tensor '{self.prefix}.weight' has shape {tuple(tensor.shape)} "
                              f"in the checkpoint but the model expects "
                              f"{tuple(self.weight.shape)}.")
        if tensor.dtype == E4M3:
            self._stored = tensor.to(self.weight.device)
        else:
            self.weight.copy_(tensor)

    def finish_loading(self) -> None:
        q, scale, self._stored, self._scale = self._stored, self._scale, None, None
        name = f"{self.prefix}.{self._scale_name}"
        if not scale_expected(q is not None, scale, f"{self.prefix}.weight", name,
                              "float8_e4m3fn"):
            return
        rows, cols = q.shape
        w = widen_e4m3(q, torch.float32) / WIDEN_FACTOR
        if self.block is not None:
            check_scale(name, scale, rows, cols, self.block)
            s = scale.repeat_interleave(self.block[0], 0)[:rows].repeat_interleave(
                self.block[1], 1)[:, :cols]
        elif scale.numel() in (1, rows):
            s = scale.reshape(-1, 1)
        else:
            raise EngineError(f"'{name}' has shape {tuple(scale.shape)}; expected one scale "
                              f"per tensor or per output channel ({rows}).")
        self.weight = nn.Parameter((w * s.to(w.device)).to(self.out_dtype), requires_grad=False)
