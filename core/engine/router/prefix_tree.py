"""An approximate, character-level prefix tree of the prompts routed to each replica (SGLang's
router keeps one over request text): which replica has seen the longest prefix of a prompt.

It approximates the replicas' radix caches: it records what was sent, not what is still cached.
Each replica's share is bounded: past ``max_chars`` characters, its least recently matched
leaves are dropped (SGLang's router evicts by LRU too).
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("children", "parent", "key", "last_used")

    def __init__(self, parent=None, key: str = ""):
        self.children: dict[str, _Node] = {}
        self.parent, self.key = parent, key
        self.last_used: dict[int, int] = {}  # replica -> tick of its last insert or match


class PrefixTree:
    """One char-level trie shared by every replica; a node records the replicas that sent a
    prompt through it."""

    def __init__(self, max_chars: int = 1 << 20):
        self.root = _Node()
        self.max_chars = max_chars
        self.size: dict[int, int] = {}  # replica -> characters it holds
        self._clock = itertools.count(1)

    def insert(self, text: str, replica: int) -> None:
        tick = next(self._clock)
        node = self.root
        for ch in text:
            child = node.children.get(ch)
            if child is None:
                child = node.children[ch] = _Node(node, ch)
            if replica not in child.last_used:
                self.size[replica] = self.size.get(replica, 0) + 1
            child.last_used[replica] = tick
            node = child
        if self.size.get(replica, 0) > self.max_chars:
            self._evict(replica, self.size[replica] - self.max_chars)

    def match(self, text: str) -> dict[int, int]:
        """Replica -> how many leading characters of ``text`` it has sent (replicas with a
        match only); marks the matched paths as recently used."""
        tick = next(self._clock)
        matched: dict[int, int] = {}
        node, depth = self.root, 0
        for ch in text:
            node = node.children.get(ch)
            if node is None:
                break
            depth += 1
            for replica in node.last_used:
                matched[replica] = depth
                node.last_used[replica] = tick
        return matched

    def remove(self, replica: int) -> None:
        """Forget everything ``replica`` sent (it died)."""
        self._evict(replica, self.size.get(replica, 0))
        self.size.pop(replica, None)

    def _evict(self, replica: int, count: int) -> None:
        heap = [(n.last_used[replica], id(n), n) for n in self._nodes()
                if replica in n.last_used and not self._holds_child(n, replica)]
        heapq.heapify(heap)
        while count > 0 and heap:
            _, _, leaf = heapq.heappop(heap)
            del leaf.last_used[replica]
            self.size[replica] -= 1
            count -= 1
            parent = leaf.parent
            if not leaf.last_used and not leaf.children:
                del parent.children[leaf.key]
            if parent is not self.root and not self._holds_child(parent, replica):
                heapq.heappush(heap, (parent.last_used[replica], id(parent), parent))

    @staticmethod
    def _holds_child(node: _Node, replica: int) -> bool:
        return any(replica in c.last_used for c in node.children.values())

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
