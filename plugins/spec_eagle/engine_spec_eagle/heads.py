"""The EAGLE draft heads as SGLang builds and names them (``LlamaForCausalLMEagle``,
``LlamaForCausalLMEagle3``; checkpoint names without a ``model.`` prefix). Each is built from
its own config.json by the core's loader (``ModelRunner(model_cls=...)``: its KV pool and
attention backend are the core's) and shares the target's embedding (and, for EAGLE, the
target's LM head) once loaded (``share``).

EAGLE (EAGLE-1/2): at position i the input is ``fc(concat(embed(t[i+1]), f[i]))``, with f the
target's last hidden state after its final norm (what its LM head reads); then the head's
decoder layers (the first without its input norm), no final norm, and the target's LM head.

EAGLE3: f is three of the target's layer outputs side by side (3H), projected by ``fc`` to H;
one decoder layer whose attention reads ``concat(input_layernorm(embed), hidden_norm(f))``
(2H), the residual stream being f; then the head's own ``norm`` and its ``lm_head`` over a
draft vocabulary, whose ids map to the target's through ``d2t`` (target = draft + d2t[draft]).

A head's forward keeps ``last_hidden`` (its output before any norm, at the logits rows): what
the next draft step reads in place of the target's f."""

from __future__ import annotations

import torch
from engine.errors import EngineError
from engine.layers.embedding import LMHead
from engine.layers.linear import Linear, MergedLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import MLP, DecoderLayer, SelfAttention
from torch import nn


class _Unused(nn.Module):
    """A checkpoint tensor the head does not use (the target's copy is), accepted and dropped."""

    def checkpoint_tensors(self):
        return (), ("weight",)

    def load_tensor(self, name, tensor, shard):
        pass


class _Head(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling)
        self.embed_tokens = _Unused()  # the target's, once shared
        self.last_hidden = None

    def share(self, target) -> None:
        """Use the target model's embedding (``target.model.embed_tokens``)."""
        self.embed_tokens = target.model.embed_tokens

    def forward(self, batch, return_all_logits: bool = False, hidden=None) -> torch.Tensor:
        if hidden is None or hidden.shape[0] != batch.num_tokens:
            raise EngineError(f"{type(self).__name__} drafts from the target's hidden states: "
                              f"one row per new token")
        embeds = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary_emb(batch.positions, embeds.dtype)
        h = self.body(embeds, hidden, cos, sin)
        if not return_all_logits:
            h = h[batch.logits_indices]
        self.last_hidden = h
        return self.logits(h)


class EagleHead(_Head):
    """SGLang's LlamaForCausalLMEagle."""

    hidden_in = 1  # the target's states it reads, in hidden sizes

    def __init__(self, config):
        super().__init__(config)
        H = config.hidden_size
        self.fc = Linear(2 * H, H, bool(config.hf_config.get("bias", True)))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE drops the first layer's
        self.lm_head = _Unused()  # the target's, once shared

    def share(self, target) -> None:
        super().share(target)
        self.lm_head = target.lm_head

    def body(self, embeds, hidden, cos, sin):
        h = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], -1))
        for layer in self.layers:
            h = layer(h, cos, sin)
        return h

    def logits(self, h):
        return self.lm_head(h)


class _MidLayer(nn.Module):
    """EAGLE3's decoder layer: attention over [embed; hidden] (2H), MLP, the residual being
    the (projected) hidden states."""

    def __init__(self, config):
        super().__init__()
        c, H = config, config.hidden_size
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.self_attn = SelfAttention(c, 0)
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.self_attn.qkv_proj = MergedLinear(2 * H, {"q_proj": q, "k_proj": kv,
                                                       "v_proj": kv}, c.qkv_bias)
        self.mlp = MLP(c)

    def forward(self, embeds, hidden, cos, sin):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)
        attn = self.self_attn
        h = hidden + attn.output(attn.attn(*attn.project(x, cos, sin)))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(_Head):
    """SGLang's LlamaForCausalLMEagle3 (one decoder layer)."""

    hidden_in = 3

    def __init__(self, config):
        super().__init__(config)
        hf, H = config.hf_config, config.hidden_size
        if config.num_layers != 1:
            raise EngineError(f"an EAGLE3 head of {config.num_layers} layers: this engine runs "
                              f"the one-layer heads (num_hidden_layers 1)")
        if hf.get("tie_word_embeddings"):
            raise EngineError("an EAGLE3 head with tie_word_embeddings is not supported yet")
        target_h = hf.get("target_hidden_size") or H
        self.fc = Linear(3 * target_h, H, bool(hf.get("bias", False)))
        self.midlayer = _MidLayer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.draft_vocab = hf.get("draft_vocab_size")
        # its own head over the draft vocabulary; none given: the target's head
        self.lm_head = _Unused() if self.draft_vocab is None else LMHead(H, self.draft_vocab)
        self.d2t = None

    def checkpoint_tensors(self):
        return (), ("d2t", "t2d")

    def load_tensor(self, name, tensor, shard):
        if name == "d2t":  # draft id -> target id is draft id + d2t[draft id]
            self.d2t = (tensor.long() + torch.arange(tensor.shape[0])).to(self.norm.weight.device)

    def share(self, target) -> None:
        super().share(target)
        if self.draft_vocab is None:
            self.lm_head = target.lm_head

    def body(self, embeds, hidden, cos, sin):
        hidden = hidden.to(embeds.dtype)
        if hidden.shape[-1] != embeds.shape[-1]:  # the target's three layers; a draft
            hidden = self.fc(hidden)                # step's own hidden is already H wide
        return self.midlayer(embeds, hidden, cos, sin)

    def logits(self, h):
        return self.lm_head(self.norm(h))

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary ids."""
        return ids if self.d2t is None else self.d2t[ids]
