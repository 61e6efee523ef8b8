"""An MoE layer (engine.layers.moe.SparseMoE) against a dense MLP with the same active FLOPs,
float32 on this CPU, at several token counts: the MoE layer as the engine runs it on a CPU
(its experts grouped, two calls into a plugin's grouped GEMM: layers/moe_grouped.py) and with
the per-expert loop (one oneDNN GEMM per active expert, ``ENGINE_MOE_KERNEL=per_expert``); the
dense layer's linears as the engine runs them (engine-cpu-kernels' float32 kernel where it runs,
else oneDNN).

The MoE block has E experts of intermediate size I, each token routed to k of them; the dense
MLP (the Llama family's, engine.models.llama.MLP) has intermediate size k x I, so a token costs
both the same multiply-adds in its projections (the MoE's router adds hidden x E more, counted
for neither). Both are the engine's modules with their weights packed as the engine packs them
on a CPU (``prepack_linears``: oneDNN float32; ``group_moe_layers`` first for the grouped
side). Shapes (``--shape``, at ``--hidden``, 1024 by
default; each real model's E, k and I / hidden):

- ``qwen3-moe``: 128 experts, top-8, I = 0.375 hidden (Qwen3-30B-A3B: 2048 hidden, 768 per
  expert): fine-grained experts, 16 tokens per expert on average at 256 tokens;
- ``mixtral``: 8 experts, top-2, I = 3.5 hidden (Mixtral-8x7B: 4096, 14336): 64 per expert;
- ``custom``: ``--experts``, ``--top-k``, ``--expert-intermediate``.

As in a model, whose layers each have their own weights, every call reads its weights from
memory, not from the last call's cache: each side cycles through copies of its layer (at least
2, and 256 MiB of weights in all, 8x this machine's 32 MiB L3) and through 7 different inputs
(different experts). Random weights (0.05 std) and inputs, so the routing is a random router's:
uneven (the expert loads at the first input are printed).

Printed per token count: the dense layer's and each MoE side's milliseconds per call (a cycle
over all copies, divided by the copies; the dense and MoE cycles alternate, and each side's
best of ``--reps`` cycles after a warm-up cycle counts: the machine may be shared, and the best
is the least disturbed), and each MoE side's throughput as a fraction of the dense layer's
(dense ms / MoE ms; issue 31's target: >= 0.7 at 256 tokens). ``--profile N`` prints
torch.profiler's table of the engine's MoE calls at N tokens.

    python benchmarks/moe_layer.py [--shape qwen3-moe|mixtral|custom] [--hidden 1024]
        [--experts E --top-k K --expert-intermediate I] [--tokens 1,16,256] [--reps 10]
        [--threads N] [--profile 256]
"""

from __future__ import annotations

import argparse
import platform
import time
from types import SimpleNamespace

import torch

from engine.layers.linear import PrepackedWeight, prepack_linears
from engine.layers.moe import SparseMoE
from engine.layers.moe_grouped import group_moe_layers
from engine.models.llama import MLP

SCALE = 0.05


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * SCALE)


SHAPES = {"qwen3-moe": (128, 8, 0.375), "mixtral": (8, 2, 3.5)}  # E, k, I / hidden
WORKING_SET = 256 << 20  # bytes of weights each side cycles through
INPUTS = 7


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def build(args) -> tuple[list[list[torch.nn.Module]], list[int], str]:
    """Copies of the dense layer, of the MoE layer on the per-expert loop and of the MoE layer
    grouped (where a plugin's grouped GEMM runs here), each side's weights at least
    WORKING_SET bytes in all, packed as the engine packs them; one layer's weight bytes; the
    grouped side's ``MoE layers`` line."""
    from engine.plugins import get_registries

    registries, line = get_registries(), ""
    block = None
    if args.weights != "float32":  # every side's linears packed as GGUF blocks of that type
        from engine.models.block_weights import block_kernel

        block = block_kernel(registries, args.weights)
        if block is None:
            raise SystemExit(f"no usable linear kernel for {args.weights} blocks here")
    def dense_layer():
        return MLP(SimpleNamespace(hidden_size=args.hidden, mlp_bias=False,
                                   intermediate_size=args.top_k * args.expert_intermediate))

    def moe_layer():
        return SparseMoE(args.hidden, args.expert_intermediate, args.experts, args.top_k,
                         renormalize=True)

    sides, sizes = [], []
    for side, make in enumerate((dense_layer, moe_layer, moe_layer)):
        layers = [make()]
        sizes.append(weight_bytes(layers[0]))
        # blocks hold 4.5-8.5 bits a weight: 4x the copies keep the working set out of cache
        copies = max(2, -(-WORKING_SET // sizes[-1])) * (1 if block is None else 4)
        layers += [make() for _ in range(copies - 1)]
        for i, m in enumerate(layers):
            randomize(m, 100 * min(side, 1) + i)  # both MoE sides: the same weights
            m.eval()
            if block is not None:
                for lin in m.modules():
                    if isinstance(lin, PrepackedWeight) and not lin.packed:
                        lin.prepack("plugin", kernel=block.obj)
            if side == 2:
                line = group_moe_layers(m, torch.device("cpu"), torch.float32, False,
                                        registries)
            prepack_linears(m, torch.device("cpu"), torch.float32,
                            registries=registries if side != 1 else None)
        sides.append(layers)
    if "grouped GEMMs" not in line:
        print(f"no grouped side: {line}")
        sides.pop()
    return sides, sizes, line


def cycle_s(calls: list) -> float:
    t = time.perf_counter()
    for m, x in calls:
        m(x)
    return time.perf_counter() - t


def ms_per_call(sides: list[list], inputs: list[torch.Tensor], reps: int) -> list[float]:
    """Per side (a list of layer copies): one cycle calls every copy once, each on the next
    input; the sides' cycles alternate (a busy machine slows both alike), a warm-up cycle
    each, then the best of ``reps`` cycles per side, per call."""
    calls = [[(m, inputs[i % len(inputs)]) for i, m in enumerate(layers)] for layers in sides]
    best = [float("inf")] * len(sides)
    with torch.no_grad():
        for c in calls:
            cycle_s(c)
        for _ in range(reps):
            for i, c in enumerate(calls):
                best[i] = min(best[i], cycle_s(c))
    return [b / len(c) * 1e3 for b, c in zip(best, calls)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=[*SHAPES, "custom"], default="qwen3-moe")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-intermediate", type=int, default=256)
    ap.add_argument("--tokens", default="1,16,256")
    ap.add_argument("--weights", default="float32", choices=["float32", "q4_1", "q4_0", "q8_0"],
                    help="GGUF blocks: every linear of every side quantized to that type and "
                         "run by the best kernel for it (the weight-only one: float32 "
                         "activations), as a GGUF model's")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--profile", type=int, default=0, help="profile MoE calls at N tokens")
    args = ap.parse_args()
    if args.shape != "custom":
        e, k, ratio = SHAPES[args.shape]
        args.experts, args.top_k = e, k
        args.expert_intermediate = int(ratio * args.hidden)
    if args.threads:
        torch.set_num_threads(args.threads)
    sides, sizes, line = build(args)
    dense, moe = sides[0], sides[-1]
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{args.shape}: hidden {args.hidden}, {args.experts} experts x "
          f"{args.expert_intermediate} top-{args.top_k} vs dense intermediate "
          f"{args.top_k * args.expert_intermediate}, {args.weights} weights; {len(dense)} dense "
          f"and {len(moe)} MoE layer copies ({sizes[0] >> 20} and {sizes[1] >> 20} MiB "
          f"each as float32)")
    if len(sides) == 3:
        print(line)
    names = ["loop", "grouped"][:len(sides) - 1]
    print(f"{'tokens':>6} {'dense ms':>9} " + " ".join(f"{n + ' ms':>11}" for n in names) +
          " " + " ".join(f"{n + '/dense':>13}" for n in names) +
          "  active experts (min-max tokens)")
    gen = torch.Generator().manual_seed(7)
    for n in (int(t) for t in args.tokens.split(",")):
        inputs = [torch.randn(n, args.hidden, generator=gen) for _ in range(INPUTS)]
        d, *ms = ms_per_call(sides, inputs, args.reps)
        with torch.no_grad():
            _, ids = torch.topk(moe[0].gate(inputs[0]), args.top_k)
        loads = torch.bincount(ids.reshape(-1), minlength=args.experts)
        active = loads[loads > 0]
        print(f"{n:>6} {d:>9.3f} " + " ".join(f"{m:>11.3f}" for m in ms) + " " +
              " ".join(f"{d / m:>12.2f}x" for m in ms) +
              f"  {active.numel()} ({active.min().item()}-{active.max().item()})")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        inputs = [torch.randn(args.profile, args.hidden, generator=gen) for _ in range(INPUTS)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ms_per_call([moe], inputs, 1)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
