"""The guides' log lines and the counters behind them (metrics exporters read StepStats)."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

logger = logging.getLogger("engine")
MAX_SAMPLES = 4096


@dataclass
class StepStats:
    """Handed to the ``step_finished`` hook after every step."""

    step: int
    forward_mode: str  # "prefill", "decode" or "mixed" ("idle" when nothing ran)
    num_running_reqs: int
    num_queue_reqs: int
    num_used_tokens: int
    max_total_tokens: int
    new_seqs: int = 0
    new_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    retracted_reqs: int = 0
    finished_reqs: int = 0
    gen_throughput: float | None = None  # set on steps that print the decode line
    cuda_graph: bool = False  # the step's forward replayed a captured CUDA graph
    totals: "Counters" = None

    @property
    def token_usage(self) -> float:
        return self.num_used_tokens / self.max_total_tokens if self.max_total_tokens else 0.0


@dataclass
class Counters:
    """Cumulative since start."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the radix cache
    retracted_reqs: int = 0
    finished_reqs: int = 0
    aborted_reqs: int = 0
    # recent latency samples, drained by exporters each step; bounded when nobody drains them
    ttft: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    e2e: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class StatLogger:
    def __init__(self, decode_log_interval: int):
        self.interval = decode_log_interval
        self.decode_steps = 0
        self.tokens_since = 0
        self.since = time.monotonic()

    def prefill(self, s: StepStats) -> None:
        logger.info(
            f"Prefill batch. #new-seq: {s.new_seqs}, #new-token: {s.new_tokens}, "
            f"#cached-token: {s.cached_tokens}, token usage: {s.token_usage:.2f}, "
            f"#running-req: {s.num_running_reqs}, #queue-req: {s.num_queue_reqs}")

    def decode(self, s: StepStats) -> None:
        self.decode_steps += 1
        self.tokens_since += s.generated_tokens
        if self.decode_steps % self.interval:
            return
        now = time.monotonic()
        s.gen_throughput = self.tokens_since / max(now - self.since, 1e-9)
        self.tokens_since, self.since = 0, now
        logger.info(
            f"Decode batch. #running-req: {s.num_running_reqs}, #token: {s.num_used_tokens}, "
            f"token usage: {s.token_usage:.2f}, cuda graph: {s.cuda_graph}, "
            f"gen throughput (token/s): {s.gen_throughput:.2f}, "
            f"#queue-req: {s.num_queue_reqs}")

    @staticmethod
    def retraction(n: int, old: float, new: float) -> None:
        logger.warning(f"decode out of memory happened, #retracted_reqs: {n}, "
                       f"#new_token_ratio: {old:.4f} -> {new:.4f}")
