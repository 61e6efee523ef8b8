"""FP8Method: swaps the model's linear layers for FP8Linear and picks their forward path.

Checkpoints: a bf16/fp32 one is quantized at load (per output channel, e4m3); an FP8 one in
the vLLM / llm-compressor layout (config.json ``quantization_config.quant_method == "fp8"``,
float8_e4m3fn weights with ``weight_scale``) is loaded as it is, and so is a block-wise one
(DeepSeek-V3's ``weight_block_size`` with ``weight_scale_inv``: block.py, dequantized in the
forward); MLA's kv_b_proj in an FP8 checkpoint is dequantized once at load (block.py's
FP8Latent). ``ignored_layers`` stay unquantized. ``activation_scheme
"static" makes every layer use its checkpoint ``input_scale`` (see linear.py); "dynamic" (the
default) refuses checkpoints that carry one.

Each layer's forward path is decided in ``process_weights``; once the last one is, one log line
says how many layers take which path, and why the others do not take the fast one.
"""

from __future__ import annotations

import functools
import logging

import torch

from engine.interfaces import QuantMethod
from engine.layers.quantized import swap_quantizable
from engine.registry import EngineError
from engine.layers.mla import LatentProjection
from engine_quant_fp8.block import FP8BlockLinear, FP8Latent
from engine_quant_fp8.linear import FP8Linear

logger = logging.getLogger("engine")
FAST_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer


def fast_path_reason(device: torch.device) -> str | None:
    """None when ``torch._scaled_mm`` with row-wise scales runs on ``device``, else why not."""
    if device.type != "cuda":
        return f"{device.type} has no FP8 matmul"
    cap = torch.cuda.get_device_capability(device)
    if cap < FAST_CAPABILITY:
        return f"compute capability {cap[0]}.{cap[1]} < 8.9 has no FP8 tensor cores"
    return None


def usable_fast(layer: FP8Linear) -> bool:
    # cuBLASLt FP8 GEMMs need both matrix dimensions of the weight to be multiples of 16
    return layer.in_features % 16 == 0 and layer.out_features % 16 == 0


FAST = "torch._scaled_mm"
DEQUANTIZE = "weights stay FP8 and are dequantized per layer in the forward"
BLOCKS = "block-wise scales (weight_block_size {}): no block-scaled FP8 GEMM here"
ODD_SIZES = "in/out features not multiples of 16"


def layer_name(layer: FP8Linear) -> str:
    return f"{layer.prefix}.{'+'.join(layer.shards)}" if layer.shards else layer.prefix


def path_summary(decided: list[tuple[str, str, str]], static: bool) -> str:
    """One line from (path, reason, layer name) per layer: the count per path and reason,
    naming the first few layers that miss the fast path only because of their sizes."""
    total, groups = len(decided), {}
    for path, reason, name in decided:
        groups.setdefault((path, reason), []).append(name)
    parts = []
    for (path, reason), names in sorted(groups.items(), key=lambda g: g[0][0] != FAST):
        why = [reason] if reason != ODD_SIZES else [
            f"{reason}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"]
        if static:
            why.append("activations rounded to FP8 with the checkpoint's static input_scale")
        elif path == FAST:
            why.append("activations quantized per token")
        parts.append(f"{path} in {len(names)} of {total} ({'; '.join(w for w in why if w)})")
    return f"fp8 linear layers: {'; '.join(parts)}"


class FP8Method(QuantMethod):
    def __init__(self):
        self._expected = 0  # FP8Linear layers the last convert() swapped in
        self._decided: list[tuple[str, str, str]] = []

    def detect(self, hf_config: dict) -> bool:
        qc = hf_config.get("quantization_config") or {}
        return str(qc.get("quant_method", "")).lower() == "fp8"

    def convert(self, model):
        # ignored_layers and block sizes describe an FP8 checkpoint, not a bf16 one
        hf = model.config.hf_config
        qc = (hf.get("quantization_config") or {}) if self.detect(hf) else {}
        block = qc.get("weight_block_size")
        if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2 or
                                  not all(isinstance(b, int) and b > 0 for b in block)):
            raise EngineError(f"This FP8 checkpoint's weight_block_size is {block!r}; expected "
                              f"[rows, columns] of positive integers (DeepSeek-V3: [128, 128]).")
        if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
            raise EngineError(f"This FP8 checkpoint's fmt is {qc['fmt']!r}; engine-quant-fp8 "
                              f"loads float8_e4m3fn (\"e4m3\") weights.")
        scheme = str(qc.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("static", "dynamic"):
            raise EngineError(f"This FP8 checkpoint's activation_scheme is "
                              f"{qc['activation_scheme']!r}; engine-quant-fp8 supports "
                              f"'static' (per-tensor input_scale) and 'dynamic'.")
        if block is not None and scheme == "static":
            raise EngineError("This FP8 checkpoint is block-wise (weight_block_size) with "
                              "activation_scheme \"static\"; engine-quant-fp8 runs block-wise "
                              "weights with dynamic (unquantized) activations only.")
        ignored = set(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
        if block is not None:
            make = functools.partial(FP8BlockLinear.like, block=tuple(block))
        else:
            make = functools.partial(FP8Linear.like, static_input=scheme == "static")
        swap_quantizable(model, make, ignored)
        if qc:  # an FP8 checkpoint: MLA's kv_b_proj comes as FP8 too (unless ignored)
            for name, layer in list(model.named_modules()):
                if isinstance(layer, LatentProjection) and not isinstance(layer, FP8Latent) \
                        and name not in ignored:
                    parent, _, attr = name.rpartition(".")
                    setattr(model.get_submodule(parent), attr, FP8Latent.like(
                        layer, name, None if block is None else tuple(block)))
        self._expected = sum(isinstance(m, (FP8Linear, FP8BlockLinear))
                             for m in model.modules())
        self._decided = []
        if self._expected == 0:
            logger.info("fp8 linear layers: none (every quantizable layer is in ignored_layers)")
        return model

    def process_weights(self, module) -> None:
        if isinstance(module, FP8Latent):
            module.finish_loading()
            return
        if not isinstance(module, (FP8Linear, FP8BlockLinear)):
            return
        module.finish_loading()
        if isinstance(module, FP8BlockLinear):
            reason = BLOCKS.format(list(module.block))
        else:
            reason = fast_path_reason(module.weight.device)
            if reason is None and not usable_fast(module):
                reason = ODD_SIZES
        module.fast = reason is None
        self._decided.append((FAST if module.fast else DEQUANTIZE, reason or "",
                              layer_name(module)))
        if len(self._decided) >= self._expected:  # the model's last FP8 layer
            logger.info(path_summary(self._decided,
                                     getattr(module, "input_scale", None) is not None))
            self._decided, self._expected = [], 0
