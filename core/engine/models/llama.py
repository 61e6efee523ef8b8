"""The Llama family: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm). Module names follow
the HF checkpoints so the loader maps names one to one, except the packed projections (qkv_proj,
gate_up_proj: MergedLinear, whose shards are the checkpoint's q/k/v and gate/up projections).
With a tensor-parallel group each rank builds its shard (engine.parallel.layers); with a
pipeline stage (engine.parallel.stage) only the stage's layers, still named by their global
index, plus the embedding on the first stage and the final norm and LM head on the last."""

from __future__ import annotations

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.layers.activation import silu_mul
from engine.layers.attention import Attention
from engine.layers.embedding import Embedding, LMHead
from engine.layers.linear import Linear, MergedLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models.config import ModelConfig
from engine.parallel.group import TPGroup
from engine.parallel.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                    VocabParallelEmbedding)
from engine.parallel.shard import Cut, kv_cut, rank_head_counts, split_evenly
from engine.parallel.stage import PPStage, checkpoint_layer
from engine.errors import EngineError


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup | None = None,
                 global_id: int | None = None):
        """``layer_id``: the layer's index in its KV pool (local to a pipeline stage);
        ``global_id``: its index in the whole model (None: the same)."""
        super().__init__()
        c = config
        self.global_id = layer_id if global_id is None else global_id
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if tp is None:
            self.qkv_proj = MergedLinear(c.hidden_size, {"q_proj": q_size, "k_proj": kv_size,
                                                         "v_proj": kv_size}, c.qkv_bias)
            self.o_proj = Linear(q_size, c.hidden_size, c.o_bias)
        else:  # this rank's heads: q split, k/v split or one replicated head
            self.num_heads, self.num_kv_heads = rank_head_counts(c.num_heads, c.num_kv_heads,
                                                                 tp.size)
            q_cut = Cut(0, tp.size, tp.rank)
            kv = (kv_size, kv_cut(c.num_kv_heads, tp.rank, tp.size))
            self.qkv_proj = ColumnParallelLinear(
                c.hidden_size, {"q_proj": (q_size, q_cut), "k_proj": kv, "v_proj": kv},
                c.qkv_bias, tp)
            self.o_proj = RowParallelLinear(q_size, c.hidden_size, c.o_bias, tp,
                                            "attention heads' columns of o_proj")
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, c.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.output(self.attn(*self.project(x, cos, sin)))

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim]: projected and rotated."""
        T, H, KVH, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
        if hasattr(self, "q_norm"):
            q = self.q_norm(qkv[:, : H * D].view(T, H, D))
            k = self.k_norm(qkv[:, H * D: (H + KVH) * D].view(T, KVH, D))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:  # q and k side by side in qkv: one rotation for both
            qk = apply_rotary(qkv[:, : (H + KVH) * D].view(T, H + KVH, D), cos, sin)
            q, k = qk[:, :H], qk[:, H:]
        return q, k, v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention output [T, heads, head_dim]."""
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))

    # quantized checkpoints may carry KV-cache scales here (vLLM / llm-compressor layout); the
    # runner hands them to the pool when the KV dtype stores scaled values
    def checkpoint_tensors(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (), ("k_scale", "v_scale")

    def load_tensor(self, name: str, tensor: torch.Tensor, shard: str | None) -> None:
        if tensor.numel() != 1:
            raise EngineError(f"self_attn.{name} of layer {self.global_id} has shape "
                              f"{tuple(tensor.shape)} in the checkpoint; expected one scale.")
        setattr(self.attn, name, float(tensor.float()))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        c = config
        if tp is None:
            self.gate_up_proj = MergedLinear(
                c.hidden_size, {"gate_proj": c.intermediate_size, "up_proj": c.intermediate_size},
                c.mlp_bias)
            self.down_proj = Linear(c.intermediate_size, c.hidden_size, c.mlp_bias)
            return
        split_evenly(c.intermediate_size, tp.size, "intermediate_size rows")
        rows = (c.intermediate_size, Cut(0, tp.size, tp.rank))
        self.gate_up_proj = ColumnParallelLinear(
            c.hidden_size, {"gate_proj": rows, "up_proj": rows}, c.mlp_bias, tp)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, c.mlp_bias, tp,
                                           "intermediate_size columns of down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_split(x)
        return self.down_proj(silu_mul(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup | None = None,
                 global_id: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_id, tp, global_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_name, ffn = self.feed_forward(config, tp,
                                               layer_id if global_id is None else global_id)
        setattr(self, self.ffn_name, ffn)

    def feed_forward(self, config: ModelConfig, tp: TPGroup | None,
                     global_id: int) -> tuple[str, nn.Module]:
        """(the checkpoint's name, the module) of layer ``global_id``'s feed-forward block:
        the dense MLP here; an MoE layer's sparse block in models/moe.py."""
        return "mlp", MLP(config, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.after_attention(x, self.self_attn.attn(*self.before_attention(x, cos, sin)))

    def before_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """(q, k, v) of the residual stream ``x`` (the layer up to its attention)."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def after_attention(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The residual stream after this layer, from ``x`` and its attention output."""
        normed, h = self.post_attention_layernorm.add_forward(self.self_attn.output(out), x)
        return h + getattr(self, self.ffn_name)(normed)


class DecoderModel(nn.Module):
    # layers whose outputs a forward keeps in ``kept`` (layer index -> [T, hidden_size]): what
    # LlamaForCausalLM.capture_hidden asks for, for a drafter reading them (EAGLE3)
    keep_layers: frozenset = frozenset()

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None,
                 pp: PPStage | None = None, layer_cls: type = DecoderLayer):
        super().__init__()
        self.pp = pp
        if pp is not None and not 0 <= pp.start < pp.end <= config.num_layers:
            raise EngineError(f"pipeline parallelism: stage {pp.rank} holds layers {pp.start}.."
                              f"{pp.end - 1}, outside the model's {config.num_layers} layers.")
        if pp is None or pp.is_first:
            self.embed_tokens = (Embedding(config.vocab_size, config.hidden_size) if tp is None
                                 else VocabParallelEmbedding(config.vocab_size,
                                                             config.hidden_size, tp))
        if pp is None:
            self.layers = nn.ModuleList(layer_cls(config, i, tp)
                                        for i in range(config.num_layers))
        else:  # named by the global index (checkpoint names), numbered locally in the KV pool
            self.layers = nn.ModuleDict({str(i): layer_cls(config, i - pp.start, tp, i)
                                         for i in range(pp.start, pp.end)})
        if pp is None or pp.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              hidden: torch.Tensor | None = None) -> tuple:
        """(h, cos, sin): the embedded tokens (or ``hidden``) and the rotary tables of their
        positions, looked up once for all layers."""
        h = self.embed_tokens(input_ids) if hidden is None else hidden
        return (h, *self.rotary_emb(positions, h.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states after the (stage's) layers, before the final norm; ``hidden``: the
        previous pipeline stage's, instead of embedding ``input_ids``."""
        h, cos, sin = self.embed(input_ids, positions, hidden)
        keep = self.keep_layers
        if keep:
            self.kept = {}
        for i, layer in enumerate(self.layers if self.pp is None else self.layers.values()):
            h = layer(h, cos, sin)
            if keep and i in keep:
                self.kept[i] = h
        return h


class LlamaForCausalLM(nn.Module):
    supports_pp = True  # load_model refuses --pp-size for a model class without it
    layer_cls = DecoderLayer  # models/moe.py's MoE models: one whose layers may be sparse
    capture: tuple = ()  # the hidden states a forward keeps in ``captured`` (capture_hidden)
    captured: torch.Tensor | None = None

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None,
                 pp: PPStage | None = None):
        """``tp``: build this rank's shard of every layer; ``pp``: only this pipeline stage's
        part (None, None: the whole model, one process)."""
        super().__init__()
        self.config, self.tp, self.pp = config, tp, pp
        self.model = DecoderModel(config, tp, pp, self.layer_cls)
        if pp is None or pp.is_last:
            self.lm_head = (LMHead(config.hidden_size, config.vocab_size) if tp is None else
                            ParallelLMHead(config.hidden_size, config.vocab_size, tp))
        if config.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self) -> None:
        # a last stage that is not the first has no embedding: its head loads the
        # embedding's checkpoint tensor instead (checkpoint_aliases)
        if hasattr(self, "lm_head") and hasattr(self.model, "embed_tokens"):
            self.lm_head.tie_to(self.model.embed_tokens)

    def checkpoint_aliases(self) -> dict[str, str]:
        """Checkpoint name -> the model's name that loads it, where they differ."""
        pp = self.pp
        if self.config.tie_word_embeddings and pp is not None and pp.is_last and \
                not pp.is_first:
            return {"model.embed_tokens.weight": "lm_head.weight"}
        return {}

    def other_stage_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to another pipeline stage: the loader
        skips it without reading it."""
        pp = self.pp
        if pp is None:
            return False
        layer = checkpoint_layer(name)
        if layer is not None:  # a layer past the model's is unexpected, not another stage's
            return layer < self.config.num_layers and not pp.holds_layer(layer)
        if name.startswith("model.embed_tokens."):
            return not pp.is_first
        if name.startswith(("model.norm.", "lm_head.")):
            return not pp.is_last
        return False

    def forward(self, batch: ForwardBatch, return_all_logits: bool = False,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] at ``batch.logits_indices``, or [T, V] for every new token. A pipeline
        stage after the first takes the previous stage's ``hidden`` [T, hidden_size] for the
        same batch instead of embedding its tokens; a stage before the last returns its
        hidden states [T, hidden_size] of every token (before the final norm) for the next."""
        pp = self.pp
        if pp is None or pp.is_first:
            if hidden is not None:
                raise EngineError("the first pipeline stage embeds the batch's tokens; pass no "
                                  "hidden states to it.")
            h = self.model(batch.input_ids, batch.positions)
        else:
            want = (batch.num_tokens, self.config.hidden_size)
            got = None if hidden is None else tuple(hidden.shape)
            if got != want:
                raise EngineError(f"pipeline stage {pp.rank} (layers {pp.start}..{pp.end - 1}) "
                                  f"needs the previous stage's hidden states of shape "
                                  f"{list(want)} for this batch; got "
                                  f"{'none' if got is None else list(got)}.")
            h = self.model(batch.input_ids, batch.positions, hidden)
        if pp is not None and not pp.is_last:
            return h
        if self.capture:
            return self._head_capturing(h, None if return_all_logits else batch.logits_indices)
        return self.head(h, None if return_all_logits else batch.logits_indices)

    def capture_hidden(self, which: tuple) -> None:
        """Keep, after every forward, ``captured`` [T, len(which) * hidden_size]: the hidden
        states of every new token named by ``which``, side by side in its order: an int ``i``
        is layer ``i``'s output (the residual stream before the next layer's norm), "norm" the
        last layer's output after the final norm (what the LM head reads). For a drafter that
        reads the target's hidden states (EAGLE: ("norm",); EAGLE3: three layers)."""
        bad = [w for w in which if w != "norm" and not (
            isinstance(w, int) and 0 <= w < self.config.num_layers)]
        if bad or len(set(which)) != len(which):
            raise EngineError(f"hidden states {list(which)} asked of a {self.config.num_layers}-"
                              f"layer model: give distinct layer indices 0.."
                              f"{self.config.num_layers - 1} or 'norm'")
        self.capture = tuple(which)
        self.model.keep_layers = frozenset(w for w in which if w != "norm")

    def _head_capturing(self, h: torch.Tensor, logits_indices) -> torch.Tensor:
        """``head`` that also keeps ``captured`` (see capture_hidden)."""
        normed = self.model.norm(h) if "norm" in self.capture else None
        kept = self.model.kept if self.model.keep_layers else {}
        parts = [normed if w == "norm" else kept[w] for w in self.capture]
        self.captured = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
        if normed is None:
            return self.head(h, logits_indices)
        return self.lm_head(normed if logits_indices is None else normed[logits_indices])

    def head(self, h: torch.Tensor, logits_indices: torch.Tensor | None) -> torch.Tensor:
        """Logits of the final hidden states ``h`` at ``logits_indices`` (None: every row)."""
        if logits_indices is not None:
            h = h[logits_indices]  # the norm is per token, so select before it
        return self.lm_head(self.model.norm(h))

    def piecewise_parts(self):
        """The forward cut at attention, for piecewise CUDA graphs (llama_graphs.py)."""
        from engine.models.llama_graphs import piecewise_parts

        return piecewise_parts(self)

    def cpu_graph(self, g) -> torch.Tensor:
        """Record a decode forward as CPU-graph nodes (llama_graphs.py)."""
        from engine.models.llama_graphs import record_cpu_graph

        return record_cpu_graph(self, g)
