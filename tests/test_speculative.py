"""Speculative decoding (engine/speculative, engine-spec-ngram): outputs identical to decoding
without drafts for every request kind and scheduler mode (drafts accepted and rejected, with
and without the CPU graph), the KV invariant through retraction storms, the flags of SGLang
and vLLM and their clashes, the policy that drafts only where it pays, and a real server."""

import logging
import random

import httpx
import pytest
from engine import Engine
from engine.config import ConfigError
from engine.errors import EngineError
from engine.interfaces import Draft, Drafter
from engine.registry import UnknownName
from engine.server.process import ServerProcess
from engine.speculative.policy import PROBE_EVERY, DraftPolicy
from engine_testing.generation import record_proposals
from engine_testing.generation import run_requests as run
from engine_testing.generation import verify_every_draft as draft_everything
from engine_testing.invariants import assert_all_free

GREEDY = {"temperature": 0, "ignore_eos": True}


def ids(seed, n, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


class OracleDrafter(Drafter):
    """Drafts a reference output (what decoding without drafts produced), wrong at every
    ``wrong_every``-th position: drafts are accepted up to a wrong token, then rejected."""

    def __init__(self, reference: dict, wrong_every: int = 4):
        self.reference, self.wrong_every = reference, wrong_every

    def propose(self, reqs, max_tokens):
        return [self.draft(self.reference.get(tuple(r.prompt_ids), []), len(r.output_ids), k)
                for r, k in zip(reqs, max_tokens)]

    def draft(self, ref: list[int], n: int, k: int) -> Draft:
        """The draft after the first ``n`` tokens of the reference output ``ref``."""
        return Draft([t + (1 if (n + i) % self.wrong_every == 0 else 0)
                      for i, t in enumerate(ref[n: n + k])], 0)


def spec_engine(model, drafter=None, **kw):
    engine = draft_everything(Engine(model, **{"max_total_tokens": 4000,
                                               "speculative_algorithm": "NGRAM", **kw}))
    if drafter is not None:
        engine.scheduler.spec.drafter = drafter
    return engine


def compare(model, prompts, params, oracle=True, **kw):
    """Outputs without speculation, then with (oracle drafts, or n-gram drafts), and the
    speculative engine."""
    plain = Engine(model, **{"max_total_tokens": 4000, **kw})
    ref = run(plain, prompts, params)
    plain.close()  # (its ranks, with --tp-size)
    drafter = OracleDrafter({tuple(p): o for p, (o, _, _) in zip(prompts, ref)}) if oracle \
        else None
    engine = spec_engine(model, drafter, **kw)
    got = run(engine, prompts, params, every_step=lambda e: e.scheduler.check_invariants())
    assert_all_free(engine)
    return ref, got, engine


def test_greedy_and_logprobs_identical_with_drafts_accepted_and_rejected(model):
    prompts = [ids(i, 5 + 3 * i) for i in range(6)]
    params = [{**GREEDY, "max_new_tokens": 4 + 5 * i, "logprobs": i % 2 == 1,
               "top_logprobs": 2 * (i % 2)} for i in range(6)]
    ref, got, engine = compare(model, prompts, params)
    assert got == ref
    st = engine.scheduler.spec.stats
    assert st.accepted > 0 and st.drafted > st.accepted  # both happened
    assert st.accept_length > 1.5
    assert engine.scheduler.counters.generation_tokens == sum(4 + 5 * i for i in range(6))


def test_ngram_drafts_greedy_identical(model):
    # a repeated phrase in the prompt: n-gram lookup has something to draft
    phrase = ids(99, 12)
    prompts = [phrase * 3 + ids(i, 4) for i in range(3)]
    ref, got, engine = compare(model, prompts, {**GREEDY, "max_new_tokens": 40}, oracle=False)
    assert got == ref
    assert engine.scheduler.spec.stats.drafted > 0


def test_greedy_rounds_take_one_argmax_and_other_batches_the_sampler(model, monkeypatch):
    """A verify step whose requests all take their argmax (greedy, no penalty, ban, grammar or
    logprobs) picks every row's token with one argmax (verify._greedy_picks) and moves the
    sampling state on by what each request took; any other batch samples round by round.
    Outputs are identical either way, through a min_new_tokens ban that lifts mid-output (the
    state is then rebuilt, then moved on again) and next to a seeded request."""
    from engine.speculative import verify
    picks = []
    real = verify._greedy_picks

    def counted(s, decodes, logits):
        got = real(s, decodes, logits)
        picks.append(got is not None)
        return got

    monkeypatch.setattr(verify, "_greedy_picks", counted)
    prompts = [ids(40 + i, 6 + 2 * i) for i in range(4)]
    params = [{**GREEDY, "max_new_tokens": 24 + i} for i in range(4)]
    params[1] = {"temperature": 0, "min_new_tokens": 10, "max_new_tokens": 30}
    ref, got, engine = compare(model, prompts, params)
    assert got == ref and all(picks[-3:]) and not all(picks)  # the ban, then the fast path
    assert engine.scheduler.spec.stats.accepted > 0
    picks.clear()
    params[2] = {"temperature": 0.8, "seed": 11, "max_new_tokens": 26, "ignore_eos": True}
    ref, got, engine = compare(model, prompts, params)
    assert got == ref and picks and not any(picks[:3])


def test_seeded_sampling_n_and_penalties_identical(model):
    prompts = [ids(20 + i, 12) for i in range(3)]
    params = [{"temperature": 0.9, "top_p": 0.9, "seed": 5, "max_new_tokens": 16,
               "ignore_eos": True},
              {"temperature": 0.7, "seed": 8, "repetition_penalty": 1.3, "max_new_tokens": 20,
               "ignore_eos": True},
              {"temperature": 0, "frequency_penalty": 0.8, "presence_penalty": 0.4,
               "max_new_tokens": 12, "ignore_eos": True}]
    ref, got, engine = compare(model, prompts, params)
    assert got == ref and engine.scheduler.spec.stats.accepted > 0
    # n > 1 (one prompt, several seeded samples) with n-gram drafts
    n_params = {"temperature": 1.0, "seed": 3, "n": 3, "max_new_tokens": 12, "ignore_eos": True}
    ref, got, _ = compare(model, [ids(30, 24) * 2], n_params, oracle=False)
    assert got == ref


@pytest.mark.parametrize("tree", [{}, {"speculative_ngram_max_bfs_breadth": 3}])
def test_echo_with_prompt_logprobs_next_to_drafting_requests(model, tree):
    """A request scoring its prompt (echo + logprobs) among requests that draft (chains, or
    n-gram trees): its prompt chunks run without drafts, its logprobs and everyone's tokens
    are those of no speculation."""
    prompts = [ids(70 + i, 30) * 2 for i in range(3)]
    outs = []
    for spec in (False, True):
        engine = Engine(model, max_total_tokens=4000, chunked_prefill_size=16,
                        **({"speculative_algorithm": "NGRAM", **tree} if spec else {}))
        if spec:
            draft_everything(engine)
        reqs = (engine.add_request(prompts[0], {**GREEDY, "max_new_tokens": 20})
                + engine.add_request(prompts[1], {**GREEDY, "max_new_tokens": 12,
                                                  "logprobs": True}, prompt_logprobs=2)
                + engine.add_request(prompts[2], {"temperature": 0.8, "seed": 9,
                                                  "max_new_tokens": 16, "ignore_eos": True}))
        for _ in range(500):
            if all(r.finished for r in reqs):
                break
            engine.step()
            engine.scheduler.check_invariants()
        outs.append([(r.output_ids, [round(x, 3) for x in r.output_logprobs],
                      [None if x is None else round(x, 3) for x in r.input_logprobs])
                     for r in reqs])
        assert_all_free(engine)
    assert outs[1] == outs[0]
    assert len(outs[1][1][2]) == len(prompts[1]) and engine.scheduler.spec.stats.accepted > 0


def test_stop_ids_stop_strings_and_lengths_end_inside_a_draft(model):
    prompts = [ids(40 + i, 10) for i in range(4)]
    reference = Engine(model, max_total_tokens=4000).generate(
        input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 24})
    stop_id = reference[0]["output_ids"][5]
    text = reference[1]["text"]
    stop_str = text[len(text) // 3: len(text) // 3 + 2]
    params = [{"temperature": 0, "max_new_tokens": 24, "stop_token_ids": [stop_id]},
              {"temperature": 0, "max_new_tokens": 24, "stop": [stop_str]},
              {"temperature": 0, "max_new_tokens": 24, "min_new_tokens": 8,
               "stop_token_ids": [stop_id]},
              {**GREEDY, "max_new_tokens": 7}]
    ref, got, _ = compare(model, prompts, params)
    assert got == ref
    assert got[0][1] == "stop" and len(got[0][0]) <= 6 and len(got[3][0]) == 7


def test_a_retraction_storm_keeps_the_invariant_and_the_outputs(model, caplog):
    prompts = [ids(i, 20 + i) for i in range(8)]
    params = {**GREEDY, "max_new_tokens": 40}
    with caplog.at_level(logging.WARNING, logger="engine"):
        ref, got, engine = compare(model, prompts, params, max_total_tokens=200,
                                   schedule_conservativeness=0.1)
    assert engine.scheduler.counters.retracted_reqs >= 1
    assert got == ref


def test_chunked_prefill_radix_hits_and_pages(model):
    prompts = [ids(7, 150), ids(8, 5), ids(7, 150)[:100] + ids(9, 20)]
    params = [{**GREEDY, "max_new_tokens": 12}, {"temperature": 0.8, "seed": 2,
                                                 "max_new_tokens": 30, "ignore_eos": True},
              {**GREEDY, "max_new_tokens": 20}]
    for kw in ({"chunked_prefill_size": 16}, {"page_size": 4}):
        ref, got, engine = compare(model, prompts, params, **kw)
        assert got == ref
        again = run(engine, prompts, params)  # now from the radix cache
        assert again == ref
        assert_all_free(engine)


@pytest.mark.parametrize("mode", [{"enable_torch_compile": True}, {"tp_size": 2}])
def test_torch_compile_and_tensor_parallel_ranks_verify_drafts(model, mode):
    prompts = [ids(5, 12) * 3, ids(6, 9) * 2]
    params = {**GREEDY, "max_new_tokens": 24}
    ref, got, engine = compare(model, prompts, params, oracle=False, **mode)
    assert got == ref and engine.scheduler.spec.stats.accepted > 0
    engine.close()


def test_the_cpu_graph_verifies_drafts(tiny_gguf_factory):
    gguf = tiny_gguf_factory("llama", "Q8_0")
    prompts = [ids(50 + i, 9 + 4 * i) for i in range(4)]
    params = [{**GREEDY, "max_new_tokens": 20},
              {"temperature": 0.8, "seed": 1, "max_new_tokens": 16, "ignore_eos": True},
              {**GREEDY, "max_new_tokens": 12, "logprobs": True, "top_logprobs": 2},
              {**GREEDY, "max_new_tokens": 25}]
    ref, got, engine = compare(gguf, prompts, params)
    assert engine.runner.cpu_graph is not None and engine.runner.cpu_graph.replays > 0
    assert got == ref and engine.scheduler.spec.stats.accepted > 0


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_int8_activations_verify_drafts_identically(qtype, tiny_gguf_factory):
    """llama.cpp's arithmetic (--quantization w8a8_int8 on a GGUF's blocks: activations
    quantized to int8 per block of 32) turns a last-bit difference upstream into another
    token, so a verified row must get the bits it gets decoded alone: the linear kernels and
    the attention (its split-KV chunks) are batch-invariant. One request alone (its keys split
    over the threads) and eight beside each other (not split), contexts across chunk sizes."""
    gguf = tiny_gguf_factory("llama", qtype)
    for n in (1, 8):
        prompts = [ids(70 + i, 30 + 23 * i, vocab=200) for i in range(n)]
        params = [{**GREEDY, "max_new_tokens": 40 + 9 * i} for i in range(n)]
        ref, got, engine = compare(gguf, prompts, params, quantization="w8a8_int8")
        assert "int8 activations" in engine.runner.linear_kernel
        assert engine.runner.cpu_graph is not None and engine.runner.cpu_graph.replays > 0
        assert got == ref and engine.scheduler.spec.stats.accepted > 0


class TreeOracle(OracleDrafter):
    """Trees around a reference output: at each level the right token and a wrong sibling
    (listed first every ``wrong_first``-th level, so the right branch is sometimes the second),
    the right path going on for ``depth`` levels and wrong at every ``wrong_every``-th."""

    def __init__(self, reference: dict, depth=4, wrong_every=5, wrong_first=2):
        super().__init__(reference, wrong_every)
        self.depth, self.wrong_first = depth, wrong_first

    def draft(self, ref: list[int], n: int, k: int) -> Draft:
        tokens, parents, at = [], [], -1
        for level, t in enumerate(ref[n: n + self.depth]):
            right = t + (1 if (n + level) % self.wrong_every == 0 else 0)
            pair = [right, right ^ 1]
            if (n + level) % self.wrong_first == 0:
                pair.reverse()
            for tok in pair:
                tokens.append(tok)
                parents.append(at)
            at = len(tokens) - 1 if pair[1] == right else len(tokens) - 2
        return Draft(tokens[:k], 0, parents[:k])


@pytest.mark.parametrize("mode", [{}, {"disable_cpu_graph": True},
                                  {"attention_backend": "torch_native"}, {"tp_size": 2}])
def test_trees_of_drafts_verify_identically(model, tiny_gguf_factory, mode):
    """Trees (Draft.parents): every node a row attending to its request and its own
    ancestors; the accepted path's slots rearranged into the request's row (on every rank of
    --tp-size 2 too: the table journal mirrors it). Greedy, seeded, logprobs and stop ids: the
    tokens of decoding without drafts; the borrowed table rows all given back; the slot
    invariant after every step."""
    target = tiny_gguf_factory("llama", "Q8_0") if not mode else model
    prompts = [ids(80 + i, 7 + 5 * i) for i in range(4)]
    params = [{**GREEDY, "max_new_tokens": 24},
              {"temperature": 0.8, "seed": 3, "max_new_tokens": 18, "ignore_eos": True},
              {**GREEDY, "max_new_tokens": 15, "logprobs": True, "top_logprobs": 2},
              {**GREEDY, "max_new_tokens": 30}]
    plain = Engine(target, max_total_tokens=4000, **mode)
    ref = run(plain, prompts, params)
    plain.close()
    engine = spec_engine(target, TreeOracle({tuple(p): o for p, (o, _, _) in
                                             zip(prompts, ref)}), **mode)
    engine.scheduler.spec.policy.lengths = lambda reqs, drafts: [len(d.tokens) for d in drafts]
    got = run(engine, prompts, params, every_step=lambda e: e.scheduler.check_invariants())
    assert got == ref
    st = engine.scheduler.spec.stats
    assert st.accepted > 10 and st.accept_length > 1.5
    assert engine.runner.kv_pool.free_reqs == engine.runner.kv_pool.max_reqs
    assert_all_free(engine)
    engine.close()


def test_ngram_trees_greedy_identical(model):
    """--speculative-ngram-max-bfs-breadth 3: the n-gram drafter's tries (several earlier
    occurrences, different continuations) verified at once; outputs unchanged."""
    phrase, other = ids(99, 12), ids(98, 12)
    prompts = [phrase + ids(1, 3) + phrase + ids(2, 3) + phrase + other + phrase + ids(i, 4)
               for i in range(3)]
    params = {**GREEDY, "max_new_tokens": 40}
    plain = Engine(model, max_total_tokens=4000)
    ref = run(plain, prompts, params)
    engine = spec_engine(model, speculative_ngram_max_bfs_breadth=3)
    engine.scheduler.spec.policy.lengths = lambda reqs, drafts: [len(d.tokens) for d in drafts]
    got = run(engine, prompts, params, every_step=lambda e: e.scheduler.check_invariants())
    assert got == ref
    drafter = engine.scheduler.spec.drafter
    assert drafter.breadth == 3 and engine.scheduler.spec.stats.drafted > 0
    # seeded samples (n > 1) and penalties over the same tries
    sampled = [{"temperature": 1.0, "seed": 3, "n": 3, "max_new_tokens": 12, "ignore_eos": True},
               {"temperature": 0.7, "seed": 8, "repetition_penalty": 1.3, "max_new_tokens": 20,
                "ignore_eos": True}]
    assert run(engine, prompts[:2], sampled) == run(plain, prompts[:2], sampled)
    assert_all_free(engine)


def test_the_ngram_drafter_builds_tries_likeliest_first():
    from engine_spec_ngram.drafter import NgramDrafter

    d = NgramDrafter(1, 4, breadth=2)

    class R:
        rid, output_ids = "r", []
        prompt_ids = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    [draft] = d.propose([R()], [6])
    # after "1 2 3": 5 6 1 2 (the most recent occurrence) and 4 9 (the one before) branch at
    # the root; likeliest first (0.6 ** depth x 0.4 per earlier sibling): 5, 6, 4, 1, 9, 2
    assert draft.tokens == [5, 6, 4, 1, 9, 2]
    assert draft.parents == [-1, 0, -1, 1, 2, 3]
    assert draft.kind == 3 and draft.depths() == [1, 2, 1, 3, 2, 4]
    assert draft.first(3) == Draft([5, 6, 4], 3, [-1, 0, -1])


@pytest.mark.parametrize("tree", [{}, {"speculative_ngram_max_bfs_breadth": 3}])
def test_a_grammar_constrained_request_is_identical(model, tree):
    from engine.interfaces import Constraint

    regex = Constraint("regex", "(ab|cd)+x", "regex")
    outs = []
    for spec in (False, True):
        kw = {"speculative_algorithm": "NGRAM", **tree} if spec else {}
        engine = Engine(model, max_total_tokens=1000, **kw)
        if spec:
            draft_everything(engine)
        reqs = (engine.add_request("hello", {"temperature": 0.9, "seed": 4, "max_new_tokens": 30},
                                   constraint=regex)
                + engine.add_request(ids(1, 12) * 2, {**GREEDY, "max_new_tokens": 20}))
        for _ in range(400):
            if all(r.finished for r in reqs):
                break
            engine.step()
        outs.append([r.output_ids for r in reqs])
        assert_all_free(engine)
    assert outs[0] == outs[1]


# -- STANDALONE: a draft model -----------------------------------------------------------------
def standalone(model, draft, **kw):
    return draft_everything(Engine(model, **{"max_total_tokens": 4000,
                                             "speculative_algorithm": "STANDALONE",
                                             "speculative_draft_model_path": draft, **kw}))


DRAFT_PROMPTS = [ids(60 + i, 8 + 5 * i) for i in range(4)]
DRAFT_PARAMS = [{**GREEDY, "max_new_tokens": 24},
                {"temperature": 0.8, "seed": 3, "max_new_tokens": 20, "ignore_eos": True},
                {**GREEDY, "max_new_tokens": 16, "logprobs": True, "top_logprobs": 2,
                 "frequency_penalty": 0.5},
                {**GREEDY, "max_new_tokens": 30}]


def test_draft_model_trees_give_identical_outputs(model, tiny_model_factory):
    """--speculative-eagle-topk 3: each request's draft is a tree (S levels of the 3 most
    likely branches); every node's token is among its parent's 3 most likely next tokens of
    the draft model (checked against the draft model alone, each node's path fed whole), the
    most likely first; the target's outputs unchanged, with the target as its own draft every
    greedy step accepting its whole best path."""
    prompts, params = DRAFT_PROMPTS, DRAFT_PARAMS
    ref = run(Engine(model, max_total_tokens=4000), prompts, params)
    other = tiny_model_factory("llama", num_hidden_layers=1, seed=7)
    for draft, least in ((model, 2.0), (other, 1.0)):
        engine = standalone(model, draft, speculative_eagle_topk=3, speculative_num_steps=3,
                            speculative_num_draft_tokens=7)
        drafter = engine.scheduler.spec.drafter
        proposals = record_proposals(drafter)
        got = run(engine, prompts, params, every_step=lambda e: e.scheduler.check_invariants())
        assert got == ref
        assert engine.scheduler.spec.stats.accept_length >= least
        assert_all_free(engine)
        assert not drafter.state and drafter.pool.free_slots == drafter.pool.size
        trees = [d for _, d in proposals if d.parents is not None and d.tokens]
        assert trees and any(len(set(d.parents)) < len(d.parents) for d in trees)  # branches
        for d in trees:
            assert all(p < j for j, p in enumerate(d.parents)) and max(d.depths()) <= 3
    # against the draft model alone: each node among the top 3 after its path
    plain = Engine(other, max_total_tokens=500)
    checked = 0
    for seq, d in proposals[::11]:
        checked += len(d.tokens)
        for j, (token, p) in enumerate(zip(d.tokens, d.parents)):
            path, at = [], p
            while at >= 0:
                path.insert(0, d.tokens[at])
                at = d.parents[at]
            [out] = plain.generate(input_ids=[seq + path],
                                   sampling_params={"max_new_tokens": 1, "temperature": 0,
                                                    "logprobs": True, "top_logprobs": 3})
            top = [t for t, _ in out["meta_info"]["output_top_logprobs"][0]]
            assert token in top, (j, token, top)
    assert checked >= 20


def test_a_draft_model_gives_identical_outputs(model, tiny_model_factory):
    prompts, params = DRAFT_PROMPTS, DRAFT_PARAMS
    ref = run(Engine(model, max_total_tokens=4000), prompts, params)
    # the target as its own draft: greedy drafts all accepted (where the target samples
    # greedily); a different small model: mostly rejected. Both give the target's outputs.
    other = tiny_model_factory("llama", num_hidden_layers=1, seed=7)
    for draft, least in ((model, 2.0), (other, 1.0)):
        engine = standalone(model, draft)
        got = run(engine, prompts, params, every_step=lambda e: e.scheduler.check_invariants())
        assert got == ref
        assert engine.scheduler.spec.stats.accept_length >= least
        assert_all_free(engine)
    drafter = engine.scheduler.spec.drafter
    assert not drafter.state and drafter.pool.free_slots == drafter.pool.size  # all released


def test_a_draft_model_through_a_retraction_storm(model):
    prompts = [ids(i, 20 + i) for i in range(8)]
    params = {**GREEDY, "max_new_tokens": 40}
    kw = {"max_total_tokens": 200, "schedule_conservativeness": 0.1}
    ref = run(Engine(model, **kw), prompts, params)
    engine = standalone(model, model, **kw)
    got = run(engine, prompts, params, every_step=checked_with_no_state_for_the_waiting)
    assert engine.scheduler.counters.retracted_reqs >= 1 and got == ref
    drafter = engine.scheduler.spec.drafter
    assert engine.scheduler.spec.stats.drafted > 0
    assert not drafter.state and drafter.pool.free_slots == drafter.pool.size


def checked_with_no_state_for_the_waiting(engine):
    """The slot invariant, and a retracted (waiting) request holds no drafter row: its
    slots in the draft model's pool went back for the running requests."""
    s = engine.scheduler
    s.check_invariants()
    assert not {r.rid for r in s.waiting} & set(s.spec.drafter.state)


def test_a_draft_model_is_refused_with_the_reason(model, tiny_model_factory):
    with pytest.raises(EngineError, match="needs --speculative-draft-model-path"):
        Engine(model, speculative_algorithm="STANDALONE")
    with pytest.raises(EngineError, match="--speculative-num-steps 2 and "
                                          "--speculative-num-draft-tokens 5 disagree"):
        Engine(model, speculative_algorithm="STANDALONE", speculative_draft_model_path=model,
               speculative_num_steps=2, speculative_num_draft_tokens=5)
    with pytest.raises(EngineError, match="--speculative-ngram-\\* flags are NGRAM's"):
        Engine(model, speculative_algorithm="STANDALONE", speculative_draft_model_path=model,
               speculative_ngram_max_match_window_size=4)
    with pytest.raises(EngineError, match="vocabulary \\(1024 tokens\\) is larger"):
        Engine(model, speculative_algorithm="STANDALONE",
               speculative_draft_model_path=tiny_model_factory("llama", vocab_size=1024))
    with pytest.raises(EngineError, match="--speculative-draft-model-path: Model path "
                                          "'/nonexistent/draft' does not exist"):
        Engine(model, speculative_algorithm="STANDALONE",
               speculative_draft_model_path="/nonexistent/draft")
    # vLLM's spelling: a model and no method is a draft model
    engine = Engine(model, max_total_tokens=500,
                    speculative_config={"model": model, "num_speculative_tokens": 3})
    assert engine.spec_settings.algorithm == "STANDALONE"
    assert engine.scheduler.spec.settings.max_drafts == 3


# -- flags -------------------------------------------------------------------------------------
def test_flags_sglang_and_vllm_spellings_and_clashes(model):
    from engine.config import EngineConfig
    from engine.speculative.settings import spec_settings

    def settings(**kw):
        return spec_settings(EngineConfig(model=model, **kw).validate())

    assert settings() is None
    s = settings(speculative_algorithm="ngram", speculative_num_draft_tokens=5,
                 speculative_ngram_min_match_window_size=2,
                 speculative_ngram_max_match_window_size=6)
    assert (s.algorithm, s.num_draft_tokens, s.max_drafts, s.ngram_min_match_window,
            s.ngram_max_match_window) == ("NGRAM", 5, 4, 2, 6)
    assert settings(speculative_algorithm="NGRAM").ngram_min_match_window is None  # not given
    v = settings(speculative_config='{"method": "ngram", "num_speculative_tokens": 4, '
                                    '"prompt_lookup_max": 6, "prompt_lookup_min": 2}')
    assert v == s
    assert settings(speculative_config={"method": "ngram"}).num_draft_tokens == 8
    # both spellings agreeing is fine; disagreeing names both
    assert settings(speculative_algorithm="NGRAM",
                    speculative_config={"method": "ngram"}).algorithm == "NGRAM"
    for kw, msg in [
        ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 3,
          "speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
         ("--speculative-num-draft-tokens 3 and --speculative-config num_speculative_tokens "
          "\\+ 1 5 disagree")),
        ({"speculative_algorithm": "EAGLE", "speculative_config": {"method": "ngram"}},
         "--speculative-algorithm 'EAGLE' and --speculative-config method 'NGRAM' disagree"),
        ({"speculative_config": "{not json"}, "must be a JSON object"),
        ({"speculative_config": {"method": "ngram", "lookahead": 3}}, "unknown key"),
        ({"speculative_config": {"method": "medusa"}}, "method 'medusa' is not one"),
        ({"speculative_num_draft_tokens": 4}, "needs --speculative-algorithm"),
        ({"speculative_ngram_max_match_window_size": 4}, "needs --speculative-algorithm"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1}, ">= 2"),
        ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 5,
          "speculative_ngram_max_match_window_size": 3}, "is above"),
        ({"speculative_algorithm": "NGRAM", "speculative_ngram_max_bfs_breadth": 10,
          "page_size": 4}, "with --page-size 4"),
        ({"speculative_algorithm": "NGRAM", "enable_overlap_schedule": True},
         "with --enable-overlap-schedule is not supported"),
        ({"speculative_algorithm": "NGRAM", "pp_size": 2}, "with --pp-size > 1"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            settings(**kw)


def test_an_algorithm_without_its_plugin_or_with_foreign_flags_is_refused(model):
    with pytest.raises(UnknownName, match="NGRAM"):  # the installed ones are listed
        Engine(model, speculative_algorithm="LOOKAHEAD")
    with pytest.raises(EngineError, match="--speculative-draft-model-path does not apply"):
        Engine(model, speculative_algorithm="NGRAM", speculative_draft_model_path=model)


def test_the_cli_flags_reach_the_engine(model, tmp_path):
    import json

    from click.testing import CliRunner
    from engine_cli.main import cli

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "input_ids": ' + json.dumps(ids(3, 10) * 3) + '}\n')
    base = ["generate", "--model", model, "--input", str(inp), "--max-total-tokens", "500",
            "--temperature", "0", "--max-new-tokens", "12"]
    runs = []
    for extra in ([], ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"],
                  ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']):
        out = tmp_path / f"{len(runs)}.jsonl"
        result = CliRunner().invoke(cli, [*base, "--output", str(out), *extra])
        assert result.exit_code == 0, result.output
        runs.append(json.loads(out.read_text())["output_ids"])
    assert runs[0] == runs[1] == runs[2]
    result = CliRunner().invoke(cli, [*base, "--output", str(tmp_path / "x.jsonl"),
                                      "--speculative-algorithm", "NGRAM",
                                      "--speculative-config", '{"method": "eagle"}'])
    assert result.exit_code != 0 and "disagree" in result.output


# -- the policy --------------------------------------------------------------------------------
class _R:
    def __init__(self, rid):
        self.rid = rid


def test_the_policy_drafts_where_it_pays_and_probes_where_it_did_not():
    p = DraftPolicy(max_drafts=7)
    for m in (1, 2, 4, 8):  # an extra token costs a fifth of a one-token step
        for _ in range(10):
            p.cost.observe(m, 0.010 + 0.002 * (m - 1))
    reqs = [_R("good"), _R("bad")]
    good, bad = Draft(list(range(7)), 6), Draft(list(range(7)), 1)
    for _ in range(20):  # kind 6 (long matches) always right, kind 1 never
        p.observe(reqs, [good, bad], [7, 3], [7, 0], 12, 0.032)
    take = p.lengths(reqs, [good, bad])
    assert take[0] >= 4 and take[1] == 0
    probes = [p.lengths(reqs, [good, bad])[1] for _ in range(40)]
    assert 1 <= sum(probes) <= 3  # now and then one draft, to learn again
    # where nothing else drafts, one probe per PROBE_EVERY steps for the whole batch (a probe
    # then turns a plain step into a verify step), the longest idle first
    many = [_R(f"bad{i}") for i in range(8)]
    for _ in range(20):
        p.observe(many, [bad] * 8, [3] * 8, [0] * 8, 32, 0.05)
    steps = [p.lengths(many, [bad] * 8) for _ in range(4 * PROBE_EVERY)]
    probed = [sum(t) for t in steps]
    assert set(probed) <= {0, 1} and 3 <= sum(probed) <= 5
    assert len({i for t in steps for i, k in enumerate(t) if k}) == sum(probed)
    cheap = DraftPolicy(max_drafts=7)  # extra tokens nearly free (a GPU): more drafts pay
    for m in (1, 2, 4, 8):
        for _ in range(10):
            cheap.cost.observe(m, 0.010 + 0.0001 * (m - 1))
    assert cheap.lengths([_R("new")], [Draft(list(range(7)), 3)])[0] >= 3


# -- a real server -----------------------------------------------------------------------------
def test_engine_serve_with_ngram(model, tmp_path):
    prompts = [ids(5, 12) * 3, ids(6, 9)]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    reference = Engine(model, max_total_tokens=2000).generate(input_ids=prompts,
                                                              sampling_params=params)
    server = ServerProcess(["--model", model, "--max-total-tokens", "2000",
                            "--speculative-algorithm", "NGRAM", "--decode-log-interval", "1"],
                           tmp_path / "serve.log")
    try:
        server.wait_ready(120)
        r = httpx.post(server.url + "/generate",
                       json={"input_ids": prompts, "sampling_params": params}, timeout=60)
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == [o["output_ids"] for o in reference]
        info = httpx.get(server.url + "/get_server_info", timeout=10).json()
        assert info["speculative"]["algorithm"] == "NGRAM"
        assert info["speculative_algorithm"] == "NGRAM"
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert "engine:spec_decode_num_draft_tokens_total" in metrics
        assert "engine:spec_decode_num_accepted_tokens_total" in metrics
    finally:
        server.stop()
    log = server.log()
    assert "speculative decoding: NGRAM (engine-spec-ngram" in log
    assert "accept len: " in log
