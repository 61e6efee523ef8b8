"""Pipeline micro-batching: does cutting a batch into --pp-size micro-batches overlap the stages?

Generates the same requests offline (greedy, fixed lengths) with:
  - pp 1 (one process, all cores),
  - pp 2 with one micro-batch per step (``--pp-max-micro-batch-size`` = the batch: stage 1 waits
    while stage 0 runs, and the other way round),
  - pp 2 with the default 2 micro-batches (stage 0 runs micro-batch 2 while stage 1 runs 1),
    and with 4 (``--pp-max-micro-batch-size`` = a quarter of the batch),
and prints decode+prefill throughput and the ratios against the one-micro-batch run, checking
that all three produce the same tokens. A random-weight model (8 layers, hidden 512) unless
``--model`` is given; on a CPU the two stages share the machine's cores (each rank gets half).

    python benchmarks/pipeline_overlap.py
    python benchmarks/pipeline_overlap.py --requests 32 --new-tokens 64
"""

from __future__ import annotations

import argparse
import tempfile
import time


def run(model: str, prompts: list[str], new_tokens: int, **kwargs) -> tuple[float, list]:
    from engine.engine import Engine

    engine = Engine(model, device="cpu", dtype="float32", attention_backend="torch_native",
                    max_total_tokens=8192, dist_timeout=120, **kwargs)
    try:
        params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
        engine.generate(prompts[:2], params)  # warm up
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    return len(prompts) * new_tokens / seconds, [o["output_ids"] for o in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="an HF directory or GGUF file [default: a random model]")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from engine_testing.checkpoints import make_tiny_model

        model = make_tiny_model(tempfile.mkdtemp(), "LlamaForCausalLM", hidden_size=512,
                                intermediate_size=1536, num_hidden_layers=8,
                                num_attention_heads=8, num_key_value_heads=4)
    prompts = [f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 3
               for i in range(args.requests)]
    runs = {
        "pp 1": {},
        "pp 2, 1 micro-batch": {"pp_size": 2, "pp_max_micro_batch_size": args.requests},
        "pp 2, 2 micro-batches": {"pp_size": 2},
        "pp 2, 4 micro-batches": {"pp_size": 2,
                                  "pp_max_micro_batch_size": -(-args.requests // 4)},
    }
    results = {name: run(model, prompts, args.new_tokens, **kw) for name, kw in runs.items()}
    base = results["pp 2, 1 micro-batch"][0]
    print(f"{args.requests} requests x {args.new_tokens} new tokens, greedy")
    print(f"{'run':24} {'tok/s':>8} {'vs 1 micro-batch':>17}")
    for name, (tps, _) in results.items():
        print(f"{name:24} {tps:8.1f} {tps / base:16.2f}x")
    outputs = [o for _, o in results.values()]
    print("same tokens in all runs:", all(o == outputs[0] for o in outputs))


if __name__ == "__main__":
    main()
