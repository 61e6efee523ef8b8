"""Decode throughput on a GPU, with and without CUDA graphs, per attention backend.

For each backend and batch size B: an engine prefills B requests with 128-token prompts, then
decode steps are timed (every row one token: one forward of B tokens plus sampling). The same
runs eagerly (--disable-cuda-graph) and with graphs, side by side in this process; the ratio is
graphs / eager. Needs a CUDA GPU (elsewhere it says so and exits 1).

    python benchmarks/cuda_graphs.py [--model default|PATH] [--backends triton,torch_native]
        [--batch-sizes 1,32,128] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
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
    from engine.testing import make_tiny_model

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
        engines = {graphs: Engine(path, device="cuda", dtype=args.dtype,
                                  attention_backend=backend, disable_cuda_graph=not graphs,
                                  cuda_graph_max_bs=max(sizes), max_running_requests=max(sizes))
                   for graphs in (False, True)}
        if engines[True].runner.cuda_graphs is None:  # the backend cannot be captured
            print(f"{backend:<14} {engines[True].cuda_graph}")
            engines.pop(True)
        for bs in sizes:
            tps = {g: bs / (decode_ms(e, bs, args.steps, prompt_len=128) / 1e3)
                   for g, e in engines.items()}
            graphs = (f"{tps[True]:>14.1f}{tps[True] / tps[False]:>8.2f}" if True in tps else
                      f"{'-':>14}{'-':>8}")
            print(f"{backend:<14}{bs:>6}{tps[False]:>14.1f}{graphs}")
        del engines
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
