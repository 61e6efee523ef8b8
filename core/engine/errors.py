"""The errors a user can fix (a wrong name, an unusable backend, an incompatible pair of
options, ...), each worded to say what was wrong and what to do; and where each bundled name
lives, so that a missing one can say what to install."""

from __future__ import annotations

# Where the bundled names live, so that a missing one can say what to install.
KNOWN_PROVIDERS = {
    "attention backend": {
        "fa3": ("engine-attention-fa3", "plugins/attention_fa3"),
        "flashinfer": ("engine-attention-flashinfer", "plugins/attention_flashinfer"),
        "trtllm_mha": ("engine-attention-flashinfer", "plugins/attention_flashinfer"),
    },
    "quantization method": {"fp8": ("engine-quant-fp8", "plugins/quant_fp8")},
    "KV-cache dtype": {
        "fp8_e4m3": ("engine-quant-fp8", "plugins/quant_fp8"),
        "fp8_e5m2": ("engine-quant-fp8", "plugins/quant_fp8"),
    },
    "schedule policy": {
        "lpm": ("engine-policy-lpm", "plugins/policy_lpm"),
        "fcfs": ("engine-policy-fcfs", "plugins/policy_fcfs"),
    },
    "grammar backend": {
        "xgrammar": ("engine-grammar-xgrammar", "plugins/grammar_xgrammar"),
        "llguidance": ("engine-grammar-llguidance", "plugins/grammar_llguidance"),
    },
    "tool-call parser": {name: ("engine-parsers", "plugins/parsers") for name in (
        "hermes", "qwen25", "qwen", "llama3_json", "llama3", "mistral", "pythonic",
        "llama4_pythonic")},
    "reasoning parser": {name: ("engine-parsers", "plugins/parsers") for name in (
        "deepseek-r1", "deepseek_r1", "qwen3", "qwen3-thinking")},
}
GRAMMAR_INSTALL = ("pip install ./plugins/grammar_xgrammar (or ./plugins/grammar_llguidance; "
                   "from PyPI: engine-grammar-xgrammar, engine-grammar-llguidance)")


class EngineError(Exception):
    """A mistake the user can fix; its message says what was wrong and what to do."""

    def __str__(self) -> str:  # KeyError subclasses would otherwise print the repr
        return str(self.args[0]) if self.args else ""


class UnknownName(EngineError, KeyError):
    pass


class UnknownAttentionBackend(UnknownName):
    pass


class BackendUnavailable(EngineError):
    pass


class NoBackendAvailable(EngineError):
    pass


class IncompatibleOptions(EngineError, ValueError):
    pass


class DuplicateRegistration(EngineError):
    pass


class NotImplementedYet(EngineError):
    pass
