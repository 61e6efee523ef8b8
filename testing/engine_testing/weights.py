"""Weights in and out of layers as tests need them: a float weight fed to a quantized layer as
the loader would, a state dict with oneDNN-prepacked weights made plain again, and HF's model
on float16-rounded linear weights (what --dtype float16 holds on a CPU)."""

from __future__ import annotations

import torch


def load_float_weight(layer, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """Feed a float ``weight`` [out, in] (and ``bias``) to a quantized layer (RowQuantLinear)
    as the loader would: one tensor per projection when the layer packs several. The caller
    finishes loading."""
    if layer.shards:
        start = 0
        for name, rows in layer.shards.items():
            layer.load_tensor("weight", weight[start:start + rows], name)
            start += rows
    else:
        layer.load_tensor("weight", weight, None)
    if bias is not None:
        layer.load_tensor("bias", bias, None)
    return layer


def dense_state_dict(model) -> dict:
    """``model.state_dict()`` with oneDNN-prepacked weights turned back into plain tensors."""
    return {k: v.to_dense() if v.is_mkldnn else v for k, v in model.state_dict().items()}


def hf_on_half_weights(path: str):
    """HF's model of checkpoint ``path`` in float32 with every linear weight rounded to float16
    (what ``--dtype float16`` holds on a CPU), generating past EOS."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(module.weight.detach().half().float(),
                                               requires_grad=False)
    return model
