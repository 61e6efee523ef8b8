"""GPU check step (b): the engine's greedy tokens on CUDA equal HF transformers' greedy tokens.

A tiny random-init Llama (engine_testing.checkpoints.make_tiny_model, initializer_range 0.08), three
prompts, 16 new tokens each; float32 must match exactly, for every attention backend that runs here
and takes float32, with and without CUDA graphs. bfloat16 (backends that take it, graphs on) is
reported as agreement with HF's bfloat16 greedy (informational: rounding may flip a near tie).
Then, float32 without graphs: a tiny Qwen3-MoE and a tiny DeepSeek-V3 (MLA) on every backend that
takes them (on CUDA their MoE layers must run the fused Triton kernel: each case records the
start log's MoE line as ``moe_path``), both again with their decode steps in CUDA graphs (a
backend that can be captured must capture them), and the Llama with speculative decoding
(NGRAM, every draft verified) on each backend, graphs on: their tokens must equal HF's too.

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


def hf_greedy(path: str, prompts: list, dtype: str, args) -> list[list[int]]:
    """HF transformers' greedy continuations of ``prompts`` (the reference)."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation="eager").eval().to(args.device)
    out = [hf.generate(torch.tensor([p], device=args.device), max_new_tokens=args.new_tokens,
                       do_sample=False, pad_token_id=2)[0, len(p):].tolist() for p in prompts]
    del hf
    return out


def matching(ids: list, ref: list) -> str:
    """"same/total": the tokens equal to the reference's, position by position."""
    same = sum(a == b for o, r in zip(ids, ref) for a, b in zip(o, r))
    return f"{same}/{sum(len(r) for r in ref)}"


def record_failure(case: dict, exc: Exception) -> None:
    """``case`` failed with ``exc`` (one case's failure must not hide the others')."""
    case["status"] = "fail"
    case["error"] = f"{type(exc).__name__}: {exc}"[:500]
    traceback.print_exc()


def closed(case: dict, t0: float, device) -> dict:
    """``case`` with its seconds, printed (one JSON line); the GPU's cache emptied for the next."""
    import torch

    case["seconds"] = round(time.perf_counter() - t0, 1)
    if device.is_cuda:
        torch.cuda.empty_cache()
    print(json.dumps(case), flush=True)
    return case


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
    refs = {dtype: hf_greedy(path, prompts, dtype, args) for dtype in ("float32", "bfloat16")}
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
                    case["matching_tokens"] = matching(ids, refs[dtype])
                    exact = ids == refs[dtype]
                    if dtype == "float32":
                        case["status"] = "pass" if exact else "fail"
                    else:
                        case["status"] = "pass" if exact else "info"
                    if not exact:
                        case["ours"], case["hf"] = ids, refs[dtype]
                    del engine
                except Exception as exc:  # noqa: BLE001 - recorded, the next backend runs
                    record_failure(case, exc)
                result["cases"].append(closed(case, t0, device))
    result["cases"] += model_cases(args, device, regs, wanted, prompts, path)
    ran = [c for c in result["cases"] if c["status"] in ("pass", "fail", "info")]
    failed = [c for c in ran if c["status"] == "fail"]
    if not ran:
        result.update(status="fail", reason="no attention backend ran")
    elif failed:
        result["status"] = "fail"
        result["reason"] = "; ".join(
            f"{c.get('model', 'llama')} {c['backend']} {c['dtype']} graphs={c['cuda_graphs']}: "
            f"{c.get('error') or 'tokens differ from HF (' + c['matching_tokens'] + ')'}"
            for c in failed)
    result["figures"] = {f"{c.get('model', 'llama')} {c['backend']} {c['dtype']}"
                         f"{' graphs' if c.get('cuda_graphs') else ''}":
                         c.get("matching_tokens", c["status"]) for c in ran}
    write()
    return 0


def model_cases(args, device, regs, wanted, prompts, llama_path) -> list[dict]:
    """The MoE and MLA families against HF, and NGRAM speculation against HF, per backend."""
    from engine import Engine
    from engine.registry import takes_dtype, takes_model
    from engine_testing.checkpoints import DEEPSEEK_CASES, MOE_CASES, make_tiny_model

    repeated = [p * 3 for p in prompts]  # something for n-gram lookup to draft from
    models = {"llama+NGRAM": (llama_path, repeated,
                              hf_greedy(llama_path, repeated, "float32", args))}
    for arch, overrides in (MOE_CASES["qwen3_moe_mlp_only"], DEEPSEEK_CASES["v3_noaux_tc"]):
        path = make_tiny_model(tempfile.mkdtemp(prefix="gpu-greedy-"), arch,
                               initializer_range=0.08, **overrides)
        models[arch] = (path, prompts, hf_greedy(path, prompts, "float32", args))
        models[arch + "+graphs"] = models[arch]  # decode steps captured (the fused MoE kernel)
    cases = []
    for name, (path, inputs, ref) in models.items():
        for entry in regs.attention:
            if (wanted and entry.name not in wanted) or entry.unavailable_reason(device) or \
                    not takes_dtype(entry, "float32"):
                continue
            spec = name.endswith("+NGRAM")
            graphs = spec or name.endswith("+graphs")
            case = {"backend": entry.name, "dtype": "float32", "cuda_graphs": graphs,
                    "model": name}
            t0 = time.perf_counter()
            try:
                engine = Engine(path, device=args.device, dtype="float32",
                                attention_backend=entry.name, max_total_tokens=4096,
                                disable_cuda_graph=not graphs, cuda_graph_max_bs=4,
                                **({"speculative_algorithm": "NGRAM"} if spec else {}))
                if not takes_model(entry, engine.runner.model_config):
                    continue
                if spec:
                    engine.scheduler.spec.policy.lengths = \
                        lambda reqs, drafts: [len(d.tokens) for d in drafts]
                outs = engine.generate(input_ids=inputs, sampling_params={
                    "max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True})
                ids = [o["output_ids"] for o in outs]
                case["matching_tokens"] = matching(ids, ref)
                case["status"] = "pass" if ids == ref else "fail"
                moe = engine.runner.moe_kernel  # the start log's MoE line ("" for the llama)
                if moe:
                    case["moe_path"] = moe
                    if device.is_cuda and "fused Triton kernel" not in moe:
                        case["status"] = "fail"
                        case["error"] = f"the MoE layers did not take the fused path: {moe}"
                if graphs and device.is_cuda and engine.runner.cuda_graphs is None and \
                        entry.name != "torch_native":
                    case["status"] = "fail"
                    case["error"] = f"no decode graphs captured: {engine.cuda_graph}"
                if spec:
                    case["accept_length"] = round(engine.scheduler.spec.stats.accept_length, 2)
                del engine
            except Exception as exc:  # noqa: BLE001 - recorded, the next case runs
                if "has no multi-head latent attention" in str(exc):
                    continue  # a backend without MLA: refused, as it should be
                record_failure(case, exc)
            cases.append(closed(case, t0, device))
    return cases


if __name__ == "__main__":
    sys.exit(main())
