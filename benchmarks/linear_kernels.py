"""The linear kernels on this machine: one decode step's matmuls, per path, at several batch sizes.

A step of M tokens runs every linear of the model once (q/k/v packed, o, gate/up packed, down,
per layer; then the LM head): each layer has its own weights, as in the model, so they stream
from memory as they do in a real step (random weights of the model's shapes). Paths:

- ``F.linear``: plain float32 (the engine on CUDA, and with ENGINE_LINEAR_KERNEL=plain);
- ``oneDNN``: float32 weights prepacked for oneDNN (the engine's float32 path on CPU);
- ``fbgemm int8``: ``--quantization w8a8_int8``'s CPU kernel (engine-quant-int8), per-token int8
  activations; its LM head stays float32 (oneDNN), as the engine runs it;
- ``fbgemm fp16``: fbgemm's fp16-weight GEMM (``linear_dynamic_fp16``: weights stored in
  float16, converted on the fly, float32 arithmetic; llama.cpp's approach for F16 GGUFs), LM head
  included: the core's path with ``--dtype float16`` on a CPU (ENGINE_LINEAR_KERNEL=torch);
- ``F.linear bf16``: bfloat16 weights and activations through torch (oneDNN): the core's path
  with ``--dtype bfloat16`` on a CPU (ENGINE_LINEAR_KERNEL=torch);
- engine-cpu-kernels' GEMMs (when installed), each instruction set this CPU has, the AVX2 ones
  too on an AVX-512 CPU (what ENGINE_CPU_ISA=avx2 runs): ``avx512_bf16`` (vdpbf16ps) and
  ``avx512_bf16_fma`` / ``avx2_bf16`` (widened + FMA) on bfloat16 activations, as a
  ``--dtype bfloat16`` model runs them; ``avx512_fp16`` / ``avx2_fp16`` on float32 activations
  (``--dtype float16``); ``avx512_q8_0`` (vpdpbusd) / ``avx2_q8_0`` on GGUF Q8_0 blocks;
  ``avx512_q4_1`` / ``avx2_q4_1`` and ``avx512_q4_0`` / ``avx2_q4_0`` on GGUF Q4_1 / Q4_0
  blocks (every linear, LM head included, quantized as llama.cpp quantizes), all of these with
  int8 activations per block; ``avx512_q4_1_f32`` ... ``avx2_q8_0_f32``: the same blocks,
  weight-only (float32 activations, the blocks dequantized in registers: the engine's default);
- ``gguf avx512`` / ``gguf avx2`` (int8 activations) and ``gguf f32 avx512`` / ``gguf f32 avx2``
  (weight-only): the default GGUF file's mix as its blocks are, packed from GGUF bytes
  (``CPUGemm.pack_blocks``): Q4_1 decoder linears, the Q8_0 tied LM head.

Prints, per path and M, milliseconds per step (each linear's best of --reps steps, summed),
GFLOP/s, the fraction of the machine's arithmetic peak for the instruction the path is built on
(measured first: 12 independent chains of that instruction per thread, on --threads threads,
the best of many short runs on one core, times the threads; the int8 block kernels: vpdpbusd,
or vpmaddubsw on AVX2, counting 2 operations per byte multiplied), the weight bytes streamed per
second and their fraction of the machine's memory bandwidth (a 256 MiB torch copy, read + write
bytes per second, and a 256 MiB torch sum, reads only; the best of several), and the speed-up
over ``F.linear``; ``--per-shape`` adds each linear shape's share (ms per step, weight GB/s) for
the plugin's paths. On a machine shared with other work (2 cores,
other processes' tests), every figure is a best of several runs and still noisy: rerun and
take the best.

    python benchmarks/linear_kernels.py [--model default] [--batch-sizes 1,16,64,512] [--no-head]
        [--paths avx512_bf16,avx2_bf16,...] [--per-shape]
"""

from __future__ import annotations

import argparse
import platform
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


class Path:
    """One way to run the step: ``fn(x, handle)`` over ``layers`` [(handle, in_features)] and
    ``head``; activations in ``x_dtype``; ``peak`` names the instruction it is built on;
    ``weight_bytes``: (the layers', the head's) as stored."""

    def __init__(self, layers, head, fn, x_dtype=torch.float32, peak="avx512 FMA (fp32)",
                 weight_bytes=(0, 0)):
        self.layers, self.head, self.fn, self.x_dtype = layers, head, fn, x_dtype
        self.peak, self.weight_bytes = peak, weight_bytes


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return ""
    keep = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
            "avx512_vnni", "amx_bf16")
    return " ".join(f for f in keep if f in flags)


def build_paths(c, with_int8: bool, plugin_paths: list[str] | None, fp32_peak: str):
    """{name: Path}"""
    shapes = layer_shapes(c)
    weights = [torch.randn(o, i) * SCALE for _ in range(c.num_layers) for o, i in shapes]
    head = torch.randn(c.vocab_size, c.hidden_size) * SCALE
    n_layers, n_head = sum(w.numel() for w in weights), head.numel()

    def onednn(w):
        return torch.ops.mkldnn._reorder_linear_weight(w, 64)

    def run_onednn(x, p):
        return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    paths = {
        "F.linear": Path([(w, w.shape[1]) for w in weights], head, F.linear, peak=fp32_peak,
                         weight_bytes=(4 * n_layers, 4 * n_head)),
        "oneDNN": Path([(onednn(w), w.shape[1]) for w in weights], onednn(head), run_onednn,
                       peak=fp32_peak, weight_bytes=(4 * n_layers, 4 * n_head)),
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

        paths["fbgemm int8"] = Path(
            [(pack8(w), w.shape[1]) for w in weights], packed_head, run_int8,
            peak=fp32_peak, weight_bytes=(n_layers, 4 * n_head))
    fp16 = torch.ops.quantized.linear_prepack_fp16
    paths["fbgemm fp16"] = Path([(fp16(w, None), w.shape[1]) for w in weights], fp16(head, None),
                                torch.ops.quantized.linear_dynamic_fp16, peak=fp32_peak,
                                weight_bytes=(2 * n_layers, 2 * n_head))
    paths["F.linear bf16"] = Path([(w.bfloat16(), w.shape[1]) for w in weights], head.bfloat16(),
                                  F.linear, torch.bfloat16, peak="avx512 vdpbf16ps",
                                  weight_bytes=(2 * n_layers, 2 * n_head))
    if plugin_paths is not None:
        from engine_cpu_kernels import ops
        from engine_cpu_kernels.ops import KERNELS

        for k in KERNELS:
            if plugin_paths and k.name not in plugin_paths:
                continue
            reason = k.unavailable_reason()
            if reason:
                print(f"({k.name}: {reason})")
                continue
            packed = [(k.pack(w), w.shape[1]) for w in weights]
            k_head = k.pack(head)
            x_dtype = torch.bfloat16 if k.weight_dtype == "bfloat16" else torch.float32
            peak = {"avx512_bf16": "avx512 vdpbf16ps", "avx512_q8_0": "avx512 vpdpbusd (int8)",
                    "avx512_q4_0": "avx512 vpdpbusd (int8)",
                    "avx512_q4_1": "avx512 vpdpbusd (int8)"}.get(k.name, fp32_peak)
            if k.name.startswith("avx2"):
                peak = "avx2 vpmaddubsw (int8)" if k.weight_dtype in ("q8_0", "q4_0", "q4_1") \
                    and not k.weight_only else "avx2 FMA (fp32)"
            paths[k.name] = Path(packed, k_head, k.linear, x_dtype, peak,
                                 (sum(p.nbytes for p, _ in packed), k_head.nbytes))
        by_name = {k.name: k for k in KERNELS}
        # the default GGUF's mix, from its blocks' bytes: int8 activations ("gguf avx512") and
        # weight-only, float32 activations ("gguf f32 avx512", the engine's default)
        for isa, mode in (("avx512", ""), ("avx512", "_f32"), ("avx2", ""), ("avx2", "_f32")):
            name = f"gguf{' f32' if mode else ''} {isa}"
            if plugin_paths and name not in plugin_paths:
                continue
            layer_k, head_k = by_name[f"{isa}_q4_1{mode}"], by_name[f"{isa}_q8_0{mode}"]
            reason = layer_k.unavailable_reason() or head_k.unavailable_reason()
            if reason:
                print(f"({name}: {reason})")
                continue
            packed = [(layer_k.pack_blocks(ops.quantize_gguf(w, "q4_1"), "q4_1", *w.shape),
                       w.shape[1]) for w in weights]
            k_head = head_k.pack_blocks(ops.quantize_gguf(head, "q8_0"), "q8_0", *head.shape)
            peak = f"{isa} {'vpdpbusd' if isa == 'avx512' else 'vpmaddubsw'} (int8)"
            if mode:
                peak = f"{isa} FMA (fp32)"
            paths[name] = Path(packed, k_head, layer_k.linear, torch.float32, peak,
                               (sum(p.nbytes for p, _ in packed), k_head.nbytes))
    return paths


def step_runner(path: Path, m: int, hidden: int, head: bool):
    """One step of ``path`` at ``m`` rows, as a function returning each linear's seconds."""
    inputs = {k: torch.randn(m, k).to(path.x_dtype) for k in {i for _, i in path.layers} | {hidden}}
    calls = [(w, inputs[i]) for w, i in path.layers] + ([(path.head, inputs[hidden])] if head
                                                         else [])
    fn, clock = path.fn, time.perf_counter

    def once() -> list[float]:
        times = []
        for w, x in calls:
            start = clock()
            fn(x, w)
            times.append(clock() - start)
        return times

    once()  # warm-up: first-touch, scratch buffers
    return once


def best_ms(paths: dict[str, Path], m: int, hidden: int, reps: int, head: bool) -> dict:
    """Per path, the sum over the step's linears of each one's best time over ``reps`` steps.
    The linears run in the step's order, so each one's weights come from memory as in a real
    step, but each is timed alone: on a machine shared with other work, a whole step is rarely
    left alone, one linear (milliseconds at most) often is. The paths take turns within each
    repetition, so that a burst of other work hits them alike."""
    runs = {name: step_runner(path, m, hidden, head) for name, path in paths.items()}
    best: dict[str, list[float]] = {}
    for _ in range(reps):
        for name, once in runs.items():
            times = once()
            best[name] = [min(a, b) for a, b in zip(best.get(name, times), times)]
    return {name: sum(t) * 1e3 for name, t in best.items()}, best


def copy_bandwidth(reps: int = 20) -> float:
    """GB/s of a 256 MiB torch copy, read + write bytes (the best of ``reps``)."""
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


def read_bandwidth(reps: int = 20) -> float:
    """GB/s of a 256 MiB torch sum (reads only; the best of ``reps``)."""
    src = torch.ones(64 << 20)
    src.sum()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - start)
    return src.numel() * 4 / best / 1e9


def measure_peaks(threads: int) -> dict[str, float]:
    """One core's peak (the best of many short runs on one thread) times ``threads``: on a
    machine shared with other work, runs on all cores at once are rarely left alone, and the
    cores are alike."""
    try:
        from engine_cpu_kernels import kernel
    except ImportError:
        return {}
    try:
        return {k: v * threads for k in kernel.PEAK_KINDS
                if (v := kernel.peak(k, 1, seconds=0.02, reps=50)) is not None}
    except kernel.KernelUnavailable as e:
        print(f"(no peak measurement: {e})")
        return {}


def print_per_shape(paths: dict[str, Path], per_linear: dict[str, list[float]], m: int,
                    head: bool) -> None:
    """Each linear shape's share of the step for the plugin's paths: ms per step (all layers),
    GFLOP/s and the weight bytes read per second."""
    for name, path in paths.items():
        if not hasattr(path.head, "fmt"):  # not one of the plugin's (Packed) paths
            continue
        shares: dict[tuple[int, int], list[float]] = {}
        calls = list(path.layers) + ([(path.head, path.head.k)] if head else [])
        for (p, _), t in zip(calls, per_linear[name]):
            s = shares.setdefault((p.n, p.k), [0.0, 0.0, 0.0])
            s[0] += t
            s[1] += 2 * m * p.n * p.k
            s[2] += p.nbytes
        print("      " + name + ": " + ", ".join(
            f"{n}x{k} {t * 1e3:.3f} ms {fl / t / 1e9:.0f} GFLOP/s {b / t / 1e9:.1f} GB/s"
            for (n, k), (t, fl, b) in shares.items()), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT,
                    help="'default' (SmolLM2-135M-Instruct's shapes, the default) or a path")
    ap.add_argument("--batch-sizes", default="1,16,64,512")
    ap.add_argument("--reps", type=int, default=10,
                    help="best of this many steps (a third of them from 256 rows)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--paths", default="",
                    help="only these paths (comma-separated names, as printed)")
    ap.add_argument("--no-head", action="store_true",
                    help="the decoder layers only, as a prompt chunk runs them (its LM head "
                         "runs for the last token alone)")
    ap.add_argument("--per-shape", action="store_true",
                    help="each linear shape's share of the step (the plugin's paths)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    c = model_config(resolve(args.model, lambda: None))
    try:
        import engine_quant_int8  # noqa: F401
        with_int8 = True
    except ImportError:
        with_int8 = False
    try:
        import engine_cpu_kernels  # noqa: F401
        plugin_paths: list[str] | None = []
    except ImportError:
        plugin_paths = None
    only = [p for p in args.paths.split(",") if p]
    if plugin_paths is not None and only:
        plugin_paths = only
    peaks = measure_peaks(args.threads)
    fp32_peak = "avx512 FMA (fp32)" if "avx512 FMA (fp32)" in peaks else "avx2 FMA (fp32)"
    bandwidth, read_bw = copy_bandwidth(), read_bandwidth()
    paths = build_paths(c, with_int8, plugin_paths, fp32_peak)
    if only:
        paths = {k: v for k, v in paths.items() if k in only or k == "F.linear"}
    params = sum(o * i for o, i in layer_shapes(c)) * c.num_layers \
        + (0 if args.no_head else c.vocab_size * c.hidden_size)
    head = "no LM head" if args.no_head else f"LM head {c.vocab_size} x {c.hidden_size}"
    print(f"CPU: {cpu_name()} ({cpu_flags()}), {args.threads} threads")
    print(f"peak (one core measured x {args.threads}, GFLOP/s; int8: GOP/s): " + (", ".join(
        f"{k} {v:.0f}" for k, v in peaks.items()) or "not measured (no engine-cpu-kernels)"))
    print(f"memory bandwidth: 256 MiB torch copy {bandwidth:.1f} GB/s (read + write bytes), "
          f"256 MiB torch sum {read_bw:.1f} GB/s (reads)")
    print(f"{c.num_layers} layers x {layer_shapes(c)} (out, in) + {head}: "
          f"{params / 1e6:.1f}M weights")
    if not with_int8:
        print("(engine-quant-int8 is not installed: no fbgemm int8 path)")
    if plugin_paths is None:
        print("(engine-cpu-kernels is not installed: none of its paths)")
    print(f"{'M':>4} {'path':>16} {'ms/step':>9} {'GFLOP/s':>8} {'% peak':>7} {'weights GB/s':>13} "
          f"{'% copy':>6} {'% read':>6} {'vs F.linear':>11}")
    for m in [int(b) for b in args.batch_sizes.split(",")]:
        base = None
        reps = args.reps if m < 256 else max(2, args.reps // 3)
        times, per_linear = best_ms(paths, m, c.hidden_size, reps, not args.no_head)
        for name, path in paths.items():
            ms = times[name]
            base = base or ms
            gflops = 2 * m * params / ms / 1e6
            peak = peaks.get(path.peak)
            wbytes = path.weight_bytes[0] + (0 if args.no_head else path.weight_bytes[1])
            gbs = wbytes / ms / 1e6
            print(f"{m:>4} {name:>16} {ms:9.2f} {gflops:8.1f} "
                  f"{(f'{100 * gflops / peak:6.0f}%') if peak else '      -':>7} "
                  f"{gbs:13.1f} {100 * gbs / bandwidth:5.0f}% {100 * gbs / read_bw:5.0f}% "
                  f"{base / ms:10.2f}x", flush=True)
        if args.per_shape:
            print_per_shape(paths, per_linear, m, not args.no_head)


if __name__ == "__main__":
    main()
