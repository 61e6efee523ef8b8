"""What graphs take of the Llama family's model (models/llama.py): the CPU graph's nodes
(engine/cpu_graph: the decode forward recorded once as C nodes) and the piecewise CUDA graph's
parts (engine/piecewise_cuda_graph.py: the forward cut at each layer's attention)."""

from __future__ import annotations

import torch

from engine.interfaces import GraphUnsupported
from engine.layers.embedding import Embedding, LMHead


def record_cpu_graph(model, g) -> torch.Tensor:
    """Record ``model``'s (a LlamaForCausalLM's) decode forward as CPU-graph nodes (``g`` is
    the cpu_graph's GraphBuilder): embedding, every layer, the final norm and the LM head, over
    float32 buffers of ``g.max_rows`` rows; returns the logits buffer [max_rows, vocab]. Raises
    GraphUnsupported for what has no node (tensor or pipeline parallel layers, ...)."""
    if model.pp is not None or not isinstance(model.model.embed_tokens, Embedding) or \
            not isinstance(model.lm_head, LMHead):
        raise GraphUnsupported("tensor- or pipeline-parallel layers")
    c, m = model.config, model.model
    sa, mlp = m.layers[0].self_attn, m.layers[0].mlp
    q, kv = sa.num_heads * sa.head_dim, sa.num_kv_heads * sa.head_dim
    bufs = {"h": g.buffer(c.hidden_size), "x": g.buffer(c.hidden_size),
            "qkv": g.buffer(q + 2 * kv), "attn": g.buffer(q), "o": g.buffer(c.hidden_size),
            "gate_up": g.buffer(mlp.gate_up_proj.out_features),
            "act": g.buffer(mlp.down_proj.in_features), "down": g.buffer(c.hidden_size)}
    g.embed(m.embed_tokens.weight, bufs["h"])
    add = None
    for layer in m.layers:
        add = record_layer(layer, g, bufs, m.rotary_emb.cos_sin, add)
    g.rmsnorm(bufs["h"], m.norm.weight, m.norm.eps, bufs["x"], add)
    logits = g.buffer(c.vocab_size)
    g.linear(model.lm_head, bufs["x"], logits, "the LM head")
    return logits


def record_layer(layer, g, bufs: dict, cos_sin: torch.Tensor,
                 add: torch.Tensor | None) -> torch.Tensor:
    """Record a DecoderLayer's decode forward: ``bufs["h"]`` is the residual stream, to which
    ``add`` (the previous layer's MLP output) is added first; returns this layer's MLP output,
    for the next one to add."""
    sa, mlp, b = layer.self_attn, layer.mlp, bufs
    H, KVH, D = sa.num_heads, sa.num_kv_heads, sa.head_dim
    where = f"layer {sa.global_id}"
    norm = layer.input_layernorm
    g.rmsnorm(b["h"], norm.weight, norm.eps, b["x"], add)
    qkv = b["qkv"]
    g.linear(sa.qkv_proj, b["x"], qkv, f"{where}'s qkv_proj")
    qk_norm = hasattr(sa, "q_norm")
    g.rope(qkv, H + KVH, D, cos_sin, sa.q_norm.weight if qk_norm else None,
           sa.k_norm.weight if qk_norm else None, H, sa.q_norm.eps if qk_norm else 0.0)
    g.attention(sa.attn.layer_id, qkv[:, : H * D], qkv[:, H * D: (H + KVH) * D],
                qkv[:, (H + KVH) * D:], b["attn"])
    g.linear(sa.o_proj, b["attn"], b["o"], f"{where}'s o_proj")
    norm = layer.post_attention_layernorm
    g.rmsnorm(b["h"], norm.weight, norm.eps, b["x"], b["o"])
    inter = mlp.gate_up_proj.shard_sizes[0]
    g.linear(mlp.gate_up_proj, b["x"], b["gate_up"], f"{where}'s gate_up_proj")
    g.silu_mul(b["gate_up"], inter, b["act"])
    g.linear(mlp.down_proj, b["act"], b["down"], f"{where}'s down_proj")
    return b["down"]


def piecewise_parts(model):
    """``model``'s (a LlamaForCausalLM's) forward cut at attention (a PiecewiseParts): the
    embedding with the rotary lookup, each layer's halves before and after its attention, and
    the final norm with the LM head. Raises GraphUnsupported with tensor- or pipeline-parallel
    layers: the parts are the single-process model's."""
    from engine.piecewise_cuda_graph import PiecewiseLayer, PiecewiseParts

    if model.tp is not None or model.pp is not None:
        raise GraphUnsupported("tensor- or pipeline-parallel layers (--tp-size/--pp-size > 1): "
                               "the piecewise parts are the single-process model's")
    layers = []
    for layer in model.model.layers:
        sa = layer.self_attn
        layers.append(PiecewiseLayer(layer.before_attention, layer.after_attention,
                                     sa.attn.layer_id, sa.num_heads, sa.num_kv_heads,
                                     sa.head_dim))
    return PiecewiseParts(model.model.embed, layers, model.head)
