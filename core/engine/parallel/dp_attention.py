"""Data-parallel attention (SGLang's ``--enable-dp-attention``) for mixture-of-experts models.

Each of the ranks is a process of its own with its own requests, scheduler, KV cache and the
whole attention (and dense layers, embedding and head), as a ``--dp-size`` replica is; its MoE
layers are one layer over all the ranks: the experts split over them as ``--tp-size`` splits
them (``--ep-size`` runs of whole experts, each cut over its ranks), the router whole. So the
ranks run their forwards in step:

- a forward starts with ``begin``: an all-gather of every rank's token count;
- each MoE layer gathers every rank's tokens (padded to the largest count, one all-gather),
  computes its experts' share for all of them (the same routing on every rank), sums the
  shares (the tp block's one all-reduce) and keeps its own tokens' rows;
- a rank with nothing to run while another runs takes part through ``ModelRunner.dp_idle``:
  the same count exchange, then each MoE layer's collectives with no tokens of its own.

An all-gather of tokens before the experts and each rank's slice after, rather than a
dispatch and combine all-to-all: with the experts cut as the tp group cuts them, every rank
computes on every token whose experts it holds a slice of, which is what the gather gives it
(see docs/parallelism.md).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from engine.parallel.group import TPGroup, init_tp_group


class DPAttentionGroup(TPGroup):
    """The ranks of data-parallel attention as the MoE layers see them (a TPGroup over all of
    them), with the step's token counts."""

    dp_attention = True

    def __init__(self, rank: int, size: int, group=None, ep_size: int = 1,
                 device: torch.device | None = None):
        super().__init__(rank, size, group, ep_size)
        self.device = device or torch.device("cpu")  # where the collectives' tensors live
        self.counts: list[int] = [0] * size  # each rank's tokens in this forward

    def begin(self, tokens: int) -> list[int]:
        """Every rank's token count this step (each calls it once per forward or idle step)."""
        mine = torch.tensor([tokens], dtype=torch.int64, device=self.device)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.group)
        self.counts = [int(p.item()) for p in parts]
        return self.counts

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of ``x`` [n, ...], in rank order (this step's counts)."""
        most = max(self.counts)
        if x.shape[0] < most:
            x = torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))])
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat([p[:n] for p, n in zip(parts, self.counts)])

    def own(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``y``, the gathered tokens' outputs."""
        start = sum(self.counts[:self.rank])
        return y[start:start + self.counts[self.rank]]


def init_dp_attention_group(backend: str, rank: int, size: int, init_method: str,
                            ep_size: int = 1, device: torch.device | None = None,
                            timeout: timedelta = timedelta(seconds=600)) -> DPAttentionGroup:
    """Join the ``size`` data-parallel attention ranks as ``rank`` (``init_method``:
    ``tcp://host:port``, where they meet); ``timeout`` bounds the joining and every
    collective (a rank that is gone ends its peers' waits with an error)."""
    init_tp_group(backend, rank, size, init_method, timeout)  # the default process group
    return DPAttentionGroup(rank, size, ep_size=ep_size, device=device)


def in_step(block: torch.nn.Module, group: DPAttentionGroup) -> None:
    """Make an MoE block a layer over every rank's tokens: its input gathered from the ranks
    before it runs, its output cut back to this rank's rows after (forward hooks, so the
    block's own forward and checkpoint names stay as they are)."""
    block.register_forward_pre_hook(lambda _m, args: (group.gather(args[0]), *args[1:]))
    block.register_forward_hook(lambda _m, _args, out: group.own(out))
