"""A rank's experts of a mixture-of-experts layer (placed as experts.py says): each expert it
holds cut by its intermediate dimension like a dense MLP (gate/up column-parallel, down's
input columns cut, its output left partial), the others ``AbsentExpert``. The block's one
all-reduce is layers/moe.py's ``SparseMoE.reduce``; the router stays whole on every rank."""

from __future__ import annotations

from torch import nn

from engine.layers.moe import AbsentExpert, Expert
from engine.parallel.experts import ExpertPlacement, expert_placement
from engine.parallel.group import TPGroup
from engine.parallel.layers import ColumnParallelLinear, PartialRowLinear
from engine.parallel.shard import Cut


class ExpertShard(Expert):
    """An expert's rows ``cut`` (gate/up rows, down's matching input columns) on one rank."""

    def __init__(self, hidden_size: int, intermediate_size: int, names: tuple[str, str, str],
                 cut: Cut, tp: TPGroup):
        nn.Module.__init__(self)
        gate, up, down = names
        rows = (intermediate_size, cut)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, {gate: rows, up: rows}, False, tp)
        self.down_name = down
        setattr(self, down, PartialRowLinear(intermediate_size, hidden_size,
                                             Cut(1, cut.parts, cut.index),
                                             "expert intermediate columns"))


def rank_experts(hidden_size: int, intermediate_size: int, num_experts: int,
                 names: tuple[str, str, str], tp: TPGroup) -> tuple[nn.ModuleList,
                                                                     ExpertPlacement]:
    """(the experts list a ``SparseMoE`` of this rank takes, where they are)."""
    place = expert_placement(num_experts, intermediate_size, tp)
    cut = place.intermediate_cut
    experts = nn.ModuleList(
        ExpertShard(hidden_size, intermediate_size, names, cut, tp) if place.holds(e)
        else AbsentExpert() for e in range(num_experts))
    return experts, place


def shared_expert(hidden_size: int, intermediate_size: int, tp: TPGroup) -> ExpertShard:
    """DeepSeek's shared experts (one MLP every token runs) cut over the whole tp group."""
    return ExpertShard(hidden_size, intermediate_size, ("gate_proj", "up_proj", "down_proj"),
                       Cut(0, tp.size, tp.rank), tp)
