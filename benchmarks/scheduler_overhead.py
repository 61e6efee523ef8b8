"""Scheduler overhead: the step time spent outside the model forward, at 256/64/16 running requests.

Per decode step it times the whole ``Engine.step``, the ``runner.forward`` inside it and the
sampler inside it (both wrapped with a timer); the scheduler's overhead is the step minus the
forward (sampling included: it runs on the same cores between two forwards). 256 requests are
prefilled once per mode and decode with EOS ignored; after the 256-request measurement all but 64
are aborted, then all but 16, so every measurement is a full batch of pure decode steps.
Modes: greedy, greedy with repetition, frequency and presence penalties, ``stream``: greedy
requests that stream, as the server's (each registered with an EngineRuntime, whose
``_publish`` hands every step's new tokens to the detokenizer thread), and ``stream+stop``: the
same with two stop strings that never match (so every token is checked on the engine thread:
only a token that might end one of them is decoded there, IncrementalDetokenizer.check).
For the streaming modes the engine thread's time per step is the step minus the forward plus
the publish (``engine ms``); the detokenizer thread's own time (``detok ms``, on another thread,
not the engine's: the text, and the stop strings applied to it) is shown too; the stop-string
checks cost the difference between the two modes.

Then (``--long-chars``, default 100000) one streamed output of that many characters: the
engine thread's cost per token (stop-string check and publish) and the detokenizer thread's
(the text deltas of a stream with those stop strings and one without), over the first and the
last 1000 tokens; and the same for the way streams were made before (the whole text re-joined
each step, to slice the delta off it).

    python benchmarks/scheduler_overhead.py [--model default] [--sizes 256,64,16] [--steps 10]
                                            [--prompt-len 128] [--modes greedy,stream+stop]
                                            [--long-chars 100000] [--profile]

``--model``: ``random`` (a random 4-layer 256-wide Llama, the default), ``default``
(SmolLM2-135M-Instruct) or a path. ``--profile`` prints cProfile's top functions over the
measured steps at the largest size.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import random
import tempfile
import time

import torch
from bench_models import add_model_option, resolve
from bench_models import name as model_name

from engine import Engine
from engine_testing.checkpoints import make_tiny_model

STOPS = ["\u2603 never", "\u00a7\u00a7"]  # never generated: every token is checked
MODES = {
    "greedy": {"temperature": 0},
    "penalties": {"temperature": 0, "repetition_penalty": 1.1, "frequency_penalty": 0.2,
                  "presence_penalty": 0.1},
    "stream": {"temperature": 0},
    "stream+stop": {"temperature": 0, "stop": STOPS},
}
STREAMING = {"stream", "stream+stop"}
CHUNK = 4096  # prompt tokens per prefill step while filling the batch


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = CLOCKS["wall"]  # --clock
PROFILE_SORT = "tottime"  # --profile-sort


class Timer:
    """Wraps a callable and adds the seconds spent in it to ``total`` (by ``clock``)."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = clock()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += clock() - start


def fill(engine, n, prompt_len, vocab, params, seed, runtime=None):
    """Queue ``n`` requests and step until every one is decoding; with ``runtime``, as streams
    of the server (an EngineRuntime publishes their tokens after each step)."""
    from engine.server.handle import Handle

    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        ids = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        r = engine.add_request(ids, params, stream=runtime is not None)
        if runtime is not None:  # what EngineRuntime.submit does
            handle = Handle(stream=True)
            handle.prompt_ids = ids
            handle.started(r)
            runtime._live[r[0]] = (handle, 0)
        reqs += r
    s = engine.scheduler
    while s.waiting or any(r.prefilling for r in s.running):
        touched = engine.step()
        if runtime is not None:
            runtime._publish(touched)
    assert len(s.running) == n, (len(s.running), n)
    return reqs


def measure(engine, steps, warmup, profile, runtime=None):
    """Per-step milliseconds over ``steps`` decode steps: (step, forward, sample, publish,
    detokenizer thread)."""
    s = engine.scheduler
    n = len(s.running)
    publish = runtime._publish if runtime is not None else (lambda touched: None)
    for _ in range(warmup):
        publish(engine.step())
    drain(runtime)
    forward, sample = engine.runner.forward, s.sampler
    f0, s0 = forward.total, sample.total
    detok0 = runtime._detok._delta.total if runtime is not None else 0.0
    prof = cProfile.Profile() if profile else None
    stepped = published = 0.0
    if prof:
        prof.enable()
    for _ in range(steps):
        t0 = clock()
        touched = engine.step()
        t1 = clock()
        publish(touched)
        t2 = clock()
        stepped, published = stepped + t1 - t0, published + t2 - t1
    if prof:
        prof.disable()
    drain(runtime)
    assert len(s.running) == n, "a request finished during the measurement: raise max_new_tokens"
    if prof:
        pstats.Stats(prof).sort_stats(PROFILE_SORT).print_stats(40)
    detok = runtime._detok._delta.total - detok0 if runtime is not None else 0.0
    return [1000 * x / steps for x in (stepped, forward.total - f0, sample.total - s0,
                                       published, detok)]


def drain(runtime, timeout=60.0):
    """Wait until the detokenizer thread has turned everything published into deltas."""
    if runtime is None:
        return
    deadline = time.monotonic() + timeout
    while not runtime._detok._queue.empty() and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.005)  # the batch it took last


def streaming_runtime(engine):
    """An EngineRuntime whose detokenizer thread runs (its deltas go nowhere) but whose engine
    loop does not: this script steps the engine itself and calls ``_publish`` as the loop
    would."""
    from engine.server.runtime import EngineRuntime

    runtime = EngineRuntime(engine)
    detok = runtime._detok
    detok._delta = Timer(detok._delta)
    detok._deliver = lambda out: None
    detok.start(None)
    return runtime


def long_output(engine, chars: int, window: int = 1000):
    """Per-token microseconds over the first and the last ``window`` tokens of one streamed
    output of ``chars`` characters, on the engine thread (stop-string check + publish) and on
    the detokenizer thread (the delta's text); and the same for the old way (the whole text
    re-joined each step to slice the delta off it). The tokens are the model tokenizer's
    encoding of a long text (so the text is real), fed as if sampled."""
    from engine.sampling import IncrementalDetokenizer, SamplingParams
    from engine.scheduler.request import Req
    from engine.server.handle import Handle, build_delta, collect
    from engine_testing.checkpoints import corpus

    tok = engine.tokenizer
    text = ""
    for doc in corpus() * 50:
        text += doc + "\n"
        if len(text) > chars * 1.05:
            break
    ids = tok.encode(text, add_special_tokens=False)
    s = engine.scheduler
    params = SamplingParams(max_new_tokens=len(ids) + 1, stop=STOPS, ignore_eos=True)
    prompt = [5, 6, 7]

    def run_new():
        """Engine thread: the stop-string request's check (its tokens queued undecoded unless
        they might end a stop string) + what _publish hands over; detokenizer thread: both
        requests' deltas (the stop-string one applies its stop strings to its text there)."""
        r = Req("long", prompt, params)
        r.detokenizer = IncrementalDetokenizer(tok, prompt, params)
        if r.detokenizer._mask_future is not None:
            r.detokenizer._mask_future.result()  # (built once per set of stop strings)
        plain = Req("plain", prompt, SamplingParams(max_new_tokens=len(ids) + 1))
        h, hp = Handle(stream=True), Handle(stream=True)
        for handle, req in ((h, r), (hp, plain)):
            handle.prompt_ids = prompt
            handle.started([req])
        eng, det, emitted = [], [], 0
        for t in ids:
            t0 = clock()
            r.append_token(t)
            s._check_stop(r, t)
            step = ((h, 0), r, len(r.output_ids), r.finished)
            t1 = clock()
            plain.append_token(t)
            build_delta(engine, collect(hp, 0, plain, len(plain.output_ids), False))
            d = build_delta(engine, collect(h, 0, *step[1:]))
            t2 = clock()
            emitted += len(d.text)
            eng.append(t1 - t0)
            det.append(t2 - t1)
            assert not r.finished
        return eng, det, emitted

    def run_old():
        """Before: the engine thread's detokenizer for every stream, and the delta sliced off
        ``det.text`` (the whole text, re-joined) every step."""
        r = Req("old", prompt, params)
        det = IncrementalDetokenizer(tok, prompt, params)
        sent, times = 0, []
        for t in ids:
            t0 = clock()
            det.add([t])
            full = det.text
            _ = full[sent:]
            sent = len(full)
            times.append(clock() - t0)
        return times, sent

    eng, det, emitted = run_new()
    old, old_chars = run_old()

    def us(xs):
        return 1e6 * sum(xs) / len(xs)

    w = min(window, len(ids) // 4)
    print(f"\none streamed output of {emitted} characters ({len(ids)} tokens, "
          f"{old_chars} the old way); microseconds per token, first {w} / last {w} tokens:")
    print(f"{'':<44} {'first':>8} {'last':>8} {'last/first':>10}")
    for label, xs in (("engine thread (stop check + publish)", eng),
                      ("detokenizer thread (two text deltas)", det),
                      ("before: engine thread (detok + re-join)", old)):
        a, b = us(xs[:w]), us(xs[-w:])
        print(f"{label:<44} {a:>8.2f} {b:>8.2f} {b / a:>10.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,64,16", help="running requests, largest first")
    ap.add_argument("--steps", type=int, default=10, help="measured decode steps per size")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured decode steps per size")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--long-chars", type=int, default=100000,
                    help="characters of the long streamed output (0: skip it)")
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="wall: elapsed time; cpu: the measuring thread's own CPU time (what "
                         "the engine thread itself spends, without waits for the GIL or the "
                         "cores: for a loaded machine; the forward's share is then only the "
                         "main thread's)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-sort", default="tottime", help="pstats sort key (cumulative, ...)")
    add_model_option(ap, "a 4-layer 256-wide Llama")
    args = ap.parse_args()
    global clock, PROFILE_SORT
    clock = CLOCKS[args.clock]
    PROFILE_SORT = args.profile_sort
    sizes = sorted((int(x) for x in args.sizes.split(",")), reverse=True)
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    # every request stays running: the first admitted decode while the last ones prefill
    fill_steps = -(-sizes[0] * args.prompt_len // CHUNK)
    max_new = fill_steps + len(sizes) * (args.warmup + args.steps) + 8
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = resolve(args.model, lambda: make_tiny_model(
            tmp, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024))
        engine = Engine(model_dir, max_running_requests=sizes[0], chunked_prefill_size=CHUNK,
                        max_total_tokens=int(1.2 * sizes[0] * (args.prompt_len + max_new)),
                        schedule_conservativeness=0.1)
        engine.runner.forward = Timer(engine.runner.forward)
        engine.scheduler.sampler = Timer(engine.scheduler.sampler)
        vocab = engine.runner.model_config.vocab_size
        print(f"model: {model_name(args.model, model_dir)}; prompt {args.prompt_len} tokens, "
              f"{args.steps} decode steps per size after {args.warmup} warm-up, "
              f"{torch.get_num_threads()} threads, {args.clock} clock")
        print(f"{'mode':<11} {'running':>7} {'step ms':>9} {'forward ms':>10} "
              f"{'sample ms':>9} {'sched ms':>9} {'sched %':>8} "
              f"{'publish ms':>10} {'engine ms':>9} {'detok ms':>8}")
        for i, mode in enumerate(args.modes.split(",")):
            params = {**MODES[mode], "ignore_eos": True, "max_new_tokens": max_new}
            runtime = streaming_runtime(engine) if mode in STREAMING else None
            reqs = fill(engine, sizes[0], args.prompt_len, vocab, params, seed=i,
                        runtime=runtime)
            for size in sizes:
                for r in reqs[size:]:
                    engine.abort(r)
                    if runtime is not None:
                        runtime._live.pop(r, None)
                reqs = reqs[:size]
                step, fwd, smp, pub, det = measure(
                    engine, args.steps, args.warmup, args.profile and size == sizes[0],
                    runtime)
                sched = step - fwd
                print(f"{mode:<11} {size:>7} {step:>9.1f} {fwd:>10.1f} {smp:>9.2f} "
                      f"{sched:>9.2f} {100 * sched / step:>7.1f}% {pub:>10.2f} "
                      f"{sched + pub:>9.2f} {det:>8.2f}", flush=True)
            for r in reqs:
                engine.abort(r)
            if runtime is not None:
                runtime._detok.close(timeout=10)
            engine.scheduler.check_invariants()
            engine.flush_cache()  # every mode starts from an empty pool (no evictions)
        if args.long_chars:
            long_output(engine, args.long_chars)


if __name__ == "__main__":
    main()
