"""Quality of ``--quantization w8a8_int8`` against float32, measured on a fixed English text.

Prints, for float32 and each int8 kernel: perplexity of the text (teacher-forced, one prefill),
top-1 agreement of the next-token predictions with float32 over the text, and how many greedy
tokens each of a few chat-free prompts keeps equal to float32 before the first difference.

    python benchmarks/int8_quality.py [--model default|PATH] [--kernels fbgemm,int_mm]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_models  # noqa: E402
from engine_quant_int8.quality import (GREEDY_TOKENS, PROMPTS, TEXT, common_prefix,  # noqa: E402
                                       evaluate, greedy)


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
    ref = Engine(path, max_total_tokens=4096)
    ids = ref.tokenizer.encode(TEXT)
    ref_logits, ref_ppl = evaluate(ref, ids)
    ref_greedy = greedy(ref)
    del ref
    print(f"{bench_models.name(args.model, path)}; text of {len(ids)} tokens, "
          f"{len(PROMPTS)} prompts x {GREEDY_TOKENS} greedy tokens")
    print(f"{'':28s} {'perplexity':>10s} {'d ppl':>8s} {'top-1 agree':>11s} "
          f"{'greedy tokens equal (per prompt)':>34s}")
    print(f"{'float32':28s} {ref_ppl:10.3f} {0:8.3f} {1:11.3f}")
    rows = {}
    for kernel in args.kernels.split(","):
        os.environ["ENGINE_INT8_KERNEL"] = kernel
        eng = Engine(path, quantization="w8a8_int8", max_total_tokens=4096)
        logits, ppl = evaluate(eng, ids)
        agree = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
        prefix = [common_prefix(a, b) for a, b in zip(greedy(eng), ref_greedy)]
        rows[kernel] = (ppl, agree, prefix)
        print(f"{'w8a8_int8 (' + kernel + ')':28s} {ppl:10.3f} {ppl - ref_ppl:8.3f} "
              f"{agree:11.3f} {str(prefix):>34s}")
        del eng
    os.environ.pop("ENGINE_INT8_KERNEL", None)
    return ref_ppl, rows


if __name__ == "__main__":
    main()
