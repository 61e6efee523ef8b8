"""The overlap scheduler (--enable-overlap-schedule, SGLang's): a model-worker thread runs batch
N's forward while the scheduler thread prepares batch N+1 (admission, KV growth, batch
tensors); the scheduler waits only for batch N's sampled tokens.

Outputs are those of the synchronous scheduler, because:
- a decode row whose token is still being sampled in the previous batch carries a placeholder
  that the worker fills in from that batch's tokens before the forward;
- the worker samples a batch only after the scheduler has processed the previous one (tokens
  appended, stop checks, grammar advanced), so grammar masks see exactly what they would see
  synchronously, and the scheduler's SamplingState (penalty counts, seed positions: it takes
  in each batch's sampled tokens, which the commit then appends) is used by one thread at a
  time, batch after batch in order (the worker; after a drain, the synchronous step's
  thread); rows of requests that finished (or were aborted) meanwhile are computed and
  discarded, never sampled (the state drops them);
- a request in flight is never retracted: when the pool is short for the decodes, the
  in-flight batch is drained and a synchronous step runs (it retracts as usual).
A request whose pending token is its last (max_new_tokens) gets no extra row.

On a GPU the worker launches ahead: having queued batch N's sampling it takes batch N+1 (the
scheduler submits it before collecting N) and queues its forward, the placeholders filled from
N's tokens on the device, before it reads N's tokens back, so the GPU runs N+1 right after N
instead of idling while the host reads, commits and launches (SGLang's overlap does the same
with its future token ids). N+1 is still sampled only after N is committed.
``ENGINE_OVERLAP_LAUNCH_AHEAD=1`` forces it on a CPU (the tests: same outputs), ``=0`` off.

With HiCache (engine/hicache/tree.py) a prefix is inserted into the radix tree when its batch
is submitted, before the worker writes its K/V: the tree numbers the batches
(``batch_submitted``), copies a node to the host tier only once the scheduler has seen its
batch done (``written_up_to``), and, where it needs slots at once (a device eviction, a load
back into freed slots), waits for the batch in flight through ``fence``.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from engine.forward_batch import ForwardBatch
from engine.host import long_tensor
from engine.scheduler.admission import StepPrefill
from engine.scheduler.grammar import wait_for_compiles
from engine.scheduler.prompt_logprobs import all_logits_needed, record
from engine.scheduler.request import Req, Status
from engine.scheduler.step_batch import rows_to_sample, scored_done
from engine.stats import is_out_of_memory


@dataclass(eq=False)
class Job:
    """One submitted batch: the scheduler fills the first fields, the worker the rest."""

    reqs: list[Req]
    batch: ForwardBatch
    sample: list[int]  # indices in reqs of the rows to sample (if still running by then)
    placeholders: list[tuple[int, Req]]  # (index in input_ids, request whose token goes there)
    prev: "Job | None"
    chunks: bool  # the batch holds prompt chunks (for the prefill OOM counter)
    all_logits: bool = False  # a prompt chunk's logprobs are asked for (prompt_logprobs.py)
    scored: list[Req] = field(default_factory=list)  # requests only scoring, done with it
    done: threading.Event = field(default_factory=threading.Event)  # worker: sampled
    processed: threading.Event = field(default_factory=threading.Event)  # scheduler: committed
    rows: list[Req] = field(default_factory=list)  # the rows sampled
    position: dict = field(default_factory=dict)  # request -> index in rows
    next_ids: torch.Tensor | None = None  # the sampled tokens (device)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list | None = None
    error: BaseException | None = None
    ready: "torch.cuda.Event | None" = None  # on a GPU: the batch's inputs are on the device
    seq: int = 0  # HiCache: the batch's number in the tree (its K/V written when it is done)
    launched: bool = False  # the worker ran (on a GPU: queued) its forward
    logits: "torch.Tensor | None" = None  # the forward's, until sampled
    out: object = None  # the sampler's output, until read back

    @property
    def sampled(self) -> set[Req]:
        return {self.reqs[i] for i in self.sample}


LAUNCH_AHEAD_ENV = "ENGINE_OVERLAP_LAUNCH_AHEAD"  # 1 / 0: force it on or off (default: a GPU)
LAUNCH_AHEAD_POLL_S = 20e-6
LAUNCH_AHEAD_CPU_WAIT_S = 0.05  # forced on a CPU, where no event says the tokens are ready


def launch_ahead_default(device: torch.device) -> bool:
    """Launching the next forward before reading back this batch's tokens pays where the
    forward is queued (a GPU); on a CPU it would run the whole next forward first."""
    forced = os.environ.get(LAUNCH_AHEAD_ENV)
    if forced is not None:
        return forced == "1"
    return device.type == "cuda"


class OverlapSchedule:
    """The overlapped step of one Scheduler, and its model-worker thread."""

    def __init__(self, scheduler):
        self.s = scheduler
        self.inflight: Job | None = None  # submitted, results not processed yet
        self._jobs: queue.Queue = queue.Queue()
        # on a GPU the worker runs on a stream of its own, so the scheduler's copies of the next
        # batch's inputs (pinned, non-blocking) do not queue behind the forward in flight; it
        # waits for each batch's inputs through an event recorded after they were issued
        device = scheduler.kv.pool.req_to_token.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.launch_ahead = launch_ahead_default(device)
        self.launched_ahead = 0  # batches whose forward went ahead of the previous read-back
        cache = scheduler.kv.cache
        self.tree = cache if hasattr(cache, "batch_submitted") else None  # HiCache
        if self.tree is not None:
            self.tree.fence = self._fence
        self._thread = threading.Thread(target=self._work, name="overlap-worker", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Drain and stop the worker thread (the engine cannot step afterwards)."""
        if self._thread.is_alive():
            self._settle()
            self._jobs.put(None)
            self._thread.join()

    # -- the scheduler thread --------------------------------------------------------------------
    def step(self) -> list[Req]:
        s, prev = self.s, self.inflight
        s.kv.poll()  # HiCache: copies that landed since the last step
        pending = prev.sampled if prev is not None else set()
        # (a request only scoring its prompt whose prompt ran in flight has nothing to decode)
        decodes = [r for r in s.running if not r.prefilling
                   and not (r in pending and r.remaining_new_tokens <= 1)
                   and (r in pending or r.kv_len < r.seq_len)]
        if not s.kv.ensure_free(s.kv.decode_slots_needed(decodes)):
            # retract only with nothing in flight: drain it, then a synchronous step
            return self.drain() + s.sync_step()
        failed = s.finish_failed_grammars()
        s.kv.grow_decodes(decodes)
        prefill = s.admit_prompts(len(decodes))
        job = self._submit(decodes, prefill, pending) if decodes or prefill.chunks else None
        self.inflight = job
        try:
            touched = self._collect(prev) if prev is not None else []
        except Exception as e:
            s.counters.prefill_oom_errors += bool(prev.chunks and is_out_of_memory(e))
            self._fail(e)
            raise
        if job is None and prev is None:  # only compiling grammars or copies: wait, don't spin
            wait_for_compiles(s.waiting)
            s.kv.idle()
        s.report(decodes, prefill, 0, touched, job is not None)
        return failed + touched

    def drain(self) -> list[Req]:
        """Process the in-flight batch's results now; returns the requests they touched."""
        prev, self.inflight = self.inflight, None
        if prev is None:
            return []
        try:
            return self._collect(prev)
        except Exception as e:
            self._fail(e)
            raise

    def _submit(self, decodes: list[Req], prefill: StepPrefill, pending: set[Req]) -> Job:
        s = self.s
        ids, placeholders = [], []
        for i, r in enumerate(decodes):
            if r in pending:  # its token is being sampled: the worker fills it in
                placeholders.append((i, r))
                ids.append([0])
            else:
                ids.append(r.tokens(r.kv_len, r.kv_len + 1))
        batch = s.forward_batch(decodes, prefill.chunks, ids)
        all_logits = all_logits_needed(prefill.chunks)
        seq = self.tree.batch_submitted() if self.tree is not None else 0
        s.kv.computed(decodes, prefill.chunks)  # the forward will have written them
        reqs = decodes + [r for r, _ in prefill.chunks]
        job = Job(reqs, batch, rows_to_sample(reqs, len(decodes)), placeholders, self.inflight,
                  bool(prefill.chunks), all_logits, scored_done(reqs), seq=seq)
        if self.stream is not None:
            job.ready = torch.cuda.Event()
            job.ready.record()  # on this thread's stream, after the inputs' copies
        self._jobs.put(job)
        return job

    def _collect(self, job: Job) -> list[Req]:
        """Wait for ``job``'s tokens (the step's only wait) and commit those of the requests
        still running (one aborted meanwhile drops its token)."""
        job.done.wait()
        if self.tree is not None:  # its K/V are written: the backups waiting for them go
            self.tree.written_up_to(job.seq)
        try:
            if job.error is not None:
                raise job.error
            scored = self.s.finish_scored(job.scored)  # only scored their prompt: done
            keep = [j for j, r in enumerate(job.rows) if r.status is Status.RUNNING]
            if not keep:
                return scored

            def pick(xs):
                return xs if xs is None or len(keep) == len(job.rows) else [xs[j] for j in keep]

            return scored + self.s.commit(pick(job.rows), pick(job.tokens), pick(job.logprobs),
                                          pick(job.top_logprobs))
        finally:
            job.processed.set()

    def _fail(self, e: Exception) -> None:
        """A batch failed: the batches after it were built on its results (K/V counted as
        written, prompt pages cached), so every running request fails (reason "error") and
        the prefix cache is emptied; waiting requests hold nothing and stay queued."""
        self._settle()
        self.s.fail_running(f"the model forward failed: {type(e).__name__}: {e}")

    def _fence(self) -> int:
        """HiCache: wait for the batch in flight (its forward); the number of the last batch
        whose K/V are written."""
        job = self.inflight
        if job is None:
            return self.tree.submitted
        job.done.wait()
        return job.seq

    def _settle(self) -> None:
        """After a failure (or to stop): let the submitted batch finish and drop it."""
        job, self.inflight = self.inflight, None
        if job is not None:
            job.processed.set()  # nobody will commit it
            job.done.wait()

    # -- the worker thread -----------------------------------------------------------------------
    def _work(self) -> None:
        job = self._jobs.get()
        while job is not None:
            nxt = None
            try:
                with self._on_stream():
                    if job.error is None:  # (a launch ahead may have failed it already)
                        if not job.launched:
                            self._launch(job)
                        self._sample(job)
                        if self.launch_ahead:
                            nxt = self._next_job(job)
                        self._finish(job)
            except BaseException as e:  # handed to the scheduler thread, which raises it
                job.error = e
            finally:
                job.prev = None  # done with it (and no chain of every batch ever run)
                job.done.set()
            if nxt is self._STOP:
                return
            job = nxt if nxt is not None else self._jobs.get()

    _STOP = object()

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def _next_job(self, job: Job):
        """Launch ahead (a GPU): the next batch's forward queued behind ``job``'s sampling
        before ``job``'s tokens are read back, so the GPU never waits for the host between
        them (the scheduler submits the next batch before it collects this one). Waits for it
        until ``job``'s tokens are ready; returns it launched (its error kept in it), None
        when none came in time, or _STOP."""
        if job.next_ids is None:
            return None
        sampled = torch.cuda.Event() if self.stream is not None else None
        if sampled is not None:
            sampled.record(self.stream)
        deadline = time.monotonic() + LAUNCH_AHEAD_CPU_WAIT_S  # (forced on a CPU: the tests)
        while True:
            try:
                nxt = self._jobs.get_nowait()
                break
            except queue.Empty:
                if sampled.query() if sampled is not None else time.monotonic() > deadline:
                    return None
                time.sleep(LAUNCH_AHEAD_POLL_S)
        if nxt is None:
            return self._STOP
        self.launched_ahead += 1
        try:
            self._launch(nxt)
        except BaseException as e:  # that batch's own failure, raised at its collection
            nxt.error = e
        return nxt

    def _launch(self, job: Job) -> None:
        """The batch's forward: the placeholders filled in from the previous batch's tokens
        (on the device), then the model (queued on a GPU)."""
        job.launched = True
        prev = job.prev
        if prev is not None and prev.error is not None:
            raise RuntimeError(f"the previous batch failed: {prev.error}")
        if self.stream is not None:
            self.stream.wait_event(job.ready)
        if job.placeholders:
            dst, src = [], []
            for i, r in job.placeholders:
                j = prev.position.get(r)
                if j is not None:  # else not sampled (finished or aborted): a discarded row
                    dst.append(i)
                    src.append(j)
            if dst:
                ids = job.batch.input_ids
                ids[long_tensor(dst, ids.device)] = prev.next_ids[
                    long_tensor(src, prev.next_ids.device)].to(ids.device, ids.dtype)
        if job.all_logits:  # the prompt logprobs asked for (echo): every position's logits
            job.logits = record(self.s.runner.forward(job.batch, return_all_logits=True),
                                job.batch, job.reqs)
        else:
            job.logits = self.s.runner.forward(job.batch)

    def _sample(self, job: Job) -> None:
        """Once the previous batch's tokens are appended and its finished known: the rows of
        the requests still running sampled (queued on a GPU: ``next_ids`` on the device)."""
        prev = job.prev
        if prev is not None:
            prev.processed.wait()
        logits, job.logits = job.logits, None
        sample = [i for i in job.sample if job.reqs[i].status is Status.RUNNING]
        if not sample:
            return
        rows = [job.reqs[i] for i in sample]
        out = self.s.sample(logits, sample, rows)
        job.out = out
        job.next_ids = out.next_token_ids
        job.position = {r: k for k, r in enumerate(rows)}
        job.rows = rows

    @staticmethod
    def _finish(job: Job) -> None:
        """The sampled tokens read back (the worker's device sync)."""
        out, job.out = job.out, None
        if out is None:
            return
        job.tokens = out.next_token_ids.tolist()
        job.logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        job.top_logprobs = out.top_logprobs

