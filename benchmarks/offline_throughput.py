"""Offline throughput: Engine.generate against HF transformers' generate, same model, same run.

Workload (fixed seed): prompt lengths uniform in [32, 512], output lengths uniform in [16, 256],
EOS ignored. HF runs padded batches of 32 (left padding), each to its longest request; both sides
count only the requested tokens. Also prints the decode step time at batch 64 against the
float32 matmul roofline: the same step's matmuls alone through the fastest float32 path measured
here (oneDNN-prepacked weights or a plain matmul).

    python benchmarks/offline_throughput.py [--requests 256] [--skip-hf] [--model default]

``--model``: ``random`` (a random 125M-parameter Llama, the default), ``default``
(SmolLM2-135M-Instruct) or a path (HF directory or .gguf; HF loads a GGUF with its own loader).
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time

import torch

from bench_models import add_model_option, describe, load_hf, model_config, resolve

from engine import Engine
from engine_testing.checkpoints import make_tiny_model

MODEL = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
             max_position_embeddings=1024)


def workload(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(32, 512))],
             rng.randint(16, 256)) for _ in range(n)]


def run_engine(model_dir, work):
    engine = Engine(model_dir, max_total_tokens=200_000)
    engine.generate(input_ids=[work[0][0]], sampling_params={"max_new_tokens": 2})  # warm-up
    start = time.perf_counter()
    outs = engine.generate(input_ids=[p for p, _ in work], sampling_params=[
        {"temperature": 0, "ignore_eos": True, "max_new_tokens": n} for _, n in work])
    elapsed = time.perf_counter() - start
    assert [len(o["output_ids"]) for o in outs] == [n for _, n in work]
    return sum(n for _, n in work) / elapsed, elapsed, engine


def run_hf(model_dir, work, batch_size=32):
    model = load_hf(model_dir)
    model.generation_config.eos_token_id = None  # run every request to its length
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        batch = work[i: i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), 2, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, (p, _) in enumerate(batch):  # left padding, as a user does for generation
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=2,
                           max_new_tokens=max(n for _, n in batch))
    elapsed = time.perf_counter() - start
    return sum(n for _, n in work) / elapsed, elapsed


def decode_matmuls(c, m=64, reps=7):
    """The float32 matmul roofline of a decode step of the model of ModelConfig ``c``: the
    step's linear layers alone (same shapes, separate weights per layer, so they stream from
    memory as in the model) at batch ``m``, each through the fastest float32 path this machine
    offers: oneDNN-prepacked weights (what the engine runs on CPU) or a plain matmul, whichever
    measures faster in total. Returns (GFLOP per step, best seconds, path)."""
    h, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * f), (f, h)] * c.num_layers
    weights = [torch.randn(n, k) for k, n in [*shapes, (h, v)]]
    inputs = {k: torch.randn(m, k) for k in {k for k, _ in shapes}}
    paths = {"matmul": [(w.t(), lambda x, w: x @ w) for w in weights]}
    if torch.backends.mkldnn.is_available():
        linear = torch.ops.mkldnn._linear_pointwise
        paths["oneDNN prepacked"] = [
            (torch.ops.mkldnn._reorder_linear_weight(w, m),
             lambda x, w: linear(x, w, None, "none", [], "")) for w in weights]
    best = {}
    for name, calls in paths.items():
        best[name] = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            for (w, call), raw in zip(calls, weights):
                call(inputs[raw.shape[1]], w)
            best[name] = min(best[name], time.perf_counter() - start)
    path = min(best, key=best.get)
    return 2 * m * sum(w.numel() for w in weights) / 1e9, best[path], path


def read_bandwidth(mib=512, reps=5):
    """Bytes per second this machine streams from memory (a float32 sum over ``mib`` MiB)."""
    x = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def decode_step_time(engine, batch=64, prompt_len=128, steps=20):
    vocab = engine.runner.model_config.vocab_size
    reqs = [r for i in range(batch) for r in engine.add_request(
        [3 + (i * 31 + j) % (vocab - 3) for j in range(prompt_len)],
        {"temperature": 0, "ignore_eos": True, "max_new_tokens": steps + 4})]
    while any(r.prefilling or r.kv_len == 0 for r in reqs):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.scheduler.has_work:
        engine.step()
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--skip-hf", action="store_true")
    add_model_option(ap, "a 125M-parameter Llama")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = resolve(args.model, lambda: make_tiny_model(tmp, "LlamaForCausalLM", **MODEL))
        config = model_config(model_dir)
        work = workload(args.requests, config.vocab_size)
        ours, ours_s, engine = run_engine(model_dir, work)
        model = engine.runner.model  # prepacked weights are buffers named ...weight
        params = sum(p.numel() for p in model.parameters()) + sum(
            b.numel() for n, b in model.named_buffers() if n.endswith(".weight"))
        step = decode_step_time(engine)
        step1 = decode_step_time(engine, batch=1)
        hf = run_hf(model_dir, work) if not args.skip_hf else None
    gflop, matmul_s, path = decode_matmuls(config)
    print(f"model: {describe(args.model, model_dir, params)}, float32, "
          f"{torch.get_num_threads()} threads; {args.requests} requests, "
          f"{sum(n for _, n in work)} output tokens; engine attention backend: "
          f"{engine.attention_backend}")
    print(f"{'':<22}{'output tok/s':>14}{'seconds':>10}")
    print(f"{'engine':<22}{ours:>14.1f}{ours_s:>10.1f}")
    if hf:
        print(f"{'HF generate (bs 32)':<22}{hf[0]:>14.1f}{hf[1]:>10.1f}")
        print(f"ratio engine / HF: {ours / hf[0]:.2f}x")
    print(f"decode step at batch 64 (128-token prompts): {step * 1e3:.1f} ms = "
          f"{gflop / step:.1f} GFLOP/s; its {gflop:.1f} GFLOP of matmuls alone (float32, same "
          f"shapes and weight sizes, {path}, the faster here): {matmul_s * 1e3:.1f} ms = {gflop / matmul_s:.1f} GFLOP/s; "
          f"fraction of that roofline: {matmul_s / step:.2f}")
    bw = read_bandwidth()
    embed = engine.runner.model.model.embed_tokens.weight
    read = engine.runner.weight_bytes - embed.numel() * embed.element_size()  # rows looked up
    mib, floor = read / 2**20, read / bw
    print(f"decode step at batch 1: {step1 * 1e3:.1f} ms; reading the {mib:.0f} MiB of "
          f"weights a step reads (all but the embedding) once at this machine's "
          f"{bw / 1e9:.1f} GB/s takes {floor * 1e3:.1f} ms; fraction of that bandwidth "
          f"roofline: {floor / step1:.2f}")

if __name__ == "__main__":
    main()
