"""CpuGraphRunner: a model's decode forward recorded once as a CPU graph, replayed each decode
step (``--disable-cpu-graph``, ``--cpu-graph-max-bs``); the CPU's counterpart of CUDA graphs.

A decode step run eagerly costs ~60 torch ops and the Python around them per layer: on a small
model more than its matmuls (SmolLM2-135M at batch 1: ~6 ms of a ~10 ms step). The graph runs
the same computation as one call into C: the model's ``cpu_graph(builder)`` recorded its
forward as nodes over fixed float32 buffers of ``max_rows`` rows (engine/cpu_graph/builder.py)
and a replay hands the step's tokens, positions, slots and request rows to the executor
(graph.c), which runs every node on torch's threads in one OpenMP region. No padding: a step
of b <= max_rows rows runs b rows. A step of at most max_rows tokens that is not a decode (a
small prompt chunk, draft tokens to verify) runs in it too, one row per token; bigger ones run
eagerly."""

from __future__ import annotations

import logging
import time

import torch

from engine.cpu_graph import native
from engine.cpu_graph.builder import GraphBuilder
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.interfaces import GraphUnsupported
from engine.memory.kv_dtype import KVDtype

logger = logging.getLogger("engine")


class CpuGraphRunner:
    def __init__(self, runner, max_rows: int):
        """Record ``runner``'s model (its KV pool and attention backend built) for decode
        steps of up to ``max_rows`` requests; raises GraphUnsupported saying why not."""
        start = time.perf_counter()
        model = runner.model
        if not hasattr(model, "cpu_graph"):
            raise GraphUnsupported(f"{type(model).__name__} records no CPU graph")
        self.lib = native.load()
        self.max_rows = max_rows
        self.builder = builder = GraphBuilder(max_rows, runner.backend)
        with torch.no_grad():
            self.logits = model.cpu_graph(builder)
        self.graph = self.lib.ek_graph_new()
        if not self.graph:
            raise MemoryError("out of memory for the CPU graph")
        for node in builder.nodes:
            if self.lib.ek_graph_add(self.graph, node.fn, node.args) < 0:
                raise MemoryError("out of memory for the CPU graph")
        self.buffer_bytes = sum(b.numel() * 4 for b in builder.buffers)
        self.seconds = time.perf_counter() - start
        self.replays = 0

    def __del__(self):
        graph, self.graph = getattr(self, "graph", None), None
        if graph:
            self.lib.ek_graph_free(graph)

    @property
    def num_nodes(self) -> int:
        return len(self.builder.nodes)

    def profile(self, on: bool = True) -> None:
        """From now on (``on``) add up each node's time per replay (``node_times``)."""
        if on:
            self.node_times = torch.zeros(self.num_nodes, dtype=torch.float64)
            self.lib.ek_graph_profile(self.graph, self.node_times.data_ptr())
        else:
            self.lib.ek_graph_profile(self.graph, None)

    def profile_table(self) -> list[tuple[str, float, int]]:
        """(node kind, seconds, nodes of that kind) from the profile, the slowest first."""
        totals: dict[str, list] = {}
        for node, seconds in zip(self.builder.nodes, self.node_times.tolist()):
            kind = node.name.split(" layer ")[0]
            entry = totals.setdefault(kind, [0.0, 0])
            entry[0] += seconds
            entry[1] += 1
        return sorted(((k, s, n) for k, (s, n) in totals.items()), key=lambda r: -r[1])

    def can_run(self, batch: ForwardBatch) -> bool:
        """Any batch of at most max_rows tokens: decode steps, and small prompt chunks or
        draft tokens to verify next to them (one graph row per token)."""
        return batch.num_tokens <= self.max_rows

    def replay(self, batch: ForwardBatch, return_all_logits: bool = False) -> torch.Tensor:
        """float32 logits of ``batch``: [B, V] at each request's last new token, or [T, V] at
        every token with ``return_all_logits`` (a view of the graph's buffer where it can be:
        valid until the next replay). Each token is a row of the graph, attending to the first
        position + 1 slots of its request's row of the table."""
        t = batch.num_tokens
        ids, pos, loc, table = batch.input_ids, batch.positions, batch.out_cache_loc, \
            batch.req_to_token
        decode = batch.mode == ForwardMode.DECODE
        if decode:  # one token per request: the batch's own columns
            rows, lens = batch.req_pool_indices, batch.seq_lens
        else:  # a request's tokens each see the keys up to their own position
            rows = batch.req_pool_indices.repeat_interleave(batch.extend_lens, output_size=t)
            lens = pos + 1
        for x in (ids, pos, loc, rows, lens):
            if x.dtype != torch.int64 or not x.is_contiguous() or x.device.type != "cpu":
                raise ValueError(f"a CPU graph step takes contiguous int64 CPU tensors, got "
                                 f"{x.dtype} on {x.device}")
        self.lib.ek_graph_run(self.graph, torch.get_num_threads(), t, ids.data_ptr(),
                              pos.data_ptr(), loc.data_ptr(), rows.data_ptr(), lens.data_ptr(),
                              table.data_ptr(), table.stride(0))
        self.replays += 1
        if decode or return_all_logits:
            return self.logits[:t]
        return self.logits[batch.logits_indices]


def off_reason(runner, config, device) -> str | None:
    """Why the CPU graph is not tried here (None: it is)."""
    if device.is_cuda:
        return "a CUDA device runs CUDA graphs instead"
    if config.disable_cpu_graph:
        return "--disable-cpu-graph"
    if config.tp_size * config.pp_size > 1:
        return "--tp-size / --pp-size: each rank's forward waits on the others"
    if runner.compiled is not None:
        return "--enable-torch-compile compiles the decoder instead"
    pool = runner.kv_pool
    if type(pool.kv_dtype) is not KVDtype:
        return (f"the KV cache dtype {type(pool.kv_dtype).__name__} stores K/V its own way; "
                f"the graph's attention writes plain float32/bfloat16/float16 K/V")
    if pool.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the KV cache is {pool.dtype}; the graph's attention writes float32/16-bit K/V"
    if runner.dtype != torch.float32:
        return (f"the model computes in {runner.dtype}; the graph runs float32 activations "
                f"(--dtype float16 keeps them float32 with float16 weights)")
    return None


def build_cpu_graph(runner, config, device) -> str:
    """Record the CPU graph where it applies; returns the start log's line about it ("" on a
    GPU, whose line is the CUDA graphs')."""
    if device.is_cuda:
        return ""
    reason = off_reason(runner, config, device)
    if reason is None:
        max_rows = max(1, min(config.cpu_graph_max_bs, runner.kv_pool.max_reqs))
        try:
            graph = runner.init_cpu_graph(max_rows)
        except (GraphUnsupported, native.BuildError) as e:
            reason = str(e)
    if reason is not None:
        return f"cpu graph: off ({reason})"
    return (f"cpu graph: on, steps of up to {graph.max_rows} tokens "
            f"({graph.num_nodes} nodes, {graph.buffer_bytes / 2**20:.1f} MiB of buffers, "
            f"recorded in {graph.seconds:.2f} s)")
