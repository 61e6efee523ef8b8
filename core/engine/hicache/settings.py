"""HiCache's flags (SGLang's spellings and defaults): their checks, the host pool's size and the
storage directory."""

from __future__ import annotations

import os

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# SGLang's file backend reads its directory from this variable (default /tmp/hicache)
STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
DEFAULT_STORAGE_DIR = "/tmp/hicache"
# a storage page holds this many tokens (rounded up to a multiple of --page-size): one file per
# page, so a page of one token would be a file per token
STORAGE_PAGE_TOKENS = 32
# --hicache-storage-prefetch-policy timeout: SGLang's prefetch_timeout_base / _per_ki_token
PREFETCH_TIMEOUT_BASE_S = 1.0
PREFETCH_TIMEOUT_PER_KI_TOKEN_S = 0.25


def check_hicache(config, need) -> None:
    """The HiCache flags of ``config`` (an EngineConfig being validated); ``need(ok, msg)``
    raises the config error."""
    on = config.enable_hierarchical_cache
    given = [flag for flag, set_ in (
        ("--hicache-ratio", config.hicache_ratio != 2.0),
        ("--hicache-size", bool(config.hicache_size)),
        ("--hicache-write-policy", config.hicache_write_policy != "write_through"),
        ("--hicache-storage-backend", config.hicache_storage_backend is not None),
        ("--hicache-storage-prefetch-policy",
         config.hicache_storage_prefetch_policy != "best_effort"),
        ("--hicache-storage-dir", config.hicache_storage_dir is not None)) if set_]
    need(on or not given,
         f"{', '.join(given)} only mean something with --enable-hierarchical-cache: add it, or "
         f"drop {'them' if len(given) > 1 else 'it'}.")
    if not on:
        return
    need(not config.disable_radix_cache,
         "--enable-hierarchical-cache keeps the radix cache's evicted prefixes: it cannot be "
         "combined with --disable-radix-cache; drop one of them.")
    need(config.hicache_ratio > 0,
         f"--hicache-ratio must be > 0 (the host pool's size as a multiple of the device pool's; "
         f"SGLang's default 2), got {config.hicache_ratio}")
    need(config.hicache_size >= 0,
         f"--hicache-size must be >= 0 GiB (0: --hicache-ratio decides), got "
         f"{config.hicache_size}")
    need(config.hicache_write_policy in WRITE_POLICIES,
         f"--hicache-write-policy must be one of {', '.join(WRITE_POLICIES)}, got "
         f"{config.hicache_write_policy!r}")
    need(config.hicache_storage_prefetch_policy in PREFETCH_POLICIES,
         f"--hicache-storage-prefetch-policy must be one of {', '.join(PREFETCH_POLICIES)}, got "
         f"{config.hicache_storage_prefetch_policy!r}")
    need(config.hicache_storage_backend is not None or (
        config.hicache_storage_prefetch_policy == "best_effort"
        and config.hicache_storage_dir is None),
        "--hicache-storage-prefetch-policy and --hicache-storage-dir are the storage tier's: "
        "add --hicache-storage-backend file (or a plugin's backend), or drop them.")


def host_pool_tokens(config, device_tokens: int, bytes_per_token: int, page_size: int) -> int:
    """The host pool's size in tokens: --hicache-size GiB, else --hicache-ratio x the device
    pool; whole pages, at least one."""
    if config.hicache_size:
        tokens = int(config.hicache_size * (1 << 30)) // bytes_per_token
    else:
        tokens = int(device_tokens * config.hicache_ratio)
    tokens -= tokens % page_size
    if tokens < page_size:
        from engine.errors import EngineError

        raise EngineError(
            f"the HiCache host pool would hold {tokens} tokens, less than a page ({page_size}): "
            f"raise --hicache-ratio or --hicache-size.")
    return tokens


def storage_page_tokens(page_size: int) -> int:
    """Tokens per storage page: STORAGE_PAGE_TOKENS rounded up to a multiple of the page size."""
    return -(-STORAGE_PAGE_TOKENS // page_size) * page_size


def storage_dir(config) -> str:
    """--hicache-storage-dir, else SGLang's environment variable, else /tmp/hicache."""
    return config.hicache_storage_dir or os.environ.get(STORAGE_DIR_ENV) or DEFAULT_STORAGE_DIR


def prefetch_timeout(tokens: int) -> float:
    """How long --hicache-storage-prefetch-policy timeout waits for ``tokens`` (SGLang's)."""
    return PREFETCH_TIMEOUT_BASE_S + PREFETCH_TIMEOUT_PER_KI_TOKEN_S * tokens / 1024
