"""``--enable-torch-compile``: the decoder stack (embedding, layers, final hidden states) runs
through ``torch.compile`` (inductor, with freezing) for forwards of at most
``--torch-compile-max-bs`` tokens; bigger forwards (prompt chunks) stay eager.

- Attention is one opaque custom op (``engine::attention``, layers/attention.py), so the graph
  holds everything around it and the backend keeps its own metadata and KV writes.
- The oneDNN-prepacked linears stay what they are in eager mode, called from the graph as the
  opaque op ``engine::prepacked_linear`` (layers/linear.py); inductor fuses what lies between
  them (norms, rotary, SiLU x up, residual adds). Left to itself inductor packs float32 linears
  for MKL's GEMM (static sizes) or oneDNN with its own blocking (dynamic sizes), both measured
  slower here than the engine's prepacked weights. Other linears (a quantization plugin's) are
  traced as they are.
- The token dimension is dynamic: one graph serves every size from 2 to the limit, without
  recompiling (a one-token forward is padded to two, since inductor specializes sizes 0 and 1).
- Compiled graphs are cached by inductor under ``$TORCHINDUCTOR_CACHE_DIR`` (by default
  ``<engine cache>/inductor``), so a second start with the same model and flags is faster.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from engine.paths import cache_root

MIN_ROWS = 2


def compile_cache_dir() -> str:
    """Where inductor caches compiled graphs: $TORCHINDUCTOR_CACHE_DIR, set here when unset."""
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not path:
        path = os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
    return path


class CompiledDecoder:
    """Installed as ``decoder.forward``: the model's own code calls it unchanged."""

    def __init__(self, decoder: nn.Module, max_tokens: int):
        self.eager = decoder.forward
        self.max_tokens = max_tokens
        self.cache_dir = compile_cache_dir()
        self.compiled = torch.compile(self.eager, dynamic=True, options={"freezing": True})
        self.calls = {"compiled": 0, "eager": 0}
        decoder.forward = self

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        if n > self.max_tokens:
            self.calls["eager"] += 1
            return self.eager(input_ids, positions)
        self.calls["compiled"] += 1
        if n < MIN_ROWS:
            pad = MIN_ROWS - n
            input_ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        elif not input_ids.is_inference():
            # dynamo guards on inference-ness: a padded (new, inference) tensor and the batch's
            # own (normal) one would each compile a graph; hand it inference tensors only
            input_ids, positions = input_ids.clone(), positions.clone()
        return self.compiled(input_ids, positions)[:n]


def warm_up(runner, rows: int = MIN_ROWS) -> float:
    """Compile now (a forward of ``rows`` tokens in one extend), not on the first request;
    returns the seconds it took."""
    from engine.forward_batch import ForwardBatch

    pool = runner.kv_pool
    row = pool.alloc_req()
    locs = pool.extend_slots(row, 0, rows)
    start = time.perf_counter()
    try:
        batch = ForwardBatch.build([[0] * rows], [0], [row], locs, pool.req_to_token,
                                   device=pool.req_to_token.device)
        runner.forward(batch)
    finally:
        pool.free_request(row, rows)
    return time.perf_counter() - start
