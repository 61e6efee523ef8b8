"""GPU check step (b): the engine's greedy tokens on CUDA equal HF transformers' greedy tokens.

A tiny random-init Llama (engine_testing.checkpoints.make_tiny_model, initializer_range 0.08), three
prompts, 16 new tokens each; float32 must match exactly, for every attention backend that runs here
and takes float32, with and without CUDA graphs. bfloat16 (backends that take it, graphs on) is
reported as agreement with HF's bfloat16 greedy (informational: rounding may flip a near tie).

    python scripts/gpu_greedy.py --json OUT.json [--device cuda] [--new-tokens 16] [--backends a,b]

Without CUDA it writes status "skipped" and exits 0 (``--device cpu`` runs it on the CPU,
without graphs: a smoke test of the script itself).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback

TEXTS = ["Beautiful is better than ugly.", "Simple is better", "In the face of ambiguity,"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--backends", default="", help="only these (comma-separated)")
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
    import transformers

    from engine import Engine
    from engine.device import detect_device
    from engine.plugins import get_registries
    from engine.registry import takes_dtype
    from engine_testing.checkpoints import make_tiny_model

    path = make_tiny_model(tempfile.mkdtemp(prefix="gpu-greedy-"), "LlamaForCausalLM",
                           initializer_range=0.08)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompts = [tok(t).input_ids for t in TEXTS]
    refs = {}
    for dtype in ("float32", "bfloat16"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), attn_implementation="eager").eval().to(args.device)
        refs[dtype] = [hf.generate(torch.tensor([p], device=args.device),
                                   max_new_tokens=args.new_tokens, do_sample=False,
                                   pad_token_id=2)[0, len(p):].tolist() for p in prompts]
        del hf
    device = detect_device(args.device)
    regs = get_registries()
    graph_modes = (False, True) if device.is_cuda else (False,)
    wanted = set(filter(None, args.backends.split(",")))
    for entry in regs.attention:
        if wanted and entry.name not in wanted:
            continue
        reason = entry.unavailable_reason(device)
        if reason:
            result["cases"].append({"backend": entry.name, "status": "skipped",
                                    "reason": reason})
            continue
        for dtype in ("float32", "bfloat16"):
            if not takes_dtype(entry, dtype):
                result["cases"].append({"backend": entry.name, "dtype": dtype,
                                        "status": "skipped",
                                        "reason": f"does not take {dtype}"})
                continue
            for graphs in (graph_modes if dtype == "float32" else graph_modes[-1:]):
                case = {"backend": entry.name, "dtype": dtype, "cuda_graphs": graphs}
                t0 = time.perf_counter()
                try:
                    engine = Engine(path, device=args.device, dtype=dtype,
                                    attention_backend=entry.name, disable_cuda_graph=not graphs,
                                    cuda_graph_max_bs=4, max_total_tokens=4096)
                    outs = engine.generate(input_ids=prompts, sampling_params={
                        "max_new_tokens": args.new_tokens, "temperature": 0.0,
                        "ignore_eos": True})
                    ids = [o["output_ids"] for o in outs]
                    graphs_run = engine.runner.cuda_graphs
                    case["graphs_captured"] = graphs_run is not None
                    case["replays"] = getattr(graphs_run, "replays", 0)
                    if graphs and graphs_run is None:
                        case["graphs_note"] = str(engine.cuda_graph)
                    same = sum(a == b for o, r in zip(ids, refs[dtype]) for a, b in zip(o, r))
                    case["matching_tokens"] = f"{same}/{sum(len(r) for r in refs[dtype])}"
                    exact = ids == refs[dtype]
                    if dtype == "float32":
                        case["status"] = "pass" if exact else "fail"
                    else:
                        case["status"] = "pass" if exact else "info"
                    if not exact:
                        case["ours"], case["hf"] = ids, refs[dtype]
                    del engine
                except Exception as exc:  # one backend's failure must not hide the others'
                    case["status"] = "fail"
                    case["error"] = f"{type(exc).__name__}: {exc}"[:500]
                    traceback.print_exc()
                case["seconds"] = round(time.perf_counter() - t0, 1)
                if device.is_cuda:
                    torch.cuda.empty_cache()
                print(json.dumps(case), flush=True)
                result["cases"].append(case)
    ran = [c for c in result["cases"] if c["status"] in ("pass", "fail", "info")]
    failed = [c for c in ran if c["status"] == "fail"]
    if not ran:
        result.update(status="fail", reason="no attention backend ran")
    elif failed:
        result["status"] = "fail"
        result["reason"] = "; ".join(
            f"{c['backend']} {c['dtype']} graphs={c['cuda_graphs']}: "
            f"{c.get('error') or 'tokens differ from HF (' + c['matching_tokens'] + ')'}"
            for c in failed)
    result["figures"] = {f"{c['backend']} {c['dtype']}{' graphs' if c.get('cuda_graphs') else ''}":
                         c.get("matching_tokens", c["status"]) for c in ran}
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
