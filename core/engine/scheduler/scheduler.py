"""The scheduling loop: decodes first, then admit and chunk prompts, one forward per step."""

from __future__ import annotations

import time
from operator import attrgetter

from engine.forward_batch import ForwardBatch
from engine.sampling import Sampler, SamplingState
from engine.scheduler.adaptive import make_ratio
from engine.scheduler.admission import (PrefillBudget, StepPrefill, Verdict,
                                        prefix_in_flight, waits_for_leader)
from engine.scheduler.commit import Commit
from engine.scheduler.grammar import StepMasks, admissible, wait_for_compiles
from engine.scheduler.kv import DecodeSlots, KVManager
from engine.scheduler.prompt_logprobs import all_logits_needed, chunk_cap, record
from engine.scheduler.request import Req, Status
from engine.scheduler.retract import pick_victims
from engine.scheduler.step_batch import forward_batch, rows_to_sample, scored_done
from engine.stats import Counters, StatLogger, StepStats, is_out_of_memory

_FINISHED = attrgetter("finished")  # counted per step


class Scheduler(Commit):
    """The loop: each step retracts if decode is short of slots, grows the decodes, admits and
    chunks prompts (this file), runs one forward, samples, and takes the tokens in (``Commit``:
    scheduler/commit.py); the step's batch is scheduler/step_batch.py's."""

    def __init__(self, runner, kv: KVManager, policy, cache_aware: bool, sizing, config,
                 eos_ids, vocab_size: int, on_step=None):
        self.runner, self.kv, self.policy, self.cache_aware = runner, kv, policy, cache_aware
        self.sizing, self.config = sizing, config
        self.eos_ids = set(eos_ids)
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        self.sampling = SamplingState(vocab_size, self.eos_ids)  # kept across steps
        self.masks = StepMasks(vocab_size)  # structured outputs: the constrained rows' bitmask
        self.ratio = make_ratio(config.schedule_conservativeness)  # a number, or "auto"
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.counters = Counters()
        self.log = StatLogger(config.decode_log_interval)
        self.on_step = on_step
        self.extra_info: dict = {}  # observers' additions to /get_server_info
        self.step_no = 0
        self._step_started = 0.0  # perf_counter at the start of the step (StepStats.seconds)
        self._reported = 0  # counters.generation_tokens at the last report
        self.overlap = None  # an OverlapSchedule with --enable-overlap-schedule
        self.spec = None  # a SpecDecoder with --speculative-algorithm (engine/speculative)

    # -- queue -----------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, req: Req) -> None:
        if req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
            self.kv.forget(req)  # HiCache: a host load it was waiting for
        if req in self.running:
            self.running.remove(req)
            self.kv.release(req)
        self._finish(req, "abort")
        self.counters.aborted_reqs += 1

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_used_tokens(self) -> int:
        return self.kv.used_tokens

    def check_invariants(self) -> None:
        self.kv.check(self.running)

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one forward; returns the requests that got a token or finished this step."""
        self.step_no += 1
        self._step_started = time.perf_counter()
        if self.overlap is not None:  # --enable-overlap-schedule (scheduler/overlap.py)
            return self.overlap.step()
        return self.sync_step()

    def sync_step(self) -> list[Req]:
        """Plan, forward, sample and finish one batch, all before returning."""
        self.kv.poll()  # HiCache: copies that landed since the last step
        failed = self.finish_failed_grammars()
        # Req.prefilling, inline (every running request, every step)
        decodes = [r for r in self.running
                   if r.kv_len >= len(r.prompt_ids) + len(r.output_ids) - 1]
        retracted = self._make_room(decodes)
        if retracted:
            decodes = [r for r in decodes if r.status is Status.RUNNING]
        grown = self.kv.grow_decodes(decodes)
        prefill = self.admit_prompts(len(decodes))
        ran = bool(decodes or prefill.chunks)
        try:
            if self.spec is not None and decodes and not prefill.chunks:
                touched = self.spec.run(self, decodes, grown)  # drafts verified where they pay
            else:
                touched = self._run(decodes, prefill.chunks, grown) if ran else []
        except Exception as e:  # counted for observers (the advisor); the caller handles it
            self.counters.prefill_oom_errors += bool(prefill.chunks and is_out_of_memory(e))
            raise
        if not ran:  # only requests whose grammar compiles or KV loads: wait, don't spin
            wait_for_compiles(self.waiting)
            self.kv.idle()
        self.report(decodes, prefill, retracted, touched, ran)
        return failed + touched

    def report(self, decodes: list[Req], prefill: StepPrefill, retracted: int,
               touched: list[Req], ran: bool) -> None:
        """The step's stats: ratio decay, log lines, observers."""
        if decodes:
            self.ratio.step()
        mode = ("mixed" if prefill.chunks and decodes else
                "prefill" if prefill.chunks else "decode" if decodes else "idle")
        stats = StepStats(self.step_no, mode, len(self.running), len(self.waiting),
                          self.num_used_tokens, self.kv.pool.size, prefill.new_seqs,
                          prefill.tokens, prefill.cached,
                          generated_tokens=self._generated(),
                          retracted_reqs=retracted,
                          finished_reqs=sum(map(_FINISHED, touched)),
                          cuda_graph=ran and self.runner.last_cuda_graph, totals=self.counters,
                          max_running_requests=self.sizing.max_running_requests,
                          extra_info=self.extra_info,
                          spec=None if self.spec is None else self.spec.stats,
                          cache_tiers=self.kv.stats if self.config.enable_cache_report else None,
                          seconds=time.perf_counter() - self._step_started if ran else None)
        self.ratio.observe(stats)
        if prefill.chunks:
            self.log.prefill(stats)
        elif decodes:
            self.log.decode(stats)
        self.kv.stats.new_step()
        if self.on_step:
            self.on_step(stats)

    def _generated(self) -> int:
        """Tokens generated since the last report (a verify step gives a request several)."""
        total = self.counters.generation_tokens
        n, self._reported = total - self._reported, total
        return n

    def _make_room(self, decodes: list[Req]) -> int:
        """Free slots for this step's decodes, retracting requests when the pool is short."""
        need = self.kv.decode_slots_needed(decodes)
        if self.kv.ensure_free(need):
            return 0
        self.kv.drop_loads()  # HiCache: waiting requests' loads give their slots up first
        if self.kv.ensure_free(need):
            return 0
        victims = []
        for victim in pick_victims(self.running):
            if self.kv.ensure_free(need) or len(self.running) - len(victims) == 1:
                break
            if not victim.prefilling:
                need -= self.kv.decode_slots_needed([victim])
            self.kv.retract(victim)
            victim.status = Status.WAITING
            victim.num_retractions += 1
            if self.spec is not None:
                self.spec.retracted(victim.rid)
            victims.append(victim)
        self.running = [r for r in self.running if r.status is Status.RUNNING]
        self.waiting += victims
        assert self.kv.ensure_free(need), "a lone request does not fit the KV pool"
        old, new = self.ratio.after_retraction(self.running, victims)
        self.counters.retracted_reqs += len(victims)
        self.log.retraction([v.rid for v in victims], old, new)
        return len(victims)

    # -- admission -------------------------------------------------------------------------------
    def admit_prompts(self, num_decodes: int) -> StepPrefill:
        """This step's prompt chunks: a chunked prompt continues first, then waiting requests
        are tried in the policy's order until one says stop."""
        prefill = StepPrefill(PrefillBudget.for_step(self.sizing.chunked_prefill_size, num_decodes,
                                                     self.config.max_prefill_tokens, self.kv.page))
        if len(self.running) > num_decodes:  # a chunked prompt continues first
            for r in self.running:
                if r.prefilling:
                    n = prefill.budget.take(self._chunk_len(r, r.seq_len - r.kv_len, prefill))
                    if n and self.kv.grow(r, n):
                        prefill.add(r, n)
        # nothing can be admitted (every prompt brings at least one token): don't order the queue
        if (not self.waiting or len(self.running) >= self.sizing.max_running_requests
                or prefill.budget.take(1) == 0 or self.kv.pool.free_reqs == 0):
            return prefill
        # what the running requests hold back
        prefill.plan = self.ratio.plan(self.running, capacity=self.kv.pool.size)
        prefill.reserve = prefill.plan.held
        if self.kv.available() - prefill.reserve < 1 and (self.running or prefill.chunks):
            return prefill
        for r in self._queue_in_policy_order():
            if not self._try_admit(r, prefill).tries_next:
                break
        if prefill.new_seqs:
            self.waiting = [r for r in self.waiting if r.status is Status.WAITING]
        return prefill

    def _try_admit(self, r: Req, prefill: StepPrefill) -> Verdict:
        """SGLang's rule: admit ``r`` when the batch, the token budget, a request row and the KV
        room (free + evictable - reserved) allow its uncached prompt and its own reservation."""
        if len(self.running) >= self.sizing.max_running_requests:
            return Verdict.BATCH_FULL
        if waits_for_leader(r):
            return Verdict.WAITS
        prefix = self.kv.match(r)
        if prefix.wait:  # HiCache: its prefix is still being read or loaded (only it waits)
            return Verdict.WAITS
        cached = prefix.cached  # every tier's (HiCache loads the host/storage part back)
        if self.kv.cache is not None and prefix_in_flight(r, cached, prefill.chunks):
            return Verdict.WAITS  # that prefix is cached in a step or two: don't compute it twice
        extend = r.seq_len - cached
        n = prefill.budget.take(self._chunk_len(r, extend, prefill))
        if n == 0:
            return Verdict.NO_BUDGET
        reservation = prefill.plan.reservation(r, extend)
        room = self.kv.available(prefix.node) - prefill.reserve  # its prefix is no longer evictable
        # a lone request is always tried; one is not lone while another's host load holds
        # slots (each lone waiter starting its own load would lock the pool up between them)
        others_loading = any(rid != r.rid for rid in self.kv.loads)
        if extend + prefix.loading + reservation > room and (
                self.running or prefill.chunks or others_loading):
            return Verdict.NO_ROOM
        if prefix.loads is not None and prefix.loads.storage_len:  # HiCache: stored pages
            prefix = self.kv.stage_storage(r, prefix)  # into the host tier, then as host nodes
        if prefix.loads is not None and prefix.loads.host_len:  # HiCache: copied back beside
            # the running batch first; it waits for the copy (False: its slots can't be freed)
            if not self.kv.start_load(r, prefix):
                return Verdict.NO_ROOM
            if not self.kv.land_now(r):  # (a CPU lands it now: admitted in this step)
                return Verdict.WAITS
            prefix = self.kv.match(r)
        if not self.kv.admit(r, prefix, n):
            return Verdict.NO_ROOM  # no request row, or its slots could not be freed
        r.status = Status.RUNNING
        self.running.append(r)
        if r.num_retractions == 0:  # a retracted request was counted at its first admission
            r.cached_tokens = cached
            self.counters.prompt_tokens += len(r.prompt_ids)
            self.counters.cached_tokens += cached
        prefill.add_new(r, n, extend, cached, reservation)
        return Verdict.ADMITTED if n == extend else Verdict.CHUNKED

    @staticmethod
    def _chunk_len(r: Req, extend: int, prefill: StepPrefill) -> int:
        """The prompt tokens ``r`` asks to run this step: all ``extend``, or fewer when it
        scores its prompt (every position's logits are kept: prompt_logprobs.py caps them)."""
        cap = chunk_cap(r, prefill.tokens)
        if cap is None:
            return extend
        if cap < extend:  # a partial chunk ends on a page boundary
            cap -= cap % prefill.budget.page_size
        prefill.budget.chunk = min(prefill.budget.chunk, cap)  # the step holds no more
        return min(extend, cap)

    def _queue_in_policy_order(self) -> list[Req]:
        hints = {}  # a policy may ask twice: match once

        def prefix_len(r: Req) -> int:
            if r not in hints:
                hints[r] = self.kv.match(r).cached
            return hints[r]

        aware = self.cache_aware and self.kv.cache
        # a grammar that compiled after this step's start_matchers waits for the next step
        ready = [r for r in admissible(self.waiting)
                 if r.grammar is None or r.grammar.matcher is not None]
        return self.policy.order(ready, prefix_len if aware else (lambda r: 0))

    # -- forward, sample, finish -----------------------------------------------------------------
    def _run(self, decodes: list[Req], chunks: list[tuple[Req, int]],
             grown: DecodeSlots | None = None) -> list[Req]:
        """One forward over the decodes and the prompt chunks (in that order); samples a token
        for every request whose K/V then covers its whole sequence."""
        reqs = decodes + [r for r, _ in chunks] if chunks else decodes
        batch = self.forward_batch(decodes, chunks, None, grown)
        scoring = all_logits_needed(chunks)
        if scoring:  # the prompt logprobs asked for (echo): every position's logits
            logits = record(self.runner.forward(batch, return_all_logits=True), batch, reqs)
        else:
            logits = self.runner.forward(batch)
        if self.spec is not None and self.spec.wants_hidden:  # a drafter reading them (EAGLE)
            self.spec.forwarded(reqs, batch)
        self.kv.computed(decodes, chunks)
        if chunks:
            sample = rows_to_sample(reqs, len(decodes))
            scored = self.finish_scored(scored_done(reqs))
        else:  # a decode step: every row samples (a request that only scores never decodes)
            sample, scored = range(len(reqs)), []
        if not sample:
            return scored
        rows = reqs if len(sample) == len(reqs) else [reqs[i] for i in sample]
        out = self.sample(logits, sample, rows)
        tokens = out.next_token_ids.tolist()  # the step's one device sync
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        return scored + self.commit(rows, tokens, logprobs, out.top_logprobs)

    def forward_batch(self, decodes: list[Req], chunks: list[tuple[Req, int]],
                      decode_ids: list[list[int]] | None = None,
                      grown: DecodeSlots | None = None) -> ForwardBatch:
        """The step's batch (scheduler/step_batch.py) over this scheduler's request table."""
        return forward_batch(self.kv.pool.req_to_token, decodes, chunks, decode_ids, grown)

    def sample(self, logits, sample: list[int], rows: list[Req]):
        """Sample the logits rows ``sample`` (those of requests ``rows``)."""
        return self._sample(logits if len(sample) == logits.shape[0] else logits[sample], rows)

    def _sample(self, logits, rows: list[Req]):
        """Sample one token per request of ``rows`` (logits [len(rows), V]). The sampling
        inputs persist across steps (SamplingState: only rows that join are built) and take in
        the tokens sampled here, which ``commit`` appends to the same requests before any
        later sampling (the overlap worker samples only after the previous batch's commit)."""
        batch = self.sampling.batch(rows, logits.device)
        batch.allowed = self.masks.fill(rows)
        out = self.sampler(logits, batch, overwrite=True)
        self.sampling.advance(out.next_token_ids)
        return out
