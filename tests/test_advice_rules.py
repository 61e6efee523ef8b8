"""Each rule of the guides' advice, fed its symptom together with every other one, gives exactly
the guide's advice for that mix: no window gets two contradicting pieces of advice (the advisor
used to tell a server with 208 requests waiting that its client sent too slowly)."""

from __future__ import annotations

import pytest

from engine.advice import Sample, Settings, diagnose

CAP = 512
N = 64


def window(running, queued, usage, retract_every=0, oom=0) -> list[Sample]:
    """N samples a second apart; a retraction every ``retract_every`` samples."""
    return [Sample(float(t), running, queued, usage,
                   t // retract_every if retract_every else 0, oom if t == N - 1 else 0)
            for t in range(N)]


# symptom -> a window showing it
SYMPTOMS = {
    "healthy": window(CAP, 300, 0.95),
    "idle_client": window(4, 0, 0.3),  # nothing waits, tiny batch
    "too_conservative": window(39, 208, 0.6),  # the issue's run: waiting, the pool has room
    "retracting": window(CAP, 300, 0.95, retract_every=4),
    "retracting_low_usage": window(39, 208, 0.6, retract_every=4),
    "long_queue": window(CAP, 3000, 0.95),
    "small_pool": window(20, 300, 0.97),  # waiting, the pool full with a small batch
    "prefill_oom": window(CAP, 300, 0.95, oom=2),
}

EXPECTED = {
    "healthy": [],
    "idle_client": ["queue_empty", "small_decode_batch"],
    "too_conservative": ["low_token_usage"],
    "retracting": ["frequent_retractions"],
    "retracting_low_usage": ["frequent_retractions"],
    "long_queue": ["long_queue"],
    "small_pool": ["small_decode_batch"],
    "prefill_oom": ["prefill_oom"],
}


@pytest.mark.parametrize("name", SYMPTOMS)
def test_each_symptom_alone_gets_exactly_its_advice(name):
    advice = diagnose(SYMPTOMS[name], Settings(max_running_requests=CAP))
    assert [a.symptom for a in advice] == EXPECTED[name], [a.message for a in advice]


def test_the_issues_run_is_told_to_lower_conservativeness_only():
    advice = diagnose(SYMPTOMS["too_conservative"], Settings(max_running_requests=CAP))
    assert len(advice) == 1 and "Decrease --schedule-conservativeness" in advice[0].message
    assert not any("too slowly" in a.message for a in advice)


@pytest.mark.parametrize("first", SYMPTOMS)
@pytest.mark.parametrize("second", SYMPTOMS)
def test_two_symptoms_in_one_window_never_contradict(first, second):
    """Half the window shows one symptom, half the other (times continue)."""
    a, b = SYMPTOMS[first][: N // 2], SYMPTOMS[second][N // 2:]
    base = a[-1].retracted_total
    b = [Sample(s.time, s.running, s.queued, s.token_usage,
                base + s.retracted_total - SYMPTOMS[second][N // 2].retracted_total,
                s.prefill_oom_total) for s in b]
    got = {x.symptom for x in diagnose(a + b, Settings(max_running_requests=CAP))}
    assert not {"low_token_usage", "frequent_retractions"} <= got  # lower vs raise
    if "small_decode_batch" in got:  # "the client is too slow" only with an empty queue
        message = next(x.message for x in diagnose(a + b, Settings(max_running_requests=CAP))
                       if x.symptom == "small_decode_batch")
        if "too slowly" in message:
            assert "low_token_usage" not in got and "long_queue" not in got
    assert not {"queue_empty", "long_queue"} <= got
