"""Decode throughput on a GPU, with and without CUDA graphs, per attention backend.

For each backend and batch size B: an engine prefills B requests with 128-token prompts, then
decode steps are timed (every row one token: one forward of B tokens plus sampling). The same
runs eagerly (--disable-cuda-graph) and with graphs in this process, one engine alive at a time
(each closed and collected before the next sizes its KV pool); the ratio is graphs / eager.
Needs a CUDA GPU (elsewhere it says so and exits 1).

    python benchmarks/cuda_graphs.py [--model default|PATH] [--backends triton,torch_native]
        [--batch-sizes 1,32,128] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import bench_models  # noqa: E402
from torch_compile import decode_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_models.add_model_option(ap, "a random 8-layer Llama")
    ap.add_argument("--backends", default="triton,torch_native")
    ap.add_argument("--batch-sizes", default="1,32,128")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/cuda_graphs.py needs a CUDA GPU; torch sees none here.")
    from engine import Engine
    from engine_testing.checkpoints import make_tiny_model

    def random_model() -> str:
        import tempfile

        out = tempfile.mkdtemp(prefix="bench-graphs-")
        return make_tiny_model(out, "LlamaForCausalLM", hidden_size=1024, intermediate_size=2816,
                               num_hidden_layers=8, num_attention_heads=16,
                               num_key_value_heads=4, vocab_size=32000)

    path = bench_models.resolve(args.model, random_model)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    print(f"{torch.cuda.get_device_name(0)}, model {bench_models.name(args.model, path)}, "
          f"dtype {args.dtype}, decode after 128-token prompts, {args.steps} steps")
    print(f"{'backend':<14}{'batch':>6}{'eager tok/s':>14}{'graphs tok/s':>14}{'ratio':>8}")
    for backend in args.backends.split(","):
        def make_engine(graphs: bool, backend=backend):
            return Engine(path, device="cuda", dtype=args.dtype, attention_backend=backend,
                          disable_cuda_graph=not graphs, cuda_graph_max_bs=max(sizes),
                          max_running_requests=max(sizes))

        def measure(engine):
            if not engine.config.disable_cuda_graph and engine.runner.cuda_graphs is None:
                return engine.cuda_graph  # the backend cannot be captured: why
            return {bs: bs / (decode_ms(engine, bs, args.steps, prompt_len=128) / 1e3)
                    for bs in sizes}

        tps = measure_one_at_a_time(make_engine, (False, True), measure)
        if isinstance(tps[True], str):
            print(f"{backend:<14} {tps[True]}")
        for bs in sizes:
            graphs = (f"{tps[True][bs]:>14.1f}{tps[True][bs] / tps[False][bs]:>8.2f}"
                      if isinstance(tps[True], dict) else f"{'-':>14}{'-':>8}")
            print(f"{backend:<14}{bs:>6}{tps[False][bs]:>14.1f}{graphs}")


def release_memory() -> None:
    """Collect what the last engine left (its runner and CUDA-graph runner refer to each other,
    so dropping the last reference frees nothing until the cycle collector runs) and hand the
    freed blocks back to the device, so that the next engine's sizing sees them free."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_one_at_a_time(make_engine, modes, measure) -> dict:
    """``measure(make_engine(mode))`` for each mode, one engine alive at a time: each is closed
    and collected before the next is built, since an engine sizes its KV pool from the memory
    free at its start (two alive at once, or one kept by a reference cycle, would shrink the
    next one's pool or refuse it). ``measure`` must return plain data, not the engine."""
    results = {}
    for mode in modes:
        engine = make_engine(mode)
        try:
            results[mode] = measure(engine)
        finally:
            engine.close()
            del engine
            release_memory()
    return results

if __name__ == "__main__":
    main()
