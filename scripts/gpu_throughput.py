"""GPU check step (e): offline decode throughput on a model of real size, built on the GPU.

A random-init model with Llama-3-8B's shapes (hidden 4096, 32 layers, 32 heads, 8 KV heads,
intermediate 14336, vocab 128256) in bfloat16: nothing can be downloaded on a lent machine and
decode speed does not depend on the weights' values. Only config.json and a small tokenizer are
written; the engine's loader gets its tensors from a checkpoint whose ``tensors()`` fills each
one on the GPU (no 16 GB of safetensors). Reports decode ms/step at batch 1 with and without
CUDA graphs (and with the overlap scheduler, --overlap: the better of the two is held to the
target) against the bandwidth roofline (weight bytes / device-to-device copy bandwidth
measured in this run, bytes read + written), and tok/s at batch 32 and 128 (graphs).

    python scripts/gpu_throughput.py --json OUT.json [--preset 8b|tiny] [--device cuda]
        [--batch-sizes 1,32,128] [--steps 30] [--target 0.70] [--no-eager] [--overlap]
        [--profile STEPS]

Without CUDA it writes status "skipped" and exits 0; ``--preset tiny --device cpu`` runs the
same path on a small model (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

PRESETS = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
               max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=512, vocab_size=32000,
                 max_position_embeddings=2048, rope_theta=500000.0),
}


def write_model_dir(preset: str) -> str:
    """config.json (LlamaForCausalLM, bfloat16) and the tests' small tokenizer; no weights."""
    import transformers

    from engine_testing.checkpoints import train_tokenizer

    out = tempfile.mkdtemp(prefix=f"gpu-throughput-{preset}-")
    config = transformers.LlamaConfig(**PRESETS[preset], rms_norm_eps=1e-5,
                                      bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                      tie_word_embeddings=False, initializer_range=0.02)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    train_tokenizer(out, 512)
    return out


def random_checkpoint_class(device: str):
    """An HFCheckpoint whose tensors are made on ``device`` (random, norms 1) instead of read."""
    import torch
    import transformers

    from engine.models.checkpoint import HFCheckpoint

    class RandomCheckpoint(HFCheckpoint):
        def tensors(self, dtype, keep=None):
            config = transformers.LlamaConfig(**{k: v for k, v in self.hf_config.items()
                                                 if k != "architectures"})
            with torch.device("meta"):
                shapes = [(n, tuple(p.shape)) for n, p in
                          transformers.LlamaForCausalLM(config).named_parameters()]
            gen = torch.Generator(device=device).manual_seed(0)
            for name, shape in shapes:
                if keep is not None and not keep(name):
                    continue
                t = torch.empty(shape, dtype=dtype, device=device)
                if "norm" in name:
                    t.fill_(1.0)
                else:
                    t.normal_(0.0, 0.02, generator=gen)
                yield name, t

    return RandomCheckpoint


def copy_bandwidth(device: str, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (best of 10)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()  # the engine sizes its KV pool from the free memory
    return 2 * nbytes / best


def profile_decode(engine, batch: int, steps: int, prompt_len: int) -> dict:
    """torch.profiler over ``steps`` steady decode steps at ``batch``: wall and device-busy ms a
    step, and the kernels by device time (printed; the figures returned)."""
    import random

    import torch
    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(7)
    params = {"max_new_tokens": steps + 16, "ignore_eos": True, "temperature": 0.0}
    reqs = [r for _ in range(batch) for r in engine.add_request(
        [rng.randrange(100, 30000) for _ in range(prompt_len)], params)]
    while any(r.prefilling or not r.output_ids for r in reqs):
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    for r in reqs:
        engine.abort(r)
    events = prof.key_averages()
    busy_us = sum(e.self_device_time_total for e in events)
    print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=70))
    out = {f"profile batch {batch}: wall ms/step": round(wall / steps * 1e3, 3),
           f"profile batch {batch}: device-busy ms/step": round(busy_us / steps / 1e3, 3)}
    print(out, flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--preset", default="8b", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch-sizes", default="1,32,128")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--target", type=float, default=0.70)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--no-eager", action="store_true", help="skip the batch-1 eager run")
    ap.add_argument("--overlap", action="store_true",
                    help="also the first batch size with graphs and --enable-overlap-schedule "
                         "(the host's scheduling hidden behind the GPU's step)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also profile STEPS decode steps at each batch size with graphs "
                         "(torch.profiler: wall vs device-busy time, kernels by device time)")
    args = ap.parse_args()
    import torch

    result = {"status": "pass", "figures": {}, "preset": args.preset}

    def write():
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    if args.device == "cuda" and not torch.cuda.is_available():
        result.update(status="skipped", reason="no CUDA device (torch.cuda.is_available() is "
                                               "False)")
        write()
        return 0
    import engine.models.checkpoint as checkpoint
    from engine import Engine
    from torch_compile import decode_ms

    sizes = [int(x) for x in args.batch_sizes.split(",")]
    figures = result["figures"]
    bw = copy_bandwidth(args.device, (2 << 30) if args.device == "cuda" else (64 << 20))
    figures["copy bandwidth (GB/s, read+write)"] = round(bw / 1e9, 1)
    path = write_model_dir(args.preset)
    random_ckpt = random_checkpoint_class(args.device)
    opened = checkpoint.open_checkpoint
    checkpoint.open_checkpoint = lambda p: random_ckpt(p) if p == path else opened(p)
    tokens = max(sizes) * (args.prompt_len + args.steps + 16) + 4096
    common = dict(device=args.device, dtype="bfloat16", attention_backend=args.attention_backend,
                  max_running_requests=max(sizes), max_total_tokens=tokens,
                  cuda_graph_max_bs=max(sizes))
    runs = [(True, False, sizes)] if args.device == "cuda" else []
    if args.overlap and args.device == "cuda":
        runs.append((True, True, [sizes[0]]))
    if not args.no_eager or args.device != "cuda":
        runs.append((False, False, [sizes[0]] if args.device == "cuda" else sizes))
    try:
        for graphs, overlap, batch_sizes in runs:
            t0 = time.perf_counter()
            engine = Engine(path, disable_cuda_graph=not graphs,
                            enable_overlap_schedule=overlap, **common)
            label = ("graphs" if graphs else "eager") + ("+overlap" if overlap else "")
            figures[f"engine start, {label} (s)"] = round(time.perf_counter() - t0, 1)
            result["attention_backend"] = engine.attention_backend
            result["weight_bytes"] = engine.runner.weight_bytes
            if graphs:
                result["cuda_graph"] = str(engine.cuda_graph)
                if engine.runner.cuda_graphs is None:
                    result["graphs_note"] = "no graphs captured: " + str(engine.cuda_graph)
            for bs in batch_sizes:
                ms = decode_ms(engine, bs, args.steps, prompt_len=args.prompt_len)
                figures[f"batch {bs} {label}: ms/step"] = round(ms, 3)
                figures[f"batch {bs} {label}: tok/s"] = round(bs / (ms / 1e3), 1)
                print(f"{label} batch {bs}: {ms:.3f} ms/step, {bs / (ms / 1e3):.1f} tok/s",
                      flush=True)
                if graphs and not overlap and args.profile:
                    figures.update(profile_decode(engine, bs, args.profile, args.prompt_len))
            del engine
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    except Exception as exc:
        traceback.print_exc()
        result.update(status="fail", reason=f"{type(exc).__name__}: {exc}"[:500])
    finally:
        checkpoint.open_checkpoint = opened
    weights = result.get("weight_bytes")
    if weights:
        roofline_ms = weights / bw * 1e3
        figures["weights (GB)"] = round(weights / 1e9, 2)
        figures["batch 1 roofline (ms/step)"] = round(roofline_ms, 3)
        for label in ("graphs", "graphs+overlap", "eager"):
            ms = figures.get(f"batch {sizes[0]} {label}: ms/step")
            if ms:
                figures[f"batch {sizes[0]} {label}: % of roofline"] = round(
                    100 * roofline_ms / ms, 1)
        share = max((figures[k] for k in (f"batch {sizes[0]} graphs: % of roofline",
                                          f"batch {sizes[0]} graphs+overlap: % of roofline")
                     if k in figures), default=None)
        if result["status"] == "pass" and args.device == "cuda":
            if share is None:
                result.update(status="fail", reason="no batch-1 figure with CUDA graphs")
            elif share < 100 * args.target:
                result.update(status="fail",
                              reason=f"batch-1 decode with CUDA graphs at {share}% of the "
                                     f"bandwidth roofline, under the {100 * args.target:.0f}% "
                                     f"target")
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
