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
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.index import READY, Node
from kvstore.keys import BlockKey
from kvstore.shared.tier import Known, Lent, Outgoing, SharedTier, Wanted
from kvstore.store_parts import StoreParts
from kvstore.store_reads import ready_prefix
from kvstore.store_writes import Writes

MAX_ANCESTORS = 8192  # the longest unsent run of parents lent with one block


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

    def lend_blocks(self, wanted: Wanted, min_priority: int, known: Known) -> Lent:
        """For the shared tier's writer: the blocks of ``wanted`` (ns_id, key) that are
        not ``known`` to be on the cluster and are at or above ``min_priority``, each
        after its unsent ancestors, pinned in their host slots until the returned
        release is called; and how many could not be lent (no longer in the host tier,
        nor an unsent ancestor)."""
        lent: list[Outgoing] = []
        pinned: list[Node] = []
        lost = 0
        with self._lock:
            array = self._arena.array()
            chosen: set[BlockKey] = set()
            for ns_id, key in wanted:
                node = self._index.get(key)
                if node is None or node.ns.spec.ns_id != ns_id:
                    lost += 1
                    continue
                if known(key) or key in chosen or node.priority < min_priority:
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
                            array[start : start + block.size].data,
                        )
                    )

        def release() -> None:
            with self._lock:
                for block in pinned:
                    block.pins -= 1

        return Lent(lent, release, lost)
