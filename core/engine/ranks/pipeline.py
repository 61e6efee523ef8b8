"""One step through the pipeline stages, micro-batch after micro-batch (GPipe's schedule inside
a step): stage s runs micro-batch k while stage s+1 runs micro-batch k-1, so with M
micro-batches over S stages the stages idle (S-1)/(M+S-1) of the step instead of (S-1)/S.

Each stage's rank t receives the hidden states [T, hidden] of a micro-batch from rank t of the
stage before and sends its own to rank t of the stage after (torch.distributed point-to-point
on the device backend, asynchronous sends); the last stage's rank 0 sends the micro-batch's
float32 logits back to rank 0, which runs the scheduler."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.forward_batch import ForwardBatch
from engine.parallel.topology import Topology


def run_stage(runner, topo: Topology, rank: int, parts: list[ForwardBatch],
              return_all_logits: bool) -> list[torch.Tensor]:
    """This rank's stage over every micro-batch; returns the logits it computed when it is the
    last stage and rank 0 itself (pp 1), else []. Waits for its sends before returning."""
    stage, t = topo.pp_rank(rank), topo.tp_rank(rank)
    last = stage == topo.pp - 1
    hidden_size = runner.model_config.hidden_size
    device = runner.device.torch_device
    sends, outs = [], []
    for mb in parts:
        hidden = None
        if stage > 0:
            hidden = torch.empty(mb.num_tokens, hidden_size, dtype=runner.dtype, device=device)
            dist.recv(hidden, src=topo.rank_of(stage - 1, t))
        out = runner.forward(mb, return_all_logits, hidden=hidden)
        if not last:
            out = out.contiguous()
            sends.append((dist.isend(out, dst=topo.rank_of(stage + 1, t)), out))
        elif rank == 0:
            outs.append(out)
        elif t == 0:  # the stage's logits are whole on each of its tp ranks: one sends them
            out = out.contiguous()
            sends.append((dist.isend(out, dst=0), out))
    for work, _ in sends:
        work.wait()
    return outs


def receive_logits(topo: Topology, parts: list[ForwardBatch], return_all_logits: bool,
                   vocab_size: int, device) -> torch.Tensor:
    """Rank 0: the last stage's logits of every micro-batch, in request order."""
    src = topo.rank_of(topo.pp - 1, 0)
    out = []
    for mb in parts:
        rows = mb.num_tokens if return_all_logits else mb.batch_size
        logits = torch.empty(rows, vocab_size, dtype=torch.float32, device=device)
        dist.recv(logits, src=src)
        out.append(logits)
    return out[0] if len(out) == 1 else torch.cat(out)
