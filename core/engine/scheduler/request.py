"""A request as the scheduler tracks it."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

_arrivals = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True, weakref_slot=True)
class Req:
    rid: str
    prompt_ids: list[int]
    params: Any  # SamplingParams
    arrival: int = field(default_factory=lambda: next(_arrivals))
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    matched_stop: Any = None  # the eos / stop token id or stop string that ended it
    group_leader: "Req | None" = None  # for n > 1: wait until the leader's prompt is cached
    detokenizer: Any = None  # set by whoever needs text while running (stop strings, streams)
    seen: Any = None  # optional SeenTokens that append_token counts into (the scheduler's
    # sampling keeps its own penalty state: engine.sampling.SamplingState)
    grammar: Any = None  # engine.grammar.RequestGrammar of a constrained request (own matcher)
    error: str | None = None  # why it finished with reason "error"
    # KV state: written only by engine.scheduler.kv.KVManager (read by anyone)
    row: int | None = None  # row in kv_pool.req_to_token
    kv_len: int = 0  # tokens of seq whose K/V is in the pool
    alloc_len: int = 0  # tokens of seq with slots allocated (>= kv_len)
    cached_len: int = 0  # leading tokens whose slots the radix cache owns
    last_node: Any = None  # radix node locked for the cached prefix
    cached_tokens: int = 0  # prompt tokens served from the cache at (first) admission
    num_retractions: int = 0
    # per-token extras
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # the prompt's own logprobs (echo + logprobs): how many top entries per position (None:
    # not asked); input_logprobs[i] is log p(prompt[i] | prompt[:i]) (None for i = 0), filled
    # as its prompt chunks run (scheduler/prompt_logprobs.py)
    prompt_logprobs: int | None = None
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    # timing
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finished_time: float | None = None

    def append_token(self, token: int) -> None:
        self.output_ids.append(token)
        if self.seen is not None:
            self.seen.add(token)

    @property
    def seq(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """seq[start:end] without building seq (decode asks for the last token every step)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p: end - p]
        return (self.prompt_ids + self.output_ids)[start:end] if end > p else self.prompt_ids[start:end]

    @property
    def remaining_new_tokens(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        """True until every token but the last has K/V (after that it decodes)."""
        return self.kv_len < self.seq_len - 1

    @property
    def scores_prompt(self) -> bool:
        """True while the logprobs of its prompt are asked for and not all computed yet: its
        prompt then runs from the first token (no cached prefix) in chunks that return the
        logits of every position."""
        return self.prompt_logprobs is not None and len(self.input_logprobs) < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
