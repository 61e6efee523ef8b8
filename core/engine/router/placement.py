"""What each dp replica gets of the machine: on GPUs its own devices through
``CUDA_VISIBLE_DEVICES`` (dp rank i: the i-th run of tp_size x pp_size devices); on a CPU 1/N
of the cores (``OMP_NUM_THREADS``) and 1/N of the memory fraction (``--mem-fraction-static``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Placement:
    """What one replica gets of the machine: ``env`` (set in its environment), ``args`` (added
    to its command line), ``note`` (for the log)."""

    env: dict[str, str]
    args: list[str]
    note: str


def visible_gpus() -> list[str]:
    """The CUDA devices this process may use, as ``CUDA_VISIBLE_DEVICES`` names them."""
    try:
        import torch

        count = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch CUDA at all: no GPU
        return []
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
              if d.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


def place(dp_size: int, per_replica: int, gpus: list[str], cpus: int,
          mem_fraction: float | None, env: Mapping[str, str]) -> list[Placement]:
    """Each replica's share. ``per_replica``: devices one replica uses (tp_size x pp_size);
    ``gpus``: the visible GPUs (empty: the replicas run on the CPU); ``cpus``: the cores this
    process may use; ``mem_fraction``: the --mem-fraction-static given (None: the CPU default);
    ``env``: this process's environment (an OMP_NUM_THREADS set there is kept per replica).
    ValueError when the GPUs are too few for a device of their own per replica."""
    if gpus:
        need = dp_size * per_replica
        if len(gpus) < need:
            raise ValueError(f"--dp-size {dp_size} x {per_replica} GPU(s) per replica (--tp-size "
                             f"x --pp-size) needs {need} GPUs, {len(gpus)} visible "
                             f"({','.join(gpus)}): replicas would share devices; lower "
                             f"--dp-size or --tp-size, or make more GPUs visible")
        out = []
        for i in range(dp_size):
            mine = ",".join(gpus[i * per_replica:(i + 1) * per_replica])
            out.append(Placement({"CUDA_VISIBLE_DEVICES": mine}, [],
                                 f"GPU(s) {mine} (CUDA_VISIBLE_DEVICES={mine})"))
        return out
    from engine.memory.sizing import DEFAULT_MEM_FRACTION

    given = env.get("OMP_NUM_THREADS")
    threads = given if given else str(max(1, cpus // dp_size))
    whole = mem_fraction if mem_fraction is not None else DEFAULT_MEM_FRACTION["cpu"]
    fraction = f"{whole / dp_size:.4g}"
    how = "as OMP_NUM_THREADS is set" if given else f"of {cpus} cores / {dp_size} replicas"
    note = (f"CPU: {threads} thread(s) ({how}), --mem-fraction-static {fraction} (the "
            f"memory fraction {whole:g} / {dp_size} replicas)")
    return [Placement({"OMP_NUM_THREADS": threads}, ["--mem-fraction-static", fraction], note)
            for _ in range(dp_size)]


def without_flags(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """``args`` less each of ``flags`` with its value (``--flag value`` or ``--flag=value``)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not any(a.startswith(f + "=") for f in flags):
            out.append(a)
    return out


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
