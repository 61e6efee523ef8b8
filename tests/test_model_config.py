"""ModelConfig parsing (transformers' semantics) and --dtype resolution; no model needed."""

from __future__ import annotations

import pytest
import torch

from engine.device import DeviceInfo
from engine.models.config import ModelConfig
from engine.models.dtype import resolve_dtype
from engine.registry import EngineError

BASE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 3,
    "intermediate_size": 128,
    "vocab_size": 100,
    "sliding_window": 8,
}


@pytest.mark.parametrize(
    "arch,extra,layers",
    [
        ("MistralForCausalLM", {}, (0, 1, 2)),
        ("MistralForCausalLM", {"sliding_window": None}, ()),
        ("LlamaForCausalLM", {}, ()),
        ("Qwen2ForCausalLM", {"use_sliding_window": False}, ()),
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 1}, (1, 2)),
        ("Qwen3ForCausalLM", {"use_sliding_window": True, "max_window_layers": 0}, (0, 1, 2)),
        (
            "Qwen2ForCausalLM",
            {
                "use_sliding_window": True,
                "max_window_layers": 1,
                "layer_types": ["sliding_attention", "full_attention", "full_attention"],
            },
            (0,),
        ),
    ],
)
def test_sliding_window_layers_follow_transformers(arch, extra, layers):
    c = ModelConfig.from_hf({**BASE, "architectures": [arch], **extra})
    assert c.sliding_window_layers == layers
    assert [s.sliding_window for s in c.layer_specs()] == [
        8 if i in layers else None for i in range(3)
    ]


def test_config_fields_old_and_new_rope_layouts():
    old = ModelConfig.from_hf(
        {
            **BASE,
            "architectures": ["Qwen2ForCausalLM"],
            "rope_theta": 1e6,
            "rope_scaling": {"type": "linear", "factor": 2.0},
            "eos_token_id": [5, 6],
            "torch_dtype": "bfloat16",
        }
    )
    assert old.rope_theta == 1e6 and old.rope_scaling == {
        "type": "linear",
        "factor": 2.0,
        "rope_type": "linear",
    }
    assert old.eos_token_ids == (5, 6) and old.torch_dtype == "bfloat16"
    assert old.qkv_bias and not old.o_bias and old.head_dim == 16 and old.num_kv_heads == 4
    new = ModelConfig.from_hf(
        {
            **BASE,
            "architectures": ["Qwen3ForCausalLM"],
            "head_dim": 32,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        }
    )
    assert new.rope_theta == 5e5 and new.rope_scaling is None and new.qk_norm
    assert new.head_dim == 32 and new.layer_specs()[0].scaling == 32**-0.5
    with pytest.raises(EngineError, match="rope scaling type 'yarn'"):
        ModelConfig.from_hf(
            {
                **BASE,
                "architectures": ["LlamaForCausalLM"],
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
            }
        )


def test_dtype_resolution():
    cpu = DeviceInfo("cpu", "CPU", native_bf16=False)
    dtype, reason = resolve_dtype("auto", "bfloat16", cpu)
    assert dtype == torch.float32 and "no native bf16" in reason and "~50x" in reason
    assert (
        resolve_dtype("auto", "bfloat16", DeviceInfo("cpu", "CPU", native_bf16=True))[0]
        == torch.bfloat16
    )
    gpu = DeviceInfo("cuda", "H100", (9, 0), native_bf16=True)
    assert resolve_dtype("auto", "float16", gpu)[0] == torch.float16
    assert resolve_dtype("auto", None, cpu)[0] == torch.float32
    dtype, reason = resolve_dtype("bfloat16", "float32", cpu)
    assert dtype == torch.bfloat16 and "forced" in reason
    with pytest.raises(EngineError, match="Unknown --dtype 'int8'"):
        resolve_dtype("int8", None, cpu)
