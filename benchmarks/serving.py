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
    python benchmarks/serving.py --baseline-llama-server  # vs llama.cpp on the same GGUF

``--baseline-llama-server [PATH]``: the project's CPU yardstick. Runs the workload against a
fresh llama.cpp ``llama-server`` on the same GGUF file (``--model``, default the default model),
then against a fresh ``engine serve`` (one after the other, never both at once), and prints both
tables and the ratios engine / llama-server of output tok/s and median ITL. PATH defaults to the
binary scripts/build_llama_server.sh builds (run that script first: ~15-20 min on 2 cores).

Prompts are the same for every run with the same ``--seed``, so two servers see one workload.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

from engine.bench import Workload, format_table, run_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_SCRIPT = os.path.join("scripts", "build_llama_server.sh")
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")
DEFAULT = object()  # --baseline-llama-server given without a PATH
QUIET = 0.25  # cores other processes may take before a run without a warning


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
    ap.add_argument("--baseline-llama-server", nargs="?", const=DEFAULT, metavar="PATH",
                    help=f"also run the workload on llama.cpp's llama-server (this binary) "
                         f"on the same GGUF, first, and print the ratios engine / llama-server "
                         f"[PATH default: what {BUILD_SCRIPT} builds]")
    ap.add_argument("--llama-server-args", default="", metavar="ARGS",
                    help="more llama-server flags, one string (with --baseline-llama-server)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="llama-server -t (with --baseline-llama-server) [default: all cores]")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="with --baseline-llama-server: before each server's run, wait up to "
                         "this long for other processes to leave the CPU idle (llama-server "
                         "slows down many times over when another process takes a core)")
    ap.add_argument("serve_flags", nargs="*", help="more engine serve flags (after --)")
    args = ap.parse_args(argv)

    workload = Workload("random", num_prompts=args.num_prompts, random_input_len=args.input_len,
                        random_output_len=args.output_len, random_range_ratio=1.0,
                        seed=args.seed, text_prompts=True)
    if args.baseline_llama_server is not None:
        try:
            return compare(args, workload)
        except KeyboardInterrupt:  # the servers are stopped by then
            raise SystemExit("interrupted") from None

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


# --- the llama-server baseline ------------------------------------------------------------------

def cpu_info() -> tuple[str, dict[str, bool]]:
    """(this CPU's model name, which of CPU_FLAGS it has); from /proc/cpuinfo (Linux)."""
    name, flags = "unknown CPU", None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name == "unknown CPU":
                    name = value.strip()
                elif key == "flags" and flags is None:
                    flags = set(value.split())
                if flags is not None and name != "unknown CPU":
                    break
    except OSError:
        pass
    return name, {f: (f in flags) if flags is not None else None for f in CPU_FLAGS}


def header(args, model: str, llama_server: str) -> str:
    name, flags = cpu_info()
    have = ", ".join(f"{f} {'yes' if v else 'no' if v is not None else '?'}"
                     for f, v in flags.items())
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return "\n".join([
        f"CPU: {name}; {os.cpu_count()} cores; {have}",
        f"load average (1/5/15 min) before the runs: {load}",
        f"model: {model}",
        f"llama-server: {llama_server}",
        f"workload: {args.num_prompts} prompts x {args.input_len} tokens in, {args.output_len} "
        f"out, concurrency {args.concurrency}, seed {args.seed} (same prompts for both)"])


def cpu_busy(seconds: float = 2.0) -> float | None:
    """How many cores' worth of CPU the machine used over ``seconds`` (from /proc/stat): before a
    run, with nothing of ours running, what other processes take."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
        return sum(v[:8]), idle

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (1 - (i1 - i0) / (t1 - t0)) * (os.cpu_count() or 1) if t1 > t0 else None


def wait_quiet(limit_s: float, what: str) -> None:
    """Up to ``limit_s`` seconds until other processes take under QUIET cores (3 s samples)."""
    if limit_s <= 0:
        return
    deadline = time.monotonic() + limit_s
    while True:
        busy = cpu_busy(3.0)
        if busy is None or busy < QUIET:
            return
        if time.monotonic() > deadline:
            print(f"      still {busy:.2f} cores busy after --wait-quiet {limit_s:.0f}: running "
                  f"{what} anyway", flush=True)
            return


def busy_line(what: str) -> str:
    busy = cpu_busy()
    if busy is None:
        return ""
    line = f"      other load before {what}: {busy:.2f} of {os.cpu_count()} cores busy"
    if busy > QUIET:
        line += ("  WARNING: the machine is busy; llama-server (-t = all cores) slows down "
                 "badly when another process takes a core, so the figures are not a fair "
                 "comparison")
    return line


def default_llama_server() -> str:
    """Where scripts/build_llama_server.sh installs llama-server on this machine (it keys the
    folder by version and CPU flags; the script says, so the two never disagree)."""
    script = os.path.join(ROOT, BUILD_SCRIPT)
    try:
        out = subprocess.run(["bash", script, "--print-path"], capture_output=True, text=True,
                             timeout=60, check=True).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError) as e:
        raise SystemExit(f"error: cannot ask {BUILD_SCRIPT} where llama-server is ({e}); give "
                         f"--baseline-llama-server PATH") from None
    return out[-1] if out else ""


def resolve_llama_server(given) -> str:
    path = default_llama_server() if given is DEFAULT else given
    if not (path and os.path.isfile(path) and os.access(path, os.X_OK)):
        how = (f"build it with `{BUILD_SCRIPT}` (once per machine, ~15-20 min on 2 cores; it "
               f"prints the path)" if given is DEFAULT else
               f"give the path of a llama-server binary, or leave PATH out for the one "
               f"`{BUILD_SCRIPT}` builds")
        raise SystemExit(f"error: no llama-server binary at {path or '(none)'}: {how}.")
    return os.path.abspath(path)


def resolve_gguf(model: str | None) -> str:
    """The GGUF file both servers load: --model (a .gguf, or a folder holding one) or the
    default model's."""
    if model is None:
        from engine.models.default import default_model_path

        return default_model_path()
    if os.path.isdir(model):
        ggufs = sorted(f for f in os.listdir(model) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(model, ggufs[0])
        raise SystemExit(f"error: --baseline-llama-server needs one GGUF file; {model} holds "
                         f"{len(ggufs) or 'no'} .gguf files: give --model FILE.gguf")
    if not (os.path.isfile(model) and model.endswith(".gguf")):
        raise SystemExit(f"error: --baseline-llama-server needs --model to be a .gguf file "
                         f"(llama-server loads only GGUF), not {model!r}")
    return model


class LlamaServer:
    """A llama-server subprocess on 127.0.0.1 and a free port; ``with`` stops it always (the
    process group, SIGTERM then SIGKILL), also on errors and Ctrl-C."""

    def __init__(self, binary: str, gguf: str, *, parallel: int, ctx: int, threads: int,
                 extra: list[str], log_path: str):
        from engine.net import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port),
                    "-c", str(ctx), "-np", str(parallel), "-t", str(threads), "--cont-batching",
                    *extra]
        self._log = open(log_path, "w")
        # its own session: a Ctrl-C reaches only this script, whose `finally` stops the server
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def log(self, tail: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-tail:]

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until GET /health is 200 with status ok (503 while the model loads)."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"error: llama-server exited with {self.proc.returncode}:\n"
                                 f"{' '.join(self.cmd)}\n{self.log()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200 and r.json().get("status") == "ok":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise SystemExit(f"error: llama-server not ready after {timeout:.0f} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the `finally`s that stop the servers


def relabel(table: str, backend: str) -> str:
    """format_table names every server run "engine serve"; the llama-server run's table says
    llama-server."""
    return "\n".join(f"{'Backend:':<40} {backend}" if line.startswith("Backend:") else line
                     for line in table.splitlines())


def ratio_lines(engine, llama) -> list[str]:
    def ratio(a, b):
        return a / b if b and b == b and a == a else float("nan")

    rows = []
    e, l = engine.output_throughput, llama.output_throughput
    r = ratio(e, l)
    better = "engine" if r > 1 else "llama-server" if r < 1 else "even"
    rows.append(f"{'Output tok/s':<18} engine {e:9.2f}   llama-server {l:9.2f}   "
                f"engine/llama-server {r:6.2f}x  (higher is better: {better})")
    for name, key in (("Median ITL (ms)", "itl_ms"), ("Median TTFT (ms)", "ttft_ms"),
                      ("Median E2E (ms)", "e2e_ms")):
        e, l = getattr(engine, key)["median"], getattr(llama, key)["median"]
        r = ratio(e, l)
        better = "engine" if r < 1 else "llama-server" if r > 1 else "even"
        rows.append(f"{name:<18} engine {e:9.2f}   llama-server {l:9.2f}   "
                    f"engine/llama-server {r:6.2f}x  (lower is better: {better})")
    return rows


def compare(args, workload):
    if args.url:
        raise SystemExit("error: --baseline-llama-server starts both servers itself; leave "
                         "out --url")
    llama_bin = resolve_llama_server(args.baseline_llama_server)
    gguf = resolve_gguf(args.model)
    tokenizer = args.tokenizer or gguf
    signal.signal(signal.SIGTERM, _sigterm)
    print(header(args, gguf, llama_bin), flush=True)

    # -c is the context of all -np slots together: each gets its prompt (re-tokenized text may
    # come out a little longer than --input-len), its output and a margin
    per_slot = args.input_len + args.output_len + 64 + args.input_len // 2
    per_slot = -(-per_slot // 256) * 256
    ctx = per_slot * args.concurrency
    client = dict(max_concurrency=args.concurrency, backend="openai", tokenizer=tokenizer,
                  model=args.served_model, timeout=args.timeout, progress=sys.stderr.isatty())
    results = {}

    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False).name
    print(f"\n[1/2] llama-server (-c {ctx} = {args.concurrency} slots x {per_slot}, "
          f"-t {args.threads}; log {log})", flush=True)
    with LlamaServer(llama_bin, gguf, parallel=args.concurrency, ctx=ctx, threads=args.threads,
                     extra=shlex.split(args.llama_server_args), log_path=log) as server:
        print("      " + " ".join(server.cmd), flush=True)
        server.wait_ready()
        wait_quiet(args.wait_quiet, "llama-server's run")
        print(busy_line("llama-server's run (server idle)"), flush=True)
        results["llama-server"] = run_bench(server.url, workload, **client)
    print(relabel(format_table(results["llama-server"]), "llama-server"), flush=True)

    flags = ["--model", gguf, *args.serve_flags]
    print(f"\n[2/2] engine serve {' '.join(flags)}", flush=True)
    wait_quiet(args.wait_quiet, "engine serve")
    print(busy_line("engine serve starts"), flush=True)
    results["engine"] = run_bench(flags, workload, **client)
    print(relabel(format_table(results["engine"]), "engine serve"), flush=True)

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = ratio_lines(results["engine"], results["llama-server"])
    print(f"\n{' engine vs llama-server (same GGUF, same prompts) ':=^50}")
    print("\n".join(lines))
    print(f"load average (1/5/15 min) after the runs: {load}")
    if args.json:
        name, flags_ = cpu_info()
        with open(args.json, "w") as f:
            json.dump({"cpu": name, "cpu_flags": flags_, "model": gguf,
                       "llama_server": llama_bin,
                       "llama_server_ctx": ctx, "threads": args.threads,
                       "runs": {k: v.to_dict(timeline=False) for k, v in results.items()},
                       "ratios": lines}, f, indent=1)
    if any(r.failed for r in results.values()):
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
