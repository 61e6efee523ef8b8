"""Multi-head latent attention (layers/mla.py) over a tensor-parallel group, as SGLang and vLLM
split it: the heads are cut over the ranks, the latent is not. Each rank projects its heads'
queries (``q_proj`` or ``q_b_proj`` cut by output rows, head-major), folds its heads' rows of
``kv_b_proj`` (W_UK, W_UV) in, and its heads' columns of ``o_proj`` give a partial sum that is
all-reduced. The compressed latent and the rope key (``kv_a_proj_with_mqa``, ``q_a_proj`` with
a q LoRA, their norms) are computed whole on every rank, and every rank's KV pool holds the same
latent rows: MLA's one latent "head" is replicated, as a single KV head is for dense models."""

from __future__ import annotations

from engine.layers.mla import LatentProjection, MLAttention
from engine.parallel.group import TPGroup
from engine.parallel.layers import ColumnParallelLinear, RowParallelLinear
from engine.parallel.shard import Cut, split_evenly

WHOLE = Cut(0, 1, 0)  # a projection every rank holds whole, packed with a cut one


class LatentProjectionShard(LatentProjection):
    """``kv_b_proj``'s rows of this rank's heads."""

    def __init__(self, kv_lora_rank: int, out_features: int, cut: Cut):
        super().__init__(kv_lora_rank, cut.size(out_features))
        self.cut = cut

    def tp_cut(self, local: str, shard: str | None) -> Cut:
        return self.cut


class ParallelMLAttention(MLAttention):
    """The one-process layer's modules (built on the meta device: free), then this rank's
    head-cut ones in their place, named as the checkpoint names them."""

    def __init__(self, config, layer_id: int, tp: TPGroup):
        super().__init__(config, layer_id)
        m, hidden, H = config.mla, config.hidden_size, config.num_heads
        self.num_heads = split_evenly(H, tp.size, "attention heads")
        heads = Cut(0, tp.size, tp.rank)
        q_rows = (H * (m.qk_nope_head_dim + m.qk_rope_head_dim), heads)
        if m.q_lora_rank:  # q_a and kv_a whole (qkv_a_proj as built), q_b cut
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, {"q_b_proj": q_rows}, False, tp)
        elif hasattr(self, "qkv_a_proj"):  # q cut, packed with kv_a whole
            kv_rows = (m.kv_lora_rank + m.qk_rope_head_dim, WHOLE)
            self.qkv_a_proj = ColumnParallelLinear(
                hidden, {"q_proj": q_rows, "kv_a_proj_with_mqa": kv_rows}, m.attention_bias, tp)
        else:  # q_proj without a bias apart from kv_a's with one
            self.q_proj = ColumnParallelLinear(hidden, {"q_proj": q_rows}, False, tp)
        self.kv_b_proj = LatentProjectionShard(m.kv_lora_rank,
                                               H * (m.qk_nope_head_dim + m.v_head_dim), heads)
        self.o_proj = RowParallelLinear(H * m.v_head_dim, hidden, m.attention_bias, tp,
                                        "attention heads' columns of o_proj")
