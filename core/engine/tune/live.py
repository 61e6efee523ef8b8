"""Setting a knob on a running engine between runs, where the scheduler reads it every step
(its ratio object, its policy, sizing.chunked_prefill_size, sizing.max_running_requests): the
same behaviour as a new Engine started with that value, without loading the model again."""

from __future__ import annotations

from engine.memory.sizing import DEFAULT_CHUNKED_PREFILL, default_max_running_requests

LIVE = ("schedule_conservativeness", "schedule_policy", "chunked_prefill_size",
        "max_running_requests")


def _kind(engine) -> str:
    return "cuda" if engine.device.is_cuda else "cpu"


def sized(engine, name: str, value):
    """What the engine would have used had it started with ``value`` (None: its default)."""
    if value is not None:
        return value
    if name == "chunked_prefill_size":
        return DEFAULT_CHUNKED_PREFILL[_kind(engine)]
    return default_max_running_requests(engine.sizing.max_total_tokens, _kind(engine))


def live_problem(engine, name: str, value) -> str | None:
    """Why ``engine`` cannot take ``value`` for ``name`` live (None: it can)."""
    if name not in LIVE:
        return f"{name} is fixed when the engine starts"
    if name != "max_running_requests":
        return None
    if engine.config.max_total_tokens is None:
        return ("without --max-total-tokens the KV pool's size depends on "
                "--max-running-requests (its request table comes out of the same memory)")
    if engine.sizing.cuda_graph_max_bs:
        return "CUDA graphs were captured up to --max-running-requests"
    rows = engine.scheduler.kv.pool.max_reqs
    if sized(engine, name, value) > rows:
        return f"the request table has {rows} rows"
    return None


def set_live(engine, name: str, value) -> None:
    """Give the running ``engine`` ``value`` for ``name`` (live_problem must be None)."""
    from engine.plugins import get_registries
    from engine.registry import resolve_policy
    from engine.scheduler.adaptive import make_ratio

    sched = engine.scheduler
    setattr(engine.config, name, value)
    if name == "schedule_conservativeness":
        sched.ratio = make_ratio(value)
    elif name == "schedule_policy":
        entry = resolve_policy(get_registries(), value)
        sched.policy, sched.cache_aware = entry.obj(engine.config), entry.extra["cache_aware"]
    else:
        setattr(sched.sizing, name, sized(engine, name, value))


def reset_for_run(engine) -> None:
    """What a run must not inherit from the last one on this engine: cached prefixes (the same
    prompts would hit them) and the new-token ratio's decayed state."""
    from engine.scheduler.adaptive import make_ratio

    engine.flush_cache()
    engine.scheduler.ratio = make_ratio(engine.config.schedule_conservativeness)
