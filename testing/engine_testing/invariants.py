"""Checks on a whole Engine after its requests are done."""

from __future__ import annotations


def assert_all_free(engine) -> None:
    """Nothing queued or running, the slot accounting consistent, and (once the prefix cache
    is flushed) every KV slot and request row free again."""
    s = engine.scheduler
    assert not s.running and not s.waiting
    s.check_invariants()
    assert engine.flush_cache() or s.kv.cache is None
    assert s.kv.pool.free_slots == s.kv.pool.size
    assert s.kv.pool.free_reqs == s.kv.pool.max_reqs
    host = getattr(s.kv.cache, "host", None)  # HiCache's host tier: all free too
    assert host is None or host.free_slots == host.size


def run_checked(engine, reqs) -> None:
    """Step ``engine`` until ``reqs`` are finished, checking every tier's slot accounting
    (free + held by requests + cached = total; the host tier's free + cached = total) after
    every step."""
    while not all(r.finished for r in reqs):
        engine.step()
        engine.scheduler.check_invariants()
