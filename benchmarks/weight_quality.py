"""Quality of the cheaper weight formats against float32, measured on a fixed English text.

Prints, for float32 (a GGUF's weights dequantized: ``ENGINE_LINEAR_KERNEL=torch``) and each
variant: perplexity of the text (teacher-forced, one prefill),
top-1 agreement of the next-token predictions with float32 over it, and how many greedy tokens
each of a few chat-free prompts keeps equal to float32 before the first difference. Variants:
a GGUF's Q4_1/Q8_0 blocks as they are (weight-only kernels: the default; and the best
int8-activation kernel, llama.cpp's arithmetic), ``--dtype float16`` (float16 linear weights,
float32 arithmetic, on a CPU), ``--dtype bfloat16``, and
``--quantization w8a8_int8`` per int8 kernel, alone and with ``--dtype float16`` (its LM head in
float16; needs the engine-quant-int8 plugin); on a GGUF of Q8_0/Q4_0/Q4_1 blocks w8a8_int8 runs
the blocks with int8 activations whatever ENGINE_INT8_KERNEL says, one row "w8a8_int8 (GGUF
blocks)".

    python benchmarks/weight_quality.py [--model default|PATH] [--kernels fbgemm,int_mm]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_models  # noqa: E402
from engine.quality import GREEDY_TOKENS, PROMPTS, TEXT, common_prefix, evaluate, greedy  # noqa: E402,E501


def block_kernels() -> list[tuple[str, dict, dict]]:
    """A GGUF's blocks as they are (the default where a kernel runs them: weight-only), and
    through the best int8-activation kernel for Q4_1 (llama.cpp's arithmetic) usable here."""
    from engine.plugins import get_registries

    regs = get_registries()
    int8 = [e for e in regs.linear_kernels if e.extra.get("weight_dtype") == "q4_1"
            and not e.name.endswith("_f32") and e.unavailable_reason(torch.device("cpu")) is None]
    out = [("GGUF blocks (default)", {}, {})]
    if int8:
        best = max(int8, key=lambda e: e.extra.get("priority", 0))
        out.append((f"GGUF blocks, {best.name}", {}, {"ENGINE_LINEAR_KERNEL": best.name}))
    return out


def variants(kernels: list[str]) -> list[tuple[str, dict, dict]]:
    """(label, Engine kwargs, environment) of each variant."""
    out = [*block_kernels(), ("--dtype float16", {"dtype": "float16"}, {}),
           ("--dtype bfloat16", {"dtype": "bfloat16"}, {})]
    try:
        import engine_quant_int8  # noqa: F401
    except ImportError:
        print("(engine-quant-int8 is not installed: no w8a8_int8 rows)")
        return out
    for kernel in kernels:
        env = {"ENGINE_INT8_KERNEL": kernel}
        out.append((f"w8a8_int8 ({kernel})", {"quantization": "w8a8_int8"}, env))
    out.append(("w8a8_int8 + --dtype float16", {"quantization": "w8a8_int8", "dtype": "float16"},
                {"ENGINE_INT8_KERNEL": "fbgemm"}))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default",
                    help="'default' (SmolLM2-135M-Instruct) or a path")
    ap.add_argument("--kernels", default="fbgemm,int_mm",
                    help="int8 kernels to compare (ENGINE_INT8_KERNEL values)")
    args = ap.parse_args()
    from engine import Engine

    path = bench_models.resolve(args.model, lambda: None)
    torch.set_num_threads(os.cpu_count() or 1)
    os.environ["ENGINE_LINEAR_KERNEL"] = "torch"  # float32: a GGUF dequantized, oneDNN
    ref = Engine(path, max_total_tokens=4096)
    del os.environ["ENGINE_LINEAR_KERNEL"]
    ids = ref.tokenizer.encode(TEXT)
    ref_logits, ref_ppl = evaluate(ref, ids)
    ref_greedy = greedy(ref)
    del ref
    print(f"{bench_models.name(args.model, path)}; text of {len(ids)} tokens, "
          f"{len(PROMPTS)} prompts x {GREEDY_TOKENS} greedy tokens")
    print(f"{'':30s} {'perplexity':>10s} {'d ppl':>8s} {'top-1 agree':>11s} "
          f"{'greedy tokens equal (per prompt)':>34s}")
    print(f"{'float32':30s} {ref_ppl:10.3f} {0:8.3f} {1:11.3f}")
    rows = {}
    for label, kwargs, env in variants(args.kernels.split(",")):
        os.environ.update(env)
        try:
            eng = Engine(path, max_total_tokens=4096, **kwargs)
            if "blocks as they are" in (eng.runner.quant_note or ""):
                # the GGUF's blocks with int8 activations: ENGINE_INT8_KERNEL does not apply
                label = "w8a8_int8 (GGUF blocks)"
                if label in rows:
                    continue
            logits, ppl = evaluate(eng, ids)
            agree = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
            prefix = [common_prefix(a, b) for a, b in zip(greedy(eng), ref_greedy)]
            rows[label] = (ppl, agree, prefix)
            print(f"{label:30s} {ppl:10.3f} {ppl - ref_ppl:8.3f} {agree:11.3f} "
                  f"{str(prefix):>34s}")
            del eng
        finally:
            for key in env:
                os.environ.pop(key, None)
    return ref_ppl, rows


if __name__ == "__main__":
    main()
