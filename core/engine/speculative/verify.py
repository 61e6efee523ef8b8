"""A speculative decode step: the drafter proposes, the policy picks how many drafts each
request verifies, one target forward runs every request's last token and drafts (an extend of
``1 + k`` tokens over its paged KV, every position's logits kept), and the tokens are sampled
position by position: round ``j`` samples position ``j`` of every request still accepting,
with the same sampler, penalties, grammar masks, seeds, logprobs and stop checks as a decode
step (``Commit.commit``), and a request stops accepting at its first draft that differs from
the token sampled before it. The output is what decoding without drafts gives: each sampled
token comes from the logits of exactly the sequence it follows. (For a drafter whose
proposals are certain, as n-gram lookup's are, this is rejection sampling: a draft is
accepted with the target's probability of it.)

KV: a request's slots grow to cover its ``1 + k`` tokens; after round ``j`` its ``kv_len``
is ``old + j + 1`` (the inputs up to the token sampled there); slots past it (rejected drafts)
stay allocated to it and are overwritten by later steps, so nothing is freed here and the slot
invariant holds.

Trees of drafts (``Draft.parents``: n-gram lookup with ``--speculative-ngram-max-bfs-breadth``
> 1, the model drafters with ``--speculative-eagle-topk`` > 1): each node must attend to the
request's sequence and its own ancestors only. Every node becomes a one-token row of its own
request-table row, borrowed for the step (a copy of the request's row up to its last token,
then the slots of the node's ancestors and its own), so every attention backend and the CPU
graph run it as a decode row of a request whose sequence is exactly the node's path. The
request's own slots hold the nodes' K/V (its row grows by the tree's size); round ``j`` samples
at the node the request has reached (the root: its last token), and a child carrying the
sampled token is accepted: the request's row is rewritten so that its positions hold the
accepted path's slots first (the others after it, still its own).
A drafter reading hidden states gets the root's and the accepted path's, in position order.
Only with pages of one token (a page's slots must stay together)."""

from __future__ import annotations

import time

import torch

from engine.forward_batch import ForwardBatch
from engine.interfaces import Draft
from engine.sampling.sampler import argmax_rows
from engine.speculative.policy import DraftPolicy


class SpecStats:
    """Cumulative, for the decode log line, /metrics and /get_server_info."""

    def __init__(self):
        self.request_steps = 0  # a request decoding in a step while speculation is on
        self.tokens = 0  # the tokens those request-steps produced
        self.drafted = 0
        self.accepted = 0
        self.verify_steps = 0  # steps that verified at least one draft

    @property
    def accept_length(self) -> float:
        """Tokens per request-step (1.00: no gain; SGLang's "accept len")."""
        return self.tokens / self.request_steps if self.request_steps else 1.0

    def as_dict(self) -> dict:
        return {"accept_length": round(self.accept_length, 3), "drafted_tokens": self.drafted,
                "accepted_tokens": self.accepted, "verify_steps": self.verify_steps}


class SpecDecoder:
    def __init__(self, drafter, settings, max_context: int, runner=None):
        self.drafter, self.settings = drafter, settings
        self.runner = runner  # the target's: its hidden states, for a drafter reading them
        self.wants_hidden = bool(drafter.hidden_states)
        self.policy = DraftPolicy(settings.max_drafts)
        self.max_context = max_context
        self.stats = SpecStats()

    def finished(self, rid: str) -> None:
        self.drafter.release(rid)
        self.policy.forget(rid)

    def retracted(self, rid: str) -> None:
        """A retracted request gives its drafter state up (a draft model's row and slots go
        back to its pool for the requests still running); it is rebuilt when the request runs
        again, from the recomputed prompt and output as for a new one. The policy keeps the
        request's acceptance record: its text has not changed."""
        self.drafter.release(rid)

    def forwarded(self, reqs: list, batch) -> None:
        """The target's forward over ``batch`` (of ``reqs``) ran and keeps all its tokens: a
        drafter reading hidden states gets them (scheduler._run, before its commit)."""
        self._hand_hidden(reqs, batch.prefix_lens_list, batch.extend_lens_list,
                          batch.extend_lens_list)

    def _hand_hidden(self, reqs: list, starts: list[int], lens: list[int],
                     kept: list[int]) -> None:
        """``Drafter.observe`` of the first ``kept[i]`` of request ``i``'s ``lens[i]`` rows of
        the latest forward (positions from ``starts[i]``); finished requests left out (their
        drafter state was released)."""
        hidden = self.runner.last_hidden
        out_reqs, out_starts, out_hidden, at = [], [], [], 0
        for r, start, n, k in zip(reqs, starts, lens, kept):
            if k and not r.finished:
                out_reqs.append(r)
                out_starts.append(start)
                out_hidden.append(hidden[at: at + k])
            at += n
        if out_reqs:
            self.drafter.observe(out_reqs, out_starts, out_hidden)

    def run(self, s, decodes: list, grown) -> list:
        """One decode step of the scheduler ``s`` over ``decodes`` (grown by one slot each),
        speculative where the policy finds drafts worth verifying."""
        start = time.perf_counter()
        limits = [max(0, min(self.settings.max_drafts, r.remaining_new_tokens - 1,
                             self.max_context - r.kv_len - 1)) for r in decodes]
        if not any(limits):
            return self._plain(s, decodes, grown, start)
        drafts = self.drafter.propose(decodes, limits)
        take = self.policy.lengths(decodes, drafts)
        for i, lim in enumerate(limits):
            take[i] = min(take[i], lim)
        for i, r in enumerate(decodes):  # slots for the drafts (none left: no drafts)
            if take[i] and not s.kv.grow(r, take[i] + 1):
                take[i] = 0
        if not any(take):
            return self._plain(s, decodes, grown, start)
        chosen = [d.first(k) for d, k in zip(drafts, take)]
        if any(d.parents is not None for d in chosen):
            accepted, tokens = self._verify_tree(s, decodes, chosen)
        else:
            accepted, tokens = self._verify(s, decodes, [d.tokens for d in chosen])
        st = self.stats
        st.request_steps += len(decodes)
        st.verify_steps += 1
        st.drafted += sum(take)
        st.accepted += sum(accepted)
        st.tokens += len(decodes) + sum(accepted)
        self.policy.observe(decodes, drafts, take, accepted, tokens, time.perf_counter() - start)
        return decodes

    def _plain(self, s, decodes: list, grown, start: float) -> list:
        """A decode step without drafts (none proposed, or none worth verifying)."""
        touched = s._run(decodes, [], grown)
        self.stats.request_steps += len(decodes)
        self.stats.tokens += len(decodes)
        self.policy.observe_plain(len(decodes), time.perf_counter() - start)
        return touched

    def _verify(self, s, decodes: list, drafts: list[list[int]]) -> tuple[list[int], int]:
        """The forward and the rounds; returns each request's accepted drafts and the
        forward's token count."""
        table = s.kv.pool.req_to_token
        ids = [[(r.output_ids or r.prompt_ids)[-1], *d] for r, d in zip(decodes, drafts)]
        old = [r.kv_len for r in decodes]
        batch = ForwardBatch.build(ids, old, [r.row for r in decodes], None, table,
                                   device=table.device)
        logits = s.runner.forward(batch, return_all_logits=True)
        offsets, at = [], 0
        for x in ids:
            offsets.append(at)
            at += len(x)
        accepted = [0] * len(decodes)
        active = list(range(len(decodes)))
        greedy = _greedy_picks(s, decodes, logits)
        before = [len(r.output_ids) for r in decodes] if greedy is not None else None
        j = 0
        while active:
            sampled = _round(s, decodes, old, active, j, logits,
                             [offsets[i] + j for i in active], greedy)
            nxt = []
            for i, token in zip(active, sampled):
                d = drafts[i]
                if j < len(d) and token == d[j] and not decodes[i].finished:
                    accepted[i] += 1
                    nxt.append(i)
            active, j = nxt, j + 1
        if greedy is not None:
            _advance_sampling(s, decodes, before)
        if self.wants_hidden:  # the positions kept: the last token's and the accepted drafts'
            self._hand_hidden(decodes, old, [len(x) for x in ids], [a + 1 for a in accepted])
        return accepted, at

    def _verify_tree(self, s, decodes: list, drafts: list[Draft]) -> tuple[list[int], int]:
        """``_verify`` for trees (the module's docstring): every node a one-token row of a
        borrowed table row; returns each request's accepted drafts and the forward's rows."""
        pool = s.kv.pool
        table, host = pool.req_to_token, pool.host_table  # (host: the table's CPU mirror)
        if pool.free_reqs < sum(len(d.tokens) for d in drafts):
            # (rare) too few spare rows: each tree's first path, a chain
            return self._verify(s, decodes, [_first_path(d).tokens for d in drafts])
        ids, prefix, rows, borrowed = [], [], [], []
        first_row, slots, children = [], [], []
        old = [r.kv_len for r in decodes]
        try:
            for r, d, o in zip(decodes, drafts, old):
                first_row.append(len(ids))
                ids.append([(r.output_ids or r.prompt_ids)[-1]])
                prefix.append(o)
                rows.append(r.row)
                n = len(d.tokens)
                own = host[r.row, o + 1: o + 1 + n].clone()  # the nodes' slots, in node order
                head = host[r.row, : o + 1]
                slots.append(own)
                kids: dict[tuple[int, int], int] = {}
                paths: list[list[int]] = []
                parents = d.parents if d.parents is not None else list(range(-1, n - 1))
                for j, (token, p) in enumerate(zip(d.tokens, parents)):
                    kids.setdefault((p, token), j)
                    path = (paths[p] if p >= 0 else []) + [j]
                    paths.append(path)
                    t = pool.alloc_req()
                    borrowed.append(t)
                    pool.write_row(t, 0, torch.cat([head, own[path]]))  # (ranks mirror it)
                    ids.append([token])
                    prefix.append(o + len(path))
                    rows.append(t)
                children.append(kids)
            batch = ForwardBatch.build(ids, prefix, rows, None, table, device=table.device)
            logits = s.runner.forward(batch, return_all_logits=True)
        finally:
            for t in borrowed:
                pool.free_req(t)
        path_of: list[list[int]] = [[] for _ in decodes]  # each request's accepted nodes
        active = list(range(len(decodes)))
        greedy = _greedy_picks(s, decodes, logits)
        before = [len(r.output_ids) for r in decodes] if greedy is not None else None
        j = 0
        while active:  # a request at node m samples from its row first_row + 1 + m (root: + 0)
            sampled = _round(s, decodes, old, active, j, logits,
                             [first_row[i] + (path_of[i][-1] + 1 if path_of[i] else 0)
                              for i in active], greedy)
            nxt = []
            for i, token in zip(active, sampled):
                at = path_of[i][-1] if path_of[i] else -1
                child = children[i].get((at, token))
                if child is None or decodes[i].finished:
                    continue
                path_of[i].append(child)
                # the request's positions after its root: the accepted path's slots first
                own, path = slots[i], path_of[i]
                rest = [m for m in range(len(own)) if m not in path]
                r, o = decodes[i], old[i]
                pool.write_row(r.row, o + 1, own[path + rest])
                nxt.append(i)
            active, j = nxt, j + 1
        if greedy is not None:
            _advance_sampling(s, decodes, before)
        if self.wants_hidden:  # the root's state and the accepted path's, position by position
            hidden = self.runner.last_hidden
            kept = [(r, o, hidden[[first_row[i]] + [first_row[i] + 1 + m for m in path_of[i]]])
                    for i, (r, o) in enumerate(zip(decodes, old)) if not r.finished]
            if kept:
                self.drafter.observe(*map(list, zip(*kept)))
        return [len(p) for p in path_of], len(ids)


def _first_path(d: Draft) -> Draft:
    """A tree's first path (each node the first child of the one before), as a chain."""
    if d.parents is None:
        return d
    tokens, at = [], -1
    for j, (token, p) in enumerate(zip(d.tokens, d.parents)):
        if p == at:
            tokens.append(token)
            at = j
    return Draft(tokens, d.kind)


def _round(s, decodes: list, old: list[int], active: list[int], j: int, logits,
           picked: list[int], greedy: list[int] | None = None) -> list[int]:
    """Round ``j`` of a verify step: each active request's K/V counts up to its position
    ``old + j`` (its inputs so far), its token is sampled from row ``picked`` of ``logits``
    (or read from ``greedy``, every row's argmax: ``_greedy_picks``) and committed (stop
    checks, grammar, logprobs); returns the tokens."""
    reqs = [decodes[i] for i in active]
    for i in active:
        s.kv.computed_to(decodes[i], old[i] + j + 1)
    if greedy is not None:
        sampled = [greedy[k] for k in picked]
        s.commit(reqs, sampled, None, None)
        return sampled
    out = s._sample(logits[picked], reqs)
    sampled = out.next_token_ids.tolist()
    logprobs = out.logprobs.tolist() if out.logprobs is not None else None
    s.commit(reqs, sampled, logprobs, out.top_logprobs)
    return sampled


def _greedy_picks(s, decodes: list, logits) -> list[int] | None:
    """Every row's token at once, when each request of ``decodes`` takes the argmax of its raw
    logits (greedy, no penalty, no min_new_tokens ban in force, no grammar, no logprobs): the
    sampler would pick exactly that in each round, so one argmax and one device sync replace a
    sampling pass per round. None when any request needs the sampler."""
    batch = s.sampling.batch(decodes, logits.device)
    if not batch.all_greedy or batch.penalties is not None or batch.banned is not None or \
            batch.top_logprobs is not None or any(r.grammar is not None for r in decodes):
        return None
    with torch.inference_mode():
        return argmax_rows(logits.float()).tolist()


def _advance_sampling(s, decodes: list, before: list[int]) -> None:
    """After greedy rounds (``_greedy_picks``): the sampling state's rows move on by the tokens
    each request took, as if each had been sampled through it."""
    s.sampling.skip(decodes, [len(r.output_ids) - n for r, n in zip(decodes, before)])
