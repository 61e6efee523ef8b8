"""GPU check step (d): decode attention of every attention backend that runs here, against
torch_native (the reference) on the same pool.

Per backend: (1) float32 correctness on the tests' mixed extend/decode steps, a full and a
sliding-window layer (engine_testing.attention.backend_matches_torch_native, tolerance 1e-4: TF32
matmuls would fail it); (2) one bfloat16 decode step with Llama-3-8B's attention shapes (32 heads, 8
KV heads, head dim 128), batch 32, contexts uniform in [512, 2048], timed (init_forward_metadata
plus every layer's forward; mean of the steps after warm-ups) with its largest difference from
torch_native. Backends that cannot run here are listed with their reason.

    python scripts/gpu_attention.py --json OUT.json [--device cuda] [--batch 32] [--layers 4]

Without CUDA it writes status "skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback


def decode_case(entry, native_entry, device, dtype, batch: int, layers: int, steps: int,
                shape=(32, 8, 128), max_ctx: int = 2048):
    """(ms per step of the backend, of torch_native, max |difference|) on one bf16 decode."""
    import torch

    from engine.forward_batch import ForwardBatch
    from engine.interfaces import AttentionLayerSpec, BackendContext
    from engine.memory.kv_pool import KVPool
    from engine.registry import default_page_size

    H, KVH, D = shape
    page = default_page_size(entry)
    rng = random.Random(0)
    lens = [rng.randint(max_ctx // 4, max_ctx) for _ in range(batch)]
    pool = KVPool(layers, KVH, D, sum(lens) + batch * (page + 1) + 1024, dtype, device=device,
                  page_size=page, max_reqs=batch + 1, max_context_len=max_ctx + 64)
    gen = torch.Generator(device=device).manual_seed(0)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.normal_(generator=gen)
    rows = [pool.alloc_req() for _ in lens]
    for r, n in zip(rows, lens):
        pool.extend_slots(r, 0, n)
    locs = torch.cat([pool.extend_slots(r, n, 1) for r, n in zip(rows, lens)])
    fb = ForwardBatch.build([[5]] * batch, lens, rows, locs, pool.req_to_token, device=device)
    specs = [AttentionLayerSpec(H, KVH, D, D ** -0.5) for _ in range(layers)]
    qkv = [tuple(torch.randn(batch, n, D, device=device, dtype=dtype, generator=gen)
                 for n in (H, KVH, KVH)) for _ in range(layers)]

    def run(backend):
        backend.init_forward_metadata(fb)
        return [backend.forward(q, k, v, layer, fb) for layer, (q, k, v) in enumerate(qkv)]

    def timed(backend) -> float:
        for _ in range(3):
            run(backend)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            run(backend)
        sync()
        return (time.perf_counter() - t0) / steps * 1e3

    ctx = BackendContext(pool, specs, device, dtype)
    ours, ref = entry.obj(ctx), native_entry.obj(ctx)
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(run(ours), run(ref)))
    return timed(ours), timed(ref), diff


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-ctx", type=int, default=2048)
    ap.add_argument("--backends", default="", help="only these (comma-separated)")
    ap.add_argument("--float32-tol", type=float, default=1e-4)
    args = ap.parse_args()
    import torch

    result = {"status": "pass", "figures": {}, "cases": []}

    def write():
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    if args.device == "cuda" and not torch.cuda.is_available():
        result.update(status="skipped", reason="no CUDA device (torch.cuda.is_available() is "
                                               "False)")
        write()
        return 0
    from engine.device import detect_device
    from engine.plugins import get_registries
    from engine.registry import default_page_size, takes_dtype
    from engine_testing.attention import backend_matches_torch_native

    device = detect_device(args.device)
    regs = get_registries()
    native = regs.attention.get("torch_native")
    wanted = set(filter(None, args.backends.split(",")))
    for entry in regs.attention:
        if entry.name == "torch_native" or (wanted and entry.name not in wanted):
            continue
        case = {"backend": entry.name}
        result["cases"].append(case)
        reason = entry.unavailable_reason(device)
        if reason:
            case.update(status="skipped", reason=reason)
            continue
        problems = []
        if takes_dtype(entry, "float32"):
            try:
                backend_matches_torch_native(entry.obj, (32, 8, 128), default_page_size(entry),
                                             tol=args.float32_tol, device=args.device)
                case["float32 mixed steps"] = f"match (tol {args.float32_tol:g})"
            except Exception as exc:
                traceback.print_exc()
                first = str(exc).strip().splitlines()
                case["float32 mixed steps"] = f"{type(exc).__name__}: " + " ".join(first[:3])
                problems.append(f"float32: {case['float32 mixed steps']}"[:300])
        dtype = "bfloat16" if takes_dtype(entry, "bfloat16") else "float32"
        try:
            ms, ref_ms, diff = decode_case(entry, native, args.device, getattr(torch, dtype),
                                           args.batch, args.layers, args.steps,
                                           max_ctx=args.max_ctx)
            case.update({"decode dtype": dtype, "ms/step": round(ms, 3),
                         "torch_native ms/step": round(ref_ms, 3),
                         "speed-up": round(ref_ms / ms, 2), "max |diff|": f"{diff:.3g}"})
            tol = 2e-2 if dtype == "bfloat16" else 1e-3
            if diff > tol:
                problems.append(f"{dtype} decode differs from torch_native by {diff:.3g} "
                                f"(> {tol})")
            result["figures"][f"{entry.name} decode ({dtype}, batch {args.batch}, "
                              f"{args.layers} layers)"] = (
                f"{ms:.3f} ms vs torch_native {ref_ms:.3f} ms ({ref_ms / ms:.2f}x), "
                f"max diff {diff:.3g}")
        except Exception as exc:
            traceback.print_exc()
            problems.append(f"decode: {type(exc).__name__}: {exc}"[:300])
        case["status"] = "fail" if problems else "pass"
        if problems:
            case["reason"] = "; ".join(problems)
        print(json.dumps(case), flush=True)
        if device.is_cuda:
            torch.cuda.empty_cache()
    ran = [c for c in result["cases"] if c["status"] != "skipped"]
    failed = [c for c in ran if c["status"] == "fail"]
    if not ran:
        result.update(status="fail", reason="no attention backend besides torch_native ran: " +
                      "; ".join(f"{c['backend']}: {c.get('reason')}" for c in result["cases"]))
    elif failed:
        result.update(status="fail", reason="; ".join(f"{c['backend']}: {c['reason']}"
                                                      for c in failed))
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
