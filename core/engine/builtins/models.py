"""The Llama family, its mixture-of-experts relatives and DeepSeek-V2/V3, registered lazily
("module:attr") so that listing plugins stays cheap."""

from engine.hookspecs import hookimpl

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@hookimpl
def register_models(register):
    for arch in ARCHITECTURES:
        register(arch, "engine.models.llama:LlamaForCausalLM")
    for arch in MOE_ARCHITECTURES:
        register(arch, "engine.models.moe:MoEForCausalLM")
    for arch in MLA_ARCHITECTURES:
        register(arch, "engine.models.deepseek:DeepseekForCausalLM")
