"""The guides' log lines and the counters behind them (metrics exporters read StepStats)."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

logger = logging.getLogger("engine")
MAX_SAMPLES = 4096
VLLM_PREEMPTION_LOG_EVERY = 50  # vLLM warns on the 1st, 51st, 101st, ... preemption


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
    max_running_requests: int = 0  # the batch cap (--max-running-requests, or its default)
    # what observers publish for this engine: /get_server_info shows each key (see the
    # engine_started hook); the same dict every step of one engine, so it also tells engines apart
    extra_info: dict = None
    # speculative decoding's cumulative counts (engine.speculative.verify.SpecStats; None: off)
    spec: object = None
    # --enable-cache-report: the prompt tokens served per tier, this step's and since start
    # (engine.hicache.report.TierStats; None: off)
    cache_tiers: object = None
    # the step's wall time, from the scheduler taking it up to this report (None: nothing ran)
    seconds: float | None = None

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
    prefill_oom_errors: int = 0  # steps whose forward ran out of memory with prompt chunks in it
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
        self.preemptions = 0  # cumulative, for vLLM's warning
        self.spec_since = (0, 0)  # speculation's (tokens, request-steps) at the last line

    def prefill(self, s: StepStats) -> None:
        logger.info(
            f"Prefill batch. #new-seq: {s.new_seqs}, #new-token: {s.new_tokens}, "
            f"#cached-token: {s.cached_tokens}"
            f"{s.cache_tiers.step_line() if s.cache_tiers is not None else ''}, "
            f"token usage: {s.token_usage:.2f}, "
            f"#running-req: {s.num_running_reqs}, #queue-req: {s.num_queue_reqs}")

    def decode(self, s: StepStats) -> None:
        self.decode_steps += 1
        self.tokens_since += s.generated_tokens
        if self.decode_steps % self.interval:
            return
        now = time.monotonic()
        s.gen_throughput = self.tokens_since / max(now - self.since, 1e-9)
        self.tokens_since, self.since = 0, now
        accept = ""
        if s.spec is not None:  # SGLang's "accept len": tokens per request-step since the last
            tokens, steps = s.spec.tokens, s.spec.request_steps
            t0, n0 = self.spec_since
            self.spec_since = (tokens, steps)
            accept = f"accept len: {(tokens - t0) / max(steps - n0, 1):.2f}, "
        logger.info(
            f"Decode batch. #running-req: {s.num_running_reqs}, #token: {s.num_used_tokens}, "
            f"token usage: {s.token_usage:.2f}, {accept}cuda graph: {s.cuda_graph}, "
            f"gen throughput (token/s): {s.gen_throughput:.2f}, "
            f"#queue-req: {s.num_queue_reqs}")
        if s.cache_tiers is not None:  # --enable-cache-report's periodic line
            logger.info(s.cache_tiers.report_line(s.totals.prompt_tokens,
                                                  s.totals.cached_tokens))

    def retraction(self, rids: list[str], old: float, new: float) -> None:
        """SGLang's line for the step, and vLLM's warning for every 50th preempted request (as
        vLLM logs it, from the first), with the cumulative count and our flags."""
        logger.warning(f"decode out of memory happened, #retracted_reqs: {len(rids)}, "
                       f"#new_token_ratio: {old:.4f} -> {new:.4f}")
        for rid in rids:
            if self.preemptions % VLLM_PREEMPTION_LOG_EVERY == 0:
                logger.warning(
                    f"Sequence group {rid} is preempted by PreemptionMode.RECOMPUTE mode because "
                    f"there is not enough KV cache space. This can affect the end-to-end "
                    f"performance. Increase --mem-fraction-static (--gpu-memory-utilization) or "
                    f"--max-total-tokens to provide more KV cache memory. "
                    f"total_num_cumulative_preemption={self.preemptions + 1}")
            self.preemptions += 1


def is_out_of_memory(e: BaseException) -> bool:
    """torch's OutOfMemoryError, or an allocator's RuntimeError saying "out of memory"."""
    return type(e).__name__ == "OutOfMemoryError" or (
        isinstance(e, RuntimeError) and "out of memory" in str(e).lower())
