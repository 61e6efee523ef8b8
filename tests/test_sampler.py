import dataclasses
import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import engine.sampling.sampler as sampler_module
from engine.sampling import Sampler, SamplingBatch, SamplingParams, SamplingState
from engine.sampling.penalties import SeenTokens
from engine.sampling.sampler import top_k_top_p_min_p

V = 64
EOS = 3


def build(params, prompts=None, outputs=None, vocab=V, eos=(EOS,)):
    n = len(params)
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    return SamplingBatch.build(params, prompts, outputs, None, set(eos), vocab)


class FakeReq:
    """What SamplingState reads of a request."""

    def __init__(self, params, prompt_ids, output_ids=None):
        self.params, self.prompt_ids = params, prompt_ids
        self.output_ids = list(output_ids or [])


def random_logits(rows, vocab=V, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def hf_row(processors, logits_row, input_ids=None):
    ids = torch.tensor([input_ids if input_ids is not None else [0]], dtype=torch.long)
    scores = logits_row.unsqueeze(0).clone()
    for proc in processors:
        scores = proc(ids, scores)
    return scores.squeeze(0)


def hf_warpers(p):
    procs = [TemperatureLogitsWarper(p.temperature)]
    procs += [TopKLogitsWarper(p.top_k)] if p.top_k > 0 else []
    procs += [TopPLogitsWarper(p.top_p)] if p.top_p < 1 else []
    return procs + ([MinPLogitsWarper(p.min_p)] if p.min_p > 0 else [])


def test_temperature_matches_hf():
    temps = [0.3, 0.7, 1.0, 1.9, 5.0]
    logits = random_logits(len(temps))
    ours = Sampler().warp(logits, build([SamplingParams(temperature=t) for t in temps]))
    for i, t in enumerate(temps):
        assert torch.equal(ours[i], hf_row([TemperatureLogitsWarper(t)], logits[i]))


@pytest.mark.parametrize(
    "name, values, warper",
    [
        ("top_k", [1, 2, 5, 17, V - 1, V], TopKLogitsWarper),
        # 1e-9: only the top token stays, whatever the rounding of the cumulative sum
        ("top_p", [1e-9] * 6 + [0.05, 0.3, 0.5, 0.8, 0.95, 0.999, 1.0], TopPLogitsWarper),
        ("min_p", [0.0, 0.01, 0.1, 0.3, 0.7, 1.0], MinPLogitsWarper),
    ],
)
def test_each_filter_matches_hf_row_by_row(name, values, warper):
    logits = random_logits(len(values), seed=1)
    kwargs = {"top_k": None, "top_p": None, "min_p": None, name: torch.tensor(values)}
    ours = top_k_top_p_min_p(logits, **kwargs)
    for i, value in enumerate(values):
        assert torch.equal(ours[i], hf_row([warper(value)], logits[i])), f"{name}={value}"


def test_full_warp_chain_matches_hf_in_a_mixed_batch():
    params = [
        SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=0.5, top_k=-1, min_p=0.2),
        SamplingParams(temperature=2.0, top_k=0, top_p=0.95),
        SamplingParams(temperature=0.9, top_k=3),
        SamplingParams(temperature=1.1, top_k=V + 10, top_p=0.99),
    ]
    logits = random_logits(len(params), seed=3)
    ours = Sampler().warp(logits, build(params))
    for i, p in enumerate(params):
        assert torch.equal(ours[i], hf_row(hf_warpers(p), logits[i])), f"row {i}"


def test_repetition_penalty_matches_hf_over_prompt_and_output():
    penalties = [1.0, 1.2, 0.8, 2.0, 1.5]
    prompts = [[5, 6, 7], [1, 2, 2, 9], [10, 11], [], [40, 41, 42, 43]]
    outputs = [[8], [9, 30, 31], [12, 10], [20, 21, 20], []]
    logits = random_logits(len(penalties), seed=4)
    batch = build([SamplingParams(repetition_penalty=r) for r in penalties], prompts, outputs)
    ours = Sampler().penalize(logits, batch)
    for i, r in enumerate(penalties):
        proc = RepetitionPenaltyLogitsProcessor(r)
        assert torch.equal(ours[i], hf_row([proc], logits[i], prompts[i] + outputs[i]))
    assert batch.penalties.rows.tolist() == [1, 2, 3, 4]  # only the rows with a penalty
    assert batch.penalties.frequency.eq(0).all() and batch.penalties.presence.eq(0).all()


def test_frequency_and_presence_follow_the_openai_formula():
    rows = [(0.5, 0.0), (0.0, 1.0), (-1.0, 0.7), (2.0, -2.0), (0.0, 0.0)]
    prompts = [[1, 2, 3]] * len(rows)  # prompt tokens never count for these penalties
    outputs = [[4, 4, 4, 5], [4, 6], [7, 7, 1], [9], [4]]
    logits = random_logits(len(rows), seed=5)
    params = [SamplingParams(frequency_penalty=f, presence_penalty=q) for f, q in rows]
    ours = Sampler().penalize(logits, build(params, prompts, outputs))
    for i, (f, q) in enumerate(rows):
        expected = logits[i].clone()
        for tok in set(outputs[i]):
            count = outputs[i].count(tok)
            expected[tok] = logits[i][tok] - count * f - (count > 0) * q
        torch.testing.assert_close(ours[i], expected, rtol=0, atol=1e-6)


def test_all_penalties_apply_in_order_repetition_then_frequency_presence():
    p = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    prompt, output = [1, 2], [2, 5, 5]
    logits = random_logits(1, seed=6)
    ours = Sampler().penalize(logits, build([p], [prompt], [output]))[0]
    expected = hf_row([RepetitionPenaltyLogitsProcessor(1.3)], logits[0], prompt + output)
    expected[2] -= 1 * 0.4 + 0.2
    expected[5] -= 2 * 0.4 + 0.2
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_penalty_table_holds_each_row_token_pair_once_with_its_output_count():
    prompts = [[1, 1, 2], [], [63, 0, 63], [5]]
    outputs = [[2, 7, 7], [4, 4], [], [9]]
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.1),
              SamplingParams(presence_penalty=0.3),  # no repetition: its prompt is not kept
              SamplingParams(repetition_penalty=0.9), SamplingParams()]
    table = build(params, prompts, outputs).penalties
    assert table.rows.tolist() == [0, 1, 2]
    got = [{int(t): float(c) for t, c in zip(table.tokens[k, :n], table.counts[k, :n])}
           for k, n in enumerate(table.length.tolist())]
    assert got == [{1: 0, 2: 1, 7: 2}, {4: 2}, {0: 0, 63: 0}]
    with pytest.raises(AssertionError, match="outside vocab"):
        build([SamplingParams(repetition_penalty=1.2)], [[1, V]])
    with pytest.raises(AssertionError, match="outside vocab"):
        SeenTokens(V, [1, V], [])


def test_running_state_over_many_steps_equals_a_from_scratch_batch():
    """The persistent state, advanced with the sampled tokens, penalises, bans and samples
    exactly as a batch built from scratch from the requests every step."""
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.3),
        SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.4),
        SamplingParams(temperature=0, repetition_penalty=0.9, frequency_penalty=-0.5,
                       presence_penalty=1.0, min_new_tokens=5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, repetition_penalty=1.2, presence_penalty=0.3, seed=1),
        SamplingParams(temperature=1.1, seed=2, min_new_tokens=3, stop_token_ids=[8]),
    ]
    prompts = [[1, 2, 2, 9], [3, 4], [5, 5, 6, 7, 8, 60], [10], [11, 12, 11], [13]]
    reqs = [FakeReq(p, pr) for p, pr in zip(params, prompts)]
    state = SamplingState(V, {EOS})
    for step in range(40):
        logits = random_logits(len(params), seed=100 + step, scale=1.0)
        running = state.batch(reqs, "cpu")
        scratch = build(params, prompts, [r.output_ids for r in reqs])
        penalized = Sampler().penalize(logits, running)
        assert torch.equal(penalized, Sampler().penalize(logits, scratch))
        for i, p in enumerate(params):  # HF's repetition rule, then OpenAI's formula
            out = reqs[i].output_ids
            expected = hf_row([RepetitionPenaltyLogitsProcessor(p.repetition_penalty)],
                              logits[i], prompts[i] + out)
            for tok in set(out):
                count = out.count(tok)
                expected[tok] -= count * p.frequency_penalty + p.presence_penalty
            if len(out) < p.min_new_tokens:
                expected[EOS] = -math.inf
                expected[p.stop_token_ids] = -math.inf
            torch.testing.assert_close(penalized[i], expected, rtol=0, atol=1e-6)
        torch.manual_seed(step)
        tokens = Sampler()(logits.clone(), running, overwrite=True).next_token_ids
        state.advance(tokens)
        torch.manual_seed(step)
        assert torch.equal(tokens, Sampler()(logits, scratch).next_token_ids)
        for r, tok in zip(reqs, tokens.tolist()):
            r.output_ids.append(tok)
    assert state.rows_built == len(reqs)  # built once, then only advanced
    assert all(len(set(r.output_ids)) > 5 for r in reqs[:3])  # the penalties had tokens to act on


def test_overwrite_penalizes_in_place_but_keeps_raw_logits_for_logprobs():
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    logits = random_logits(1, seed=15)
    batch = build(params, [[int(logits[0].argmax())]])
    kept = logits.clone()
    tokens = Sampler()(kept, batch, overwrite=True).next_token_ids
    assert not torch.equal(kept, logits)  # overwritten: no [B, V] copy
    assert tokens.tolist() == Sampler().penalize(logits, batch).argmax(-1).tolist()
    params = [dataclasses.replace(params[0], logprobs=True)]
    kept = logits.clone()
    result = Sampler()(kept, build(params, [[int(logits[0].argmax())]]), overwrite=True)
    assert torch.equal(kept, logits)
    assert result.logprobs.tolist() == logits.log_softmax(-1)[0, tokens].tolist()


def test_penalty_tensors_are_skipped_when_no_row_uses_them():
    batch = build([SamplingParams(temperature=0.5), SamplingParams()], [[1, 2], [3]], [[4], [5]])
    assert batch.penalties is None and batch.banned is None
    assert batch.filter_rows is None and batch.top_k is None and batch.top_p is None
    logits = random_logits(2)
    assert Sampler().penalize(logits, batch) is logits  # no copy when nothing changes


def test_only_rows_that_filter_are_sorted():
    params = [SamplingParams(), SamplingParams(top_p=0.5), SamplingParams(temperature=0, top_k=3)]
    batch = build(params)
    assert batch.filter_rows.tolist() == [1]
    logits = random_logits(3, seed=7)
    ours = Sampler().warp(logits, batch)
    assert torch.equal(ours[0], logits[0])
    assert torch.equal(ours[1], hf_row([TopPLogitsWarper(0.5)], logits[1]))


def test_min_new_tokens_bans_eos_and_stop_tokens_until_reached():
    params = [
        SamplingParams(min_new_tokens=2, stop_token_ids=[7], ignore_eos=True),
        SamplingParams(min_new_tokens=2, stop_token_ids=[7]),
        SamplingParams(stop_token_ids=[7]),
    ]
    logits = torch.zeros(3, V)
    logits[:, EOS], logits[:, 7] = 100.0, 50.0
    out = Sampler().penalize(logits, build(params, outputs=[[1], [1, 2], [1]]))
    assert out[0, EOS] == -math.inf and out[0, 7] == -math.inf
    assert torch.isfinite(out[1:]).all()
    result = Sampler()(logits[:1], build([SamplingParams(temperature=0, min_new_tokens=1)]))
    assert result.next_token_ids.tolist() != [EOS]


def test_greedy_rows_take_argmax_of_penalised_logits_in_a_mixed_batch():
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0, repetition_penalty=100.0),
        SamplingParams(top_k=1, temperature=1.5, seed=7),
    ]
    logits = random_logits(len(params), seed=8)
    outputs = [[], [], [int(logits[2].argmax())], []]
    tokens = Sampler()(logits, build(params, outputs=outputs)).next_token_ids
    assert tokens[0] == logits[0].argmax()
    assert tokens[2] == Sampler().penalize(logits, build(params, outputs=outputs))[2].argmax()
    assert tokens[2] != logits[2].argmax()
    assert tokens[3] == logits[3].argmax()


def test_top_k_1_equals_greedy():
    logits = random_logits(32, seed=9)
    greedy = Sampler()(logits, build([SamplingParams(temperature=0)] * 32)).next_token_ids
    for temperature in (0.5, 1.0, 3.0):
        params = [SamplingParams(top_k=1, temperature=temperature, top_p=0.9)] * 32
        assert torch.equal(Sampler()(logits, build(params)).next_token_ids, greedy)
    mixed = build([SamplingParams(top_k=1), SamplingParams(temperature=1.0)] * 16)
    assert torch.equal(Sampler()(logits, mixed).next_token_ids[::2], greedy[::2])
    tiny = build([SamplingParams(temperature=1e-7)] * 32)  # logits / 1e-7 would overflow
    assert torch.equal(Sampler()(logits, tiny).next_token_ids, greedy)


def test_all_greedy_batch_neither_sorts_nor_draws_noise(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the greedy fast path must not get here")

    monkeypatch.setattr(sampler_module, "top_k_top_p_min_p", forbidden)
    monkeypatch.setattr(Sampler, "_noise", forbidden)
    monkeypatch.setattr(Sampler, "warp", forbidden)
    params = [SamplingParams(temperature=0, top_p=0.5, seed=3), SamplingParams(top_k=1, min_p=0.3)]
    logits = random_logits(2, seed=10)
    batch = build(params)
    assert batch.all_greedy and batch.top_p is None and batch.min_p is None
    assert batch.seed_rows is None
    assert torch.equal(Sampler()(logits, batch).next_token_ids, logits.argmax(-1))


def filtered_distribution(params, logits_row):
    return hf_row(hf_warpers(params), logits_row).softmax(-1).double()


def assert_matches_distribution(tokens, expected, vocab):
    draws = tokens.numel()
    freq = torch.bincount(tokens, minlength=vocab).double() / draws
    assert freq[expected == 0].sum() == 0, "sampled a token the filters removed"
    tv = 0.5 * (freq - expected).abs().sum().item()
    assert tv < 0.02, f"total variation {tv:.4f}"
    support = expected > 0
    observed, wanted = freq[support] * draws, expected[support] * draws
    chi2 = ((observed - wanted) ** 2 / wanted).sum()
    dof = int(support.sum()) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2), chi2 / 2).item()
    assert p_value > 1e-3, f"chi-square p-value {p_value:.2e} (chi2={chi2:.1f}, dof={dof})"


PARAM_SETS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=12, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.5, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.1),
]


@pytest.mark.parametrize(
    "params", PARAM_SETS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}"
)
def test_global_rng_draws_match_the_filtered_distribution(params):
    vocab, draws = 32, 20000
    logits_row = random_logits(1, vocab, seed=11, scale=1.5)[0]
    torch.manual_seed(1234)
    batch = build([params] * draws, vocab=vocab)
    tokens = Sampler()(logits_row.expand(draws, vocab), batch).next_token_ids
    assert_matches_distribution(tokens, filtered_distribution(params, logits_row), vocab)


def test_seeded_draws_match_the_filtered_distribution():
    vocab, draws = 32, 20000
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95)
    logits_row = random_logits(1, vocab, seed=12, scale=1.5)[0]
    batch = build([dataclasses.replace(params, seed=seed) for seed in range(draws)], vocab=vocab)
    tokens = Sampler()(logits_row.expand(draws, vocab), batch).next_token_ids
    assert_matches_distribution(tokens, filtered_distribution(params, logits_row), vocab)


def run_steps(rows, steps=6, target=0):
    """Sample `steps` tokens for every row (a persistent SamplingState); return the tokens of
    row `target` per step."""
    reqs = [FakeReq(p, [1, 2, 3]) for p, _ in rows]
    state = SamplingState(V, {EOS})
    for step in range(steps):
        logits = torch.stack([random_logits(1, seed=key * 100 + step)[0] for _, key in rows])
        result = Sampler()(logits, state.batch(reqs, "cpu"))
        state.advance(result.next_token_ids)
        for r, tok in zip(reqs, result.next_token_ids.tolist()):
            r.output_ids.append(tok)
    return reqs[target].output_ids


@pytest.mark.parametrize(
    "target_params",
    # the plain row takes the no-filter path alone and the sorting path among the others
    [SamplingParams(temperature=1.2, top_p=0.95, seed=4242), SamplingParams(seed=4242)],
)
def test_seed_gives_the_same_tokens_whatever_the_batch_and_order(target_params):
    target = (target_params, 1)
    others = [
        (SamplingParams(temperature=0), 2),
        (SamplingParams(temperature=0.9, repetition_penalty=1.3, logprobs=True, top_logprobs=3), 3),
        (SamplingParams(temperature=1.0, seed=99, top_k=5, min_p=0.05), 4),
        (SamplingParams(temperature=1.1, frequency_penalty=0.5), 5),
    ]
    torch.manual_seed(0)
    alone = run_steps([target])
    torch.manual_seed(1)
    first = run_steps([target, *others])
    torch.manual_seed(2)
    last = run_steps([*reversed(others), target], target=len(others))
    torch.manual_seed(3)
    middle = run_steps([others[1], target, others[3]], target=1)
    assert alone == first == last == middle
    other_seed = run_steps([(dataclasses.replace(target_params, seed=4243), 1)])
    assert other_seed != alone


def test_unseeded_rows_follow_the_global_rng():
    params = [SamplingParams(temperature=1.0)] * 64
    logits = random_logits(64, seed=13, scale=0.5)
    torch.manual_seed(5)
    a = Sampler()(logits, build(params)).next_token_ids
    torch.manual_seed(5)
    b = Sampler()(logits, build(params)).next_token_ids
    c = Sampler()(logits, build(params)).next_token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_logprobs_are_raw_log_softmax_and_top_logprobs_per_row():
    params = [
        SamplingParams(temperature=0.5, repetition_penalty=1.5, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0),
        SamplingParams(logprobs=True),
        SamplingParams(temperature=0, logprobs=True, top_logprobs=5),
    ]
    logits = random_logits(len(params), seed=14)
    result = Sampler()(logits, build(params, outputs=[[1, 2], [], [], []]))
    raw = logits.log_softmax(-1)
    tokens = result.next_token_ids
    torch.testing.assert_close(result.logprobs, raw.gather(1, tokens[:, None]).squeeze(1))
    assert result.top_logprobs[1] == [] and result.top_logprobs[2] == []
    for row, k in ((0, 3), (3, 5)):
        values, ids = raw[row].topk(k)
        assert [t for t, _ in result.top_logprobs[row]] == ids.tolist()
        assert [v for _, v in result.top_logprobs[row]] == pytest.approx(values.tolist())


def test_no_logprobs_when_nobody_asks():
    result = Sampler()(random_logits(2), build([SamplingParams(), SamplingParams(temperature=0)]))
    assert result.logprobs is None and result.top_logprobs is None
    assert result.next_token_ids.dtype == torch.int64 and result.next_token_ids.shape == (2,)


def test_argmax_rows_picks_what_torch_picks():
    """numpy's argmax on a CPU (argmax_rows) against torch's: ties and NaNs take the first,
    strided rows, other dtypes and devices go to torch."""
    from engine.sampling.sampler import argmax_rows

    x = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3))
    x[1, 5] = x[1, 9] = 50.0  # a tie
    x[2, 7] = x[2, 3] = float("nan")
    x[3] = float("-inf")
    for t in (x, x[:, ::3], x[::2], x.bfloat16(), x.double()):
        got = argmax_rows(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim=-1))
