"""Radix prefix cache: token-id prefixes -> KV slots, shared by requests, evicted LRU.

Nodes hold a run of token ids (``key``) and their pool slots (``value``). A node is locked while a
running request uses it (``lock_ref`` counts along the path to the root); only unlocked leaves are
evicted. With ``page_size > 1`` every key length is a multiple of the page size, so node
boundaries fall on pages and evicting a node frees whole pages.
"""

from __future__ import annotations

import itertools
from typing import Callable, NamedTuple

import torch

_tick = itertools.count()


class Node:
    # host_value / hit_count / loading / writing: HiCache's (engine/hicache/tree.py): the
    # node's host-tier slots, how often it was hit (--hicache-write-policy
    # write_through_selective), and the copies in flight into its device / host slots
    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "host_value",
                 "hit_count", "loading", "writing")

    def __init__(self, key=(), value=None, parent=None):
        self.key: tuple[int, ...] = tuple(key)
        self.value: torch.Tensor = value if value is not None else torch.empty(0, dtype=torch.int64)
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent: Node | None = parent
        self.lock_ref = 0
        self.last_access = next(_tick)
        self.host_value: torch.Tensor | None = None
        self.hit_count = 0
        self.loading = self.writing = None


class Inserted(NamedTuple):
    cached: int  # leading tokens the tree already held (under other slots)
    node: Node  # the node that ends at the inserted key
    slots: torch.Tensor  # the tree's slots for the whole key


class RadixCache:
    def __init__(self, free_slots: Callable[[torch.Tensor], None], page_size: int = 1):
        self.free_slots = free_slots
        self.page_size = page_size
        self.reset_tree()

    def reset_tree(self) -> None:
        self.root = Node()
        self.root.lock_ref = 1  # the root is never evicted
        self.total_size = 0  # slots held by the tree
        self.protected_size = 0  # slots held by locked nodes

    @property
    def evictable_size(self) -> int:
        return self.total_size - self.protected_size

    def _child_key(self, key) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def _align(self, n: int) -> int:
        return n - n % self.page_size

    def _common(self, a: tuple, b: tuple) -> int:
        """Length of the common prefix, page-aligned. Slice comparisons run in C, so a binary
        search over them beats a Python loop over tokens (prompts are hundreds long)."""
        n = min(len(a), len(b))
        if a[:n] == b[:n]:
            return self._align(n)
        lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if a[lo:mid] == b[lo:mid]:
                lo = mid
            else:
                hi = mid
        return self._align(lo)

    # -- lookup ------------------------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, Node]:
        """Longest cached (page-aligned) prefix of ``key``: its slots and its last node."""
        key = tuple(key[: self._align(len(key))])
        node, values = self.root, []
        node.last_access = next(_tick)
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._common(child.key, key)
            if n < len(child.key):
                if n:
                    child = self._split(child, n)
                    values.append(child.value)
                    node = child
                break
            values.append(child.value)
            node, key = child, key[n:]
            node.last_access = next(_tick)
        slots = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return slots, node

    def _split(self, child: Node, n: int) -> Node:
        """Cut ``child`` after ``n`` tokens; returns the new upper node."""
        upper = Node(child.key[:n], child.value[:n], child.parent)
        upper.lock_ref = child.lock_ref
        upper.children[self._child_key(child.key[n:])] = child
        child.parent.children[self._child_key(child.key)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        return upper

    # -- insert ------------------------------------------------------------------------------
    def insert(self, key: list[int], value: torch.Tensor) -> Inserted:
        """Insert ``key`` -> ``value`` (page-aligned lengths). Returns how many leading tokens
        were already cached (the caller owns those slots of ``value`` and must free them), the
        node that ends at ``key`` and the slots the tree now holds for ``key``."""
        assert len(key) == len(value) and len(key) % self.page_size == 0
        key = tuple(key)
        node, done, values, dup = self.root, 0, [], None
        node.last_access = next(_tick)
        while done < len(key):
            rest = key[done:]
            child = node.children.get(self._child_key(rest))
            if child is None:
                new = Node(rest, value[done:].clone(), node)
                node.children[self._child_key(rest)] = new
                self.total_size += len(rest)
                values.append(new.value)
                self._added(new)
                return Inserted(done if dup is None else dup, new, torch.cat(values))
            n = self._common(child.key, rest)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = next(_tick)
            if self._adopt(child, value[done: done + n]) and dup is None:
                dup = done  # the caller's slots from here on are the tree's now
            values.append(child.value)
            node, done = child, done + n
        return Inserted(done if dup is None else dup, node,
                        torch.cat(values) if values else value[:0])

    def _added(self, node: Node) -> None:
        """``insert`` made ``node`` (a subclass's hook)."""

    def _adopt(self, node: Node, value: torch.Tensor) -> bool:
        """``insert`` passed through ``node``, whose key ``value``'s slots also hold: True when
        the node takes them as its own (a subclass's node with no device copy), else False."""
        return False

    # -- locks ---------------------------------------------------------------------------------
    def inc_lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: Node) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlocking a node that is not locked"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= len(node.key)
            node = node.parent

    def evictable_size_after_lock(self, node: Node) -> int:
        """``evictable_size`` as it would be with ``node`` locked, without locking it."""
        unlocked = 0
        while node is not self.root:
            unlocked += 0 if node.lock_ref else len(node.key)
            node = node.parent
        return self.evictable_size - unlocked

    # -- eviction ------------------------------------------------------------------------------
    def _leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, least recently used first.
        Returns the number freed (less when not enough is evictable)."""
        import heapq

        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            self.free_slots(node.value)
            freed += len(node.key)
            self.total_size -= len(node.key)
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def flush(self) -> bool:
        """Drop everything; refused (False) while any node is locked by a running request."""
        if self.protected_size:
            return False
        self.evict(self.total_size)
        assert self.total_size == 0
        self.reset_tree()
        return True

    # -- integrity -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        total = protected = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for k, child in node.children.items():
                assert child.parent is node and k == self._child_key(child.key)
                assert len(child.key) == len(child.value) > 0
                assert len(child.key) % self.page_size == 0
                assert child.lock_ref >= 0
                total += len(child.key)
                protected += len(child.key) if child.lock_ref else 0
                stack.append(child)
        assert total == self.total_size, (total, self.total_size)
        assert protected == self.protected_size, (protected, self.protected_size)
