"""The core's answer for `--attention-backend auto` (trylast: a platform plugin can override)."""

from engine.hookspecs import hookimpl

# DESIGN.md: fa3 on Hopper, trtllm_mha on Blackwell, flashinfer on Ampere/Ada, torch_native on CPU
PREFERENCE = {9: ("fa3", "flashinfer"), 10: ("trtllm_mha", "flashinfer"), 8: ("flashinfer",)}
# an MLA model (DeepSeek): the guide's trtllm_mla on Blackwell, flashinfer's MLA kernels on
# Hopper and Ampere (SGLang's fa3 has MLA; the engine's fa3 plugin does not yet), then triton
MLA_PREFERENCE = {10: ("trtllm_mla", "flashinfer"), 9: ("flashinfer",), 8: ("flashinfer",)}


@hookimpl(trylast=True)
def select_attention_backend(device, model_config, kv_dtype, page_size, registries, dtype):
    from engine.registry import backend_kv_dtypes, takes_dtype, takes_model, takes_page_size

    regs = registries.attention
    major = device.capability[0] if device.capability else None
    by_priority = [e.name for e in sorted(regs, key=lambda e: -e.extra["priority"])]
    # on a GPU: the guide's pick for the architecture, then every backend by its registered
    # priority (torch_native, at 0, last); on a CPU torch_native, unless a plugin's own
    # select_attention_backend answered first; only backends with MLA for an MLA model
    latent = bool(getattr(getattr(model_config, "mla", None), "kv_lora_rank", 0))
    table = MLA_PREFERENCE if latent else PREFERENCE
    preferred = [*table.get(major, ())] if device.is_cuda else ["torch_native"]
    ranked = preferred + by_priority
    for name in ranked:
        if name not in regs:
            continue
        entry = regs.get(name)
        if (entry.unavailable_reason(device) is None and takes_page_size(entry, page_size)
                and takes_dtype(entry, dtype) and takes_model(entry, model_config)
                and kv_dtype in backend_kv_dtypes(registries, entry)):
            return entry.name
    return None
