"""The tiers behind the node's own: reading through them, and writing behind to them.

The node's own tiers, host (the arena every block passes through) and disk, keep their
blocks' places in the index (:mod:`kvstore.tiering`). Behind them, a :class:`TierStack`
holds an ordered list of far tiers (:mod:`kvstore.far_tier`: the shared tier, or any
store that answers by key), and is their only caller.

Reads fall through host, disk, far tiers: :meth:`TierStack.pull` finds where this
node's ready prefix of a chain stops, asks the far tiers in order for the rest (lock
released: a network wait, at most each tier's deadline), each for what the tiers before
it did not have, and puts what came back after that prefix, as any put, so the host
tier holds it and the disk takes it by the usual admission. A chain whose next block is
pending here is not pulled: a session on this node computes it (early reuse). A caller
that must not wait asks :meth:`TierStack.gap` first.

Writes go out behind the puts, through one :class:`WriteBehind` queue per far tier:
each committed block at or above the tier's ``min_priority`` is queued (its bytes
counted) until the tier's writer takes it (:meth:`TierStack.source` lends it). Past
``queue_bytes``, a tier without ``wait`` queues no more (counted as dropped); with
``wait`` it keeps queueing and holds the puts back instead: a put waits while the queue
is over its bound, and the host tier does not evict a block such a queue holds
(``Node.held_behind``, :mod:`kvstore.tiering`), so a put that needs the room waits for
the writer, as for the disk's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence

from kvstore.far_tier import FarTier, FarTierEntry, Known, Lent, Outgoing
from kvstore.index import READY, Node
from kvstore.keys import BlockKey
from kvstore.store_parts import StoreParts
from kvstore.store_reads import ready_prefix
from kvstore.store_writes import Writes

MAX_ANCESTORS = 8192  # the longest unsent run of parents lent with one block


class WriteBehind:
    """One far tier's write-behind queue (see the module docstring). Under the store's
    lock."""

    def __init__(self, entry: FarTierEntry) -> None:
        self.wait = entry.wait
        self.limit = entry.queue_bytes
        self.min_priority = entry.min_priority
        self.nodes: deque[Node] = deque()
        self.bytes = 0
        self.dropped = 0  # blocks not queued because it was full (without wait)

    def add(self, batch: Sequence[Node]) -> None:
        """Queue just-committed blocks that are due on the tier."""
        for node in batch:
            if node.priority < self.min_priority:
                continue
            if not self.wait and self.bytes + node.size > self.limit:
                self.dropped += 1
                continue
            if self.wait:
                node.held_behind += 1
            self.nodes.append(node)
            self.bytes += node.size

    @property
    def full(self) -> bool:
        """Whether puts must wait for the writer (``wait``, over the bound)."""
        return self.wait and self.bytes > self.limit

    def take(self, limit: int) -> list[Node]:
        """The oldest ``limit`` queued blocks, off the queue."""
        taken: list[Node] = []
        while self.nodes and len(taken) < limit:
            node = self.nodes.popleft()
            if self.wait:
                node.held_behind -= 1
            self.bytes -= node.size
            taken.append(node)
        return taken


class TierStack:
    """The far tiers behind the node's own (see the module docstring), in order."""

    def __init__(self, parts: StoreParts, writes: Writes) -> None:
        """The queues are the store's (``parts.queues``, one per entry of its
        configuration); the tiers are made by :meth:`start`."""
        self._parts = parts
        self._lock = parts.lock
        self._writes = writes
        self._tiers: list[tuple[FarTierEntry, FarTier]] = []

    def start(self, entries: Sequence[FarTierEntry]) -> None:
        """Make the far tiers, each with the source of its queue (they start writing)."""
        assert len(entries) == len(self._parts.queues)
        for entry, queue in zip(entries, self._parts.queues, strict=True):
            self._tiers.append((entry, entry.make(_QueueSource(self._parts, entry, queue))))

    def tier(self, name: str) -> FarTier | None:
        return next((tier for entry, tier in self._tiers if entry.name == name), None)

    def stats(self, name: str) -> object | None:
        """The figures of the far tier called ``name`` (None: there is none)."""
        for (entry, tier), queue in zip(self._tiers, self._parts.queues, strict=True):
            if entry.name == name:
                return tier.stats(queue_bytes=queue.bytes, queue_dropped=queue.dropped)
        return None

    def close(self) -> None:
        for _, tier in self._tiers:
            tier.close()  # its writer reads the arena

    # --- reads ------------------------------------------------------------------------
    def gap(self, ns_id: str, keys: Sequence[BlockKey]) -> bool:
        """Whether :meth:`pull` could add blocks to ``keys``' ready prefix: a far tier
        is usable and the prefix stops before a block nobody here computes."""
        if not any(tier.usable() for _, tier in self._tiers):
            return False
        namespaces = self._parts.namespaces
        namespaces.check_keys(namespaces.entry(ns_id), keys)
        with self._lock:
            return self._gap(keys) is not None

    def pull(self, ns_id: str, keys: Sequence[BlockKey]) -> int:
        """Store the blocks the far tiers have after this node's ready prefix of
        ``keys`` (see the module docstring); how many were stored."""
        usable = [tier for _, tier in self._tiers if tier.usable()]
        if not usable:
            return 0
        namespaces = self._parts.namespaces
        entry = namespaces.entry(ns_id)
        namespaces.check_keys(entry, keys)
        with self._lock:
            self._parts.check_open()
            start = self._gap(keys)
        if start is None:
            return 0
        payloads: list[memoryview] = []
        for tier in usable:  # each for what the tiers before it did not have
            payloads += tier.fetch(entry.spec, keys[start + len(payloads) :])
            if start + len(payloads) == len(keys):
                break
        if not payloads:
            return 0
        return self._writes.put(ns_id, keys[: start + len(payloads)], payloads, start=start).stored

    def _gap(self, keys: Sequence[BlockKey]) -> int | None:
        """Where the ready prefix of ``keys`` stops, or None: the whole chain is ready,
        or its next block is pending. Under the lock."""
        found = ready_prefix(self._parts.index, keys)
        if found.pending_keys or found.ready_blocks == len(keys):
            return None
        return found.ready_blocks


class _QueueSource:
    """What one far tier's writer takes its blocks from: its queue (BlockSource)."""

    def __init__(self, parts: StoreParts, entry: FarTierEntry, queue: WriteBehind) -> None:
        self._parts = parts
        self._medium = entry.medium
        self._queue = queue

    def lend_queued(self, limit: int, known: Known, timeout: float, drop: bool) -> Lent:
        """See :class:`kvstore.far_tier.BlockSource`: blocks no longer in the host tier
        (nor an unsent ancestor) are counted as lost."""
        parts, queue = self._parts, self._queue
        lent: list[Outgoing] = []
        pinned: list[Node] = []
        lost = 0
        with parts.lock:
            parts.check_open()
            if not queue.nodes:
                parts.changed.wait(timeout)
            taken = queue.take(limit)
            if taken:
                parts.changed.notify_all()  # puts waiting for the queue to shrink
            if drop:
                return Lent([], lambda _sent: None, len(taken))
            array = parts.arena.array()
            chosen: set[BlockKey] = set()
            for node in taken:
                key = node.key
                if parts.index.get(key) is not node:  # gone (evicted, deleted) meanwhile
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
            with parts.lock:
                for block in pinned:
                    block.pins -= 1
                feed = parts.tiers.feed
                if feed.on:  # (each block after its parent: the order they were lent)
                    feed.stored([b for b in pinned if b.key in sent], self._medium)

        return Lent(lent, release, lost)
