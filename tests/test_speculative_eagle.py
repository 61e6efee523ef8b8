"""EAGLE / EAGLE3 drafting (engine-spec-eagle over the core's hidden-state hook): outputs
identical to decoding without drafts (greedy, seeded, through a retraction storm, the slots'
invariant after every step), the target's hidden states handed over equal to transformers',
the heads' forward equal to the plain torch math of SGLang's heads on the same weights, the
drafts equal to that math's greedy chain, and the refusals."""

import random

import pytest
import torch
from engine import Engine
from engine.errors import EngineError
from engine_testing.eagle_heads import reference_head, write_eagle_head
from engine_testing.generation import record_proposals
from engine_testing.generation import run_requests as run
from engine_testing.generation import verify_every_draft
from engine_testing.invariants import assert_all_free

GREEDY = {"temperature": 0, "ignore_eos": True}
AUX = [0, 1, 2]  # the EAGLE3 head's target layers (SGLang's default needs a deeper target)


def ids(seed, n, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return tiny_model_factory("llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle-heads")
    return {"EAGLE": write_eagle_head(str(d / "eagle"), target, "EAGLE", num_layers=2),
            "EAGLE3": write_eagle_head(str(d / "eagle3"), target, "EAGLE3",
                                       aux_layer_ids=AUX, draft_vocab_size=200, seed=1)}


def eagle_engine(target, algo, head, **kw):
    engine = Engine(target, **{"max_total_tokens": 3000, "speculative_algorithm": algo,
                               "speculative_draft_model_path": head, **kw})
    return verify_every_draft(engine)


PROMPTS = [ids(60 + i, 6 + 7 * i) for i in range(4)]
PARAMS = [{**GREEDY, "max_new_tokens": 24},
          {"temperature": 0.8, "seed": 3, "max_new_tokens": 20, "ignore_eos": True},
          {**GREEDY, "max_new_tokens": 16, "logprobs": True, "top_logprobs": 2,
           "frequency_penalty": 0.5},
          {"temperature": 1.0, "top_p": 0.9, "seed": 11, "max_new_tokens": 30,
           "ignore_eos": True}]


def drafted_run(target, algo, head, **kw):
    """PROMPTS with PARAMS drafted by ``head`` (every draft verified): the outputs of decoding
    without drafts, drafts verified, every row and slot of the head's pool back; returns
    (engine, drafter, every (sequence, Draft) proposed)."""
    ref = run(Engine(target, max_total_tokens=3000), PROMPTS, PARAMS)
    engine = eagle_engine(target, algo, head, **kw)
    drafter = engine.scheduler.spec.drafter
    proposals = record_proposals(drafter)
    got = run(engine, PROMPTS, PARAMS, every_step=lambda e: e.scheduler.check_invariants())
    assert got == ref
    st = engine.scheduler.spec.stats
    assert st.drafted > 50 and st.verify_steps > 10
    assert_all_free(engine)
    assert not drafter.state and drafter.pool.free_slots == drafter.pool.size  # all released
    return engine, drafter, proposals


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_outputs_identical_and_drafts_are_the_heads_greedy_chain(algo, target, heads):
    from transformers import AutoModelForCausalLM

    engine, drafter, proposals = drafted_run(target, algo, heads[algo])
    assert engine.runner.cpu_graph is None  # the target's forwards ran eagerly

    # each draft is the head's greedy chain over the target's own hidden states (transformers')
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    head = drafter.head
    checked = 0
    for seq, draft in ((seq, d.tokens) for seq, d in proposals[::7]):
        if not draft:
            continue
        with torch.no_grad():
            states = hf(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        f = (states[-1][0] if algo == "EAGLE"  # after the final norm
             else torch.cat([states[i + 1][0] for i in AUX], -1))  # layer outputs
        toks, own, chain = list(seq[1:]), f[:0, :head.config.hidden_size], []
        for _ in draft:
            logits, out = reference_head(heads[algo], target, toks, f, own)
            t = int(logits[-1].argmax())
            t = int(head.d2t[t]) if algo == "EAGLE3" else t
            chain.append(t)
            toks, own = toks + [t], torch.cat([own, out[-1:]])
        assert chain == draft
        checked += 1
    assert checked >= 5



@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_tree_drafts_identical_outputs_and_the_heads_top_k(algo, target, heads):
    """--speculative-eagle-topk 3: trees of drafts; outputs unchanged, and every tree's first
    level is the head's most likely tokens (in order) over the target's own hidden states
    (transformers'), which the core hands back along the accepted path of each tree."""
    from transformers import AutoModelForCausalLM

    engine, drafter, proposals = drafted_run(target, algo, heads[algo],
                                             speculative_eagle_topk=3, speculative_num_steps=3,
                                             speculative_num_draft_tokens=7)
    trees = [(seq, d) for seq, d in proposals if d.tokens]
    assert all(d.parents is not None for _, d in trees)
    assert any(len(set(d.parents)) < len(d.parents) for _, d in trees)  # it branches

    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    head, checked = drafter.head, 0
    for seq, d in trees[::7]:
        with torch.no_grad():
            states = hf(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        f = (states[-1][0] if algo == "EAGLE"
             else torch.cat([states[i + 1][0] for i in AUX], -1))
        logits, _ = reference_head(heads[algo], target, list(seq[1:]), f,
                                   f[:0, :head.config.hidden_size])
        top = logits[-1].topk(3).indices
        top = (head.d2t[top] if algo == "EAGLE3" else top).tolist()
        first = [t for t, p in zip(d.tokens, d.parents) if p < 0]
        assert first == top[:len(first)] and first, (first, top)
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_a_retraction_storm_keeps_the_invariant_and_the_outputs(algo, target, heads):
    prompts = [ids(i, 20 + i) for i in range(8)]
    params = [{**GREEDY, "max_new_tokens": 30} if i % 2 else
              {"temperature": 0.9, "seed": i, "max_new_tokens": 30, "ignore_eos": True}
              for i in range(8)]
    kw = {"max_total_tokens": 200, "schedule_conservativeness": 0.1}
    ref = run(Engine(target, **kw), prompts, params)
    engine = eagle_engine(target, algo, heads[algo], **kw)

    def checked(e):  # the invariant; a retracted request holds no drafter row
        e.scheduler.check_invariants()
        assert not {r.rid for r in e.scheduler.waiting} & set(e.scheduler.spec.drafter.state)

    got = run(engine, prompts, params, every_step=checked)
    assert engine.scheduler.counters.retracted_reqs >= 1 and got == ref
    assert engine.scheduler.spec.stats.drafted > 0
    assert_all_free(engine)
    drafter = engine.scheduler.spec.drafter
    assert not drafter.state and drafter.pool.free_slots == drafter.pool.size


def test_the_hidden_states_handed_over_are_the_targets(target, heads):
    """What the drafter observes for a prompt (EAGLE3: layer outputs, EAGLE: the final normed
    states) equals transformers' hidden states of the same tokens; Engine.generate spelled
    vLLM's way."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    prompt = ids(5, 40)
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    for algo, want in (("EAGLE", states[-1][0]),
                       ("EAGLE3", torch.cat([states[i + 1][0] for i in AUX], -1))):
        engine = Engine(target, max_total_tokens=1000, speculative_config={
            "method": algo.lower(), "model": heads[algo], "num_speculative_tokens": 2})
        assert engine.scheduler.spec.settings.max_drafts == 2
        seen = []
        drafter = engine.scheduler.spec.drafter

        def observe(reqs, starts, hidden, seen=seen, inner=drafter.observe):
            seen.extend(zip(starts, [h.clone() for h in hidden]))
            inner(reqs, starts, hidden)

        drafter.observe = observe
        out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 3})
        assert len(out["output_ids"]) == 3
        assert seen[0][0] == 0 and seen[0][1].shape == want.shape
        torch.testing.assert_close(seen[0][1], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_the_heads_forward_is_sglangs_math(algo, target, heads):
    """The head's forward over a fresh row, one extend then one decode, against the plain
    torch math on the checkpoint's weights."""
    from engine.forward_batch import ForwardBatch

    engine = eagle_engine(target, algo, heads[algo], max_total_tokens=500)
    drafter = engine.scheduler.spec.drafter
    runner, pool = drafter.runner, drafter.pool
    width = runner.model_config.hidden_size * (3 if algo == "EAGLE3" else 1)
    toks = ids(3, 9)
    hidden = torch.randn(len(toks), width, generator=torch.Generator().manual_seed(0))
    want, want_h = reference_head(heads[algo], target, toks, hidden)
    row = pool.alloc_req()
    assert pool.extend_slots(row, 0, len(toks)) is not None
    table = pool.req_to_token
    with torch.inference_mode():
        got = runner.forward(ForwardBatch.build([toks[:-1]], [0], [row], None, table),
                             return_all_logits=True, hidden=hidden[:-1])
        got_h = drafter.head.last_hidden
        last = runner.forward(ForwardBatch.decode([toks[-1]], [len(toks) - 1], [row], table),
                              hidden=hidden[-1:])
    torch.testing.assert_close(got, want[:-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_h, want_h[:-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, want[-1:], rtol=1e-4, atol=1e-4)
    pool.free_slots_of(pool.host_table[row, :len(toks)])
    pool.free_req(row)


def test_refusals_say_why(target, heads, tmp_path):
    def start(algo="EAGLE", head=heads["EAGLE"], **kw):
        Engine(target, max_total_tokens=500, speculative_algorithm=algo,
               speculative_draft_model_path=head, **kw)

    for kw, msg in [
        ({"speculative_eagle_topk": 17}, "at most 16 branches a level"),
        ({"speculative_eagle_topk": 2, "speculative_num_steps": 5,
          "speculative_num_draft_tokens": 4}, "--speculative-num-steps 5 levels need"),
        ({"speculative_eagle_topk": 2, "page_size": 4}, "--speculative-eagle-topk 2 with "
                                                         "--page-size 4"),
        ({"speculative_num_steps": 2, "speculative_num_draft_tokens": 5},
         "--speculative-num-steps 2 and --speculative-num-draft-tokens 5 disagree"),
        ({"speculative_ngram_max_match_window_size": 4}, "flags are NGRAM's"),
        ({"head": None}, "needs --speculative-draft-model-path"),
        ({"algo": "EAGLE3"}, "is a LlamaForCausalLMEagle; --speculative-algorithm EAGLE3 reads"),
        ({"head": write_eagle_head(str(tmp_path / "wide"), target, "EAGLE", hidden_size=64)},
         "hidden size \\(64\\) differs from the target's \\(128\\)"),
        ({"algo": "EAGLE3", "head": write_eagle_head(str(tmp_path / "default"), target,
                                                     "EAGLE3")},
         "SGLang's default layers \\[1, 1, 0\\] are not"),
    ]:
        with pytest.raises(EngineError, match=msg):
            start(**kw)
    # topk 1 and steps = draft tokens - 1 are a chain: accepted, and the start line says
    # the target runs eagerly
    engine = Engine(target, max_total_tokens=500, speculative_algorithm="EAGLE",
                    speculative_draft_model_path=heads["EAGLE"], speculative_eagle_topk=1,
                    speculative_num_steps=3, speculative_num_draft_tokens=4)
    from engine.speculative.build import spec_line

    line = spec_line(engine.scheduler.spec, engine.spec_entry)
    assert "EAGLE head of 2 layers" in line and "run eagerly" in line
