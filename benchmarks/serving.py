"""Online serving benchmark: a bounded async client against an OpenAI-compatible server.

Starts `engine serve` on 127.0.0.1 (or measures any server at ``--url``), sends ``--num-prompts``
streamed /v1/completions requests of ``--input-len`` random tokens each (random token ids of the
served model's tokenizer, decoded to text, as SGLang's bench_serving "random" dataset does) with ``max_tokens=--output-len`` and
``ignore_eos``, at most ``--concurrency`` in flight, and prints output tok/s, request throughput
and TTFT / ITL / end-to-end percentiles. A thin wrapper over engine.bench (what `engine bench
serve --backend openai --dataset-name random --random-range-ratio 1` runs), kept for the
README's figures and their flags.

    python benchmarks/serving.py                          # engine serve, default model
    python benchmarks/serving.py -- --quantization w8a8_int8
    python benchmarks/serving.py --url http://127.0.0.1:8080 --label llama-server

Prompts are the same for every run with the same ``--seed``, so two servers see one workload.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.bench import Workload, format_table, run_bench


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="measure this OpenAI-compatible server instead of starting "
                                  "engine serve")
    ap.add_argument("--label", help="name of the run in the output")
    ap.add_argument("--model", help="engine serve --model (and the tokenizer of the prompts) "
                                    "[default: the default model]")
    ap.add_argument("--served-model", help="the model name sent in requests [default: the "
                                           "first of /v1/models]")
    ap.add_argument("--tokenizer", help="a GGUF file or HF directory whose tokenizer makes the "
                                        "prompts [default: --model, else the server's model]")
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--json", help="also write the summary to this JSON file")
    ap.add_argument("serve_flags", nargs="*", help="more engine serve flags (after --)")
    args = ap.parse_args(argv)

    workload = Workload("random", num_prompts=args.num_prompts, random_input_len=args.input_len,
                        random_output_len=args.output_len, random_range_ratio=1.0,
                        seed=args.seed, text_prompts=True)
    target = args.url or (["--model", args.model] if args.model else []) + args.serve_flags
    label = args.label or ("engine serve " + " ".join(args.serve_flags)).strip()
    print(f"{label}: {args.num_prompts} prompts x {args.input_len} tokens in, "
          f"{args.output_len} out, concurrency {args.concurrency}, {args.url or 'engine serve'}")
    result = run_bench(target, workload, max_concurrency=args.concurrency, backend="openai",
                       tokenizer=args.tokenizer or args.model, model=args.served_model,
                       timeout=args.timeout, progress=sys.stderr.isatty())
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": label, **result.to_dict(timeline=False)}, f, indent=1)
    if result.failed:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
