"""Admission counts a prompt chunk allocated this step once: a running prompt reserves the
tokens that have no slot yet (seq_len - alloc_len), not those not computed yet."""

from __future__ import annotations

import random

import pytest

from engine import Engine
from engine.scheduler.request import Status
from engine_testing.invariants import assert_all_free


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def test_the_chunk_in_progress_is_not_reserved_twice(model):
    # 700 slots; a 500-token prompt in chunks of 200: its last chunk (100 tokens) runs in step
    # 3 with 100 tokens of budget left. 200 slots are free then, and a 150-token prompt needs
    # 150 + its reservation. Counting the allocated last chunk again (99 more) held it back.
    engine = Engine(model, max_total_tokens=700, chunked_prefill_size=200)
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 1}
    long, = engine.add_request(ids(1, 500), params)
    second, = engine.add_request(ids(2, 150), params)
    for _ in range(3):
        engine.step()
        engine.scheduler.check_invariants()
    assert len(long.output_ids) == 1  # its last chunk ran in step 3
    assert second.status is Status.RUNNING and second.kv_len == 100
    while engine.scheduler.has_work:
        engine.step()
    assert long.finished and second.finished
    assert_all_free(engine)
