"""A step's sampled tokens taken in: each appended to its request, the stop checks (EOS and stop
ids, stop strings, the length), the grammar advanced, and requests finished (their KV released,
counted). ``Commit`` is the Scheduler's half that does it (mixed into Scheduler, whose
``running``, ``counters``, ``kv``, ``ratio`` and ``eos_ids`` it uses); the overlap worker's
results come through the same ``commit``."""

from __future__ import annotations

import time

from engine.sampling import token_stop_reason
from engine.sampling.detokenizer import MAX_DIRTY
from engine.scheduler.grammar import advance, start_matchers
from engine.scheduler.request import Req, Status

QUEUED_PARTIALS = MAX_DIRTY - 1  # commit queues a partial character inline below check's flush


class Commit:
    def commit(self, rows: list[Req], tokens: list[int], logprobs, top_logprobs) -> list[Req]:
        """Append each row's sampled token; stop checks, grammar, finishing. Returns ``rows``.
        One pass with the per-step values hoisted; the stop checks inline (``_check_stop``
        says the same): most rows need no more than appending their token."""
        now = time.monotonic()
        finished = False
        eos = self.eos_ids
        ttft = self.counters.ttft
        check_stop = self._check_stop
        for j, r in enumerate(rows):
            token = tokens[j]
            out = r.output_ids
            out.append(token)  # Req.append_token
            if r.seen is not None:
                r.seen.add(token)
            p = r.params
            if logprobs is not None and p.logprobs:
                r.output_logprobs.append(logprobs[j])
                if top_logprobs is not None:
                    r.output_top_logprobs.append(top_logprobs[j])
            if r.first_token_time is None:
                r.first_token_time = now
                ttft.append(now - r.created)
            if r.grammar is not None:
                if self._advance_grammar(r, token):
                    finished = True
                    continue
                check_stop(r, token)
                finished = finished or r.status is Status.FINISHED
                continue
            # _check_stop, inline: an EOS / stop token id, then stop strings, then the length
            n = len(out)
            if n >= p.min_new_tokens and (
                    (token in eos and not p.ignore_eos) or token in p.stop_token_ids):
                self._release_finished(r, "stop", token)  # an EOS / stop id shows no text
                finished = True
            else:
                det = r.detokenizer
                if det is not None:  # stop strings: IncrementalDetokenizer.check
                    queued, codes = det.pending, det.codes
                    code = codes[token] if queued and token < len(codes) else -1
                    if code == 0:  # SAFE: all that check does here (most tokens)
                        queued.append(token)
                    elif code == 3 and len(queued) < QUEUED_PARTIALS:  # PARTIAL_FREE
                        queued.append(token)  # check's own path, short of its window
                        det.dirty = True
                    elif det.check(token):
                        self._release_finished(r, "stop", det.matched_stop)
                        finished = True
                        continue
                if n >= p.max_new_tokens:
                    self._release_finished(r, "length", None)
                    finished = True
        self.counters.generation_tokens += len(rows)
        if finished:
            self.running = [r for r in self.running if r.status is not Status.FINISHED]
        return rows

    def finish_scored(self, reqs: list[Req]) -> list[Req]:
        """Finish (reason "length") those of ``scored_done``'s requests still running once
        their batch ran; returns them."""
        done = [r for r in reqs if r.status is Status.RUNNING]
        for r in done:
            self._release_finished(r, "length", None)
        if done:
            self.running = [r for r in self.running if not r.finished]
        return done

    def finish_failed_grammars(self) -> list[Req]:
        """Start the matchers of the waiting requests whose grammar compiled; finish (reason
        "error") and return those whose grammar failed to compile."""
        failed = start_matchers(self.waiting)
        for r in failed:
            self.waiting.remove(r)
            self._finish(r, "error")
        return failed

    def fail_running(self, error: str) -> None:
        """Every running request fails (reason "error", ``Req.error`` = ``error``) and gives
        its KV back; the prefix cache is emptied. Waiting requests hold nothing: they stay."""
        for r in self.running:
            self.kv.retract(r)
            r.error = error
            self._finish(r, "error")
        self.running = []
        if self.kv.cache is not None:
            self.kv.cache.flush()

    def _check_stop(self, r: Req, token: int) -> None:
        """Finish ``r`` if its latest token ends it (the caller drops it from ``running``)."""
        reason = token_stop_reason(r.params, r.output_ids, self.eos_ids)
        if reason == "stop":
            return self._release_finished(r, "stop", token)  # an EOS / stop id shows no text
        if r.detokenizer is not None and r.detokenizer.check(token):
            return self._release_finished(r, "stop", r.detokenizer.matched_stop)
        if reason == "length":
            self._release_finished(r, "length", None)

    def _advance_grammar(self, r: Req, token: int) -> bool:
        """Advance ``r``'s matcher; True when that finished ``r``: "stop" when the grammar is
        complete (before max_tokens), "error" when the backend rejected the token."""
        verdict = advance(r, token)
        if verdict is None:
            return False
        if verdict == "stop" and token_stop_reason(r.params, r.output_ids, self.eos_ids) != "stop":
            if r.detokenizer is not None:
                r.detokenizer.add([token])
            token = None  # the grammar ended on a token with text, not on an EOS / stop id
        self._release_finished(r, verdict, token if verdict == "stop" else None)
        return True

    def _release_finished(self, r: Req, reason: str, matched) -> None:
        self.kv.release(r)
        r.matched_stop = matched
        self._finish(r, reason)

    def _finish(self, r: Req, reason: str) -> None:
        r.status, r.finish_reason = Status.FINISHED, reason
        r.finished_time = time.monotonic()
        self.ratio.finished(r)
        if self.spec is not None:
            self.spec.finished(r.rid)
        self.counters.finished_reqs += 1
        self.counters.e2e.append(r.finished_time - r.created)
