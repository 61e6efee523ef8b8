"""An approximate prefix tree of the prompts routed to each replica (SGLang's router keeps one
over request text): which replica has seen the longest prefix of a prompt.

It approximates the replicas' radix caches: it records what was sent, not what is still cached.
Only the first ``max_prefix`` characters of a prompt count (SGLang's router caps too): a prompt's
head is what decides where its cache is, and a 32 MiB prompt must not become 32 M tree nodes.
Each replica's share is bounded: past ``max_chars`` characters, its least recently used leaves
are dropped (SGLang's router evicts by LRU too).

The tree is a radix tree (an edge holds a run of characters), and each replica has a heap of
its leaves by last use, with lazy deletion: an entry whose node has been used since, has gained
a child of that replica or is gone is skipped when popped, and the heap is rebuilt from its valid
entries once it holds twice as many as there are. So an insert, a match and the eviction after
an insert cost O(prefix length) amortized (plus a log of the heap per leaf), never a walk of the
tree. ``visits`` counts the nodes each operation touches (tests check it stays flat).
"""

from __future__ import annotations

import heapq
import itertools

MAX_PREFIX_CHARS = 8192  # characters of a prompt the router looks at


class _Node:
    __slots__ = ("edge", "children", "parent", "last_used", "below")

    def __init__(self, edge: str = "", parent: "_Node | None" = None):
        self.edge = edge  # the characters from the parent to this node
        self.children: dict[str, _Node] = {}  # first character of the child's edge -> child
        self.parent = parent  # None once detached
        self.last_used: dict[int, int] = {}  # replica -> tick of its last insert or match here
        self.below: dict[int, int] = {}  # replica -> how many children it holds

    def leaf_of(self, replica: int) -> bool:
        return replica in self.last_used and not self.below.get(replica)


def _common(a: str, b: str) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixTree:
    """One radix tree shared by every replica; a node records the replicas that sent a prompt
    through it (if a node holds a replica, so does its parent)."""

    def __init__(self, max_chars: int = 1 << 20, max_prefix: int = MAX_PREFIX_CHARS):
        self.root = _Node()
        self.max_chars, self.max_prefix = max_chars, max_prefix
        self.size: dict[int, int] = {}  # replica -> characters it holds
        self.nodes: dict[int, int] = {}  # replica -> nodes it holds
        self.visits = 0  # nodes touched by every operation so far
        self._clock = itertools.count(1)
        self._seq = itertools.count()
        self._heaps: dict[int, list] = {}  # replica -> [(tick, seq, node)], lazily deleted
        self._heap_limit: dict[int, int] = {}

    # -- the public operations --------------------------------------------------------------
    def insert(self, text: str, replica: int) -> None:
        text = text[:self.max_prefix]
        tick = next(self._clock)
        node, pos = self.root, 0
        while pos < len(text):
            self.visits += 1
            child = node.children.get(text[pos])
            if child is None:
                child = _Node(text[pos:], node)
                node.children[text[pos]] = child
                pos = len(text)
            else:
                k = _common(child.edge, text[pos:pos + len(child.edge)])
                if k < len(child.edge):
                    child = self._split(child, k)
                pos += k
            self._hold(child, replica, tick)
            node = child
        if node is not self.root and node.leaf_of(replica):
            self._push(replica, node)
        if self.size.get(replica, 0) > self.max_chars:
            self._evict(replica, self.size[replica] - self.max_chars)

    def match(self, text: str) -> dict[int, int]:
        """Replica -> how many leading characters of ``text`` (of its first ``max_prefix``) it
        has sent (replicas with a match only); marks the matched paths as recently used."""
        text = text[:self.max_prefix]
        tick = next(self._clock)
        matched: dict[int, int] = {}
        deepest: dict[int, _Node] = {}
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            self.visits += 1
            k = _common(child.edge, text[pos:pos + len(child.edge)])
            pos += k
            for replica in child.last_used:
                matched[replica] = pos
                child.last_used[replica] = tick
                deepest[replica] = child
            if k < len(child.edge):
                break
            node = child
        for replica, n in deepest.items():
            if n.leaf_of(replica):
                self._push(replica, n)
        return matched

    def remove(self, replica: int) -> None:
        """Forget everything ``replica`` sent (it died)."""
        self._evict(replica, self.size.get(replica, 0))
        self.size.pop(replica, None)
        self.nodes.pop(replica, None)
        self._heaps.pop(replica, None)
        self._heap_limit.pop(replica, None)

    # -- internals ---------------------------------------------------------------------------
    def _hold(self, node: _Node, replica: int, tick: int) -> None:
        if replica not in node.last_used:
            self.size[replica] = self.size.get(replica, 0) + len(node.edge)
            self.nodes[replica] = self.nodes.get(replica, 0) + 1
            parent = node.parent
            parent.below[replica] = parent.below.get(replica, 0) + 1
        node.last_used[replica] = tick

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node``'s edge after ``k`` characters: a new node takes the head (and the same
        holders), ``node`` keeps the tail, its children and its heap entries; the head."""
        parent = node.parent
        head = _Node(node.edge[:k], parent)
        head.last_used = dict(node.last_used)
        head.below = {replica: 1 for replica in node.last_used}
        for replica in node.last_used:
            self.nodes[replica] += 1
        node.edge = node.edge[k:]
        node.parent = head
        head.children[node.edge[0]] = node
        parent.children[head.edge[0]] = head
        return head

    def _push(self, replica: int, node: _Node) -> None:
        heap = self._heaps.setdefault(replica, [])
        heapq.heappush(heap, (node.last_used[replica], next(self._seq), node))
        if len(heap) > self._heap_limit.get(replica, 64):
            # more stale entries than live ones: keep the valid ones (amortized O(1) a push)
            heap[:] = [e for e in heap if self._valid(replica, e)]
            heapq.heapify(heap)
            self.visits += len(heap)
            self._heap_limit[replica] = 2 * len(heap) + 64

    @staticmethod
    def _valid(replica: int, entry) -> bool:
        tick, _, node = entry
        return (node.parent is not None and node.last_used.get(replica) == tick
                and not node.below.get(replica))

    def _evict(self, replica: int, count: int) -> None:
        """Drop ``count`` characters of ``replica``'s share, least recently used leaves first
        (a leaf's tail only, when less than the whole leaf is to go)."""
        heap = self._heaps.get(replica, [])
        while count > 0 and heap:
            entry = heapq.heappop(heap)
            self.visits += 1
            if not self._valid(replica, entry):
                continue
            tick, _, node = entry
            if len(node.edge) > count:  # only the tail goes
                if len(node.last_used) == 1 and not node.children:
                    node.edge = node.edge[:-count]
                    self.size[replica] -= count
                    self._push(replica, node)
                    return
                node = self._split(node, len(node.edge) - count)
                node.last_used[replica] = tick  # the head: still this replica's, as old
                node = next(iter(node.children.values()))  # the tail, dropped below
            count -= len(node.edge)
            self._release(replica, node)

    def _release(self, replica: int, node: _Node) -> None:
        """``node`` (a leaf of ``replica``) no longer holds it."""
        del node.last_used[replica]
        self.size[replica] -= len(node.edge)
        self.nodes[replica] -= 1
        parent = node.parent
        parent.below[replica] -= 1
        if not parent.below[replica]:
            del parent.below[replica]
        if not node.last_used:  # held by no one: then no child is held either
            del parent.children[node.edge[0]]
            node.parent = None
        if parent is not self.root and parent.leaf_of(replica):
            self._push(replica, parent)
