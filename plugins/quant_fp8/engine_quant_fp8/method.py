"""FP8Method: swaps the model's linear layers for FP8Linear and picks their forward path.

Checkpoints: a bf16/fp32 one is quantized at load (per output channel, e4m3); an FP8 one in
the vLLM / llm-compressor layout (config.json ``quantization_config.quant_method == "fp8"``,
float8_e4m3fn weights with ``weight_scale``) is loaded as it is. ``ignored_layers`` stay
unquantized; block-wise checkpoints (``weight_block_size``) are refused.
"""

from __future__ import annotations

import logging

import torch

from engine.interfaces import QuantMethod
from engine.layers.quantized import swap_quantizable
from engine.registry import EngineError
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


class FP8Method(QuantMethod):
    def __init__(self):
        self._logged = False

    def detect(self, hf_config: dict) -> bool:
        qc = hf_config.get("quantization_config") or {}
        return str(qc.get("quant_method", "")).lower() == "fp8"

    def convert(self, model):
        # ignored_layers and block sizes describe an FP8 checkpoint, not a bf16 one
        hf = model.config.hf_config
        qc = (hf.get("quantization_config") or {}) if self.detect(hf) else {}
        if qc.get("weight_block_size"):
            raise EngineError(
                f"This FP8 checkpoint is block-wise quantized (weight_block_size "
                f"{qc['weight_block_size']}); engine-quant-fp8 loads per-tensor and "
                f"per-channel FP8 checkpoints only.")
        ignored = set(qc.get("ignored_layers") or ())
        swap_quantizable(model, FP8Linear.like, ignored)
        self._logged = False
        return model

    def process_weights(self, module) -> None:
        if not isinstance(module, FP8Linear):
            return
        module.finish_loading()
        reason = fast_path_reason(module.weight.device)
        module.fast = reason is None and usable_fast(module)
        if not self._logged:
            self._logged = True
            how = ("torch._scaled_mm, activations quantized per token" if reason is None else
                   f"weights stay FP8 and are dequantized per layer in the forward ({reason})")
            logger.info(f"fp8 linear layers: {how}")
