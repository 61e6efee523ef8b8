"""Rank 0's side of tp/pp: ``ParallelRunner`` stands where the ModelRunner stands (the scheduler
cannot tell them apart) and drives the workers in lockstep: each forward first sends them the
batch (messages.py), then runs rank 0's own shard; with pipeline stages, rank 0 is stage 0 and
gets the logits back from the last stage (pipeline.py).

It also watches the workers: a local one that exits, or any one whose heartbeat stops, is named
in ``failure`` (the server's /health then answers 503 with it), and a forward that fails
because a rank went away raises RankFailed naming that rank instead of a bare socket error.

A forward whose rank-0 part raises (an out-of-memory error, say) while every worker still
finished that forward (each reports its forwards in the store, failed or not) raises that error
as it is: the batch fails and the engine goes on, as in one process. Only when a worker is
stuck (rank 0 left a collective it was waiting in) or gone is it fatal."""

from __future__ import annotations

import atexit
import logging
import threading
import time

import torch
import torch.distributed as dist

from engine.errors import EngineError
from engine.ranks import rendezvous
from engine.ranks.messages import BatchMessage
from engine.ranks.pipeline import receive_logits, run_stage
from engine.ranks.world import RankContext, exited, stop_processes

logger = logging.getLogger("engine.parallel")
SILENT_AFTER_S = 10.0  # a rank whose heartbeat has not moved for this long is declared gone
FAILURE_GRACE_S = 3.0  # after a collective fails, how long to look for the rank to blame
# after rank 0's part of a forward raised: how long the workers get to report that forward
FORWARD_SETTLE_S = 5.0


class RankFailed(EngineError):
    """A rank is gone: the engine cannot serve until it is restarted."""

    fatal = True


class ParallelRunner:
    def __init__(self, runner, ctx: RankContext, procs: dict, config):
        self.inner, self.ctx, self.topo, self.procs = runner, ctx, ctx.topo, procs
        self.config = config
        self.failure: str | None = None
        self._beats: dict[int, tuple[int, float]] = {}
        self._closed = False
        self._forwards = 0  # forwards sent to the workers (they count theirs alike)
        self.rank_sizes = self._gather_sizes()
        atexit.register(self.close)
        threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()

    def __getattr__(self, name):  # everything else is rank 0's own runner's
        return getattr(self.inner, name)

    # -- what the engine calls ----------------------------------------------------------------
    def init_kv_pool(self, num_tokens: int, page_size: int = 1, max_reqs: int = 256,
                     max_context_len: int = 4096):
        kwargs = dict(num_tokens=num_tokens, page_size=page_size, max_reqs=max_reqs,
                      max_context_len=max_context_len)
        self._send("kv_pool", kwargs)
        pool = self.inner.init_kv_pool(**kwargs)
        pool.row_edits = []  # from now on every table write goes to the workers too
        pool.copy_journal = []  # and every HiCache copy (hicache/copier.py)
        return pool

    def init_cuda_graphs(self, sizes: list[int], graph_cls=None) -> float:
        if self.topo.pp > 1:
            raise EngineError("CUDA graphs with --pp-size > 1 are not captured (a stage's "
                              "forward waits on another rank's activations)")
        self._send("graphs", sizes)
        return self.inner.init_cuda_graphs(sizes, graph_cls)

    def forward(self, batch, return_all_logits: bool = False) -> torch.Tensor:
        if self.failure:
            raise RankFailed(self._cannot_serve())
        pool = self.inner.kv_pool
        edits, pool.row_edits = pool.row_edits, []
        message = BatchMessage.of(batch, edits, return_all_logits)
        message.copies, pool.copy_journal = pool.copy_journal or [], []
        message.parts = self.micro_batches(batch.batch_size)
        try:
            self._send("forward", message)
        except Exception as e:  # noqa: BLE001 - the control group failed: find out who left
            raise RankFailed(self._blame(e)) from None
        self._forwards += 1
        try:
            if self.topo.pp == 1:
                return self.inner.forward(batch, return_all_logits)
            parts = message.batches(pool.req_to_token)
            run_stage(self.inner, self.topo, 0, parts, return_all_logits)
            return receive_logits(self.topo, parts, return_all_logits,
                                  self.inner.model_config.vocab_size,
                                  self.inner.device.torch_device)
        except Exception as e:  # noqa: BLE001 - the batch's failure, or a rank's: which?
            if self._workers_finished(self._forwards):
                logger.warning(f"rank 0's part of forward {self._forwards} failed "
                               f"({type(e).__name__}); every worker finished it: the batch "
                               f"fails, the ranks stay in step")
                raise
            raise RankFailed(self._blame(e)) from None

    def hicache_storage(self, page_tokens: int) -> list:
        """HiCache's storage tier: every worker opens its own shard of it (hicache/shards.py)
        and says what its pages hold (``shard_of``), ranks 1.. in order."""
        self._send("hicache_storage", page_tokens)
        sent = [None] * self.topo.world
        dist.gather_object(None, sent, dst=0, group=self.ctx.control)
        return sent[1:]

    def hicache_flush(self) -> None:
        """The HiCache steps journaled since the last forward made on every rank, and every
        rank's queued storage pages written (returns when they are)."""
        if self._closed or self.failure:
            return
        pool = self.inner.kv_pool
        copies, pool.copy_journal = pool.copy_journal or [], []
        self._send("hicache_flush", copies)
        dist.gather_object(None, [None] * self.topo.world, dst=0, group=self.ctx.control)

    def micro_batches(self, batch_size: int) -> int:
        """--pp-size micro-batches, or as many as --pp-max-micro-batch-size requests make."""
        most = self.config.pp_max_micro_batch_size
        if self.topo.pp == 1:
            return 1
        return self.topo.pp if most is None else -(-batch_size // most)

    def describe(self) -> str:
        """The start log's line about the ranks."""
        t = self.topo
        sizes = ", ".join(f"{t.describe(r)} {w / (1 << 20):.1f} MiB weights, {kv} B/token KV"
                          for r, (w, kv) in enumerate(self.rank_sizes))
        place = self.experts_placement()
        experts = f"; MoE: {place.describe()}" if place is not None else ""
        return (f"parallel: tp_size={t.tp}, pp_size={t.pp}, nnodes={t.nnodes}: {t.world} ranks "
                f"over {dist.get_backend()}; {sizes}{experts}")

    def experts_placement(self):
        """Where an MoE model's experts are over the tp ranks (engine.parallel.experts), or
        None for a dense model."""
        return getattr(self.inner.model, "experts_placement", None)

    def info(self) -> dict:
        """/get_server_info's "parallel": the layout and every rank's sizes (and local pids)."""
        import os

        t = self.topo
        pids = {0: os.getpid(), **{r: p.pid for r, p in self.procs.items()}}
        ranks = [{"rank": r, "tp_rank": t.tp_rank(r), "pp_rank": t.pp_rank(r),
                  "node": t.node_of(r), "pid": pids.get(r), "weight_bytes": w,
                  "kv_bytes_per_token": kv} for r, (w, kv) in enumerate(self.rank_sizes)]
        place = self.experts_placement()
        experts = {} if place is None else {"ep_size": place.ep_size,
                                            "experts_per_rank": place.per_rank,
                                            "num_experts": place.num_experts}
        return {"tp_size": t.tp, "pp_size": t.pp, "nnodes": t.nnodes, "world_size": t.world,
                "backend": dist.get_backend() if dist.is_initialized() else None,
                "ranks": ranks, "failure": self.failure, **experts}

    def close(self) -> None:
        """Stop the workers (they exit on their own when rank 0 dies without this)."""
        if self._closed:
            return
        self._closed = True
        if not self.failure:
            try:
                self._send("stop", None)
            except Exception:  # noqa: BLE001 - a worker already gone; stop the rest anyway
                pass
        stop_processes(self.procs, timeout=10.0)
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- inside ---------------------------------------------------------------------------------
    def _send(self, kind: str, payload) -> None:
        dist.broadcast_object_list([(kind, payload)], src=0, group=self.ctx.control)

    def _gather_sizes(self) -> list[tuple[int, int]]:
        """(weight bytes, KV bytes per token) of every rank, rank 0's first."""
        sizes = [None] * self.topo.world
        dist.gather_object((self.inner.weight_bytes, self.inner.kv_bytes_per_token()), sizes,
                           dst=0, group=self.ctx.control)
        return sizes

    def _probe(self) -> str | None:
        """Which rank is gone, if one is: a local process that exited, an error a rank left
        in the store, or a heartbeat that stopped moving."""
        gone = exited(self.topo, self.procs, self.ctx.store)
        if gone:
            return gone
        now = time.monotonic()
        for rank in range(1, self.topo.world):
            error = rendezvous.read_error(self.ctx.store, rank)
            if error:
                return f"{self.topo.describe(rank)} failed: {error}"
            try:
                beat = rendezvous.read_beat(self.ctx.store, rank)
            except Exception:  # noqa: BLE001 - our own store: nothing to learn from it
                continue
            seen, since = self._beats.get(rank, (None, now))
            if beat != seen:
                self._beats[rank] = (beat, now)
            elif now - since > SILENT_AFTER_S:
                return (f"{self.topo.describe(rank)} stopped answering (no heartbeat for "
                        f"{now - since:.0f} s)")
        return None

    def _watch(self) -> None:
        while not self._closed and not self.failure:
            found = self._probe()
            if found:
                self.failure = found
                logger.error(self._cannot_serve())
            time.sleep(1.0)

    def _workers_finished(self, seq: int) -> bool:
        """Whether every worker reports forward ``seq`` done (failed or not) within
        FORWARD_SETTLE_S: then none waits in a collective rank 0 left, and the next forward
        finds them all in step."""
        if self.failure:
            return False
        deadline = time.monotonic() + FORWARD_SETTLE_S
        left = set(range(1, self.topo.world))
        while left and time.monotonic() < deadline:
            left = {r for r in left
                    if (rendezvous.read_forward(self.ctx.store, r) or (0, ""))[0] < seq}
            if left:
                time.sleep(0.05)
        return not left

    def _blame(self, e: Exception) -> str:
        deadline = time.monotonic() + FAILURE_GRACE_S
        while not self.failure and time.monotonic() < deadline:
            self.failure = self._probe()
            if not self.failure:
                time.sleep(0.2)
        if not self.failure:
            self.failure = f"a collective failed ({type(e).__name__}: {str(e)[:300]})"
        return self._cannot_serve()

    def _cannot_serve(self) -> str:
        return (f"the engine cannot serve: {self.failure}; every rank must run, so restart "
                f"the engine (all nodes)")
