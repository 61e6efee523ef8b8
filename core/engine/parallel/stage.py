"""Pipeline parallelism at the model level: which contiguous decoder layers one stage (pp rank)
holds. The first stage also holds the token embedding, the last the final norm and the LM
head; a stage passes the hidden states of all its batch's tokens to the next one."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import EngineError

LAYER_PREFIX = "model.layers."  # HF checkpoint names of decoder layers: model.layers.{i}.…


@dataclass(frozen=True)
class PPStage:
    rank: int
    size: int
    start: int  # the stage's global decoder layers are [start, end)
    end: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def holds_layer(self, i: int) -> bool:
        return self.start <= i < self.end


def split_layers(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) layers per stage, as even as possible. When ``pp_size`` does not
    divide ``num_layers``, the remainder goes one layer each to the stages just BEFORE the last,
    walking back from the second-to-last (the last stage never gets one: it also runs the final
    norm and the LM head), as vLLM's and SGLang's ``get_pp_indices`` do: 5 layers over 2
    stages -> (0, 3), (3, 5); 22 over 4 -> 5, 6, 6, 5 layers."""
    if not 1 <= pp_size <= num_layers:
        raise EngineError(f"pipeline parallelism: {num_layers} layers cannot be split over "
                          f"{pp_size} stages; use a --pp-size of at most {num_layers}.")
    base, extra = divmod(num_layers, pp_size)
    sizes = [base] * pp_size
    for r in range(pp_size - 1 - extra, pp_size - 1):
        sizes[r] += 1
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def make_stage(num_layers: int, pp_rank: int, pp_size: int) -> PPStage:
    """Stage ``pp_rank`` of ``pp_size`` over a model of ``num_layers`` decoder layers."""
    bounds = split_layers(num_layers, pp_size)
    if not 0 <= pp_rank < pp_size:
        raise EngineError(f"pipeline parallelism: rank {pp_rank} is outside 0..{pp_size - 1}.")
    start, end = bounds[pp_rank]
    return PPStage(pp_rank, pp_size, start, end)


def checkpoint_layer(name: str) -> int | None:
    """The global decoder layer a checkpoint tensor belongs to (``model.layers.{i}.…``), or None
    for the tensors outside the layers (embedding, final norm, head)."""
    if not name.startswith(LAYER_PREFIX):
        return None
    index = name[len(LAYER_PREFIX):].partition(".")[0]
    return int(index) if index.isdigit() else None
