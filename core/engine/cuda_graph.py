"""CUDA graphs for decode steps (SGLang's CudaGraphRunner; ``--cuda-graph-max-bs``,
``--cuda-graph-bs``, ``--disable-cuda-graph``).

At start, one graph per size in ``capture_sizes`` records a whole decode forward (embedding to
logits) of a fixed :class:`ForwardBatch` of that many rows. A decode step of ``b`` requests then
replays the smallest captured size ``bs >= b``: the step's tokens, positions, slots, request rows
and lengths are copied into the fixed batch in place, the rows past ``b`` become padding (the
pool's scratch request row: one key at the scratch slot 0, K/V written to slot 0), the attention
backend refills its own fixed metadata buffers outside the graph
(``init_forward_metadata_replay_cuda_graph``), and the graph runs with no Python and no kernel
launches of its own. Larger batches, prompts and mixed steps run eagerly (or through the
piecewise graphs: piecewise_cuda_graph.py).

The graphs share one memory pool and are captured largest first, so the smaller ones reuse the
largest one's activations; that memory lies outside ``--mem-fraction-static`` (see sizing.py).

``graph_cls`` swaps ``torch.cuda.CUDAGraph`` for a stand-in with its ``capture(fn)`` and
``replay()`` (the CPU tests' EagerGraph: the same fixed buffers and padding, the forward re-run
at each replay).
"""

from __future__ import annotations

import bisect
import logging
import time
from contextlib import contextmanager
from typing import Callable

import torch

from engine.errors import EngineError
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.layers.attention import forward_context

logger = logging.getLogger("engine")

WARMUP_RUNS = 2  # eager forwards before a capture: Triton compiles, cuBLAS picks its kernels


GRAPH_OVERHEAD_BYTES = 64 << 20  # per-graph bookkeeping, the warm-up kernels' workspaces


def estimate_graph_bytes(model_config, itemsize: int, max_bs: int,
                         backend_bytes: Callable[[int], int] | None = None) -> int:
    """What the captured graphs are expected to hold: the largest one's activations (the others
    reuse them): per row the widest layer intermediates (hidden states, q/k/v, the MLP's gate,
    up and product) in the model's dtype plus its logits in that dtype and in float32; plus
    ``backend_bytes(max_bs)``, what the attention backend holds beside the KV pool (its graph
    wrappers, index buffers, workspaces: :func:`backend_graph_bytes`)."""
    c = model_config
    per_row = (6 * c.hidden_size + 3 * c.intermediate_size) * itemsize + c.vocab_size * (
        itemsize + 4)
    extra = backend_bytes(max_bs) if backend_bytes is not None else 0
    return max_bs * per_row + GRAPH_OVERHEAD_BYTES + extra


def backend_graph_bytes(factory, layers, page_size: int, max_context_len: int,
                        options: dict | None = None,
                        explicit_sizes: list[int] | None = None) -> Callable[[int], int]:
    """``max_bs -> bytes`` that an attention backend reports through its registered factory's
    ``graph_memory_bytes(max_bs, num_sizes, layers, page_size, max_context_len, options)``
    (num_sizes: the graphs captured up to max_bs); 0 for a factory without one. Asked before
    the backend exists: the sizing runs before the KV pool and the backend are built."""
    report = getattr(factory, "graph_memory_bytes", None)

    def bytes_for(max_bs: int) -> int:
        if report is None:
            return 0
        sizes = [s for s in capture_sizes(max_bs, explicit_sizes) if s <= max_bs]
        return int(report(max_bs, len(sizes), layers, page_size, max_context_len,
                          dict(options or {})))

    return bytes_for


def capture_sizes(max_bs: int, explicit: list[int] | None = None) -> list[int]:
    """The batch sizes to capture: ``explicit`` (--cuda-graph-bs), else SGLang's ladder 1, 2, 4,
    8, 12, 16, 24, 32, ... (steps of 8) up to ``max_bs``, which is always included."""
    if explicit:
        return sorted(set(explicit))
    ladder = [1, 2, 4, 8, 12] + list(range(16, max_bs + 1, 8))
    return sorted({s for s in ladder if s < max_bs} | {max_bs})


class PooledCudaGraph:
    """One torch.cuda.CUDAGraph, captured into the runner's shared memory pool."""

    def __init__(self, pool):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn):
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphRunner:
    def __init__(self, runner, sizes: list[int], graph_cls=None):
        self.runner = runner
        self.sizes = sorted(sizes)
        self.max_bs = self.sizes[-1]
        self.graph_cls = graph_cls
        pool = runner.kv_pool
        dev = pool.device

        def buf(fill: int) -> torch.Tensor:
            return torch.full((self.max_bs,), fill, dtype=torch.int64, device=dev)

        # the fixed tensors every captured graph reads (a size's batch holds views of them)
        self.input_ids, self.positions, self.out_cache_loc = buf(0), buf(0), buf(0)
        self.req_pool_indices = buf(pool.scratch_row)
        self.prefix_lens, self.seq_lens, self.extend_lens = buf(0), buf(1), buf(1)
        self.logits_indices = torch.arange(self.max_bs, device=dev)
        self.batches = {bs: self._fixed_batch(bs) for bs in self.sizes}
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def _fixed_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs],
            positions=self.positions[:bs], out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs], prefix_lens=self.prefix_lens[:bs],
            extend_lens=self.extend_lens[:bs], seq_lens=self.seq_lens[:bs],
            req_to_token=self.runner.kv_pool.req_to_token, prefix_lens_list=[0] * bs,
            extend_lens_list=[1] * bs, logits_indices=self.logits_indices[:bs])

    def capture(self) -> float:
        """Capture every size, largest first; returns the seconds it took."""
        runner, backend = self.runner, self.runner.backend
        start = time.perf_counter()
        backend.init_cuda_graph_state(self.max_bs)
        mempool = None if self.graph_cls else torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bs in reversed(self.sizes):
                batch = self.batches[bs]
                backend.init_forward_metadata_capture_cuda_graph(bs, batch)

                def forward(batch=batch):
                    with forward_context(backend, batch):
                        return runner.model(batch)

                for _ in range(WARMUP_RUNS):
                    forward()
                if not self.graph_cls:
                    torch.cuda.synchronize()
                graph = self.graph_cls() if self.graph_cls else PooledCudaGraph(mempool)
                self.outputs[bs] = graph.capture(forward)
                self.graphs[bs] = graph
        if not self.graph_cls:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode == ForwardMode.DECODE and batch.batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [b, V] (the model's dtype) for the decode ``batch`` of b requests."""
        b = batch.batch_size
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        fixed = self.batches[bs]
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        self.out_cache_loc[:b].copy_(batch.out_cache_loc)
        self.req_pool_indices[:b].copy_(batch.req_pool_indices)
        self.prefix_lens[:b].copy_(batch.prefix_lens)
        self.seq_lens[:b].copy_(batch.seq_lens)
        if bs > b:  # padding rows: the scratch request, one key at slot 0, writing slot 0
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.out_cache_loc[b:bs].zero_()
            self.req_pool_indices[b:bs].fill_(self.runner.kv_pool.scratch_row)
            self.prefix_lens[b:bs].zero_()
            self.seq_lens[b:bs].fill_(1)
        fixed.prefix_lens_list[:] = [*batch.prefix_lens_list, *[0] * (bs - b)]
        self.runner.backend.init_forward_metadata_replay_cuda_graph(bs, fixed)
        self.graphs[bs].replay()
        self.replays += 1
        return self.outputs[bs][:b]


@contextmanager
def measure_cuda_memory():
    """Yields a dict holding ``before`` (free GPU bytes on entry), and after the block also
    ``used`` (the bytes it took) and ``free``."""
    torch.cuda.synchronize()
    info = {"before": torch.cuda.mem_get_info()[0]}
    yield info
    torch.cuda.synchronize()
    after = torch.cuda.mem_get_info()[0]
    info.update(used=info["before"] - after, free=after)


def capture_decode_graphs(runner, config, device, sizing, backend_name: str) -> str:
    """Capture the decode graphs when they apply (up to ``sizing.cuda_graph_max_bs``);
    returns the start log's line about them."""
    max_bs = sizing.cuda_graph_max_bs
    if not device.is_cuda:
        return "cuda graph: off (CUDA graphs need a CUDA GPU; this is a CPU)"
    if config.disable_cuda_graph:
        return "cuda graph: off (--disable-cuda-graph)"
    if config.pp_size > 1:
        return ("cuda graph: off (--pp-size > 1: a stage's forward waits on another "
                "rank's activations, which a captured graph cannot)")
    if config.enable_dp_attention:
        return ("cuda graph: off (--enable-dp-attention: the MoE layers' gathers are sized "
                "from every rank's token count, read on the host)")
    unsupported = getattr(runner.model, "cuda_graph_unsupported", None)
    if unsupported:  # the model's own reason (an MoE model's: models/moe.py)
        return f"cuda graph: off ({unsupported})"
    if not runner.backend.supports_cuda_graph:
        return (f"cuda graph: off (attention backend {backend_name} cannot run "
                f"inside a CUDA graph; triton, flashinfer, trtllm_mha and fa3 can)")
    sizes = [s for s in capture_sizes(max_bs, config.cuda_graph_bs) if s <= max_bs]
    logged_capture("cuda graph", lambda: runner.init_cuda_graphs(sizes), (
        f"CUDA graph capture ran out of GPU memory ({len(sizes)} sizes up to {max_bs} "
        f"requests): lower --mem-fraction-static (now {sizing.mem_fraction_static}) or "
        f"--cuda-graph-max-bs, or pass --disable-cuda-graph."))
    return f"cuda graph: on, captured bs {sizes}"


def logged_capture(what: str, capture: Callable[[], float],
                   out_of_memory: str) -> tuple[float, int]:
    """Run ``capture`` (it returns its seconds) between SGLang's ``Capture <what> begin/end``
    log lines with the GPU memory it took; returns (seconds, bytes taken). Running out of GPU
    memory raises EngineError(``out_of_memory``: what to lower)."""
    gb = 1 << 30
    try:
        with measure_cuda_memory() as mem:
            logger.info(f"Capture {what} begin. This can take up to several minutes. "
                        f"avail mem={mem['before'] / gb:.2f} GB")
            seconds = capture()
    except RuntimeError as e:  # torch.OutOfMemoryError is one
        if "out of memory" not in str(e):
            raise
        raise EngineError(out_of_memory) from None
    logger.info(f"Capture {what} end. Time elapsed: {seconds:.2f} s. "
                f"mem usage={mem['used'] / gb:.2f} GB. avail mem={mem['free'] / gb:.2f} GB.")
    return seconds, mem["used"]
