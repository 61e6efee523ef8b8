"""Decode attention alone: every registered backend that runs here, on one batch, same pool.

A decode step of the offline-throughput model's attention (12 layers, 12 heads, 4 KV heads, head
dim 64, float32): 152 requests with context lengths uniform in [300, 768]. Slots are laid out as
a long run leaves them: each prompt contiguous, then decode tokens interleaved across requests.
Prints milliseconds per step (all layers, K/V write included) and the speed-up over torch_native.

    python benchmarks/decode_attention.py [--batch 152] [--steps 5] [--model default]

``--model`` takes the attention shapes (layers, heads, KV heads, head dim) of a model instead
(``default``: SmolLM2-135M-Instruct, 30 layers, 9 heads / 3 KV heads x 64); K/V stay random.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from bench_models import RANDOM, add_model_option, model_config, resolve

from engine.device import detect_device
from engine.forward_batch import ForwardBatch
from engine.interfaces import AttentionLayerSpec, BackendContext
from engine.memory.kv_pool import KVPool
from engine.plugins import get_registries

LAYERS, H, KVH, D = 12, 12, 4, 64  # the offline-throughput model's


def build(batch_size: int, seed: int = 0):
    rng = random.Random(seed)
    lens = [rng.randint(300, 768) for _ in range(batch_size)]
    pool = KVPool(LAYERS, KVH, D, sum(lens) + 4096, torch.float32, max_reqs=batch_size,
                  max_context_len=1024)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf[1:].normal_()
    rows = [pool.alloc_req() for _ in lens]
    prompts = [n - rng.randint(16, 256) for n in lens]  # the rest came one token per step
    for r, p in zip(rows, prompts):
        pool.extend_slots(r, 0, p)
    for step in range(max(lens)):
        for r, p, n in zip(rows, prompts, lens):
            if p + step < n:
                pool.extend_slots(r, p + step, 1)
    locs = torch.stack([pool.req_to_token[r, n - 1] for r, n in zip(rows, lens)])
    batch = ForwardBatch.build([[5]] * batch_size, [n - 1 for n in lens], rows, locs,
                               pool.req_to_token)
    return pool, batch


def time_backend(factory, pool, batch, steps: int) -> float:
    specs = [AttentionLayerSpec(H, KVH, D, D ** -0.5) for _ in range(LAYERS)]
    backend = factory(BackendContext(pool, specs, "cpu", torch.float32))
    B = batch.batch_size
    q, k, v = torch.randn(B, H, D), torch.randn(B, KVH, D), torch.randn(B, KVH, D)
    times = []
    with torch.inference_mode():
        for _ in range(steps + 1):  # the first is a warm-up
            start = time.perf_counter()
            backend.init_forward_metadata(batch)
            for layer in range(LAYERS):
                backend.forward(q, k, v, layer, batch)
            times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=152)
    ap.add_argument("--steps", type=int, default=5)
    add_model_option(ap, "the offline-throughput model's shapes")
    args = ap.parse_args()
    if args.model != RANDOM:
        global LAYERS, H, KVH, D
        c = model_config(resolve(args.model, None))
        LAYERS, H, KVH, D = c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim
    pool, batch = build(args.batch)
    device = detect_device("cpu")
    regs = get_registries()
    usable = [e for e in regs.attention if not e.unavailable_reason(device)]
    print(f"batch {args.batch}, {sum(batch.seq_lens_list)} context tokens, {LAYERS} layers, "
          f"{H} heads / {KVH} KV heads x {D}, float32, {torch.get_num_threads()} threads")
    base = None
    for entry in sorted(usable, key=lambda e: e.name != "torch_native"):
        ms = time_backend(entry.obj, pool, batch, args.steps) * 1e3
        base = base or ms
        print(f"{entry.name:<14}{ms:>10.1f} ms/step{base / ms:>8.2f}x")


if __name__ == "__main__":
    main()
