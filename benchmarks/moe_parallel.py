"""An MoE model over tp ranks: one process, --tp-size 2 (every expert cut in two) and --tp-size 2
--ep-size 2 (each rank half the experts, whole). Generates the same requests offline (greedy,
fixed lengths, token-id prompts) in each layout, prints the throughput (prompt + new tokens'
wall time; new tokens per second) and checks that the three produce the same tokens. A random
Mixtral-shaped model (4 layers, hidden 512, 8 experts of 1024, top-2) unless ``--model`` is
given; on a CPU the ranks share the machine's cores (each rank gets half).

    python benchmarks/moe_parallel.py
    python benchmarks/moe_parallel.py --requests 32 --new-tokens 32
"""

from __future__ import annotations

import argparse
import tempfile
import time


def run(model: str, prompts: list[list[int]], new_tokens: int, **kwargs) -> tuple[float, list]:
    from engine.engine import Engine

    engine = Engine(model, device="cpu", dtype="float32", attention_backend="torch_native",
                    max_total_tokens=8192, dist_timeout=120, **kwargs)
    try:
        params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
        engine.generate(input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4})
        start = time.perf_counter()
        out = engine.generate(input_ids=prompts, sampling_params=params)
        return time.perf_counter() - start, [o["output_ids"] for o in out]
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an MoE checkpoint (default: a random Mixtral-shaped one)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from engine_testing.checkpoints import make_tiny_model

        model = make_tiny_model(tempfile.mkdtemp(prefix="moe-parallel-"), "MixtralForCausalLM",
                                hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=2,
                                num_local_experts=8, num_experts_per_tok=2)
    prompts = [list(range(10 + i, 10 + i + args.prompt_tokens)) for i in range(args.requests)]
    new = args.requests * args.new_tokens
    results = []
    for label, kwargs in (("one process", {}), ("tp 2", {"tp_size": 2}),
                          ("tp 2 x ep 2", {"tp_size": 2, "ep_size": 2})):
        seconds, tokens = run(model, prompts, args.new_tokens, **kwargs)
        results.append((label, seconds, tokens))
    print(f"\n{args.requests} requests x {args.prompt_tokens} prompt + {args.new_tokens} new "
          f"tokens\n| run | s | new tok/s |\n|---|---|---|")
    for label, seconds, _ in results:
        print(f"| {label} | {seconds:.2f} | {new / seconds:.1f} |")
    same = all(tokens == results[0][2] for _, _, tokens in results)
    print(f"same tokens in every run: {same}")


if __name__ == "__main__":
    main()
