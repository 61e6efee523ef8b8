"""Drafts from a smaller model (SGLang's STANDALONE, vLLM's "draft_model"): a second
ModelRunner with its own paged KV pool, greedy chains. Each step, for every request asked: the
draft's KV is cut back to the longest prefix it computed that is still the request's sequence
(a rejected draft's positions are simply overwritten), one extend catches it up to the
request's last token, and ``k - 1`` decode steps give the rest of the chain, all requests
batched together. A request whose draft rows cannot be had (its pool full) gets no draft
this step; its output is unaffected, as with any draft.

Trees (``--speculative-eagle-topk K`` > 1, SGLang's EAGLE tree): after the catch-up, each of
``--speculative-num-steps S`` levels keeps the K most likely branches of the request (by the
sum of their tokens' log-probabilities), each branch the K most likely next tokens of its
last; every branch node runs as a one-token row of a borrowed request-table row of the
drafter's pool (the request's row up to its sequence, then its ancestors' slots and its own,
slots taken for the step), so each attends to its own path. Of the S x K nodes the
``k`` most likely form the draft, most likely first (a parent is at least as likely as its
children: any first ``k`` are a tree); the core verifies trees (speculative/verify.py)."""

from __future__ import annotations

import torch

from engine.errors import EngineError
from engine.forward_batch import ForwardBatch
from engine.interfaces import Draft, Drafter
from engine.sampling.sampler import argmax_rows


def check_chain_flags(settings, what: str, path_hint: str) -> None:
    """The refusals every model-based chain drafter shares: a draft model path is needed
    (``path_hint``: what to give), top-k > 1 (tree drafts) is not verified, steps must be one
    less than the tokens verified, and NGRAM's flags do not apply (``what``: what it drafts
    with, for the message)."""
    s, algo = settings, settings.algorithm
    if not s.draft_model_path:
        raise EngineError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path "
                          f"({path_hint})")
    if (s.eagle_topk or 1) > 1:  # a tree: S levels of K branches, k of its nodes verified
        if s.eagle_topk > MAX_TOPK:
            raise EngineError(f"--speculative-eagle-topk {s.eagle_topk}: at most {MAX_TOPK} "
                              f"branches a level (SGLang's EAGLE uses 1-8)")
        if s.num_steps is not None and s.num_steps > s.max_drafts:
            raise EngineError(
                f"--speculative-num-steps {s.num_steps} levels need at least as many draft "
                f"tokens: --speculative-num-draft-tokens {s.num_draft_tokens} verifies "
                f"{s.max_drafts}; raise it or lower the steps")
    elif s.num_steps is not None and s.num_steps != s.max_drafts:
        raise EngineError(
            f"--speculative-num-steps {s.num_steps} and --speculative-num-draft-tokens "
            f"{s.num_draft_tokens} disagree: a chain of N draft steps verifies N + 1 tokens")
    if (s.ngram_min_match_window, s.ngram_max_match_window, s.ngram_max_bfs_breadth) != \
            (None, None, None):
        raise EngineError(f"the --speculative-ngram-* flags are NGRAM's; {algo} drafts with "
                          f"{what}: drop them")


MAX_TOPK = 16


def tree_shape(settings) -> tuple[int, int] | None:
    """(branches a level, levels) of ``settings``' tree drafts, or None for chains."""
    k = settings.eagle_topk or 1
    if k <= 1:
        return None
    return k, settings.num_steps or settings.max_drafts


class PooledDrafter(Drafter):
    """A drafter running a model of its own with its own KV pool (``runner.kv_pool``): one row
    per request in ``state`` (objects with ``row`` and ``alloc``, the slots it holds), grown
    with ``_room`` and freed by ``release``; ``tree``: (top-k, levels) for tree drafts."""

    def __init__(self, runner, tree: tuple[int, int] | None = None):
        self.runner, self.pool = runner, runner.kv_pool
        self.state: dict = {}
        self.tree = tree

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

    @staticmethod
    def _top(logits: torch.Tensor, k: int) -> tuple[list, list]:
        """Per row, the ``k`` most likely tokens' log-probabilities and ids (lists)."""
        lp, ids = logits.float().log_softmax(-1).topk(k, dim=-1)
        return lp.tolist(), ids.tolist()

    def _tree_drafts(self, rows: list[int], bases: list[int], logits: torch.Tensor,
                     hidden, budgets: list[int], forward) -> list[Draft]:
        """Tree drafts (the module's docstring) of the requests whose drafter rows ``rows``
        hold ``bases`` positions, ``logits`` (and, for a head, its own states ``hidden``) one
        row each from the catch-up; ``forward(batch, hidden)`` -> (logits, the states its
        rows leave, or None); ``budgets``: the nodes each may have."""
        topk, levels = self.tree
        pool, table = self.pool, self.pool.req_to_token
        # node: [score, depth, token, parent, path (its own and its ancestors' slots)]
        nodes: list[list] = [[] for _ in rows]
        lps, toks = self._top(logits, topk)
        frontier = []  # (request, node, row of the forward whose states it reads)
        for j in range(len(rows)):
            for lp, t in zip(lps[j], toks[j]):
                nodes[j].append([lp, 1, t, -1, []])
                frontier.append((j, len(nodes[j]) - 1, j))
        borrowed, taken = [], []
        try:
            for depth in range(2, levels + 1):
                if not frontier or pool.free_reqs < len(frontier):
                    break
                slots = pool.alloc_pages(len(frontier))  # (pages of one token: slots)
                if slots is None:
                    break
                taken.append(slots)
                ids, prefix, brows = [], [], []
                for x, (j, m, _) in enumerate(frontier):
                    node = nodes[j][m]
                    parent = nodes[j][node[3]][4] if node[3] >= 0 else []
                    node[4] = [*parent, int(slots[x])]
                    t = pool.alloc_req()
                    borrowed.append(t)
                    pool.write_row(t, 0, torch.cat([pool.host_table[rows[j], :bases[j]],
                                                    torch.tensor(node[4])]))
                    ids.append([node[2]])
                    prefix.append(bases[j] + depth - 2)
                    brows.append(t)
                batch = ForwardBatch.build(ids, prefix, brows, None, table, device=table.device)
                h_in = None if hidden is None else hidden[[src for _, _, src in frontier]]
                logits, hidden = forward(batch, h_in)
                lps, toks = self._top(logits, topk)
                cands: dict[int, list] = {}
                for x, (j, m, _) in enumerate(frontier):
                    base = nodes[j][m][0]
                    cands.setdefault(j, []).extend(
                        (base + lp, m, t, x) for lp, t in zip(lps[x], toks[x]))
                frontier = []
                for j, cs in cands.items():
                    cs.sort(key=lambda c: -c[0])
                    for score, m, t, x in cs[:topk]:
                        nodes[j].append([score, depth, t, m, []])
                        frontier.append((j, len(nodes[j]) - 1, x))
        finally:
            for t in borrowed:
                pool.free_req(t)
            for slots in taken:
                pool.free_slots_of(slots)
        out = []
        for j, tree in enumerate(nodes):  # the most likely nodes, parents first
            order = sorted(range(len(tree)), key=lambda m: (-tree[m][0], tree[m][1], m))
            order = order[:budgets[j]]
            at = {m: i for i, m in enumerate(order)}
            out.append(Draft([tree[m][2] for m in order], 0,
                             [at[tree[m][3]] if tree[m][3] >= 0 else -1 for m in order]))
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


def tree_label(tree) -> str:
    """The start line's words for tree drafts (nothing for chains)."""
    return "" if tree is None else f", trees of top-{tree[0]} over {tree[1]} levels"


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

    def __init__(self, runner, vocab_size: int, name: str = "draft model",
                 tree: tuple[int, int] | None = None):
        super().__init__(runner, tree)
        self.name = name
        draft_vocab = runner.model_config.vocab_size
        if draft_vocab > vocab_size:
            raise EngineError(
                f"the {name}'s vocabulary ({draft_vocab} tokens) is larger than the target's "
                f"({vocab_size}): a draft model must share the target's tokenizer")

    def describe(self) -> str:
        mc = self.runner.model_config
        return (f"{self.name} {mc.architecture}, {mc.num_layers} layers, its own KV pool of "
                f"{self.pool.size} tokens{tree_label(self.tree)}")

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
            if not self._room(st, len(seq) + (0 if self.tree else k - 1)):
                continue
            del st.fed[keep:]
            live.append((i, st, k))
            ids.append(seq[keep:])
            prefix.append(keep)
            st.fed.extend(seq[keep:])
        if not live:
            return out
        with torch.inference_mode():
            logits = self.runner.forward(self._catch_up(live, ids, prefix))
            if self.tree:
                trees = self._tree_drafts([st.row for _, st, _ in live],
                                          [len(st.fed) for _, st, _ in live], logits, None,
                                          [k for _, _, k in live],
                                          lambda b, h: (self.runner.forward(b), None))
                for (i, _, _), d in zip(live, trees):
                    out[i] = d
                return out
            tokens = argmax_rows(logits.float()).tolist()
            drafts = [[t] for t in tokens]
            step = 1
            active = [j for j, (_, _, k) in enumerate(live) if k > 1]
            while active:  # the chain's next tokens, one decode step each
                lens = [len(live[j][1].fed) for j in active]
                batch = self._chain_step(live, drafts, lens, active)
                tokens = argmax_rows(self.runner.forward(batch).float()).tolist()
                for j, t in zip(active, tokens):
                    live[j][1].fed.append(drafts[j][-1])
                    drafts[j].append(t)
                step += 1
                active = [j for j in active if live[j][2] > step]
        return self._drafts(out, live, drafts)
