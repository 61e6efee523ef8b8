"""The sampling inputs kept across steps (SamplingState: filtered and merged as requests come and
go, nothing rebuilt while the batch is the same) and seeded sampling without a generator (a
counter-based hash of seed and position, on the logits' device)."""

import dataclasses
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import Engine
from engine.grammar.bitmask import bitmask_words
from engine.sampling import Sampler, SamplingBatch, SamplingParams, SamplingState
from engine.sampling.seeds import (UNIFORM_BITS, counter_uniform, sample_inverse_cdf, seed_key,
                                   uniform_reference)

V = 64
EOS = 3


class FakeReq:
    """What SamplingState reads of a request."""

    def __init__(self, params, prompt_ids, output_ids=()):
        self.params, self.prompt_ids, self.output_ids = params, list(prompt_ids), list(output_ids)


def random_logits(rows, vocab=V, seed=0, scale=3.0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


POOL = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.9),
    SamplingParams(temperature=0.7, top_k=12, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=0, repetition_penalty=1.4, frequency_penalty=0.3),
    SamplingParams(temperature=1.1, presence_penalty=0.8, seed=11),
    SamplingParams(temperature=0.8, top_p=0.8, seed=12, min_new_tokens=4, stop_token_ids=[9]),
    SamplingParams(temperature=1.0, repetition_penalty=0.8, logprobs=True, top_logprobs=2),
    SamplingParams(temperature=0, min_new_tokens=2, logprobs=True),
    SamplingParams(temperature=1.3, seed=-5, frequency_penalty=-0.4),
]


def new_req(rng: random.Random, k: int) -> FakeReq:
    params = POOL[k % len(POOL)]
    if params.seed is not None:
        params = dataclasses.replace(params, seed=params.seed + k)
    prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 9))]
    return FakeReq(params, prompt, [rng.randrange(V) for _ in range(rng.randrange(0, 3))])


def from_scratch(reqs) -> SamplingBatch:
    return SamplingBatch.build([r.params for r in reqs], [r.prompt_ids for r in reqs],
                               [r.output_ids for r in reqs], None, {EOS}, V)


def assert_same_batch(a: SamplingBatch, b: SamplingBatch) -> None:
    assert torch.equal(a.floats, b.floats) and torch.equal(a.ints, b.ints)
    assert torch.equal(a.greedy, b.greedy) and a.lengths == b.lengths
    assert (a.all_greedy, a.any_greedy, a.top_logprobs) == (b.all_greedy, b.any_greedy,
                                                             b.top_logprobs)
    for name in ("filter_rows", "seed_rows", "top_k", "top_p", "min_p"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        assert x is None or torch.equal(x, y), name

    def active_bans(batch):
        if batch.banned is None:
            return set()
        rows, ids = batch.banned
        active = batch.positions[rows] < batch.ints[rows, 3]
        return {(r, t) for r, t, on in zip(rows.tolist(), ids.tolist(), active.tolist()) if on}

    assert active_bans(a) == active_bans(b)


# -- the hash --------------------------------------------------------------------------------------
def test_counter_uniform_is_splitmix64_bit_for_bit_over_the_whole_seed_range():
    seeds = [0, 1, -1, 7, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 12345678901234567]
    positions = [0, 1, 2, 77, 4096, 2**31 + 5]
    keys = torch.tensor([[seed_key(s)] * len(positions) for s in seeds])
    pos = torch.tensor([positions] * len(seeds))
    got = counter_uniform(keys, pos)
    assert got.dtype == torch.float32
    assert got.tolist() == [[uniform_reference(s, k) for k in positions] for s in seeds]
    assert seed_key(-1) == seed_key(2**64 - 1)  # seeds are taken mod 2**64


def test_counter_uniform_is_uniform_and_stays_below_one():
    seeds = torch.arange(2000).repeat_interleave(50)
    keys = torch.tensor([seed_key(s) for s in range(2000)]).repeat_interleave(50)
    u = counter_uniform(keys, torch.arange(50).repeat(2000))
    assert u.min() >= 0 and u.max() <= 1 - 2.0**-UNIFORM_BITS
    counts = torch.histc(u, bins=20, min=0, max=1)
    expected = seeds.numel() / 20
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 50, chi2  # 19 degrees of freedom: p ~ 1e-4
    assert len(set(u.tolist())) > 0.99 * u.numel()


def test_inverse_cdf_never_picks_a_token_without_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 3 + [[0.0, 0.0, 1.0, 0.0, 0.0]])
    u = torch.tensor([0.0, 1 - 2.0**-24, 0.5, 1 - 2.0**-24])
    assert sample_inverse_cdf(probs, u).tolist() == [1, 3, 3, 2]
    # an unnormalised row (float drift) scales the draw by its own total
    assert sample_inverse_cdf(probs[:1] * 0.9, u[1:2]).tolist() == [3]


# -- the persistent state ------------------------------------------------------------------------
def test_same_requests_as_last_step_rebuild_nothing(monkeypatch):
    rng = random.Random(0)
    reqs = [new_req(rng, k) for k in range(len(POOL))]
    state = SamplingState(V, {EOS})
    first = state.batch(reqs, "cpu")
    assert state.rows_built == len(reqs)
    tokens = Sampler()(random_logits(len(reqs)), first).next_token_ids
    state.advance(tokens)
    for r, t in zip(reqs, tokens.tolist()):
        r.output_ids.append(t)

    def forbidden(*args, **kwargs):
        raise AssertionError("rebuilt a batch whose requests did not change")

    made = []
    tensor = torch.tensor
    monkeypatch.setattr(SamplingBatch, "build", forbidden)
    monkeypatch.setattr(SamplingBatch, "take", forbidden)
    monkeypatch.setattr(SamplingBatch, "concat", forbidden)
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a) or tensor(*a, **k))
    again = state.batch(list(reqs), "cpu")
    monkeypatch.undo()
    assert again is first and made == [] and state.rows_built == len(reqs)
    assert again.positions.tolist() == [len(r.output_ids) for r in reqs]


def test_requests_leaving_and_joining_filter_and_merge_to_the_from_scratch_batch():
    rng = random.Random(1)
    reqs = [new_req(rng, k) for k in range(6)]
    joined = len(reqs)
    state = SamplingState(V, {EOS})
    for step in range(40):
        if step % 3 == 1:  # some leave, some join (at the end, or in the middle)
            for _ in range(rng.randrange(0, 3)):
                if len(reqs) > 1:
                    reqs.pop(rng.randrange(len(reqs)))
            for _ in range(rng.randrange(0, 3)):
                reqs.insert(rng.randrange(len(reqs) + 1), new_req(rng, joined))
                joined += 1
        if step % 7 == 5:
            rng.shuffle(reqs)
        running = state.batch(reqs, "cpu")
        scratch = from_scratch(reqs)
        assert_same_batch(running, scratch)
        logits = random_logits(len(reqs), seed=step)
        assert torch.equal(Sampler().penalize(logits, running), Sampler().penalize(logits, scratch))
        torch.manual_seed(step)
        out = Sampler()(logits.clone(), running, overwrite=True)
        state.advance(out.next_token_ids)
        torch.manual_seed(step)
        expected = Sampler()(logits, scratch)
        assert torch.equal(out.next_token_ids, expected.next_token_ids)
        assert out.top_logprobs == expected.top_logprobs
        for r, t in zip(reqs, out.next_token_ids.tolist()):
            r.output_ids.append(t)
    assert state.rows_built == joined  # each request built once, when it joined


def test_a_row_whose_output_did_not_grow_by_one_is_rebuilt():
    reqs = [FakeReq(SamplingParams(temperature=0, frequency_penalty=1.0), [1, 2]),
            FakeReq(SamplingParams(temperature=0.5, seed=3), [4])]
    state = SamplingState(V, {EOS})
    state.advance(Sampler()(random_logits(2), state.batch(reqs, "cpu")).next_token_ids)
    reqs[0].output_ids += [7, 7]  # two tokens (not the one sampled): its row must be redone
    reqs[1].output_ids += [5]
    batch = state.batch(reqs, "cpu")
    assert state.rows_built == 3
    assert_same_batch(batch, from_scratch(reqs))
    logits = random_logits(2, seed=3)
    assert torch.equal(Sampler().penalize(logits, batch),
                       Sampler().penalize(logits, from_scratch(reqs)))


def test_the_penalty_table_counts_repeats_in_place_and_keeps_its_width_tight():
    reqs = [FakeReq(SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.2),
                    [1, 2, 2]),
            FakeReq(SamplingParams(temperature=0, presence_penalty=0.5), [4], [6])]
    state = SamplingState(V, {EOS})
    for _ in range(70):  # the same two tokens every step: no new column after the first
        passing = FakeReq(SamplingParams(frequency_penalty=0.1), [5])  # a new one every step
        state.batch([passing] + reqs, "cpu")  # (so the table is filtered and merged each time)
        state.advance(torch.tensor([9, 7, 6]))
        for r, t in zip(reqs, (7, 6)):
            r.output_ids.append(t)
    batch = state.batch(reqs, "cpu")
    table = batch.penalties
    assert table.length.tolist() == [3, 1]  # {1, 2, 7} and {6}
    assert table.width == 3 + 70 - 64  # the bound was set back to the truth after 64 steps
    assert table.counts[0, :3].tolist() == [0, 0, 70] and table.counts[1, 0] == 71
    logits = random_logits(2, seed=9)
    expected = Sampler().penalize(logits, from_scratch(reqs))
    assert torch.equal(Sampler().penalize(logits, batch), expected)


def test_a_seed_gives_the_same_tokens_alone_and_in_a_changing_crowd():
    target = FakeReq(SamplingParams(temperature=1.2, top_p=0.95, seed=4242), [1, 2, 3])

    def run(crowd_schedule):
        me = FakeReq(target.params, target.prompt_ids)
        state, rng = SamplingState(V, {EOS}), random.Random(len(crowd_schedule))
        crowd: list = []
        for step, change in enumerate(crowd_schedule):
            crowd = crowd[change[0]:] + [new_req(rng, 100 + step + k) for k in range(change[1])]
            rows = crowd[: len(crowd) // 2] + [me] + crowd[len(crowd) // 2:]
            logits = random_logits(len(rows), seed=1000 + step)
            logits[rows.index(me)] = random_logits(1, seed=step)[0]  # my logits: mine only
            out = Sampler()(logits, state.batch(rows, "cpu"))
            state.advance(out.next_token_ids)
            for r, t in zip(rows, out.next_token_ids.tolist()):
                r.output_ids.append(t)
        return me.output_ids

    alone = run([(0, 0)] * 12)
    assert run([(0, 5), (0, 0), (2, 1), (0, 0), (3, 4), (1, 0), (0, 2), (0, 0), (5, 0),
                (0, 3), (1, 1), (0, 0)]) == alone
    assert run([(0, 9)] + [(1, 1)] * 11) == alone
    other = dataclasses.replace(target.params, seed=4243)
    target.params = other
    assert run([(0, 0)] * 12) != alone


# -- no generator, every tensor on the logits' device ------------------------------------------
class DeviceCheck(TorchDispatchMode):
    """A stand-in for a GPU's strictness on any device: an op whose tensors (0-dim host scalars
    aside) or generator sit on different devices fails, and so does any use of a generator."""

    TRANSFERS = {"aten::_to_copy", "aten::copy_", "aten::lift_fresh", "aten::lift_fresh_copy"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name not in self.TRANSFERS:
            devices = set()
            for x in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(x, torch.Tensor) and not (x.dim() == 0 and x.device.type == "cpu"):
                    devices.add(x.device)
            gen = kwargs.get("generator")
            if gen is not None:
                raise AssertionError(f"{func} draws from a generator on {gen.device}")
            if len(devices) > 1:
                raise AssertionError(f"{func} mixes devices {devices}")
        return func(*args, **kwargs)


def test_the_device_check_catches_a_host_generator_on_another_device():
    with pytest.raises(AssertionError, match="generator"), DeviceCheck():
        torch.empty(3, device="meta").uniform_(generator=torch.Generator())
    with pytest.raises(AssertionError, match="mixes devices"), DeviceCheck():
        torch.empty(3, device="meta") + torch.ones(3)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_seeded_sampling_runs_on_the_logits_device_without_a_generator(device, monkeypatch):
    """What crashed every seeded request's decode step on CUDA (a host torch.Generator drawing
    into device tensors): here the logits' device is 'meta' (or the host) and every op of the
    step must keep to it; no torch.Generator may even be made."""

    class NoGenerator:
        def __init__(self, *args, **kwargs):
            raise AssertionError("a torch.Generator was made")

    monkeypatch.setattr(torch, "Generator", NoGenerator)
    rng = random.Random(2)
    reqs = [new_req(rng, k) for k in range(len(POOL))]
    reqs = [r for r in reqs if not r.params.logprobs]  # top_logprobs read values on the host
    state, sampler = SamplingState(V, {EOS}), Sampler()
    words = bitmask_words(V)
    for step in range(5):
        if step == 2:  # one leaves, one joins: filter and merge on the device too
            reqs = reqs[1:] + [FakeReq(SamplingParams(temperature=0.9, seed=77), [5, 6])]
        logits = torch.randn(len(reqs), V).to(device)
        with DeviceCheck():
            batch = state.batch(reqs, logits.device)
            assert batch.seed_rows is not None and batch.penalties is not None
            batch.allowed = (torch.tensor([0]), torch.full((1, words), -1, dtype=torch.int32))
            out = sampler(logits, batch, overwrite=True)
            state.advance(out.next_token_ids)
        assert out.next_token_ids.device == logits.device and out.next_token_ids.shape == (
            len(reqs),)
        for r in reqs:  # the token is unknowable on 'meta': any one keeps the lengths right
            r.output_ids.append(1)


# -- in the engine -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.mark.parametrize("overlap", [False, True])
def test_the_engine_builds_each_request_s_sampling_row_once(model, overlap, monkeypatch):
    built = []
    build = SamplingBatch.build.__func__

    def counting(cls, params, *args, **kwargs):
        built.append(len(params))
        return build(cls, params, *args, **kwargs)

    monkeypatch.setattr(SamplingBatch, "build", classmethod(counting))
    engine = Engine(model, max_total_tokens=4000, enable_overlap_schedule=overlap)
    prompts = [[5 + i, 9, 11 + i, 40] for i in range(4)]
    params = [{"temperature": 0.8, "seed": i, "repetition_penalty": 1.2, "ignore_eos": True,
               "max_new_tokens": 6 + 3 * i} for i in range(4)]  # they finish one by one
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    engine.close()
    assert [len(o["output_ids"]) for o in outs] == [6, 9, 12, 15]
    assert sum(built) == 4  # one row per request: the later steps only filter and advance


def test_seeded_requests_make_no_torch_generator(model, monkeypatch):
    engine = Engine(model, max_total_tokens=4000)
    params = {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "n": 2, "max_new_tokens": 8,
              "ignore_eos": True}
    first = engine.generate("hello there", params)

    class NoGenerator:
        def __init__(self, *args, **kwargs):
            raise AssertionError("a torch.Generator was made")

    monkeypatch.setattr(torch, "Generator", NoGenerator)
    again = engine.generate("hello there", params)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first]
    assert again[0]["output_ids"] != again[1]["output_ids"]  # n = 2: seeds 1234 and 1235


def test_skip_moves_rows_on_as_if_sampled_or_drops_what_it_cannot():
    """A greedy verify step appends several tokens per request without sampling through the
    state (SamplingState.skip): its rows then equal rows built from scratch, and nothing is
    rebuilt at the next step; a state whose penalties count tokens is dropped instead."""
    rng = random.Random(7)
    state = SamplingState(V, [EOS])
    greedy = [FakeReq(SamplingParams(temperature=0), [1, 2, 3], [4]) for _ in range(3)]
    state.batch(greedy, "cpu")
    counts = [1, 3, 2]
    for r, c in zip(greedy, counts):
        r.output_ids += [rng.randrange(4, V) for _ in range(c)]
    state.skip(greedy, counts)
    built = state.rows_built
    assert_same_batch(state.batch(greedy, "cpu"), from_scratch(greedy))
    assert state.rows_built == built  # moved on, not rebuilt
    penalised = [FakeReq(POOL[3], [1, 2], [5]), greedy[0]]
    state.batch(penalised, "cpu")
    penalised[0].output_ids.append(6)
    greedy[0].output_ids.append(7)
    state.skip(penalised, [1, 1])
    assert state.current is None  # dropped: the next batch rebuilds it
    assert_same_batch(state.batch(penalised, "cpu"), from_scratch(penalised))
