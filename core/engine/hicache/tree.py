"""The radix tree over two tiers (SGLang's HiRadixCache): a node holds its device slots
(``value``; None once evicted from the device pool) and/or its host slots (``host_value``).

- Every node in the tree has a copy in at least one tier, and the device-resident nodes are
  closed under "parent of": a prefix is loaded back from its first host-only node on.
- ``total_size`` / ``protected_size`` count device slots only (the base class's accounting,
  which KVManager checks against the device pool); ``host_size`` counts host slots.
- Write policies (SGLang's): ``write_through`` copies a node to the host when it is inserted;
  ``write_through_selective`` once it was hit twice (its insertion and one reuse);
  ``write_back`` when it is evicted from the device pool.
- Eviction is LRU per tier: the device tier evicts leaves of the device-resident part (a node
  with a host copy stays, host-only; one without is dropped with its host-only descendants),
  the host tier frees the host copy of nodes without a host-held child (a host-only one
  leaves the tree).
- Copies run beside the step (``copier.py``): a load marks its nodes ``loading`` (their device
  slots are counted and locked, their data arrives later: a match stops before them, so a
  request on that prefix waits), a backup marks its node ``writing`` (its host copy arrives
  later: it is not evicted from the host tier, loaded back, or written to storage before).
  ``poll()``, once per step, finishes the copies that completed, in the order they started.
- Deferred backups (the overlap scheduler, ``defer_until_written``): a node is inserted when its
  batch is *submitted*, and the worker thread writes its K/V later, so its write-through copy
  cannot snapshot the slots at once. It is marked ``writing`` with a ``Deferred`` (its host
  slots allocated, counted) and copied once the scheduler says the batch that writes it is done
  (``written_up_to``); until then it is not evicted from either tier. What needs the slots now
  (a device eviction, a host -> device load into freed slots, a flush) first waits for the
  batch in flight (``fence``) and copies every deferred node that batch wrote.
"""

from __future__ import annotations

import heapq
from collections import deque

import torch

from engine.hicache.copier import (journal_storage, make_copier, page_spans, read_sources,
                                   write_page_host)
from engine.memory.radix_cache import Node, RadixCache, _tick

THRESHOLD = {"write_through": 1, "write_through_selective": 2, "write_back": None}


class Deferred:
    """A backup waiting for the batch that writes its slots (``need``: that batch's number)."""

    def __init__(self, node: Node, need: int):
        self.node, self.need = node, need


class HiRadixCache(RadixCache):
    def __init__(self, pool, host, write_policy: str, stats, storage=None, copier=None):
        self.pool, self.host, self.stats, self.storage = pool, host, stats, storage
        self.copier = copier if copier is not None else make_copier(pool)
        self._copies: deque = deque()  # (Copy, on_done), in the order they started
        self.write_policy = write_policy
        self.threshold = THRESHOLD[write_policy]
        self._pinned: set[int] = set()  # ids of host-only nodes being loaded back
        # the overlap scheduler's: batches submitted (their K/V written later), batches done,
        # and a wait for the batch in flight returning the number of the last one done
        self.submitted = self.written = 0
        self.fence = None
        self._deferred: deque[Deferred] = deque()
        super().__init__(pool.free_slots_of, pool.page_size)

    def reset_tree(self) -> None:
        super().reset_tree()
        self.host_size = 0  # host slots held by the tree
        self._deferred = deque()  # (their nodes left with the old tree)

    # -- lookup ----------------------------------------------------------------------------
    def match_tiers(self, key) -> tuple[torch.Tensor, Node, list[Node], bool]:
        """The longest cached prefix of ``key`` over both tiers: the device part's slots and
        last node, then the host-only nodes that continue it (in order), and whether it stops
        at a node whose load is still in flight (the match is longer once it lands)."""
        key = tuple(key[: self._align(len(key))])
        node = dev = self.root
        values, host_nodes = [], []
        node.last_access = next(_tick)
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            if child.loading is not None:
                return self._slots(values), dev, host_nodes, True
            n = self._common(child.key, key)
            if n < len(child.key):
                if n:
                    child = self._split(child, n)
                else:
                    break
            child.last_access = next(_tick)
            if child.value is not None:
                assert not host_nodes, "a device node under a host-only one"
                values.append(child.value)
                dev = child
            else:
                host_nodes.append(child)
            node, key = child, key[n:]
            if n < len(node.key):
                break
        return self._slots(values), dev, host_nodes, False

    @staticmethod
    def _slots(values: list) -> torch.Tensor:
        return torch.cat(values) if values else torch.empty(0, dtype=torch.int64)

    def match_prefix(self, key) -> tuple[torch.Tensor, Node]:
        slots, node, _, _ = self.match_tiers(key)
        return slots, node

    def path(self, node: Node) -> list[Node]:
        """The nodes from the root's child down to ``node``."""
        out = []
        while node is not self.root:
            out.append(node)
            node = node.parent
        return out[::-1]

    def _split(self, child: Node, n: int) -> Node:
        upper = Node(child.key[:n], None, child.parent)
        upper.value = None if child.value is None else child.value[:n]
        upper.host_value = None if child.host_value is None else child.host_value[:n]
        upper.lock_ref, upper.hit_count = child.lock_ref, child.hit_count
        upper.loading, upper.writing = child.loading, child.writing
        upper.children[self._child_key(child.key[n:])] = child
        child.parent.children[self._child_key(child.key)] = upper
        child.key, child.parent = child.key[n:], upper
        if child.value is not None:
            child.value = child.value[n:]
        if child.host_value is not None:
            child.host_value = child.host_value[n:]
        if id(child) in self._pinned:
            self._pinned.add(id(upper))
        return upper

    # -- insert ----------------------------------------------------------------------------
    def _added(self, node: Node) -> None:
        self._hit(node)

    def _adopt(self, node: Node, value: torch.Tensor) -> bool:
        """A host-only node on the way takes the caller's slots as its device copy (so
        ``insert``'s cached count ends where the first such node starts)."""
        if node.loading is not None:  # (rare) the caller's forward will read these slots
            node.loading.order_after()
        if node.value is not None:
            return False
        node.value = value.clone()
        self.total_size += len(value)
        return True

    # -- write policies ----------------------------------------------------------------------
    def record_hit(self, node: Node) -> None:
        """A request was admitted on ``node``'s prefix (write_through_selective counts it)."""
        if self.threshold is None or self.threshold == 1:
            return
        for n in self.path(node):
            self._hit(n)

    def _hit(self, node: Node) -> None:
        if self.threshold is None or node.host_value is not None or node.value is None:
            return
        node.hit_count += 1
        if node.hit_count >= self.threshold:
            self.backup(node)

    def backup(self, node: Node) -> bool:
        """Copy ``node``'s device slots to the host tier (evicting there, LRU, if needed);
        False when the host tier cannot take it. Also queues its pages for storage."""
        n = len(node.key)
        slots = self._host_slots(n)
        if slots is None:
            return False
        self.host_size += n
        node.host_value = slots
        if self.submitted > self.written:  # the batch that writes its K/V may still run
            node.writing = Deferred(node, self.submitted)
            self._deferred.append(node.writing)
        else:
            self._start_backup(node, node.value, slots)
        return True

    def _start_backup(self, node: Node, value: torch.Tensor, slots: torch.Tensor) -> None:
        copy = self.copier.backup(self.host, self.pool, value, slots)
        node.writing = copy

        def written():
            self.stats.moved("device->host", copy.nbytes)
            for done in self._marked(node, "writing", copy):
                done.writing = None
                if self.storage is not None and done.parent is not None:
                    self.storage.write_node(self, done)

        self._copies.append((copy, written))

    # -- deferred backups (the overlap scheduler) ---------------------------------------------
    def batch_submitted(self) -> int:
        """A batch is being submitted (its K/V are written later): its number."""
        self.submitted += 1
        return self.submitted

    def written_up_to(self, batch: int) -> None:
        """Batches up to ``batch`` wrote their K/V: copy the backups waiting for them."""
        self.written = max(self.written, batch)
        while self._deferred and self._deferred[0].need <= self.written:
            d = self._deferred.popleft()
            nodes = self._marked(d.node, "writing", d)  # (split since: the top parts too)
            if not nodes or d.node.parent is None:  # dropped meanwhile: nothing to copy
                continue
            value = torch.cat([n.value for n in nodes]) if len(nodes) > 1 else nodes[0].value
            host = torch.cat([n.host_value for n in nodes]) if len(nodes) > 1 else \
                nodes[0].host_value
            self._start_backup(nodes[-1], value, host)  # one copy, every part marked with it
            for n in nodes[:-1]:
                n.writing = nodes[-1].writing

    def settle(self) -> None:
        """Wait for the batch in flight (``fence``) and copy every backup it wrote: before
        slots are freed or overwritten outside a forward."""
        if self.fence is not None and self.submitted > self.written:
            self.written_up_to(self.fence())

    # -- load back ---------------------------------------------------------------------------
    def pin(self, nodes: list[Node]) -> None:
        self._pinned.update(map(id, nodes))

    def unpin(self) -> None:
        self._pinned.clear()

    def stage(self, parent: Node, key, pages: list, start: int, keep: list[Node]) -> Node | None:
        """Storage pages (read ahead) become a host-only child of ``parent`` (which ends at
        position ``start``) holding ``key``: host slots taken (evicting there, LRU, but not
        ``keep``), the pages' K/V written into them (with ranks, each rank its shard); then it
        loads back like any host node. None, with nothing changed, when the host tier cannot
        take it."""
        n = len(key)
        slots = self._host_slots(n, keep)
        if slots is None:
            return None
        done = moved = 0
        for page, page_key, tokens, off, used in page_spans(pages, start):
            rows = slots[done: done + used]
            moved += write_page_host(self.host, page, off, rows)
            journal_storage(self.pool, self.host, "storage_host", (page_key, tokens, off), rows)
            done += used
        assert done == n, "storage pages and the staged key disagree"
        self.stats.moved("storage->device", moved)
        node = Node(key, None, parent)
        node.value, node.host_value = None, slots
        parent.children[self._child_key(node.key)] = node
        self.host_size += n
        return node

    def _host_slots(self, n: int, keep: list[Node] = ()) -> torch.Tensor | None:
        """Host slots for ``n`` tokens, evicting there (LRU, never ``keep``) if needed; None
        when the host tier cannot free them."""
        slots = self.host.alloc(n)
        if slots is None:
            self.pin(keep)
            try:
                self.evict_host(n - self.host.free_slots)
            finally:
                self.unpin()
            slots = self.host.alloc(n)
        return slots

    def start_load(self, nodes: list[Node], slots: torch.Tensor):
        """Host-only ``nodes`` (a path, in order) get device copies at ``slots``: counted and
        marked ``loading`` now, their data copied beside the step (the Copy, returned)."""
        assert all(n.writing is None for n in nodes), "loading a host copy still being written"
        self.settle()  # the slots may have been freed by a request still in flight (an abort)
        host = torch.cat([n.host_value for n in nodes])
        copy = self.copier.load(self.host, self.pool, host, slots)
        done = 0
        for node in nodes:
            n = len(node.key)
            node.value, node.loading = slots[done: done + n].clone(), copy
            self.total_size += n
            done += n
        last = nodes[-1]

        def loaded():
            copy.order_after()  # (landed: a forward on the current stream sees it anyway)
            self.stats.moved("host->device", copy.nbytes)
            for n in self._marked(last, "loading", copy):
                n.loading = None

        self._copies.append((copy, loaded))
        return copy

    def _marked(self, node: Node, attr: str, copy) -> list[Node]:
        """``node`` and the ancestors split off it that carry ``copy`` in ``attr``."""
        out = []
        while node is not None and node is not self.root and getattr(node, attr) is copy:
            out.append(node)
            node = node.parent
        return out[::-1]

    # -- copies in flight ----------------------------------------------------------------------
    def poll(self) -> None:
        """Once per step: finish the copies that completed (never waits)."""
        self.copier.tick()
        while self._copies and self._copies[0][0].done():
            self._finish_first()

    def _finish_first(self) -> None:
        copy, on_done = self._copies.popleft()
        copy.finish()
        on_done()

    @property
    def copies_in_flight(self) -> int:
        return len(self._copies)

    def wait_first(self) -> None:
        """Nothing else to do: wait for the oldest copy's data (its test delay aside)."""
        if self._copies:
            self._copies[0][0].wait()

    def drain(self) -> None:
        """Wait for and finish every copy (flush, shutdown)."""
        self.settle()
        while self._copies:
            self._copies[0][0].wait()
            self._finish_first()

    def close(self) -> None:
        self.drain()
        if self.storage is not None:
            self.storage.close()
        self.copier.close()

    def read_kv(self, nodes: list[Node], start: int, end: int, offset: int = 0):
        """Per layer K and V of positions [start, end) of the path ``nodes`` (whose first node
        starts at position ``offset``), read from each node's host copy, else its device
        copy."""
        return read_sources(self.pool, self.host, self.kv_sources(nodes, start, end, offset))

    def kv_sources(self, nodes: list[Node], start: int, end: int, offset: int = 0) -> list:
        """Where ``read_kv`` reads positions [start, end) of the path ``nodes``: ("host" |
        "device", slots) segments, in order."""
        out, pos = [], offset
        for node in nodes:
            a, b = max(start, pos), min(end, pos + len(node.key))
            if a < b:
                if node.host_value is not None:
                    out.append(("host", node.host_value[a - pos: b - pos]))
                else:
                    out.append(("device", node.value[a - pos: b - pos]))
            pos += len(node.key)
        return out

    # -- eviction ----------------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _device_leaf(self, node: Node) -> bool:
        return node.value is not None and not any(
            c.value is not None for c in node.children.values())

    def _host_leaf(self, node: Node) -> bool:
        return (node.host_value is not None and id(node) not in self._pinned
                and node.loading is None and node.writing is None) and not any(
            c.host_value is not None for c in node.children.values())

    def evict(self, num_tokens: int, write_back: bool = True) -> int:
        """Free at least ``num_tokens`` device slots, least recently used device leaves first;
        a node keeps its host copy (write_back makes one now, unless told not to: a flush)
        and stays in the tree."""
        self.settle()  # deferred backups copy their slots before any is freed
        heap = [(n.last_access, id(n), n) for n in self._nodes()
                if n.lock_ref == 0 and self._device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node.parent is None or node.value is None or not self._device_leaf(node):
                continue  # dropped or changed since it was pushed
            if isinstance(node.writing, Deferred):  # its batch is still being submitted
                continue
            if node.host_value is None and self.write_policy == "write_back" and write_back:
                self.backup(node)
            self.free_slots(node.value)
            freed += len(node.key)
            self.total_size -= len(node.key)
            parent = node.parent
            if node.host_value is not None:
                node.value = None
            else:
                self._drop(node)
            if parent is not self.root and parent.lock_ref == 0 and self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _drop(self, node: Node) -> None:
        """Take ``node`` (no device copy left) and its host-only descendants out of the tree."""
        del node.parent.children[self._child_key(node.key)]
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.value is None or n is node
            if n.host_value is not None:
                self.host.free(n.host_value)
                self.host_size -= len(n.key)
                n.host_value = None
            stack.extend(n.children.values())
            n.parent = None

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host slots, least recently used first, from nodes with
        no host-held child; a host-only one leaves the tree."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._host_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node.parent is None or not self._host_leaf(node):
                continue
            self.host.free(node.host_value)
            node.host_value = None
            self.host_size -= len(node.key)
            freed += len(node.key)
            parent = node.parent
            if node.value is None:  # host-only, so a leaf: it leaves the tree
                assert not node.children
                del parent.children[self._child_key(node.key)]
                node.parent = None
            if parent is not self.root and self._host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def flush(self) -> bool:
        """Drop both tiers; refused (False) while any node is locked by a running request."""
        if self.protected_size:
            return False
        self.drain()
        self.evict(self.total_size, write_back=False)
        self.evict_host(self.host_size)
        assert self.total_size == 0 and self.host_size == 0, (self.total_size, self.host_size)
        self.reset_tree()
        return True

    # -- integrity -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        total = protected = host = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for k, child in node.children.items():
                assert child.parent is node and k == self._child_key(child.key)
                assert len(child.key) > 0 and len(child.key) % self.page_size == 0
                assert child.value is not None or child.host_value is not None, \
                    "a node with no copy in any tier"
                if child.value is not None:
                    assert len(child.value) == len(child.key)
                    assert node is self.root or node.value is not None, \
                        "a device node under a host-only one"
                    total += len(child.key)
                    protected += len(child.key) if child.lock_ref else 0
                else:
                    assert child.lock_ref == 0, "a locked node without device slots"
                if child.host_value is not None:
                    assert len(child.host_value) == len(child.key)
                    host += len(child.key)
                stack.append(child)
        assert total == self.total_size, (total, self.total_size)
        assert protected == self.protected_size, (protected, self.protected_size)
        assert host == self.host_size, (host, self.host_size)
        assert self.host.free_slots + self.host_size == self.host.size, (
            self.host.free_slots, self.host_size, self.host.size)
