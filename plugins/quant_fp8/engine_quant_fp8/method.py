from engine.interfaces import QuantMethod
from engine.registry import NotImplementedYet


class FP8Method(QuantMethod):
    def detect(self, hf_config: dict) -> bool:
        qc = hf_config.get("quantization_config") or {}
        return qc.get("quant_method") == "fp8"

    def convert(self, model):
        raise NotImplementedYet(
            "--quantization fp8 is registered but not implemented yet; leave --quantization unset.")
