"""EAGLE / EAGLE3 drafting: greedy chains from a draft head over the target's hidden states.

The head's KV row of a request holds one entry per position ``p`` of its sequence, computed
from (token ``p + 1``, the target's hidden state at ``p``). The core hands the drafter the
target's states of every position a forward kept (``observe``); they wait, with their
position, until the request is next drafted. Then one extend runs the head over them (the
catch-up: positions up to the one before the request's last token), its last row giving
the first draft token; each further draft token is a decode step of the head over (the
token it just drafted, its own output state in place of the target's, which the target has
not computed yet). Those speculative entries are overwritten by the next catch-up.

A position the drafter never saw (a radix-cache hit's prefix, a prompt recomputed after a
retraction from a cached prefix) leaves a gap: the head then starts the request's row again
from the first position it has, numbered from 0 (rotary attention depends on distances
only), so it drafts from what it saw. Drafts never change outputs, only how many are
accepted."""

from __future__ import annotations

import torch
from engine.interfaces import Draft
from engine.speculative import PooledDrafter, tree_label


def _rows(t: torch.Tensor, keep: list[int], n: int) -> torch.Tensor:
    """Rows ``keep`` of ``t`` (of ``n`` rows)."""
    return t if len(keep) == n else t[keep]


class _State:
    __slots__ = ("alloc", "base", "fed", "pending", "row")

    def __init__(self, row: int, base: int):
        self.row, self.alloc = row, 0
        self.reset(base)

    def reset(self, base: int) -> None:
        # row entry j is position base + j; entries [0, fed) are the target's, then pending
        # states of positions base + fed .. wait to be run
        self.base, self.fed, self.pending = base, 0, []

    @property
    def known(self) -> int:
        """The position after the last one whose target state the drafter has."""
        return self.base + self.fed + sum(h.shape[0] for h in self.pending)

    def take(self, start: int, hidden: torch.Tensor) -> None:
        """The target's states of positions ``start`` .. (replacing any it had from there)."""
        if start < self.base or start > self.known:
            self.reset(start)  # a gap: start the row again from here
        elif start < self.base + self.fed:
            self.fed, self.pending = start - self.base, []
        else:
            keep, out = start - self.base - self.fed, []
            for h in self.pending:
                if keep <= 0:
                    break
                out.append(h[:keep])
                keep -= h.shape[0]
            self.pending = out
        self.pending.append(hidden.clone())


class EagleDrafter(PooledDrafter):
    """Greedy chains of an EAGLE / EAGLE3 head (``runner``: its ModelRunner with its KV pool,
    the model an engine_spec_eagle.heads head sharing the target's embedding)."""

    def __init__(self, runner, hidden_states: tuple, name: str, describe: str, tree=None):
        super().__init__(runner, tree)
        self.head = runner.model
        self.hidden_states = hidden_states
        self.name, self._describe = name, describe

    def describe(self) -> str:
        return (f"{self._describe}, its own KV pool of {self.pool.size} tokens"
                f"{tree_label(self.tree)}")

    def observe(self, reqs: list, starts: list[int], hidden: list) -> None:
        for r, start, h in zip(reqs, starts, hidden):
            st = self.state.get(r.rid)
            if st is None:
                row = self.pool.alloc_req()
                if row is None:  # no row for it in the head's pool: no drafts for it
                    continue
                st = self.state[r.rid] = _State(row, start)
            st.take(start, h)

    def _top(self, logits: torch.Tensor, k: int) -> tuple[list, list]:
        """The ``k`` most likely tokens a row, as target ids (EAGLE3's draft vocabulary
        mapped)."""
        lp, ids = logits.float().log_softmax(-1).topk(k, dim=-1)
        to_target = getattr(self.head, "to_target", None)
        return lp.tolist(), (ids if to_target is None else to_target(ids)).tolist()

    def _tokens(self, logits: torch.Tensor) -> torch.Tensor:
        ids = logits.argmax(-1)
        to_target = getattr(self.head, "to_target", None)
        return ids if to_target is None else to_target(ids)

    def propose(self, reqs: list, max_tokens: list[int]) -> list[Draft]:
        out = [Draft([], 0) for _ in reqs]
        live, ids, prefix, hidden = [], [], [], []
        for i, (r, k) in enumerate(zip(reqs, max_tokens)):
            st = self.state.get(r.rid)
            if k <= 0 or st is None or not st.pending:
                continue
            seq = r.prompt_ids + r.output_ids
            if st.known != len(seq) - 1:  # the target's states must reach its last token
                continue
            n = st.known - st.base - st.fed  # positions to catch up
            if not self._room(st, st.fed + n + (0 if self.tree else k - 1)):
                continue
            first = st.base + st.fed
            ids.append(seq[first + 1: first + 1 + n])  # position p reads token p + 1
            prefix.append(st.fed)
            hidden.append(st.pending[0] if len(st.pending) == 1 else torch.cat(st.pending))
            live.append((i, st, k))
        if not live:
            return out
        with torch.inference_mode():
            logits = self.runner.forward(self._catch_up(live, ids, prefix),
                                         hidden=torch.cat(hidden))
            own = self.head.last_hidden  # row j: the head's state after live[j]'s last entry
            for _, st, _ in live:
                st.fed, st.pending = st.fed + sum(h.shape[0] for h in st.pending), []
            if self.tree:  # each node over its parent's own state (the catch-up's: the root)
                trees = self._tree_drafts(
                    [st.row for _, st, _ in live], [st.fed for _, st, _ in live], logits, own,
                    [k for _, _, k in live],
                    lambda b, h: (self.runner.forward(b, hidden=h), self.head.last_hidden))
                for (i, _, _), d in zip(live, trees):
                    out[i] = d
                return out
            tokens = self._tokens(logits)
            drafts = [[t] for t in tokens.tolist()]
            lens = [st.fed for _, st, _ in live]  # the next entry of each row
            active = [j for j, (_, _, k) in enumerate(live) if k > 1]
            own = _rows(own, active, len(live))
            while active:  # the chain's next tokens: the head over its own states
                batch = self._chain_step(live, drafts, [lens[j] for j in active], active)
                tokens = self._tokens(self.runner.forward(batch, hidden=own)).tolist()
                for j, t in zip(active, tokens):
                    drafts[j].append(t)
                    lens[j] += 1
                still = [x for x, j in enumerate(active) if live[j][2] > len(drafts[j])]
                own = _rows(self.head.last_hidden, still, len(active))
                active = [active[x] for x in still]
        return self._drafts(out, live, drafts)
