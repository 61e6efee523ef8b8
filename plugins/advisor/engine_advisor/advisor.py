"""One Advisor per engine: a window of recent steps, judged by engine.advice's rules."""

from __future__ import annotations

import collections
import logging
import time
from collections import deque

from engine.advice import Sample, Settings, diagnose, memory_at_start

logger = logging.getLogger("engine.advisor")
WINDOW = 64  # steps judged together
EVALUATE_EVERY = 8  # steps between two judgements (cumulative counts that moved: at once)
MAX_ENGINES = 64  # advisors kept (tests build many engines in one process)


class Advisor:
    """Keeps the last WINDOW steps of one engine; logs each symptom's advice once and lists it
    in ``info["advice"]`` (the engine's published extra info: /get_server_info's "advice")."""

    def __init__(self, settings: Settings, info: dict, totals=None, clock=time.monotonic):
        self.settings, self.info, self.clock = settings, info, clock
        self.samples: deque[Sample] = deque(maxlen=WINDOW)
        # where the cumulative counts start: 0 for a new engine, else what it counted already
        self.samples.append(Sample(clock(), 0, 0, 0.0, getattr(totals, "retracted_reqs", 0),
                                   getattr(totals, "prefill_oom_errors", 0)))
        self.given: set[str] = set()
        self.steps = 0
        info.setdefault("advice", [])

    def observe(self, stats) -> None:
        if stats.forward_mode == "idle":
            return
        totals = stats.totals
        last = self.samples[-1]
        sample = Sample(self.clock(), stats.num_running_reqs, stats.num_queue_reqs,
                        stats.token_usage, totals.retracted_reqs, totals.prefill_oom_errors)
        self.samples.append(sample)
        self.steps += 1
        moved = (sample.prefill_oom_total != last.prefill_oom_total
                 or sample.retracted_total != last.retracted_total)
        if moved or self.steps % EVALUATE_EVERY == 0:
            self.judge(stats.step)

    def judge(self, step: int) -> None:
        for advice in diagnose(list(self.samples), self.settings):
            if advice.symptom in self.given:
                continue
            self.given.add(advice.symptom)
            logger.warning(f"advisor: {advice.message}")
            self.info["advice"].append({**advice.as_dict(), "step": step})


_advisors: collections.OrderedDict[int, tuple[dict, Advisor]] = collections.OrderedDict()


def _keep(info: dict, advisor: Advisor) -> Advisor:
    _advisors[id(info)] = (info, advisor)  # holding ``info`` keeps its id from being reused
    while len(_advisors) > MAX_ENGINES:
        _advisors.popitem(last=False)
    return advisor


def start(engine) -> None:
    sizing, config = engine.sizing, engine.config
    settings = Settings(sizing.max_running_requests, sizing.chunked_prefill_size,
                        config.schedule_conservativeness)
    info = engine.scheduler.extra_info
    _keep(info, Advisor(settings, info))
    available = getattr(engine, "available_memory", None)  # an engine older than this: none
    advice = None if available is None else memory_at_start(
        available, engine.device.is_cuda, sizing.mem_fraction_static)
    if advice is not None:
        logger.warning(f"advisor: {advice.message}")
        info["advice"].append({**advice.as_dict(), "step": 0})


def observe(stats) -> None:
    info = stats.extra_info
    if info is None:
        return
    entry = _advisors.get(id(info))
    # an engine started before this plugin was registered: what its steps say is enough
    advisor = entry[1] if entry else _keep(info, Advisor(Settings(stats.max_running_requests),
                                                         info, stats.totals))
    advisor.observe(stats)
