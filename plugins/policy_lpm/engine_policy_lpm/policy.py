from engine.interfaces import SchedulePolicy

# Matching every waiting prompt against the radix tree costs O(queue x prompt) per step; past
# this queue length SGLang gives up on lpm and serves in arrival order, and so do we.
FCFS_FALLBACK_QUEUE_LEN = 128


class LPMPolicy(SchedulePolicy):
    cache_aware = True

    def __init__(self, fallback_queue_len: int = FCFS_FALLBACK_QUEUE_LEN):
        self.fallback_queue_len = fallback_queue_len

    def uses_cache(self, queue_len: int) -> bool:
        return queue_len <= self.fallback_queue_len

    def order(self, waiting, prefix_len):
        if not self.uses_cache(len(waiting)):
            return sorted(waiting, key=lambda r: r.arrival)
        return sorted(waiting, key=lambda r: (-prefix_len(r), r.arrival))
