"""Online serving benchmark: a bounded async client against an OpenAI-compatible server.

Starts `engine serve` on 127.0.0.1 (or measures any server at ``--url``), sends ``--num-prompts``
streamed /v1/completions requests of ``--input-len`` random tokens each (random token ids of the
served model's tokenizer, decoded to text, as SGLang's bench_serving "random" dataset does) with
``max_tokens=--output-len`` and ``ignore_eos``, at most ``--concurrency`` in flight, and prints
output tok/s, request throughput and TTFT / ITL / end-to-end percentiles.

    python benchmarks/serving.py                          # engine serve, default model
    python benchmarks/serving.py -- --quantization w8a8_int8
    python benchmarks/serving.py --url http://127.0.0.1:8080 --label llama-server

Prompts are the same for every run with the same ``--seed``, so two servers see one workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from engine.testing import ServerProcess


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds to the first streamed token
    latency: float = 0.0  # seconds to the last one
    itls: list[float] = field(default_factory=list)  # gaps between streamed chunks
    output_tokens: int = 0


def make_prompts(tokenizer_source: str | None, n: int, input_len: int, seed: int) -> list[str]:
    """``n`` prompts of ``input_len`` random tokens (re-encoded to about that many tokens)."""
    from engine.models.checkpoint import load_tokenizer_dir, open_checkpoint
    from engine.models.default import default_model_path

    if tokenizer_source and os.path.isdir(tokenizer_source) and not any(
            f.endswith(".gguf") for f in os.listdir(tokenizer_source)):
        tok = load_tokenizer_dir(tokenizer_source)
    else:
        tok = open_checkpoint(tokenizer_source or default_model_path()).load_tokenizer()
    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    prompts = []
    for _ in range(n):
        ids = [rng.choice(vocab) for _ in range(input_len)]
        text = tok.decode(ids)
        # decoding and encoding again changes the count a little: trim or pad to the length
        ids = tok.encode(text, add_special_tokens=False)[:input_len]
        while len(ids) < input_len:
            ids.append(rng.choice(vocab))
        prompts.append(tok.decode(ids))
    return prompts


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                      output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = Result()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
        res.latency = time.perf_counter() - start
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(url: str, model: str, prompts: list[str], output_len: int,
                   concurrency: int, timeout: float) -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def bounded(p):
            async with sem:
                return await one_request(client, url, model, p, output_len)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        return results, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(label: str, results: list[Result], wall: float, output_len: int) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens or (len(r.itls) + 1) for r in ok)
    ttft = [r.ttft * 1e3 for r in ok]
    itl = [x * 1e3 for r in ok for x in r.itls]
    e2e = [r.latency * 1e3 for r in ok]
    return {
        "label": label, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": wall, "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall, "request_s": len(ok) / wall,
        "ttft_ms": {q: pct(ttft, q) for q in (50, 90, 99)},
        "itl_ms": {q: pct(itl, q) for q in (50, 90, 99)},
        "e2e_ms": {q: pct(e2e, q) for q in (50, 90, 99)},
        "mean_itl_ms": statistics.fmean(itl) if itl else float("nan"),
        "short_outputs": sum(1 for r in ok if r.output_tokens and r.output_tokens < output_len),
    }


def print_summary(s: dict) -> None:
    print(f"== {s['label']}: {s['completed']} completed, {s['failed']} failed "
          f"in {s['duration_s']:.1f} s")
    for e in s["errors"]:
        print(f"   error: {e}")
    print(f"   output tok/s {s['output_tok_s']:.1f}   requests/s {s['request_s']:.2f}   "
          f"output tokens {s['output_tokens']}")
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        p = s[key]
        print(f"   {name:4s} ms  p50 {p[50]:8.1f}  p90 {p[90]:8.1f}  p99 {p[99]:8.1f}")


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
                                        "prompts [default: --model, else the default model]")
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--json", help="also write the summary to this JSON file")
    ap.add_argument("serve_flags", nargs="*", help="more engine serve flags (after --)")
    args = ap.parse_args(argv)

    prompts = make_prompts(args.tokenizer or args.model, args.num_prompts, args.input_len,
                           args.seed)
    server = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        flags = (["--model", args.model] if args.model else []) + args.serve_flags
        log = tempfile.NamedTemporaryFile(suffix=".log", delete=False).name
        server = ServerProcess(flags, log)
        try:
            server.wait_ready(timeout=600)
        except RuntimeError as e:
            raise SystemExit(f"engine serve: {e}") from None
        url = server.url
    try:
        model = args.served_model or httpx.get(f"{url}/v1/models", timeout=10).json()[
            "data"][0]["id"]
        label = args.label or ("engine serve " + " ".join(args.serve_flags)).strip()
        print(f"{label}: {args.num_prompts} prompts x {args.input_len} tokens in, "
              f"{args.output_len} out, concurrency {args.concurrency}, {url}")
        results, wall = asyncio.run(run_load(url, model, prompts, args.output_len,
                                             args.concurrency, args.timeout))
    finally:
        if server is not None:
            server.stop(timeout=60)
    s = summarize(label, results, wall, args.output_len)
    print_summary(s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    if s["failed"]:
        raise SystemExit(1)
    return s


if __name__ == "__main__":
    main()
