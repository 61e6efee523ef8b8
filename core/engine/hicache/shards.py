"""The storage tier with ranks (``--tp-size``/``--pp-size`` > 1): every rank's pool holds a shard
of the K/V (its heads, or its layers), so every rank stores its own shard of each page, under
the page's key (rank 0's hash chain) + ``-r{rank}`` for ranks > 0 (SGLang suffixes its keys with
the rank alike), each page recording that rank's identity (``shard``: its place in the layout).

Rank 0's tree decides, as for the host tier: when a page is written, rank 0 queues its own shard
and journals a ``store`` step (where the page's K/V are: host or device slots); the other ranks
replay it before the next forward (``hicache/copier.py``: ``replay_copies``) and queue theirs
from the same slots. Rank 0's reader reads and checks every rank's shard of a page before the
page counts as read (``StorageTier.shards``), so a stored prefix loads on every rank or none;
a ``storage_load`` step then has each rank load its own shard into the same device slots.

``RankPages`` is a worker rank's side; ``rank_identity`` / ``shard_of`` what each rank tells rank
0 at start (``ranks/executor.py``: ``hicache_storage``)."""

from __future__ import annotations

import torch

from engine.hicache.copier import load_page, read_sources, write_page_host
from engine.hicache.pages import PageError, PageKV, decode
from engine.hicache.storage import Shard, StorageTier


def suffix_of(rank: int) -> str:
    return f"-r{rank}" if rank else ""


def rank_identity(base: dict, topo, rank: int) -> dict:
    """A rank's pages' identity: the model's (with this rank's layers and K/V shape) and its
    place in the layout."""
    return {**base, "shard": f"rank {rank} of {topo.world} (tp {topo.tp_rank(rank)}/{topo.tp}, "
                             f"pp {topo.pp_rank(rank)}/{topo.pp})"}


def page_like(pool, page_tokens: int) -> PageKV:
    """One page's K and V per layer, shaped as ``pool``'s (contents unset)."""
    def like(bufs):
        return [torch.empty((page_tokens, *b.shape[1:]), dtype=b.dtype) for b in bufs]
    return PageKV(like(pool.k_buffer), like(pool.v_buffer))


def shard_of(suffix: str, identity: dict, like: PageKV) -> tuple:
    """What a rank sends rank 0 (picklable, no tensor data)."""
    return (suffix, identity, [[(tuple(t.shape), t.dtype) for t in ts] for ts in like])


def shard_from(sent: tuple) -> Shard:
    suffix, identity, shapes = sent
    return Shard(suffix, identity,
                 PageKV(*[[torch.empty(s, dtype=d) for s, d in ts] for ts in shapes]))


class RankPages:
    """A worker rank's shard of the storage tier: its writer (a ``StorageTier`` whose reader
    goes unused) and the loads rank 0 asks for."""

    def __init__(self, tier: StorageTier, suffix: str):
        self.tier, self.suffix = tier, suffix

    def store(self, pool, host, what: tuple, sources: list) -> None:
        key, tokens = what
        self.tier.put(key + self.suffix, tokens, PageKV(*read_sources(pool, host, sources)))

    def load(self, pool, what: tuple, rows: torch.Tensor, to_host: bool = False) -> None:
        """This rank's shard of a page rank 0 found whole (every shard read and checked) into
        ``rows`` of the device ``pool`` (or, ``to_host``, of the host tier given as ``pool``).
        Raises if it is gone or changed since: the ranks' K/V would disagree."""
        key, tokens, off = what
        key += self.suffix
        tier = self.tier
        data = tier.backend.get(key)
        try:
            if data is None:
                raise PageError("it is gone")
            page = decode(data, key, tier.identity, tokens, tier.like)
        except PageError as e:
            raise RuntimeError(f"HiCache storage: this rank's shard of page {key[:16]}… changed "
                               f"after rank 0 checked it ({e}): the ranks' K/V would differ; "
                               f"restart the server (the directory may be shared with a "
                               f"server that deletes pages)") from None
        if to_host:
            write_page_host(pool, page, off, rows)
        else:
            load_page(pool, page, off, rows.to(pool.k_buffer[0].device, torch.int64))

    def flush(self) -> None:
        self.tier.flush_writes()

    def close(self) -> None:
        self.tier.close()
