"""Start-up time of `engine serve`: from launching the process to /health answering 200.

The first run uses an empty engine cache (a GGUF is converted: dequantized weights and its
tokenizer written to the cache), the others the cache that run left (what every later start of
the same file costs). Each run is a fresh process; the server is stopped with SIGTERM.

    python benchmarks/startup.py [--runs 3] [--model PATH] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from engine.net import free_port


def start_once(args: list[str], cache: str, timeout: float = 300.0) -> float:
    port = free_port()
    engine = os.path.join(os.path.dirname(sys.executable), "engine")
    env = {**os.environ, "ENGINE_CACHE_DIR": cache}
    start = time.perf_counter()
    proc = subprocess.Popen([engine, "serve", "--port", str(port), *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise SystemExit(f"engine serve exited with {proc.returncode}:\n"
                                 f"{proc.stderr.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.02)
        raise SystemExit(f"not ready after {timeout} s")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="warm runs after the cold one")
    ap.add_argument("--model", help="--model for engine serve  [default: the default model]")
    ap.add_argument("serve_flags", nargs="*", help="more engine serve flags (after --)")
    args = ap.parse_args()
    flags = (["--model", args.model] if args.model else []) + args.serve_flags
    with tempfile.TemporaryDirectory() as cache:
        cold = start_once(flags, cache)
        warm = [start_once(flags, cache) for _ in range(args.runs)]
    print(f"engine serve {' '.join(flags) or '(default model)'}: ready (/health 200) after")
    print(f"  cold (empty cache, converts once): {cold:6.2f} s")
    print(f"  warm (cache present), {args.runs} runs: min {min(warm):.2f} s, median "
          f"{sorted(warm)[len(warm) // 2]:.2f} s, max {max(warm):.2f} s")


if __name__ == "__main__":
    main()
