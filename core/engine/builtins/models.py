"""The Llama family and its mixture-of-experts relatives, registered lazily ("module:attr") so
that listing plugins stays cheap."""

from engine.hookspecs import hookimpl

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


@hookimpl
def register_models(register):
    for arch in ARCHITECTURES:
        register(arch, "engine.models.llama:LlamaForCausalLM")
    for arch in MOE_ARCHITECTURES:
        register(arch, "engine.models.moe:MoEForCausalLM")
