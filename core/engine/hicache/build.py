"""HiCache built at start: the storage backend resolved with the other names, the host pool
sized and allocated, the tiered radix tree, and the start log's line."""

from __future__ import annotations

import os

from engine.hicache.host_pool import HostKVPool
from engine.hicache.pages import PageKV
from engine.hicache.settings import host_pool_tokens, storage_dir, storage_page_tokens
from engine.hicache.tree import HiRadixCache


def resolve_storage(regs, config):
    """The --hicache-storage-backend entry (None: no storage tier); an unknown name lists the
    registered ones, an unusable one says why."""
    from engine.registry import UnknownName

    if not config.enable_hierarchical_cache or config.hicache_storage_backend is None:
        return None
    entry = regs.hicache_storage.get(config.hicache_storage_backend)
    why = entry.unavailable_reason(None)
    if why:
        raise UnknownName(f"HiCache storage backend '{entry.name}' ({entry.origin}) cannot be "
                          f"used here: {why}")
    return entry


def identity(config, runner, pool, page_tokens: int) -> dict:
    """What every stored page records and every read checks: the model, the K/V format and
    the page sizes."""
    mc = runner.model_config
    model = config.model or "default"
    return {"model": os.path.realpath(model) if os.path.exists(model) else model,
            "architecture": mc.architecture, "layers": len(pool.k_buffer),
            "kv_shape": list(pool.k_buffer[0].shape[1:]), "kv_dtype": config.kv_cache_dtype,
            "storage_dtype": str(pool.dtype).removeprefix("torch."),
            "page_size": pool.page_size, "storage_page_tokens": page_tokens}


def build_hicache(config, runner, pool, storage_entry, stats) -> HiRadixCache:
    host = HostKVPool(pool, host_pool_tokens(config, pool.size, pool.bytes_per_token(),
                                             pool.page_size))
    storage = None
    if storage_entry is not None:
        from engine.hicache.shards import rank_identity, shard_from
        from engine.hicache.storage import StorageTier

        page_tokens = storage_page_tokens(pool.page_size)
        ident = identity(config, runner, pool, page_tokens)
        shards, remote_flush = [], None
        ranks = getattr(runner, "hicache_storage", None)  # ranks/executor.py's ParallelRunner
        if ranks is not None:  # every rank stores its own shard (hicache/shards.py)
            ident = rank_identity(ident, runner.topo, 0)
            shards = [shard_from(sent) for sent in ranks(page_tokens)]
            remote_flush = runner.hicache_flush
        like = PageKV(*host.read(host_slots_of(page_tokens)))
        storage = StorageTier(open_backend(storage_entry, config, ident), ident, page_tokens,
                              like, config.hicache_storage_prefetch_policy, stats, shards,
                              remote_flush)
    return HiRadixCache(pool, host, config.hicache_write_policy, stats, storage)


def open_backend(entry, config, ident: dict):
    """The storage backend of ``entry`` (a register_hicache_storage entry) for pages of
    ``ident``."""
    from engine.interfaces import HiCacheStorageContext

    return entry.obj(HiCacheStorageContext(storage_dir(config), ident,
                                           config.plugin_options.get(entry.plugin, {})))


def build_rank_pages(config, runner, topo, rank: int, page_tokens: int):
    """A worker rank's shard of the storage tier (``RankPages``) and what it tells rank 0
    about it (hicache/shards.py's ``shard_of``)."""
    from engine.hicache.report import TierStats
    from engine.hicache.shards import RankPages, page_like, rank_identity, shard_of, suffix_of
    from engine.hicache.storage import StorageTier
    from engine.plugins import get_registries

    pool = runner.kv_pool
    ident = rank_identity(identity(config, runner, pool, page_tokens), topo, rank)
    like = page_like(pool, page_tokens)
    tier = StorageTier(open_backend(resolve_storage(get_registries(), config), config, ident),
                       ident, page_tokens, like, config.hicache_storage_prefetch_policy,
                       TierStats())
    return RankPages(tier, suffix_of(rank)), shard_of(suffix_of(rank), ident, like)


def host_slots_of(n: int):
    import torch

    return torch.zeros(n, dtype=torch.int64)  # shapes and dtypes only


def hicache_line(cache) -> str:
    """The start log's line: the host pool, the write policy, the storage tier."""
    if not isinstance(cache, HiRadixCache):
        return ""
    host = cache.host
    gib = 1 << 30
    line = (f"HiCache: host pool {host.size} tokens ({host.size * host.bytes_per_token() / gib:.3f} "
            f"GiB{', pinned' if host.k and host.k[0].is_pinned() else ''}), write policy "
            f"{cache.write_policy}")
    s = cache.storage
    if s is None:
        return line + "; storage: none"
    ranks = f", each of {len(s.shards) + 1} ranks its own shard" if s.shards else ""
    return (line + f"; storage: {s.backend.describe()}, pages of {s.page_tokens} tokens, "
                   f"prefetch {s.policy}{ranks}")
