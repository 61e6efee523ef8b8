"""Piecewise CUDA graphs for prompt, extend and mixed batches (SGLang's "Piecewise CUDA Graph";
``--enable-piecewise-cuda-graph``, ``--piecewise-cuda-graph-max-tokens``): the forward is cut
at each layer's attention, the pieces between are captured once per token count, and the
attention runs eagerly between their replays, so every attention backend serves such batches
as it does eager ones (variable sequence lengths and prefixes need no fixed metadata).

For a model of L layers (its ``piecewise_parts()``: :class:`PiecewiseParts`), L + 1 pieces per
captured size Tb: piece 0 = embedding (with the rotary lookup) + layer 0 up to its attention
(q, k, v); piece i = layer i-1 after its attention (o_proj, residual, norm, MLP, residual) +
layer i up to its attention; piece L = the last layer after its attention. Each piece reads the
static buffers (token ids, positions, the residual stream h, cos/sin, the attention output:
[:Tb] views) and copies what it computes into them (h, cos/sin, q, k, v), so nothing a piece
allocates outlives it: all graphs share one memory pool, captured largest size first, and can
be replayed in any order. A batch of T tokens replays the smallest size Tb >= T: its ids and
positions are copied in, the rows past T padded with token 0 at position 0 (rows never meet
outside attention in a dense layer, so padding computes garbage only for itself), the backend
builds its metadata for the batch once, then per layer: replay piece i, attention on the T real
rows of q, k, v (eager, writing the KV pool), its output copied into the buffer; last piece;
then the final norm and LM head eagerly at the batch's logits rows. Same ops per row as
``ModelRunner.forward``. Decode batches go to the decode graphs (cuda_graph.py) first.

``graph_cls`` swaps ``torch.cuda.CUDAGraph`` for the CPU tests' stand-in (EagerGraph). Never
run on a GPU yet: off by default.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.cuda_graph import GRAPH_OVERHEAD_BYTES, WARMUP_RUNS, PooledCudaGraph, logged_capture
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.interfaces import GraphUnsupported
from engine.memory.sizing import piecewise_off_reason

@dataclass
class PiecewiseLayer:
    """One decoder layer cut at its attention."""

    before_attention: Callable  # (h, cos, sin) -> (q, k, v)
    after_attention: Callable  # (h, attention output [T, heads, head_dim]) -> h
    layer_id: int  # the layer's index in the KV pool
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class PiecewiseParts:
    """A model's forward cut at attention (what ``model.piecewise_parts()`` returns)."""

    embed: Callable  # (input_ids, positions) -> (h, cos, sin)
    layers: list[PiecewiseLayer]
    head: Callable  # (h, logits_indices or None: every row) -> logits


def capture_sizes(max_tokens: int) -> list[int]:
    """The token counts to capture: 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224,
    256, then steps of 64 to 512, 128 to 1024, 256 to 2048, 512 to 4096, 1024 beyond (little
    padding for any T), up to ``max_tokens``, which is always included."""
    ladder = [4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256]
    for step, end in ((64, 512), (128, 1024), (256, 2048), (512, 4096)):
        ladder += range(ladder[-1] + step, end + 1, step)
    while ladder[-1] < max_tokens:
        ladder.append(ladder[-1] + 1024)
    return sorted({s for s in ladder if s < max_tokens} | {max_tokens})


def estimate_piecewise_bytes(model_config, itemsize: int, max_tokens: int) -> int:
    """What the piecewise graphs are expected to hold, per token of the largest size in the
    model's dtype: the static buffers (h, cos/sin, q, k, v, the attention output; token ids
    and positions in int64) and the largest piece's temporaries, which stay in the shared
    pool (hidden states x 4, the MLP's gate, up and product, q/k/v); plus the graphs' own
    bookkeeping."""
    c = model_config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    buffers = (c.hidden_size + 2 * c.head_dim + 2 * q + 2 * kv) * itemsize + 16
    temporaries = (4 * c.hidden_size + 3 * c.intermediate_size + q + 2 * kv) * itemsize
    return max_tokens * (buffers + temporaries) + GRAPH_OVERHEAD_BYTES


class PiecewiseCudaGraphRunner:
    def __init__(self, runner, sizes: list[int], graph_cls=None):
        """Buffers for ``runner``'s model (its KV pool and backend built) up to the largest of
        ``sizes``; raises GraphUnsupported when the model has no piecewise parts."""
        make_parts = getattr(runner.model, "piecewise_parts", None)
        if make_parts is None:
            raise GraphUnsupported(f"{type(runner.model).__name__} has no piecewise_parts()")
        self.parts = parts = make_parts()
        heads = {(x.num_heads, x.num_kv_heads, x.head_dim) for x in parts.layers}
        if len(heads) != 1:
            raise GraphUnsupported(f"layers with different head counts {sorted(heads)}")
        (H, KVH, D), = heads
        self.runner, self.graph_cls = runner, graph_cls
        self.sizes = sorted(set(sizes))
        self.max_tokens = T = self.sizes[-1]
        dev = runner.kv_pool.device
        # allocated here, outside the graphs' pool: every graph reads and writes views of them
        self.input_ids = torch.zeros(T, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(T, dtype=torch.int64, device=dev)
        with torch.inference_mode():  # one row: the embedding's and rotary tables' shapes
            h, cos, sin = parts.embed(self.input_ids[:1], self.positions[:1])

        def buf(like: torch.Tensor | None, *shape: int) -> torch.Tensor:
            shape = shape or tuple(like.shape[1:])
            return torch.zeros(T, *shape, dtype=h.dtype if like is None else like.dtype,
                               device=dev)

        self.h, self.cos, self.sin = buf(h), buf(cos), buf(sin)
        self.q, self.attn_out = buf(None, H, D), buf(None, H, D)
        self.k, self.v = buf(None, KVH, D), buf(None, KVH, D)
        self.graphs: dict[int, list] = {}
        self.replays = 0

    @property
    def num_pieces(self) -> int:
        return len(self.parts.layers) + 1

    def _piece(self, i: int, tb: int) -> Callable[[], torch.Tensor]:
        """Piece ``i`` of size ``tb``: reads and writes only the static buffers' [:tb] views
        (returns h's, the tensor a graph stand-in needs)."""
        parts, layers = self.parts, self.parts.layers
        h, cos, sin, attn_out = self.h[:tb], self.cos[:tb], self.sin[:tb], self.attn_out[:tb]
        qkv = (self.q[:tb], self.k[:tb], self.v[:tb])

        def run() -> torch.Tensor:
            if i == 0:
                new_h, c, s = parts.embed(self.input_ids[:tb], self.positions[:tb])
                cos.copy_(c)
                sin.copy_(s)
            else:
                new_h = layers[i - 1].after_attention(h, attn_out)
            if i < len(layers):
                for buf, x in zip(qkv, layers[i].before_attention(new_h, cos, sin)):
                    buf.copy_(x)
            h.copy_(new_h)
            return h

        return run

    def capture(self) -> float:
        """Capture every size's pieces, largest size first; returns the seconds it took."""
        start = time.perf_counter()
        pool = None if self.graph_cls else torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for tb in reversed(self.sizes):
                pieces = [self._piece(i, tb) for i in range(self.num_pieces)]
                for _ in range(WARMUP_RUNS):  # eager: cuBLAS picks its kernels
                    for piece in pieces:
                        piece()
                if not self.graph_cls:
                    torch.cuda.synchronize()
                graphs = []
                for piece in pieces:
                    graph = self.graph_cls() if self.graph_cls else PooledCudaGraph(pool)
                    graph.capture(piece)
                    graphs.append(graph)
                self.graphs[tb] = graphs
        if not self.graph_cls:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def can_run(self, batch: ForwardBatch, return_all_logits: bool = False) -> bool:
        """Up to the largest size, unless it is a decode batch the decode graphs serve."""
        decode = self.runner.cuda_graphs
        if batch.mode == ForwardMode.DECODE and decode is not None and \
                not return_all_logits and decode.can_run(batch):
            return False
        return batch.num_tokens <= self.max_tokens

    def replay(self, batch: ForwardBatch, return_all_logits: bool = False) -> torch.Tensor:
        """Logits (the model's dtype) at ``batch.logits_indices`` ([T, V] with
        ``return_all_logits``), as ``ModelRunner.forward`` computes them."""
        T = batch.num_tokens
        tb = self.sizes[bisect.bisect_left(self.sizes, T)]
        self.input_ids[:T].copy_(batch.input_ids)
        self.positions[:T].copy_(batch.positions)
        if tb > T:  # padding rows: token 0 at position 0, seen by no real row
            self.input_ids[T:tb].zero_()
            self.positions[T:tb].zero_()
        backend = self.runner.backend
        backend.init_forward_metadata(batch)
        graphs = self.graphs[tb]
        q, k, v, attn_out = self.q[:T], self.k[:T], self.v[:T], self.attn_out[:T]
        for graph, layer in zip(graphs, self.parts.layers):
            graph.replay()
            attn_out.copy_(backend.forward(q, k, v, layer.layer_id, batch))
        graphs[-1].replay()
        self.replays += 1
        return self.parts.head(self.h[:T], None if return_all_logits else batch.logits_indices)


def capture_piecewise_graphs(runner, config, device, sizing) -> str:
    """Capture the piecewise graphs when they apply (up to
    ``sizing.piecewise_cuda_graph_max_tokens`` tokens); returns the start log's line."""
    reason = piecewise_off_reason(config, device)
    if reason is not None:
        return f"piecewise cuda graph: off ({reason})"
    max_tokens = sizing.piecewise_cuda_graph_max_tokens
    sizes = capture_sizes(max_tokens)
    try:
        seconds, used = logged_capture(
            "piecewise cuda graph", lambda: runner.init_piecewise_cuda_graphs(max_tokens),
            f"piecewise CUDA graph capture ran out of GPU memory ({len(sizes)} sizes up to "
            f"{max_tokens} tokens): lower --piecewise-cuda-graph-max-tokens or "
            f"--mem-fraction-static (now {sizing.mem_fraction_static}), or leave out "
            f"--enable-piecewise-cuda-graph.")
    except GraphUnsupported as e:
        return f"piecewise cuda graph: off ({e})"
    return (f"piecewise cuda graph: on, {len(sizes)} token sizes up to {max_tokens}, "
            f"{runner.piecewise_graphs.num_pieces} pieces each (attention eager between "
            f"them), captured in {seconds:.1f} s, mem usage={used / (1 << 30):.2f} GB")
