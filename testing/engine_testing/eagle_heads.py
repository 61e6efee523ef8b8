"""Random EAGLE / EAGLE3 draft heads for a tiny target, written as SGLang's checkpoints are
(config.json + model.safetensors, tensor names without a ``model.`` prefix), and the plain
torch math of their forward over a whole sequence, to check a head against."""

from __future__ import annotations

import json
import os

import torch


def write_eagle_head(out_dir: str, target_dir: str, kind: str = "EAGLE", *, seed: int = 0,
                     hidden_size: int | None = None, draft_vocab_size: int | None = None,
                     aux_layer_ids: list[int] | None = None, num_layers: int = 1,
                     scale: float = 0.08) -> str:
    """A random ``kind`` ("EAGLE" or "EAGLE3") head for the target checkpoint ``target_dir``
    in ``out_dir``. EAGLE writes ``fc`` (with bias), ``layers.N`` (the first without its
    input norm) and the embedding SGLang's heads carry (the target's is used); EAGLE3 one
    ``midlayer`` (q/k/v over 2H), ``fc`` (3H -> H), ``norm``, ``lm_head`` over
    ``draft_vocab_size`` tokens (default: the target's) and ``d2t`` (a random injective map
    when the draft vocabulary is smaller) and ``eagle_aux_hidden_state_layer_ids`` if given."""
    from safetensors.torch import save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        t = json.load(f)
    H = hidden_size or t["hidden_size"]
    heads, kv_heads = t["num_attention_heads"], t.get("num_key_value_heads")
    kv_heads = kv_heads or heads
    D = H // heads if hidden_size else t.get("head_dim") or H // heads
    inter, vocab = t["intermediate_size"], t["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * scale

    def norm():
        return 1 + 0.1 * torch.randn(H, generator=gen)

    def layer(prefix: str, attn_in: int, input_norm: bool) -> dict:
        out = {f"{prefix}.self_attn.q_proj.weight": rnd(heads * D, attn_in),
               f"{prefix}.self_attn.k_proj.weight": rnd(kv_heads * D, attn_in),
               f"{prefix}.self_attn.v_proj.weight": rnd(kv_heads * D, attn_in),
               f"{prefix}.self_attn.o_proj.weight": rnd(H, heads * D),
               f"{prefix}.mlp.gate_proj.weight": rnd(inter, H),
               f"{prefix}.mlp.up_proj.weight": rnd(inter, H),
               f"{prefix}.mlp.down_proj.weight": rnd(H, inter),
               f"{prefix}.post_attention_layernorm.weight": norm()}
        if input_norm:
            out[f"{prefix}.input_layernorm.weight"] = norm()
        return out

    config = {"hidden_size": H, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": D, "intermediate_size": inter, "vocab_size": vocab,
              "num_hidden_layers": num_layers,
              "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
              "rope_theta": t.get("rope_theta", 10000.0),
              "max_position_embeddings": t.get("max_position_embeddings", 2048),
              "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32"}
    if kind == "EAGLE":
        config["architectures"] = ["LlamaForCausalLMEagle"]
        tensors = {"fc.weight": rnd(H, 2 * H), "fc.bias": rnd(H),
                   "embed_tokens.weight": rnd(vocab, H)}
        for i in range(num_layers):
            tensors.update(layer(f"layers.{i}", H, input_norm=i > 0))
    elif kind == "EAGLE3":
        dv = draft_vocab_size or vocab
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=dv)
        if hidden_size and hidden_size != t["hidden_size"]:
            config["target_hidden_size"] = t["hidden_size"]
        if aux_layer_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
        tensors = {"fc.weight": rnd(H, 3 * t["hidden_size"]), "norm.weight": norm(),
                   "lm_head.weight": rnd(dv, H),
                   **layer("midlayer", 2 * H, input_norm=True),
                   "midlayer.hidden_norm.weight": norm()}
        target_ids = torch.randperm(vocab, generator=gen)[:dv].sort().values
        tensors["d2t"] = target_ids - torch.arange(dv)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[target_ids] = True
        tensors["t2d"] = t2d
    else:
        raise ValueError(f"kind is EAGLE or EAGLE3, not {kind!r}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"))
    return out_dir


# -- the reference math ----------------------------------------------------------------------
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):
    """HF's rotate-half rotary over the last dim of x [T, heads, D]."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = positions.double()[:, None] * inv[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attention(w: dict, p: str, x, positions, cfg):
    heads, kv, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    D = cfg.get("head_dim") or H // heads
    T = x.shape[0]
    q = (x @ w[f"{p}.q_proj.weight"].T).view(T, heads, D)
    k = (x @ w[f"{p}.k_proj.weight"].T).view(T, kv, D)
    v = (x @ w[f"{p}.v_proj.weight"].T).view(T, kv, D)
    q, k = _rope(q, positions, cfg["rope_theta"]), _rope(k, positions, cfg["rope_theta"])
    k = k.repeat_interleave(heads // kv, 1)
    v = v.repeat_interleave(heads // kv, 1)
    s = torch.einsum("thd,shd->hts", q, k) * D ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, heads * D)
    return o @ w[f"{p}.o_proj.weight"].T


def _mlp(w: dict, p: str, x):
    g, u = x @ w[f"{p}.gate_proj.weight"].T, x @ w[f"{p}.up_proj.weight"].T
    return (torch.nn.functional.silu(g) * u) @ w[f"{p}.down_proj.weight"].T


def reference_head(head_dir: str, target_dir: str, ids: list[int], hidden: torch.Tensor,
                   own: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V or draft V], output states [T, H]) of the head at ``head_dir`` over one
    sequence from position 0: token ``ids[i]`` and state ``hidden[i]`` (the target's, [n, H]
    for EAGLE, [n, 3H] for EAGLE3) at position i, then ``own`` [T - n, H] (the head's own
    output states, as a draft chain feeds them back) for the rest, attending causally; the
    target's embedding and LM head read from ``target_dir``."""
    from safetensors.torch import load_file

    with open(os.path.join(head_dir, "config.json")) as f:
        cfg = json.load(f)
    w = load_file(os.path.join(head_dir, "model.safetensors"))
    tw = load_file(os.path.join(target_dir, "model.safetensors"))
    eps = cfg["rms_norm_eps"]
    pos = torch.arange(len(ids))
    emb = tw["model.embed_tokens.weight"][torch.tensor(ids)]
    eagle3 = cfg["architectures"][0] == "LlamaForCausalLMEagle3"
    if eagle3 and hidden.shape[-1] != cfg["hidden_size"]:
        hidden = hidden @ w["fc.weight"].T
    if own is not None:
        hidden = torch.cat([hidden, own])
    if not eagle3:
        h = torch.cat([emb, hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}"
            x = h if i == 0 else _rms(h, w[f"{p}.input_layernorm.weight"], eps)
            h = h + _attention(w, f"{p}.self_attn", x, pos, cfg)
            h = h + _mlp(w, f"{p}.mlp", _rms(h, w[f"{p}.post_attention_layernorm.weight"], eps))
        head = tw.get("lm_head.weight", tw["model.embed_tokens.weight"])
        return h @ head.T, h
    f = hidden
    x = torch.cat([_rms(emb, w["midlayer.input_layernorm.weight"], eps),
                   _rms(f, w["midlayer.hidden_norm.weight"], eps)], -1)
    h = f + _attention(w, "midlayer.self_attn", x, pos, cfg)
    h = h + _mlp(w, "midlayer.mlp", _rms(h, w["midlayer.post_attention_layernorm.weight"], eps))
    return _rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T, h
