"""W8A8Int8Method: swaps the model's linear layers for Int8Linear and picks their kernel.

Checkpoints: a float one (bf16/fp16/fp32, or a GGUF, which the core dequantizes) is quantized
at load, per output channel; an int8 one in SGLang's ``w8a8_int8`` layout (config.json
``quantization_config.quant_method == "w8a8_int8"``, int8 weights with ``weight_scale`` [out, 1])
is loaded as it is. The embedding and the LM head stay in the model dtype, as in SGLang.

A GGUF whose blocks are all Q8_0 (int8 weights, a scale per block of 32) already is W8A8's
weights: on a CPU in float32 the engine runs those blocks as they are through a linear kernel
taking int8 activations (``gguf_blocks``, ``block_activations``: engine-cpu-kernels'
``avx512_q8_0``/``avx2_q8_0``, llama.cpp's arithmetic) and never calls ``convert`` here.
"""

from __future__ import annotations

import logging

import torch

from engine.interfaces import QuantMethod
from engine.layers.quantized import swap_quantizable
from engine_quant_int8 import kernels
from engine_quant_int8.linear import Int8Linear

logger = logging.getLogger("engine")


def kernel_reason(device) -> str | None:
    """None when w8a8_int8 runs on ``device`` (a DeviceInfo), else why not."""
    dev = torch.device(device.torch_device)
    if kernels.kernel_for(dev) is not None:
        return None
    if dev.type == "cpu":
        return ("this torch build has no fbgemm/x86 quantized engine "
                f"(torch.backends.quantized.supported_engines = "
                f"{torch.backends.quantized.supported_engines})")
    return f"w8a8_int8 runs on CPU (fbgemm) and CUDA (torch._int_mm), not on {dev.type}"


class W8A8Int8Method(QuantMethod):
    # Q8_0 blocks are int8 weights; with activations quantized to int8 per block of 32 they are
    # W8A8 as llama.cpp computes it. Q4_0 / Q4_1 blocks hold fewer bits than int8: they run as
    # they are with the same int8 activations (llama.cpp's Q8_0 / Q8_1 arithmetic), since
    # requantizing them per channel would only add rounding (see QuantMethod.gguf_blocks; the
    # engine decides where)
    gguf_blocks = ("q8_0", "q4_0", "q4_1")
    block_activations = "int8"

    def __init__(self):
        self._logged = False
        self._reduced = 0

    def detect(self, hf_config: dict) -> bool:
        qc = hf_config.get("quantization_config") or {}
        return str(qc.get("quant_method", "")).lower() == "w8a8_int8"

    def convert(self, model):
        hf = model.config.hf_config
        qc = (hf.get("quantization_config") or {}) if self.detect(hf) else {}
        swap_quantizable(model, Int8Linear.like, set(qc.get("ignored_layers") or ()))
        self._logged = self._reduced = False
        return model

    def process_weights(self, module) -> None:
        if not isinstance(module, Int8Linear):
            return
        kernel = kernels.kernel_for(module.weight.device)
        module.prepare(kernel)
        if not self._logged:
            self._logged = True
            logger.info(f"w8a8_int8 linear layers: {kernels.KERNEL_LOG[kernel]}")
        if module.reduce_range and not self._reduced:
            self._reduced = True
            logger.info("w8a8_int8: the checkpoint's int8 weights use the full [-127, 127] "
                        "range, which AVX2's 16-bit multiply-adds could saturate with 8-bit "
                        "activations; those layers quantize activations to 7 bits "
                        "(fbgemm reduce_range)")
