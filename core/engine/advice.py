"""The tuning guides' symptoms as rules over a window of samples, and their advice.

One rule per symptom of SGLang's hyperparameter tuning guide. The advisor plugin feeds it one
sample per scheduler step; `engine doctor` one per poll of a running server's /metrics and
/get_server_info: both print the same advice from the same code.

Each rule also checks the symptoms that rule it out, so that one window never gets two
contradicting pieces of advice: requests waiting in the queue mean the client is not what
keeps the batch small; frequent retractions mean conservativeness must go up, not down (a
retraction recomputes work, so it outweighs the admission it bought).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GOOD_USAGE = 0.9  # "token usage > 0.9 means good utilization"
QUEUE_HEALTHY = (100, 2000)  # "A healthy range for #queue-req is 100 - 2000"
MOSTLY = 0.9  # share of samples for "most of the time"
FREQUENTLY = 0.5  # share of samples for "frequently"
RETRACTIONS_PER_MINUTE = 1.0  # "occasionally but not frequently, it is okay"
MIN_RETRACTIONS = 3  # fewer in a window is "occasionally"
SMALL_BATCH = 0.25  # a decode batch under this share of --max-running-requests is "much smaller"
MIN_SAMPLES = 32  # fewer busy samples say nothing about "most of the time"


@dataclass
class Sample:
    """The server at one moment (cumulative counts are since start)."""

    time: float  # seconds, monotonic
    running: int
    queued: int
    token_usage: float
    retracted_total: int
    prefill_oom_total: int = 0

    @property
    def busy(self) -> bool:
        return self.running > 0 or self.queued > 0


@dataclass
class Settings:
    """The flags the advice names, as the server resolved them."""

    max_running_requests: int
    chunked_prefill_size: int | None = None
    schedule_conservativeness: float | str = 1.0


@dataclass
class Advice:
    symptom: str  # one of SYMPTOMS
    message: str  # the numbers that triggered it, then the guide's advice
    numbers: dict

    def as_dict(self) -> dict:
        return asdict(self)


def _share(samples, pred) -> float:
    return sum(1 for s in samples if pred(s)) / len(samples) if samples else 0.0


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def queue_empty(samples: list[Sample], settings: Settings) -> Advice | None:
    busy = [s for s in samples if s.busy]
    if len(busy) < MIN_SAMPLES or _share(busy, lambda s: s.queued == 0) < MOSTLY:
        return None
    share = _share(busy, lambda s: s.queued == 0)
    return Advice("queue_empty", (
        f"#queue-req was 0 in {share:.0%} of the last {len(busy)} steps (#running-req "
        f"{_mean(s.running for s in busy):.1f} on average): the client code is submitting "
        f"requests too slowly. A healthy range for #queue-req is {QUEUE_HEALTHY[0]} - "
        f"{QUEUE_HEALTHY[1]}: send more requests at once."),
        {"steps": len(busy), "share_queue_empty": round(share, 3)})


def low_token_usage(samples: list[Sample], settings: Settings) -> Advice | None:
    """Requests wait while the pool has room and the batch is not full: the reservation for
    the running requests' max_new_tokens keeps them out. Not while retractions are frequent:
    then the reservation is too small, whatever the usage in between."""
    if _retractions(samples)[0]:
        return None
    waiting = [s for s in samples if s.queued > 0 and s.running < settings.max_running_requests]
    if len(waiting) < MIN_SAMPLES or len(waiting) < FREQUENTLY * len(samples):
        return None
    share = _share(waiting, lambda s: s.token_usage < GOOD_USAGE)
    if share < FREQUENTLY:
        return None
    usage = _mean(s.token_usage for s in waiting)
    return Advice("low_token_usage", (
        f"token usage < {GOOD_USAGE} with #queue-req > 0 in {share:.0%} of {len(waiting)} steps "
        f"(token usage {usage:.2f}, #queue-req {_mean(s.queued for s in waiting):.1f} on "
        f"average; --schedule-conservativeness {settings.schedule_conservativeness}): the "
        f"server is too conservative about taking in new requests. Decrease "
        f"--schedule-conservativeness to a value like 0.3, or set it to auto. This happens when "
        f"requests have a large max_new_tokens but stop very early due to EOS or stop strings."),
        {"steps": len(waiting), "share_low_usage": round(share, 3),
         "mean_token_usage": round(usage, 3)})


def _retractions(samples: list[Sample]) -> tuple[bool, int, float, float]:
    """(frequent?, requests retracted, seconds, per minute) over the window."""
    if len(samples) < 2:
        return False, 0, 0.0, 0.0
    retracted = samples[-1].retracted_total - samples[0].retracted_total
    seconds = max(samples[-1].time - samples[0].time, 1e-6)
    per_minute = retracted * 60 / seconds
    frequent = retracted >= MIN_RETRACTIONS and per_minute > RETRACTIONS_PER_MINUTE
    return frequent, retracted, seconds, per_minute


def frequent_retractions(samples: list[Sample], settings: Settings) -> Advice | None:
    frequent, retracted, seconds, per_minute = _retractions(samples)
    if not frequent:
        return None
    events = sum(1 for a, b in zip(samples, samples[1:]) if b.retracted_total > a.retracted_total)
    return Advice("frequent_retractions", (
        f"decode out of memory happened {events} times ({retracted} requests retracted, "
        f"{per_minute:.1f} a minute) in the last {seconds:.1f} s, token usage up to "
        f"{max(s.token_usage for s in samples):.2f}: increase --schedule-conservativeness "
        f"(now {settings.schedule_conservativeness}) to a value like 1.3. Decode out of memory "
        f"happening occasionally but not frequently is okay."),
        {"retracted_reqs": retracted, "seconds": round(seconds, 2),
         "per_minute": round(per_minute, 1)})


def long_queue(samples: list[Sample], settings: Settings) -> Advice | None:
    busy = [s for s in samples if s.busy]
    high = QUEUE_HEALTHY[1]
    if len(busy) < MIN_SAMPLES or _share(busy, lambda s: s.queued > high) < FREQUENTLY:
        return None
    return Advice("long_queue", (
        f"#queue-req was above {high} in {_share(busy, lambda s: s.queued > high):.0%} of "
        f"{len(busy)} steps (up to {max(s.queued for s in busy)}): a healthy range for "
        f"#queue-req is {QUEUE_HEALTHY[0]} - {high}; a larger queue increases the scheduling "
        f"overhead on the server. Submit requests more slowly, or add replicas (--dp-size)."),
        {"steps": len(busy), "max_queue_reqs": max(s.queued for s in busy)})


def prefill_oom(samples: list[Sample], settings: Settings) -> Advice | None:
    if len(samples) < 2 or samples[-1].prefill_oom_total <= samples[0].prefill_oom_total:
        return None
    n = samples[-1].prefill_oom_total - samples[0].prefill_oom_total
    size = settings.chunked_prefill_size
    now = "disabled" if size == -1 else size
    return Advice("prefill_oom", (
        f"out of memory during prefill happened {n} time(s) (--chunked-prefill-size {now}): "
        f"try reducing --chunked-prefill-size to 4096 or 2048."),
        {"prefill_oom_errors": n, "chunked_prefill_size": size})


def small_decode_batch(samples: list[Sample], settings: Settings) -> Advice | None:
    decoding = [s for s in samples if s.running > 0]
    cap = settings.max_running_requests
    if len(decoding) < MIN_SAMPLES or cap < 8:  # "much smaller" needs room below the cap
        return None
    batch = _mean(s.running for s in decoding)
    if batch >= SMALL_BATCH * cap:
        return None
    full = _share(decoding, lambda s: s.token_usage >= GOOD_USAGE)
    if full >= FREQUENTLY:
        why = (f"the KV pool is full (token usage >= {GOOD_USAGE} in {full:.0%} of the steps): "
               f"increase --mem-fraction-static (or --max-total-tokens) for a larger KV pool")
    elif _share(decoding, lambda s: s.queued == 0) >= MOSTLY:
        why = (f"the pool has room (token usage {_mean(s.token_usage for s in decoding):.2f} on "
               f"average) and #queue-req is {_mean(s.queued for s in decoding):.1f} on average: "
               f"the client sends requests too slowly")
    else:  # requests wait while the pool has room: admission holds them (low_token_usage's
        return None  # advice, or retractions'), not the client
    return Advice("small_decode_batch", (
        f"the decode batch (#running-req {batch:.1f} on average over {len(decoding)} steps) is "
        f"much smaller than --max-running-requests {cap}: {why}."),
        {"steps": len(decoding), "mean_running_reqs": round(batch, 2),
         "max_running_requests": cap})


RULES = (queue_empty, low_token_usage, frequent_retractions, long_queue, prefill_oom,
         small_decode_batch)
SYMPTOMS = tuple(rule.__name__ for rule in RULES)


GOOD_AVAILABLE_GB = (5.0, 8.0)  # "5-8 GB" of GPU memory left after start: good


def memory_at_start(available_bytes: int, on_gpu: bool,
                    mem_fraction_static: float | None) -> Advice | None:
    """The guide's rule for --mem-fraction-static, on the GPU memory still available once the
    weights, the KV pool and the CUDA graphs are in place: 5-8 GB is good; less risks running
    out of memory while serving, more is memory the KV pool could have. (On a CPU the RAM left
    is the system's, not the engine's to fill: no advice.)"""
    if not on_gpu:
        return None
    gb = available_bytes / (1 << 30)
    low, high = GOOD_AVAILABLE_GB
    numbers = {"available_gb": round(gb, 2), "mem_fraction_static": mem_fraction_static}
    if gb < low:
        return Advice("memory_at_start", (
            f"{gb:.2f} GB of GPU memory is available after start (under {low:g} GB; "
            f"{low:g}-{high:g} GB is good): activations or a long prefill may run out of "
            f"memory. Decrease --mem-fraction-static (now {mem_fraction_static})."), numbers)
    if gb > high:
        return Advice("memory_at_start", (
            f"{gb:.2f} GB of GPU memory is available after start (over {high:g} GB; "
            f"{low:g}-{high:g} GB is good): the KV cache pool could hold more. Increase "
            f"--mem-fraction-static (now {mem_fraction_static})."), numbers)
    return None


def diagnose(samples: list[Sample], settings: Settings) -> list[Advice]:
    """Every symptom the samples show, in RULES order."""
    return [a for rule in RULES if (a := rule(samples, settings)) is not None]
