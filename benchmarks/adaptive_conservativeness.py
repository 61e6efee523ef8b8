"""--schedule-conservativeness 1.0 vs 0.3 vs auto on four workloads, random or real model.

Workloads (``--workload``):

- ``early-eos`` (default): the guide's "too conservative" case: every request asks for a large
  max_new_tokens but stops early (greedy decoding that stops at the first token of a fixed
  random stop set, the stand-in for EOS with random weights, so most outputs are a few dozen
  tokens and a few run long);
- ``full-length``: no stop set, every request runs to max_new_tokens in lockstep;
- ``shift``: the first half of the requests are early-eos ones, the second half full-length
  (a mix that changes halfway: short answers, then long ones);
- ``fruits``: issue 36's chat requests "Name k fruits." for k = 2, 3, ... (or every
  ``--fruits-stride``-th k) through the model's
  chat template, temperature 0, EOS honoured (needs a chat model: ``--model default``): outputs
  spread from a few tokens to max_new_tokens.

On a chat model (``--model default``) the first three use real chat requests too, greedy:
``early-eos`` asks "Name k fruits." for k = 2..6 in turn (short answers, EOS honoured),
``full-length`` the same with EOS ignored (every answer runs to max_new_tokens), ``shift`` the
first half early-eos, the second half full-length.

``--lengths hidden`` (default) gives each full-length request (EOS ignored) also a stop token
id that no answer contains (HIDDEN_STOP; the script checks that they all still run to
max_new_tokens), so that, as with a natural long answer, the scheduler cannot tell in advance
that it runs to the end; ``--lengths known`` sends plain ``ignore_eos`` requests, as SGLang's
bench_serving and ``engine bench`` do, which ``auto`` plans at their exact length
(``peak_plan.runs_to_max``).

Each setting serves the same requests on the same pool; printed per setting: wall time and
generation throughput (``--repeats`` runs, the last counts: a first run pays for every batch
shape it is the first to use), mean token usage over the steps with requests waiting (the
guide's "token usage < 0.9 with #queue-req > 0") and by quarter of those steps, retractions
(count and per minute of wall time), steps and tokens per step (the throughput a busy shared
machine cannot blur: every step is one forward), prompt tokens prefilled (a retraction's
recompute shows there), and the ratios against 1.0. Outputs must be identical (admission order
does not change greedy tokens); the script checks it.

    python benchmarks/adaptive_conservativeness.py [--model random|default|PATH]
        [--workload early-eos|full-length|shift|fruits] [--requests 600]
        [--max-new-tokens 256] [--max-total-tokens 4096] [--stop-ids 24] [--repeats 2]

Issue 36's run: ``--model default --workload fruits --requests 120 --max-new-tokens 400
--max-total-tokens 4000``.
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time

from bench_models import add_model_option, resolve
from bench_models import name as model_name

from engine import Engine
from engine_testing.checkpoints import make_tiny_model

SETTINGS = (1.0, 0.3, "auto")


WORKLOADS = ("early-eos", "full-length", "shift", "fruits")
HIDDEN_STOP = 49144  # --lengths hidden: a stop id no answer contains (SmolLM2: " Thessalon")


def workload(kind: str, n: int, vocab: int, stop_ids: int, max_new: int, tokenizer=None,
             seed: int = 0, stride: int = 1, hidden: bool = False):
    """``n`` (prompt ids, sampling params) pairs of workload ``kind``; ``hidden``: the
    full-length requests carry HIDDEN_STOP (their length is not known in advance)."""
    hide = {"stop_token_ids": [HIDDEN_STOP]} if hidden else {"stop_token_ids": []}
    chat = tokenizer is not None and getattr(tokenizer, "chat_template", None)

    def ask(k: int) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"Name {k} fruits."}],
                                             add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)

    if kind == "fruits":
        if not chat:
            raise SystemExit("--workload fruits needs a chat model (--model default)")
        params = {"temperature": 0, "max_new_tokens": max_new}
        return [(ask(k), params) for k in range(2, 2 + n * stride, stride)]
    if chat:  # short answers (EOS honoured) and full-length ones (EOS ignored)
        short = {"temperature": 0, "max_new_tokens": max_new}
        full = {**short, "ignore_eos": True, **hide}
        prompts = [ask(2 + i % 5) for i in range(n)]
        if kind == "early-eos":
            return [(p, short) for p in prompts]
        if kind == "full-length":
            return [(p, full) for p in prompts]
        return [(p, short if i < n // 2 else full) for i, p in enumerate(prompts)]  # shift
    rng = random.Random(seed)
    stops = rng.sample(range(3, vocab), stop_ids)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 48))] for _ in range(n)]
    early = {"temperature": 0, "ignore_eos": True, "max_new_tokens": max_new,
             "stop_token_ids": stops}
    full = {**early, **hide}
    if kind == "early-eos":
        return [(p, early) for p in prompts]
    if kind == "full-length":
        return [(p, full) for p in prompts]
    return [(p, early if i < n // 2 else full) for i, p in enumerate(prompts)]  # shift


def serve(path: str, conservativeness, requests, max_total_tokens: int) -> dict:
    engine = Engine(path, max_total_tokens=max_total_tokens,
                    schedule_conservativeness=conservativeness)
    usages, prefilled = [], [0]
    observe = engine.scheduler.on_step

    def on_step(stats):
        if stats.num_queue_reqs > 0 and stats.forward_mode != "idle":
            usages.append(stats.token_usage)
        prefilled[0] += stats.new_tokens
        if observe:
            observe(stats)

    engine.scheduler.on_step = on_step
    start = time.perf_counter()
    reqs = [engine.add_request(p, params)[0] for p, params in requests]
    steps = 0
    while engine.scheduler.has_work:
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    generated = sum(len(r.output_ids) for r in reqs)
    quarters = [usages[len(usages) * q // 4: len(usages) * (q + 1) // 4] for q in range(4)]
    return {"usage": sum(usages) / len(usages) if usages else 0.0, "tok_s": generated / seconds,
            "quarters": [sum(u) / len(u) if u else 0.0 for u in quarters],
            "steps": steps, "retracted": engine.scheduler.counters.retracted_reqs,
            "generated": generated, "outputs": [r.output_ids for r in reqs],
            "ratio": engine.scheduler.ratio, "seconds": seconds, "prefilled": prefilled[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_option(ap, "a random 4-layer 256-wide Llama")
    ap.add_argument("--workload", choices=WORKLOADS, default="early-eos")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    ap.add_argument("--stop-ids", type=int, default=24, help="size of the random stop set")
    ap.add_argument("--full-length", action="store_true", help="= --workload full-length")
    ap.add_argument("--fruits-stride", type=int, default=1,
                    help="fruits: k = 2, 2 + stride, ... (fewer requests, the same spread)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per setting, the last counts")
    ap.add_argument("--settings", default="1.0,0.3,auto", help="comma-separated")
    ap.add_argument("--lengths", choices=("hidden", "known"), default="hidden",
                    help="whether full-length requests show that they run to max_new_tokens "
                         "(plain ignore_eos) or carry a stop id no answer contains")
    args = ap.parse_args()
    kind = "full-length" if args.full_length else args.workload
    logging.basicConfig(level=logging.ERROR)
    path = resolve(args.model, lambda: make_tiny_model(
        tempfile.mkdtemp(), "LlamaForCausalLM", hidden_size=256, intermediate_size=512,
        num_hidden_layers=4))
    tokenizer = None
    if args.model != "random":  # a chat model asks real questions (see the workloads)
        from engine.models.checkpoint import open_checkpoint

        tokenizer = open_checkpoint(path).load_tokenizer()
    engine_vocab = 500  # below every model's vocabulary, above the special ids
    requests = workload(kind, args.requests, engine_vocab, args.stop_ids, args.max_new_tokens,
                        tokenizer, stride=args.fruits_stride, hidden=args.lengths == "hidden")
    print(f"model: {model_name(args.model, path)}; workload {kind}: {args.requests} requests, "
          f"max_new_tokens {args.max_new_tokens}, --max-total-tokens {args.max_total_tokens}, "
          f"--lengths {args.lengths}")
    settings = [c if c == "auto" else float(c) for c in args.settings.split(",")]
    results = {}
    for c in settings:
        results[c] = [serve(path, c, requests, args.max_total_tokens)
                      for _ in range(args.repeats)][-1]
        r = results[c]
        print(f"  {c}: {r['seconds']:.1f} s, {r['steps']} steps, {r['retracted']} retracted",
              flush=True)
    base = results[settings[0]]
    full = [o for o, (_, p) in zip(base["outputs"], requests)
            if p.get("stop_token_ids") == [HIDDEN_STOP]]
    if any(len(o) < args.max_new_tokens for o in full):
        raise SystemExit(f"a full-length answer contains the hidden stop id {HIDDEN_STOP}: "
                         "pick another HIDDEN_STOP")
    lengths = sorted(len(o) for o in base["outputs"])
    print(f"output tokens: median {lengths[len(lengths) // 2]}, max {lengths[-1]}, "
          f"mean {sum(lengths) / len(lengths):.1f}")
    print(f"{'setting':>8} {'wall s':>8} {'gen tok/s':>9} {'usage(q>0)':>10} {'retracted':>9} "
          f"{'per min':>7} {'steps':>6} {'tok/step':>8} {'prefilled':>9} {'tok/s x':>7} "
          f"{'tok/step x':>10}")
    for c, r in results.items():
        per_step = r["generated"] / r["steps"]
        print(f"{c!s:>8} {r['seconds']:>8.1f} {r['tok_s']:>9.1f} {r['usage']:>10.3f} "
              f"{r['retracted']:>9} {60 * r['retracted'] / r['seconds']:>7.2f} {r['steps']:>6} "
              f"{per_step:>8.2f} {r['prefilled']:>9} {r['tok_s'] / base['tok_s']:>7.2f} "
              f"{per_step / (base['generated'] / base['steps']):>10.2f}")
    print("token usage (queue>0) by quarter of those steps:")
    for c, r in results.items():
        print(f"{c!s:>8} " + " ".join(f"{u:.3f}" for u in r["quarters"]))
    if "auto" in results:
        print(results["auto"]["ratio"].describe())
    same = all(r["outputs"] == base["outputs"] for r in results.values())
    print(f"outputs identical across settings: {same}")
    if not same:
        raise SystemExit("outputs differ between settings: admission changed tokens")


if __name__ == "__main__":
    main()
