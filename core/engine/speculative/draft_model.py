"""Drafts from a smaller model (SGLang's STANDALONE, vLLM's "draft_model"): a second
ModelRunner with its own paged KV pool, greedy chains. Each step, for every request asked: the
draft's KV is cut back to the longest prefix it computed that is still the request's sequence
(a rejected draft's positions are simply overwritten), one extend catches it up to the
request's last token, and ``k - 1`` decode steps give the rest of the chain, all requests
batched together. A request whose draft rows cannot be had (its pool full) gets no draft
this step; its output is unaffected, as with any draft."""

from __future__ import annotations

import torch

from engine.errors import EngineError
from engine.forward_batch import ForwardBatch
from engine.interfaces import Draft, Drafter


def check_chain_flags(settings, what: str, path_hint: str) -> None:
    """The refusals every model-based chain drafter shares: a draft model path is needed
    (``path_hint``: what to give), top-k > 1 (tree drafts) is not verified, steps must be one
    less than the tokens verified, and NGRAM's flags do not apply (``what``: what it drafts
    with, for the message)."""
    s, algo = settings, settings.algorithm
    if not s.draft_model_path:
        raise EngineError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path "
                          f"({path_hint})")
    if s.eagle_topk not in (None, 1):
        raise EngineError(f"--speculative-eagle-topk {s.eagle_topk}: tree drafts (top-k > 1) "
                          f"are not verified yet, the core verifies chains; give 1 or leave it "
                          f"out")
    if s.num_steps is not None and s.num_steps != s.max_drafts:
        raise EngineError(
            f"--speculative-num-steps {s.num_steps} and --speculative-num-draft-tokens "
            f"{s.num_draft_tokens} disagree: a chain of N draft steps verifies N + 1 tokens")
    if (s.ngram_min_match_window, s.ngram_max_match_window, s.ngram_max_bfs_breadth) != \
            (None, None, None):
        raise EngineError(f"the --speculative-ngram-* flags are NGRAM's; {algo} drafts with "
                          f"{what}: drop them")


class PooledDrafter(Drafter):
    """A drafter running a model of its own with its own KV pool (``runner.kv_pool``): one row
    per request in ``state`` (objects with ``row`` and ``alloc``, the slots it holds), grown
    with ``_room`` and freed by ``release``."""

    def __init__(self, runner):
        self.runner, self.pool = runner, runner.kv_pool
        self.state: dict = {}

    def release(self, rid: str) -> None:
        st = self.state.pop(rid, None)
        if st is not None:
            if st.alloc:
                self.pool.free_slots_of(self.pool.host_table[st.row, :st.alloc])
            self.pool.free_req(st.row)

    def _catch_up(self, live: list, ids: list, prefix: list) -> ForwardBatch:
        """The batch feeding each ``live`` (index, state, k) request's row its ``ids`` after
        its ``prefix`` positions (the drafter's first forward of a step)."""
        table = self.pool.req_to_token
        return ForwardBatch.build(ids, prefix, [st.row for _, st, _ in live], None, table,
                                  device=table.device)

    def _chain_step(self, live: list, drafts: list, lens: list, active: list) -> ForwardBatch:
        """The batch of a chain's next token: each ``active`` row's last draft at position
        ``lens`` (one per active row)."""
        table = self.pool.req_to_token
        return ForwardBatch.decode([drafts[j][-1] for j in active], lens,
                                   [live[j][1].row for j in active], table, device=table.device)

    @staticmethod
    def _drafts(out: list, live: list, drafts: list) -> list[Draft]:
        """``out`` with each ``live`` request's chain in its place."""
        for (i, _, _), d in zip(live, drafts):
            out[i] = Draft(d, 0)
        return out

    def _room(self, st, upto: int) -> bool:
        """Slots for positions [0, upto) of the request's row."""
        if upto <= st.alloc:
            return True
        if upto > self.pool.max_context_len:
            return False
        if self.pool.extend_slots(st.row, st.alloc, upto - st.alloc) is None:
            return False
        st.alloc = upto
        return True


class _State:
    __slots__ = ("alloc", "fed", "row")

    def __init__(self, row: int):
        self.row, self.fed, self.alloc = row, [], 0  # fed: the tokens whose K/V it holds


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ModelDrafter(PooledDrafter):
    """Greedy chain drafts of ``runner`` (its ``kv_pool`` initialized), whose vocabulary must
    be the target's (``vocab_size``: the target's logits width)."""

    def __init__(self, runner, vocab_size: int, name: str = "draft model"):
        super().__init__(runner)
        self.name = name
        draft_vocab = runner.model_config.vocab_size
        if draft_vocab > vocab_size:
            raise EngineError(
                f"the {name}'s vocabulary ({draft_vocab} tokens) is larger than the target's "
                f"({vocab_size}): a draft model must share the target's tokenizer")

    def describe(self) -> str:
        mc = self.runner.model_config
        return (f"{self.name} {mc.architecture}, {mc.num_layers} layers, its own KV pool of "
                f"{self.pool.size} tokens")

    def propose(self, reqs: list, max_tokens: list[int]) -> list[Draft]:
        out = [Draft([], 0) for _ in reqs]
        live, ids, prefix = [], [], []  # the requests drafted this step and their catch-up
        for i, (r, k) in enumerate(zip(reqs, max_tokens)):
            if k <= 0:
                continue
            st = self.state.get(r.rid)
            if st is None:
                row = self.pool.alloc_req()
                if row is None:
                    continue
                st = self.state[r.rid] = _State(row)
            seq = r.prompt_ids + r.output_ids
            keep = min(_common_prefix(st.fed, seq), len(seq) - 1)
            if not self._room(st, len(seq) + k - 1):
                continue
            del st.fed[keep:]
            live.append((i, st, k))
            ids.append(seq[keep:])
            prefix.append(keep)
            st.fed.extend(seq[keep:])
        if not live:
            return out
        with torch.inference_mode():
            tokens = self.runner.forward(self._catch_up(live, ids, prefix)).argmax(-1).tolist()
            drafts = [[t] for t in tokens]
            step = 1
            active = [j for j, (_, _, k) in enumerate(live) if k > 1]
            while active:  # the chain's next tokens, one decode step each
                lens = [len(live[j][1].fed) for j in active]
                batch = self._chain_step(live, drafts, lens, active)
                tokens = self.runner.forward(batch).argmax(-1).tolist()
                for j, t in zip(active, tokens):
                    live[j][1].fed.append(drafts[j][-1])
                    drafts[j].append(t)
                step += 1
                active = [j for j in active if live[j][2] > step]
        return self._drafts(out, live, drafts)
