"""Where a mixture-of-experts layer's experts live over a tensor-parallel group of ``tp`` ranks
with ``--ep-size`` ``ep`` (SGLang's layout: ``ep`` divides ``tp``).

The experts are split into ``ep`` contiguous runs of ``num_experts / ep`` whole experts; each
run is held by ``tp / ep`` neighbouring ranks, which cut every expert of the run by its
intermediate dimension as a dense MLP is cut (gate/up by output rows, down by input columns).
Rank ``r`` holds run ``r // (tp / ep)`` and intermediate chunk ``r % (tp / ep)``. So ``ep`` 1 is
plain tensor parallelism (every rank a slice of every expert) and ``ep = tp`` is expert
parallelism (every rank whole experts, a share of them). Either way a rank's output is a partial
sum over the experts (and slices) it holds, and one all-reduce over the tp group completes the
block: tokens are never sent to their experts' ranks (every rank has every token, since
attention is tensor-parallel), each rank computes the (token, expert) pairs whose experts it
holds and zero for the rest. An all-to-all dispatch would move the same [tokens, hidden] bytes
per rank on a ring and needs the counts exchanged first; that pays off only where attention is
data-parallel (each rank its own tokens), which is not done yet."""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.errors import EngineError
from engine.parallel.shard import Cut

EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")  # model.layers.{i}.mlp.experts.{e}.…


@dataclass(frozen=True)
class ExpertPlacement:
    num_experts: int
    tp_size: int
    ep_size: int
    tp_rank: int

    @property
    def moe_tp_size(self) -> int:
        """Ranks that share each expert (its intermediate cut over them)."""
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp_size

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first(self) -> int:
        return self.ep_rank * self.per_rank

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.per_rank

    @property
    def intermediate_cut(self) -> Cut:
        """gate/up rows (dim 0) of each held expert; down's columns are the same chunk."""
        return Cut(0, self.moe_tp_size, self.tp_rank % self.moe_tp_size)

    def describe(self) -> str:
        """The start log's words: "4 of 8 experts per rank (--ep-size 2)"."""
        cut = (f", each expert's intermediate cut over {self.moe_tp_size} ranks"
               if self.moe_tp_size > 1 else "")
        return f"{self.per_rank} of {self.num_experts} experts per rank (--ep-size " \
               f"{self.ep_size}){cut}"


def expert_problem(num_experts: int, moe_intermediate: int, tp_size: int,
                   ep_size: int) -> str | None:
    """Why ``num_experts`` experts of ``moe_intermediate`` rows cannot be placed over
    ``tp_size`` ranks with ``--ep-size`` ``ep_size`` (None: they can)."""
    if tp_size % ep_size:
        return (f"--ep-size {ep_size} must divide --tp-size {tp_size}: the experts are split "
                f"over the ranks of the tp group; use e.g. --tp-size {ep_size} --ep-size "
                f"{ep_size}.")
    if num_experts % ep_size:
        return (f"{num_experts} experts do not split over --ep-size {ep_size}: every rank "
                f"holds the same number of whole experts; use an --ep-size that divides "
                f"{num_experts}.")
    moe_tp = tp_size // ep_size
    if moe_intermediate % moe_tp:
        return (f"the experts' intermediate size {moe_intermediate} does not split over "
                f"{moe_tp} ranks (--tp-size {tp_size} / --ep-size {ep_size}); use an --ep-size "
                f"or --tp-size whose quotient divides {moe_intermediate}.")
    return None


def expert_placement(num_experts: int, moe_intermediate: int, tp) -> ExpertPlacement:
    """This rank's placement in ``tp`` (a TPGroup, its ``ep_size`` the --ep-size)."""
    ep = getattr(tp, "ep_size", 1)
    problem = expert_problem(num_experts, moe_intermediate, tp.size, ep)
    if problem:
        raise EngineError(f"expert parallelism: {problem}")
    return ExpertPlacement(num_experts, tp.size, ep, tp.rank)


def checkpoint_expert(name: str) -> int | None:
    """The routed expert a checkpoint tensor belongs to (``….experts.{e}.…``), or None."""
    match = EXPERT_NAME.search(name)
    return int(match.group(1)) if match else None
