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
    id: object  # the line's "id" as its JSON value (7 stays 7, "7" stays "7"), else "<line>"
    prompt: object  # text or token ids
    params: dict

    @property
    def rid(self) -> str:
        """The engine's request id (text)."""
        return str(self.id)

    @property
    def key(self) -> str:
        """What tells ids apart: their JSON (so 7 and "7" are two ids)."""
        return id_key(self.id)


def id_key(value) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


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
            value = row["id"] if "id" in row else str(no)  # no id: the line number
            if id_key(value) in seen:
                raise BatchInputError(f"{path}:{no}: duplicate id {json.dumps(value)}.")
            seen.add(id_key(value))
            params = {**defaults, **(row.get("sampling_params") or {})}
            jobs.append(Job(no, value, prompt, params))
    return jobs


def finished_ids(path: str) -> set[str]:
    """Ids already in the output file (as ``id_key``s); a torn last line (interrupted write)
    is dropped."""
    if not os.path.exists(path):
        return set()
    done, keep = set(), 0
    with open(path, "rb") as f:
        data = f.read()
    for line in data.splitlines(keepends=True):
        try:
            done.add(id_key(json.loads(line)["id"]))
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
    todo = [j for j in jobs if j.key not in done]
    if done:
        echo(f"resuming: {len(jobs) - len(todo)} of {len(jobs)} already in {output}")
    pending = {}
    for job in todo:  # validate everything before running anything
        try:
            reqs = engine.add_request(job.prompt, job.params, rid=job.rid)
        except ValueError as exc:
            for _, queued in pending.values():
                for r in queued:
                    engine.abort(r)
            raise BatchInputError(f"line {job.line_no} (id {json.dumps(job.id)}): {exc}")
        pending[job.key] = (job, reqs)
    sched = engine.scheduler
    peak_usage, tokens, start = 0.0, 0, time.perf_counter()
    retracted_before = sched.counters.retracted_reqs
    with open(output, "a", encoding="utf-8") as out, click.progressbar(
            length=len(todo), label="requests", file=sys.stderr,
            item_show_func=lambda t: t) as bar:
        while pending:
            tokens += len(engine.step())  # each touched request got one token
            peak_usage = max(peak_usage, sched.num_used_tokens / sched.kv.pool.size)
            for key in [k for k, (_, reqs) in pending.items() if all(r.finished for r in reqs)]:
                job, reqs = pending.pop(key)
                outs = [engine.output(r) for r in reqs]
                row = ({"id": job.id, **outs[0]} if len(outs) == 1 else
                       {"id": job.id, "choices": outs})
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
                out.flush()  # an interruption loses nothing that finished
                elapsed = time.perf_counter() - start
                bar.update(1, f"{tokens / max(elapsed, 1e-9):.1f} tok/s")
    elapsed = time.perf_counter() - start
    return {"requests": len(todo), "skipped": len(jobs) - len(todo), "output_tokens": tokens,
            "seconds": elapsed, "throughput": tokens / elapsed if elapsed else 0.0,
            "token_usage_peak": peak_usage,
            "retractions": sched.counters.retracted_reqs - retracted_before}
