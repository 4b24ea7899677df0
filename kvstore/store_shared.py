"""The store's side of the shared tier (:mod:`kvstore.shared.tier`): pulling a
prefix's missing blocks from the cluster into the host tier, and lending the writer the
blocks it sends.

A read falls through host, disk, shared: :meth:`SharedBlocks.pull_shared` finds where
this node's ready prefix of a chain stops, asks the cluster for the rest (lock
released: it waits on the network, at most the tier's timeout) and puts what came back
after that prefix, as any put, so the host tier holds it and the disk takes it by the
usual admission. A chain whose next block is pending here is not pulled: a session on
this node is computing it (early reuse). The daemon calls it before its reads; a call
on the event loop asks :meth:`shared_gap` first and moves to a pool thread when a pull
could help.

Writes go out behind the puts through :class:`SharedQueue`: each committed block at or
above ``min_priority`` is queued (a flag on its node, ``shared_due``, and its bytes
counted) until the writer takes it (:meth:`SharedBlocks.lend_queued`). Past
``queue_bytes``, ``overflow = drop`` queues no more (counted as dropped), ``wait``
keeps queueing and holds the puts back instead: a put waits while the queue is over
its bound, and the host tier does not evict a queued block (:mod:`kvstore.tiering`),
so a put that needs the room waits for the writer, as for the disk writer's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence

from kvstore.index import READY, Node
from kvstore.keys import BlockKey
from kvstore.shared.tier import Known, Lent, Outgoing, SharedConfig, SharedTier
from kvstore.store_parts import StoreParts
from kvstore.store_reads import ready_prefix
from kvstore.store_writes import Writes
from kvstore.tier_events import SHARED

MAX_ANCESTORS = 8192  # the longest unsent run of parents lent with one block


class SharedQueue:
    """The shared tier's write-behind queue (see the module docstring). Under the
    store's lock."""

    def __init__(self, config: SharedConfig) -> None:
        self.wait = config.overflow == "wait"
        self.limit = config.queue_bytes
        self.min_priority = config.min_priority
        self.nodes: deque[Node] = deque()
        self.bytes = 0
        self.dropped = 0  # blocks not queued because it was full (overflow = drop)

    def add(self, batch: Sequence[Node]) -> None:
        """Queue just-committed blocks that are due on the cluster."""
        for node in batch:
            if node.priority < self.min_priority:
                continue
            if not self.wait and self.bytes + node.size > self.limit:
                self.dropped += 1
                continue
            node.shared_due = True
            self.nodes.append(node)
            self.bytes += node.size

    @property
    def full(self) -> bool:
        """Whether puts must wait for the writer (overflow = wait, over the bound)."""
        return self.wait and self.bytes > self.limit

    def take(self, limit: int) -> list[Node]:
        """The oldest ``limit`` queued blocks, off the queue."""
        taken: list[Node] = []
        while self.nodes and len(taken) < limit:
            node = self.nodes.popleft()
            node.shared_due = False
            self.bytes -= node.size
            taken.append(node)
        return taken


class SharedBlocks:
    """See the module docstring. ``shared`` is set once the tier is made (it needs the
    store to lend it blocks)."""

    def __init__(self, parts: StoreParts, writes: Writes) -> None:
        self._parts = parts
        self._lock = parts.lock
        self._namespaces = parts.namespaces
        self._index = parts.index
        self._arena = parts.arena
        self._writes = writes
        self._shared: SharedTier | None = None

    @property
    def shared(self) -> SharedTier | None:
        return self._shared

    @shared.setter
    def shared(self, tier: SharedTier | None) -> None:
        self._shared = tier

    def shared_gap(self, ns_id: str, keys: Sequence[BlockKey]) -> bool:
        """Whether :meth:`pull_shared` could add blocks to ``keys``' ready prefix: the
        shared tier is usable and the prefix stops before a block nobody here computes."""
        if self._shared is None or not self._shared.usable():
            return False
        self._namespaces.check_keys(self._namespaces.entry(ns_id), keys)
        with self._lock:
            return self._gap(keys) is not None

    def pull_shared(self, ns_id: str, keys: Sequence[BlockKey]) -> int:
        """Store the blocks the shared tier has after this node's ready prefix of
        ``keys`` (see the module docstring); how many were stored."""
        if self._shared is None or not self._shared.usable():
            return 0
        entry = self._namespaces.entry(ns_id)
        self._namespaces.check_keys(entry, keys)
        with self._lock:
            self._parts.check_open()
            start = self._gap(keys)
        if start is None:
            return 0
        payloads = self._shared.fetch(entry.spec, keys[start:])
        if not payloads:
            return 0
        return self._writes.put(ns_id, keys[: start + len(payloads)], payloads, start=start).stored

    def _gap(self, keys: Sequence[BlockKey]) -> int | None:
        """Where the ready prefix of ``keys`` stops, or None: the whole chain is ready,
        or its next block is pending. Under the lock."""
        found = ready_prefix(self._index, keys)
        if found.pending_keys or found.ready_blocks == len(keys):
            return None
        return found.ready_blocks

    def lend_queued(self, limit: int, known: Known, timeout: float, drop: bool) -> Lent:
        """For the shared tier's writer (see :class:`kvstore.shared.tier.BlockSource`):
        the next queued blocks not ``known`` to be on the cluster, each after its
        unsent ancestors, pinned in their host slots until the returned release is
        called; and how many could not be lent (no longer in the host tier, nor an
        unsent ancestor, or ``drop``)."""
        queue = self._parts.shared_queue
        assert queue is not None
        lent: list[Outgoing] = []
        pinned: list[Node] = []
        lost = 0
        with self._lock:
            self._parts.check_open()
            if not queue.nodes:
                self._parts.changed.wait(timeout)
            taken = queue.take(limit)
            if taken:
                self._parts.changed.notify_all()  # puts waiting for the queue to shrink
            if drop:
                return Lent([], lambda _sent: None, len(taken))
            array = self._arena.array()
            chosen: set[BlockKey] = set()
            for node in taken:
                key = node.key
                if self._index.get(key) is not node:  # gone (evicted, deleted) meanwhile
                    lost += 1
                    continue
                if known(key) or key in chosen:
                    continue
                chain = [node]
                parent = node.parent
                while parent is not None and not known(parent.key) and parent.key not in chosen:
                    chain.append(parent)
                    parent = parent.parent
                    if len(chain) > MAX_ANCESTORS:
                        break
                if (
                    parent is not None
                    and len(chain) > MAX_ANCESTORS
                    or not all(n.state == READY and n.host_offset >= 0 for n in chain)
                ):
                    lost += 1
                    continue
                for block in reversed(chain):
                    block.pins += 1
                    pinned.append(block)
                    chosen.add(block.key)
                    start = block.host_offset
                    lent.append(
                        Outgoing(
                            block.ns.spec,
                            block.key,
                            None if block.parent is None else block.parent.key,
                            array[start : start + block.host_bytes].data,
                            block.host_coded,
                        )
                    )

        def release(sent: Collection[BlockKey]) -> None:
            with self._lock:
                for block in pinned:
                    block.pins -= 1
                feed = self._parts.tiers.feed
                if feed.on:  # (each block after its parent: the order they were lent)
                    feed.stored([b for b in pinned if b.key in sent], SHARED)

        return Lent(lent, release, lost)
