"""Which rank does what: ``--tp-size`` x ``--pp-size`` ranks spread over ``--nnodes`` nodes.

Global rank ``r`` is stage ``r // tp`` of the pipeline and rank ``r % tp`` of that stage's
tensor-parallel group (SGLang's and vLLM's order: a stage's tp ranks are neighbours, so a
stage sits on one node when it can). Node ``n`` runs ranks ``n * per_node .. (n+1) * per_node
- 1``; rank 0 (node 0) runs the scheduler and the HTTP server, every other rank a worker."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import EngineError


@dataclass(frozen=True)
class Topology:
    tp: int = 1
    pp: int = 1
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self):
        for flag, value in (("--tp-size", self.tp), ("--pp-size", self.pp),
                            ("--nnodes", self.nnodes)):
            if value < 1:
                raise EngineError(f"{flag} must be >= 1, got {value}")
        if self.world % self.nnodes:
            raise EngineError(f"--nnodes {self.nnodes} does not divide the {self.world} ranks "
                              f"(--tp-size {self.tp} x --pp-size {self.pp}): every node runs "
                              f"the same number of ranks; use a --nnodes that divides "
                              f"{self.world}.")
        if not 0 <= self.node_rank < self.nnodes:
            raise EngineError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1} "
                              f"(--nnodes {self.nnodes}).")

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def per_node(self) -> int:
        return self.world // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def pp_rank(self, rank: int) -> int:
        return rank // self.tp

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp + tp_rank

    def stage_ranks(self, pp_rank: int) -> list[int]:
        """The global ranks of one stage's tensor-parallel group."""
        return [self.rank_of(pp_rank, t) for t in range(self.tp)]

    def describe(self, rank: int) -> str:
        """How logs and errors name a rank: "rank 3 (tp 1, pp 1, node 1)"."""
        parts = [f"tp {self.tp_rank(rank)}"] if self.tp > 1 else []
        parts += [f"pp {self.pp_rank(rank)}"] if self.pp > 1 else []
        parts += [f"node {self.node_of(rank)}"] if self.nnodes > 1 else []
        return f"rank {rank} ({', '.join(parts)})" if parts else f"rank {rank}"

    def short(self, rank: int) -> str:
        """The log prefix of a rank, as SGLang's: "TP1", "PP1 TP0"."""
        tp = f"TP{self.tp_rank(rank)}"
        return f"PP{self.pp_rank(rank)} {tp}" if self.pp > 1 else tp
