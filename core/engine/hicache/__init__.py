"""HiCache: host-memory and storage tiers under the radix cache (``--enable-hierarchical-cache``).

``settings.py`` the flags' checks and the host pool's size; ``host_pool.py`` the host tier's
slots; ``copier.py`` the copies between the tiers, beside the step; ``tree.py`` the radix tree that knows the tiers (``HiRadixCache``); ``pages.py`` a storage
page's key (the hash chain of its tokens) and its file format; ``storage.py`` the storage
tier (background writes, prefetches); ``report.py`` the per-tier counters and log lines.
"""
