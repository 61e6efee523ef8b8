"""The linear kernels on this machine: one decode step's matmuls, per path, at several batch sizes.

A step of M tokens runs every linear of the model once (q/k/v packed, o, gate/up packed, down,
per layer; then the LM head): each layer has its own weights, as in the model, so they stream
from memory as they do in a real step (random weights of the model's shapes). Paths:

- ``F.linear``: plain float32 (the engine on CUDA, and with ENGINE_LINEAR_KERNEL=plain);
- ``oneDNN``: float32 weights prepacked for oneDNN (the engine's float32 path on CPU);
- ``fbgemm int8``: ``--quantization w8a8_int8``'s CPU kernel (engine-quant-int8), per-token int8
  activations; its LM head stays float32 (oneDNN), as the engine runs it;
- ``fp16 weights``: fbgemm's fp16-weight GEMM (``linear_dynamic_fp16``: weights stored in
  float16, converted on the fly, float32 arithmetic; llama.cpp's approach for F16 GGUFs), LM head
  included: the engine's path with ``--dtype float16`` on a CPU.

Prints milliseconds per step, GFLOP/s and the speed-up over ``F.linear``.

    python benchmarks/linear_kernels.py [--model default] [--batch-sizes 1,16,64,256] [--no-head]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from bench_models import DEFAULT, model_config, resolve

SCALE = 0.05  # random weights of about a trained model's magnitude


def layer_shapes(c) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's linears, packed as the engine packs them."""
    kv = c.num_kv_heads * c.head_dim
    return [(c.num_heads * c.head_dim + 2 * kv, c.hidden_size),
            (c.hidden_size, c.num_heads * c.head_dim),
            (2 * c.intermediate_size, c.hidden_size),
            (c.hidden_size, c.intermediate_size)]


def build_paths(c, with_int8: bool):
    """{path: (list of (weight handle, in_features), head handle, fn(x, handle))}."""
    shapes = layer_shapes(c)
    weights = [torch.randn(o, i) * SCALE for _ in range(c.num_layers) for o, i in shapes]
    head = torch.randn(c.vocab_size, c.hidden_size) * SCALE

    def onednn(w):
        return torch.ops.mkldnn._reorder_linear_weight(w, 64)

    def run_onednn(x, p):
        return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    paths = {
        "F.linear": ([(w, w.shape[1]) for w in weights], head, F.linear),
        "oneDNN": ([(onednn(w), w.shape[1]) for w in weights], onednn(head), run_onednn),
    }
    if with_int8:
        from engine_quant_int8 import kernels

        def pack8(w):
            q, s = kernels.quantize_rows(w, kernels.FBGEMM_WEIGHT_QMAX)
            return kernels.fbgemm_pack(q, s)

        packed_head = onednn(head)

        def run_int8(x, p):
            if p is packed_head:
                return run_onednn(x, p)
            return kernels.fbgemm_linear(x, p, False)

        paths["fbgemm int8"] = ([(pack8(w), w.shape[1]) for w in weights], packed_head,
                                run_int8)
    fp16 = torch.ops.quantized.linear_prepack_fp16
    paths["fp16 weights"] = ([(fp16(w, None), w.shape[1]) for w in weights], fp16(head, None),
                             torch.ops.quantized.linear_dynamic_fp16)
    return paths


def step_ms(layers, head, fn, m: int, hidden: int, reps: int) -> float:
    inputs = {k: torch.randn(m, k) for k in {i for _, i in layers} | {hidden}}

    def once():
        for w, i in layers:
            fn(inputs[i], w)
        if head is not None:
            fn(inputs[hidden], head)

    once()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT,
                    help="'default' (SmolLM2-135M-Instruct's shapes, the default) or a path")
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--reps", type=int, default=5, help="best of this many steps")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-head", action="store_true",
                    help="the decoder layers only, as a prompt chunk runs them (its LM head "
                         "runs for the last token alone)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    c = model_config(resolve(args.model, lambda: None))
    try:
        import engine_quant_int8  # noqa: F401
        with_int8 = True
    except ImportError:
        with_int8 = False
    paths = build_paths(c, with_int8)
    params = sum(o * i for o, i in layer_shapes(c)) * c.num_layers \
        + (0 if args.no_head else c.vocab_size * c.hidden_size)
    head = "no LM head" if args.no_head else f"LM head {c.vocab_size} x {c.hidden_size}"
    print(f"{c.num_layers} layers x {layer_shapes(c)} (out, in) + {head}: "
          f"{params / 1e6:.1f}M weights, "
          f"{args.threads} threads; ms per step (GFLOP/s), speed-up over F.linear")
    if not with_int8:
        print("(engine-quant-int8 is not installed: no fbgemm int8 column)")
    print(f"{'M':>6} " + " ".join(f"{p:>24}" for p in paths))
    for m in [int(b) for b in args.batch_sizes.split(",")]:
        cells, base = [], None
        for layers, head, fn in paths.values():
            ms = step_ms(layers, None if args.no_head else head, fn, m, c.hidden_size, args.reps)
            base = base or ms
            cells.append(f"{ms:8.1f} ({2 * m * params / ms / 1e6:5.1f}) {base / ms:5.2f}x")
        print(f"{m:>6} " + " ".join(f"{cell:>24}" for cell in cells))


if __name__ == "__main__":
    main()
