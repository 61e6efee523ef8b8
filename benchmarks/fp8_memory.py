"""FP8 memory and speed: float32 / bf16 vs FP8 weights vs FP8 KV cache, side by side in one run.

Each configuration runs in its own child process (so resident memory is not polluted by the
previous one) on the same random Llama checkpoint (saved in bfloat16, like real checkpoints):
- weights: the model's tensor bytes (runner.weight_bytes: what the sizing report uses);
- RSS load: resident memory after Engine() minus before it (weights, the touched part of the KV
  pool, runtime buffers, allocator slack), from /proc/self/status; peak: the high-water mark
  (VmHWM) reached during Engine() minus the same baseline: loading transients included;
- KV B/tok and the token capacity of a fixed static budget (sizing.plan with --mem-fraction-static
  on a fake device of --budget-mib MiB, the same arithmetic as at start);
- output tok/s of a greedy batch (prefill included; best of --repeats), after a warm-up
  request, on one torch thread by default (steadier on a shared machine).
On CPUs without native bf16 (x86 without AVX512-BF16/AMX) bf16 matmuls are emulated and much
slower than float32 (3-5x for these shapes on the 2-core dev machine, torch 2.13; the core's dtype
rule quotes ~50x for big matmuls), so float32 is the CPU speed baseline and the FP8 weight rows run
float32 activations (weights widened per layer) as well as bf16 ones.

    python benchmarks/fp8_memory.py [--requests 8] [--prompt-len 32] [--new-tokens 32]
        [--threads 1] [--repeats 2] [--only 1,3] [--model default]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

from bench_models import RANDOM, add_model_option, name, resolve

MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=12,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=8000,
             max_position_embeddings=1024)
# (label, engine options)
CONFIGS = [
    ("float32 (CPU baseline)", dict(dtype="float32")),
    ("bf16", dict(dtype="bfloat16")),
    ("fp8 weights, fp32 act", dict(dtype="float32", quantization="fp8")),
    ("fp8 weights, bf16 act", dict(dtype="bfloat16", quantization="fp8")),
    ("fp8_e4m3 KV, fp32", dict(dtype="float32", kv_cache_dtype="fp8_e4m3")),
    ("fp8_e4m3 KV, bf16", dict(dtype="bfloat16", kv_cache_dtype="fp8_e4m3")),
    ("fp8 weights + fp8 KV, fp32", dict(dtype="float32", quantization="fp8",
                                        kv_cache_dtype="fp8_e4m3")),
]


def rss() -> tuple[int, int]:
    """(current, peak) resident bytes of this process."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, kb = line.split()[:2]
                values[key] = int(kb) * 1024
    return values["VmRSS:"], values["VmHWM:"]


def child(model_dir: str, options: dict, args) -> dict:
    import torch
    import transformers

    import engine.scheduler.scheduler  # noqa: F401
    from engine import Engine
    from engine.config import EngineConfig
    from engine.device import DeviceInfo
    from engine.memory.sizing import plan

    torch.set_num_threads(args.threads)
    # load the tokenizer code and run a first matmul now, so the reading below holds only them
    transformers.AutoTokenizer  # noqa: B018 - imports the tokenizer code
    torch.randn(64, 64) @ torch.randn(64, 64)
    before, _ = rss()
    tokens = args.requests * (args.prompt_len + args.new_tokens) + 256
    engine = Engine(model_dir, max_total_tokens=tokens, **options)
    loaded, load_peak = rss()
    runner = engine.runner
    budget_bytes = args.budget_mib << 20
    budget = DeviceInfo("cpu", "budget", None, budget_bytes, budget_bytes)
    mc = runner.model_config
    capacity = plan(EngineConfig(mem_fraction_static=0.5), budget, runner.weight_bytes,
                    runner.kv_bytes_per_token(), "", mc.max_position_embeddings)
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": args.new_tokens}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, mc.vocab_size, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.requests)]
    engine.generate(input_ids=[prompts[0][:8]], sampling_params={**params, "max_new_tokens": 2})
    elapsed = float("inf")
    for _ in range(args.repeats):  # best of: other processes share this machine
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = min(elapsed, time.perf_counter() - start)
        engine.flush_cache()  # the next repeat prefills again
    linear = sum(p.numel() * p.element_size() for name, p in runner.model.named_parameters()
                 if "_proj." in name)
    return {"weight_bytes": runner.weight_bytes, "linear_bytes": linear,
            "rss_load": loaded - before, "rss_peak": load_peak - before,
            "kv_bytes_per_token": runner.kv_bytes_per_token(),
            "capacity": capacity.max_total_tokens,
            "tok_s": sum(len(o["output_ids"]) for o in outs) / elapsed,
            "threads": torch.get_num_threads()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: steady timings on a shared machine)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per configuration; best")
    ap.add_argument("--only", help="comma-separated config numbers (1-based) to run")
    add_model_option(ap, "a 12-layer 512-wide Llama saved in bfloat16")
    ap.add_argument("--budget-mib", type=int,
                    help="'device memory' for the capacity column (x mem_fraction_static 0.5); "
                         "default 1024 for the random model, 4096 for others")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.budget_mib is None:
        args.budget_mib = 1024 if args.model == RANDOM else 4096
    if args.child:
        print(json.dumps(child(args.model_dir, json.loads(args.child), args)))
        return
    import torch

    from engine_testing.checkpoints import make_tiny_model

    picked = [CONFIGS[int(i) - 1] for i in args.only.split(",")] if args.only else CONFIGS
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = resolve(args.model, lambda: make_tiny_model(
            tmp, "LlamaForCausalLM", save_dtype=torch.bfloat16, **MODEL))
        for label, options in picked:
            cmd = [sys.executable, __file__, "--child", json.dumps(options),
                   "--model-dir", model_dir,
                   "--requests", str(args.requests), "--prompt-len", str(args.prompt_len),
                   "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
                   "--repeats", str(args.repeats), "--budget-mib", str(args.budget_mib)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append((label, json.loads(out.stdout.strip().splitlines()[-1])))
    base = rows[0][1]  # float32: the CPU speed baseline
    bf16 = next((r for label, r in rows if label == "bf16"), base)  # the memory baseline
    mib = 1 << 20
    about = (f"random Llama {MODEL}, checkpoint bfloat16" if args.model == RANDOM else
             name(args.model, model_dir))
    print(f"model: {about}; {args.requests} requests x "
          f"{args.prompt_len} prompt + {args.new_tokens} new tokens, greedy; "
          f"{base['threads']} torch threads; capacity: KV tokens that fit in {args.budget_mib} MiB "
          f"x mem_fraction_static 0.5 after the weights")
    print(f"{'configuration':<28}{'weights':>8}{'vs bf16':>8}{'linear':>8}{'vs bf16':>8}"
          f"{'RSS load':>9}{'peak':>7}"
          f"{'KV B/tok':>9}{'capacity':>9}{'vs bf16':>8}{'tok/s':>8}{'vs fp32':>8}")
    for label, r in rows:
        print(f"{label:<28}{r['weight_bytes'] / mib:>8.1f}"
              f"{r['weight_bytes'] / bf16['weight_bytes']:>8.2f}{r['linear_bytes'] / mib:>8.1f}"
              f"{r['linear_bytes'] / bf16['linear_bytes']:>8.2f}{r['rss_load'] / mib:>9.1f}"
              f"{r['rss_peak'] / mib:>7.1f}{r['kv_bytes_per_token']:>9}{r['capacity']:>9}"
              f"{r['capacity'] / bf16['capacity']:>8.2f}{r['tok_s']:>8.1f}"
              f"{r['tok_s'] / base['tok_s']:>8.2f}")
    print("MiB: weights (all parameters), linear (the quantizable projections), RSS load "
          "(resident set after Engine() minus before it), peak (the high-water mark during "
          "Engine() minus the same). "
          "vs bf16 / vs fp32: ratio to that row.")

if __name__ == "__main__":
    main()
