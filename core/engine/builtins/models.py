"""The Llama family, registered lazily ("module:attr") so that listing plugins stays cheap."""

from engine.hookspecs import hookimpl

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@hookimpl
def register_models(register):
    for arch in ARCHITECTURES:
        register(arch, "engine.models.llama:LlamaForCausalLM")
