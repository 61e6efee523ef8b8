"""The offline batch job behind `engine generate`: JSONL in, JSONL out, resumable."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

import click


class BatchInputError(click.ClickException):
    exit_code = 2


@dataclass
class Job:
    line_no: int
    rid: str
    prompt: object  # text or token ids
    params: dict


def read_jobs(path: str, defaults: dict) -> list[Job]:
    jobs, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BatchInputError(f"{path}:{no}: not valid JSON ({exc.msg}).")
            if isinstance(row, str):
                row = {"prompt": row}
            if not isinstance(row, dict):
                raise BatchInputError(f"{path}:{no}: each line must be a JSON object or string.")
            prompt = row.get("prompt", row.get("text", row.get("input_ids")))
            if prompt is None:
                raise BatchInputError(f"{path}:{no}: no \"prompt\" (or \"text\" / \"input_ids\").")
            rid = str(row.get("id", no))
            if rid in seen:
                raise BatchInputError(f"{path}:{no}: duplicate id {rid!r}.")
            seen.add(rid)
            params = {**defaults, **(row.get("sampling_params") or {})}
            jobs.append(Job(no, rid, prompt, params))
    return jobs


def finished_ids(path: str) -> set[str]:
    """Ids already in the output file; a torn last line (interrupted write) is dropped."""
    if not os.path.exists(path):
        return set()
    done, keep = set(), 0
    with open(path, "rb") as f:
        data = f.read()
    for line in data.splitlines(keepends=True):
        try:
            done.add(str(json.loads(line)["id"]))
            keep += len(line)
        except (ValueError, KeyError):
            break
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    return done


def run_job(engine, jobs: list[Job], output: str, echo=click.echo) -> dict:
    """Run ``jobs`` through ``engine``, appending each result to ``output`` as it finishes."""
    done = finished_ids(output)
    todo = [j for j in jobs if j.rid not in done]
    if done:
        echo(f"resuming: {len(jobs) - len(todo)} of {len(jobs)} already in {output}")
    pending = {}
    for job in todo:  # validate everything before running anything
        try:
            reqs = engine.add_request(job.prompt, job.params, rid=job.rid)
        except ValueError as exc:
            for queued in pending.values():
                for r in queued:
                    engine.abort(r)
            raise BatchInputError(f"line {job.line_no} (id {job.rid!r}): {exc}")
        pending[job.rid] = reqs
    sched = engine.scheduler
    peak_usage, tokens, start = 0.0, 0, time.perf_counter()
    retracted_before = sched.counters.retracted_reqs
    with open(output, "a", encoding="utf-8") as out, click.progressbar(
            length=len(todo), label="requests", file=sys.stderr,
            item_show_func=lambda t: t) as bar:
        while pending:
            tokens += len(engine.step())  # each touched request got one token
            peak_usage = max(peak_usage, sched.num_used_tokens / sched.kv.pool.size)
            for rid in [rid for rid, reqs in pending.items() if all(r.finished for r in reqs)]:
                outs = [engine.output(r) for r in pending.pop(rid)]
                row = {"id": rid, **outs[0]} if len(outs) == 1 else {"id": rid, "choices": outs}
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
                out.flush()  # an interruption loses nothing that finished
                elapsed = time.perf_counter() - start
                bar.update(1, f"{tokens / max(elapsed, 1e-9):.1f} tok/s")
    elapsed = time.perf_counter() - start
    return {"requests": len(todo), "skipped": len(jobs) - len(todo), "output_tokens": tokens,
            "seconds": elapsed, "throughput": tokens / elapsed if elapsed else 0.0,
            "token_usage_peak": peak_usage,
            "retractions": sched.counters.retracted_reqs - retracted_before}
