"""The scheduling loop: decodes first, then admit and chunk prompts, one forward per step."""

from __future__ import annotations

import time

from engine.forward_batch import ForwardBatch
from engine.sampling import Sampler, SamplingBatch, token_stop_reason
from engine.sampling.penalties import SeenTokens
from engine.scheduler.admission import NewTokenRatio, PrefillBudget, reserved_tokens
from engine.scheduler.kv import KVManager
from engine.scheduler.request import Req, Status
from engine.scheduler.retract import pick_victims
from engine.stats import Counters, StatLogger, StepStats

# a waiting prompt sharing this many uncached tokens with one being prefilled waits for it
IN_BATCH_PREFIX = 32


class Scheduler:
    def __init__(self, runner, kv: KVManager, policy, cache_aware: bool, sizing, config,
                 eos_ids, vocab_size: int, on_step=None):
        self.runner, self.kv, self.policy, self.cache_aware = runner, kv, policy, cache_aware
        self.sizing, self.config = sizing, config
        self.eos_ids = set(eos_ids)
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        self.ratio = NewTokenRatio(config.schedule_conservativeness)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.counters = Counters()
        self.log = StatLogger(config.decode_log_interval)
        self.on_step = on_step
        self.step_no = 0

    # -- queue -----------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, req: Req) -> None:
        if req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
            self.kv.release(req, keep_in_cache=self.kv.cache is not None)
        self._finish(req, "abort")
        self.counters.aborted_reqs += 1

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_used_tokens(self) -> int:
        return self.kv.pool.size - self.kv.pool.free_slots - self.kv.evictable

    def check_invariants(self) -> None:
        """free + held by running requests + held by the cache = total; rows likewise."""
        pool, cache = self.kv.pool, self.kv.cache
        owned = sum(self.kv.owned_slots(r) for r in self.running)
        cached = cache.total_size if cache else 0
        assert pool.free_slots + owned + cached == pool.size, (pool.free_slots, owned, cached)
        assert pool.free_reqs + len(self.running) == pool.max_reqs
        if cache:
            cache.check_integrity()

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one forward; returns the requests that got a token or finished this step."""
        self.step_no += 1
        decodes = [r for r in self.running if not r.prefilling]
        retracted = self._make_room(decodes)
        if retracted:
            decodes = [r for r in decodes if r.status is Status.RUNNING]
        self.kv.grow_decodes(decodes)
        prefill, new_seqs, cached = self._admit(len(decodes))
        entries = [(r, 1, False) for r in decodes] + [(r, n, True) for r, n in prefill]
        stats = StepStats(self.step_no, "idle", len(self.running), len(self.waiting), 0,
                          self.kv.pool.size, new_seqs, sum(n for _, n in prefill), cached,
                          retracted_reqs=retracted, totals=self.counters)
        touched = self._run(entries) if entries else []
        stats.cuda_graph = bool(entries) and self.runner.last_cuda_graph
        if decodes:
            self.ratio.step()
        stats.forward_mode = ("mixed" if prefill and decodes else
                              "prefill" if prefill else "decode" if decodes else "idle")
        stats.generated_tokens = sum(1 for r in touched if r.output_ids)
        stats.finished_reqs = sum(1 for r in touched if r.finished)
        stats.num_running_reqs, stats.num_queue_reqs = len(self.running), len(self.waiting)
        stats.num_used_tokens = self.num_used_tokens
        if prefill:
            self.log.prefill(stats)
        elif decodes:
            self.log.decode(stats)
        if self.on_step:
            self.on_step(stats)
        return touched

    def _make_room(self, decodes: list[Req]) -> int:
        """Free slots for this step's decodes, retracting requests when the pool is short."""
        need = self.kv.decode_slots_needed(decodes)
        if self.kv.ensure_free(need):
            return 0
        victims = []
        for victim in pick_victims(self.running):
            if self.kv.ensure_free(need) or len(self.running) - len(victims) == 1:
                break
            if not victim.prefilling:
                need -= self.kv.slots_needed(victim, 1)
            self.kv.release(victim, keep_in_cache=False)
            victim.status = Status.WAITING
            victim.num_retractions += 1
            victims.append(victim)
        self.running = [r for r in self.running if r.status is Status.RUNNING]
        self.waiting += victims
        assert self.kv.ensure_free(need), "a lone request does not fit the KV pool"
        old, new = self.ratio.after_retraction(self.running)
        self.counters.retracted_reqs += len(victims)
        self.log.retraction(len(victims), old, new)
        return len(victims)

    def _admit(self, num_decodes: int):
        cps = self.sizing.chunked_prefill_size
        budget = PrefillBudget(float("inf") if cps == -1 else max(cps - num_decodes, 0),
                               self.config.max_prefill_tokens, self.kv.page)
        entries, new_seqs, cached = [], 0, 0
        if len(self.running) > num_decodes:  # a chunked prompt continues first
            for r in self.running:
                if r.prefilling:
                    n = budget.take(r.seq_len - r.kv_len)
                    if n and self.kv.grow(r, n):
                        budget.spend(n)
                        entries.append((r, n))
        # nothing can be admitted (every prompt brings at least one token): don't order the queue
        if (not self.waiting or len(self.running) >= self.sizing.max_running_requests
                or budget.take(1) == 0 or self.kv.pool.free_reqs == 0):
            return entries, new_seqs, cached
        ratio = self.ratio.value
        reserve = sum(reserved_tokens(r, ratio) + (r.seq_len - r.kv_len - 1)
                      for r in self.running)
        if self.kv.pool.free_slots + self.kv.evictable - reserve < 1 and (self.running or entries):
            return entries, new_seqs, cached
        hints = {}

        def prefix_len(r: Req) -> int:
            if r not in hints:
                hints[r] = len(self.kv.match(r)[0])
            return hints[r]

        ordered = self.policy.order(list(self.waiting),
                                    prefix_len if self.cache_aware and self.kv.cache else
                                    (lambda r: 0))
        for r in ordered:
            if len(self.running) >= self.sizing.max_running_requests:
                break
            leader = r.group_leader
            if leader is not None and not leader.finished and (
                    leader.status is not Status.RUNNING or leader.prefilling):
                continue  # n > 1: share the leader's prompt KV once it is cached
            slots, node = self.kv.match(r)
            if self._prefix_in_flight(r, len(slots), entries):
                continue  # it will find that prefix cached in a step or two: don't compute it twice
            extend = r.seq_len - len(slots)
            n = budget.take(extend)
            if n == 0:
                break
            if node is not None:
                self.kv.cache.inc_lock(node)  # what it matched is no longer evictable
            avail = self.kv.pool.free_slots + self.kv.evictable - reserve
            if node is not None:
                self.kv.cache.dec_lock(node)
            cost = extend + reserved_tokens(r, ratio)
            if cost > avail and (self.running or entries):
                break
            if not self.kv.attach(r, slots, node):
                break
            if not self.kv.grow(r, n):
                self.kv.release(r, keep_in_cache=False)
                break
            r.status = Status.RUNNING
            self.running.append(r)
            if r.num_retractions == 0:
                r.cached_tokens = len(slots)
                self.counters.prompt_tokens += len(r.prompt_ids)
                self.counters.cached_tokens += len(slots)
            reserve += reserved_tokens(r, ratio) + (extend - n)
            budget.spend(n)
            entries.append((r, n))
            new_seqs += 1
            cached += len(slots)
            if n < extend:
                break  # one chunked prompt at a time
        if new_seqs:
            self.waiting = [r for r in self.waiting if r.status is Status.WAITING]
        return entries, new_seqs, cached

    def _prefix_in_flight(self, r: Req, matched: int, entries) -> bool:
        """Does a prompt being prefilled right now share ``IN_BATCH_PREFIX`` more tokens with
        ``r`` than the cache does? (SGLang's in-batch prefix check.)"""
        if self.kv.cache is None or r.seq_len - 1 - matched < IN_BATCH_PREFIX:
            return False
        head = r.tokens(matched, matched + IN_BATCH_PREFIX)
        return any(f.prefilling and f.tokens(matched, matched + IN_BATCH_PREFIX) == head
                   for f, _ in entries)

    # -- forward, sample, finish -----------------------------------------------------------------
    def _run(self, entries: list[tuple[Req, int, bool]]) -> list[Req]:
        table = self.kv.pool.req_to_token
        batch = ForwardBatch.build([r.tokens(r.kv_len, r.kv_len + n) for r, n, _ in entries],
                                   [r.kv_len for r, _, _ in entries],
                                   [r.row for r, _, _ in entries], None, table,
                                   device=table.device)
        logits = self.runner.forward(batch)
        sample = []
        for i, (r, n, is_prefill) in enumerate(entries):
            r.kv_len += n
            if is_prefill:
                self.kv.cache_prefix(r)  # share the prompt with requests admitted later
            if r.kv_len == r.seq_len:
                sample.append(i)
        if not sample:
            return []
        rows = [entries[i][0] for i in sample]
        out = self._sample(logits if len(sample) == len(entries) else logits[sample], rows)
        tokens = out.next_token_ids.tolist()  # the step's one device sync
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        now = time.monotonic()
        finished = False
        for j, r in enumerate(rows):
            token = tokens[j]
            r.append_token(token)
            if logprobs is not None and r.params.logprobs:
                r.output_logprobs.append(logprobs[j])
                if out.top_logprobs is not None:
                    r.output_top_logprobs.append(out.top_logprobs[j])
            if r.first_token_time is None:
                r.first_token_time = now
                self.counters.ttft.append(now - r.created)
            self._check_stop(r, token)
            finished = finished or r.finished
        self.counters.generation_tokens += len(rows)
        if finished:
            self.running = [r for r in self.running if not r.finished]
        return rows

    def _sample(self, logits, rows: list[Req]):
        for r in rows:
            if r.seen is None and r.params.uses_penalties:
                r.seen = SeenTokens(self.vocab_size, r.prompt_ids, r.output_ids)
        batch = SamplingBatch.build([r.params for r in rows], [r.prompt_ids for r in rows],
                                    [r.output_ids for r in rows], [r.generator for r in rows],
                                    self.eos_ids, self.vocab_size, device=logits.device,
                                    seen=[r.seen for r in rows])
        return self.sampler(logits, batch, overwrite=True)

    def _check_stop(self, r: Req, token: int) -> None:
        """Finish ``r`` if its latest token ends it (the caller drops it from ``running``)."""
        reason = token_stop_reason(r.params, r.output_ids, self.eos_ids)
        if reason == "stop":
            return self._release_finished(r, "stop", token)  # an EOS / stop id shows no text
        if r.detokenizer is not None:
            r.detokenizer.add([token])
            if r.detokenizer.stopped:
                return self._release_finished(r, "stop", r.detokenizer.matched_stop)
        if reason == "length":
            self._release_finished(r, "length", None)

    def _release_finished(self, r: Req, reason: str, matched) -> None:
        self.kv.release(r, keep_in_cache=self.kv.cache is not None)
        r.matched_stop = matched
        self._finish(r, reason)

    def _finish(self, r: Req, reason: str) -> None:
        r.status, r.finish_reason = Status.FINISHED, reason
        r.finished_time = time.monotonic()
        self.counters.finished_reqs += 1
        self.counters.e2e.append(r.finished_time - r.created)
