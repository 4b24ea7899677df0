"""Leases: who holds which blocks and slots, until when.

A read lease pins a ready prefix; a write lease holds pending blocks until they are
committed or abandoned; a staging lease holds empty slots for a client's next puts.
Each has a TTL (the reaper thread ends those run out) and may have an owner (a
client connection, whose end ends its leases).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence

from kvstore.errors import (
    LeaseError,
)
from kvstore.index import NamespaceEntry, Node
from kvstore.results import (
    EventKind,
    Tier,
)
from kvstore.store_state import (
    ENDED_LEASES_KEPT,
    Lease,
)
from kvstore.tiering import Tiering

log = logging.getLogger(__name__)


class Leases(Tiering):
    """The lease table (see the module docstring)."""

    def release(self, lease_id: int) -> None:
        with self._lock:
            self._expire()
            lease = self._lease(lease_id)
            self._end_lease(lease, "released")

    def own(self, owner: str, lease_ids: Sequence[int]) -> None:
        """Tie leases to ``owner`` (a client connection): :meth:`release_owner` ends
        them when it goes away, so a killed client holds nothing for its leases' TTL.
        Ids that are 0 or no longer live are skipped (a lease may end before its
        answer leaves)."""
        with self._lock:
            for lease_id in lease_ids:
                lease = self._leases.get(lease_id)
                if lease is None or lease.owner == owner:
                    continue
                if lease.owner:
                    self._owned[lease.owner].discard(lease_id)
                lease.owner = owner
                self._owned.setdefault(owner, set()).add(lease_id)

    def release_owner(self, owner: str) -> int:
        """End every lease of ``owner`` (its client disconnected): read leases unpin,
        write leases drop their pending blocks, staging leases free their slots, as
        when they expire. The number of leases ended."""
        with self._lock:
            if self._closed:
                return 0
            lease_ids = self._owned.pop(owner, set())
            for lease_id in lease_ids:
                lease = self._leases.get(lease_id)
                if lease is not None:
                    lease.owner = ""
                    self._end_lease(lease, "its client disconnected")
            return len(lease_ids)

    def expire(self) -> None:
        """Reclaim expired leases and priorities now (also done on every call)."""
        with self._lock:
            self._expire()

    # --- leases -------------------------------------------------------------------
    def _new_lease(
        self, entry: NamespaceEntry, nodes: list[Node], write: bool, ttl: float
    ) -> Lease:
        lease_id = self._lease_ids.next()
        while lease_id in self._leases or lease_id in self._ended:
            lease_id = self._lease_ids.next()
        lease = Lease(lease_id, write, entry, nodes, self._clock() + ttl)
        self._leases[lease_id] = lease
        heapq.heappush(self._lease_heap, (lease.expires_at, lease_id))
        return lease

    def _lease(self, lease_id: int, write: bool | None = None) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            why = self._ended.get(lease_id)
            if why is None:
                raise LeaseError(f"unknown lease {lease_id}")
            raise LeaseError(f"lease {lease_id} has ended ({why})")
        if write is not None and (lease.write != write or lease.staged is not None):
            raise LeaseError(f"lease {lease_id} is a {lease.kind} lease")
        return lease

    def _end_lease(self, lease: Lease, why: str) -> None:
        if lease.write:
            dropped = lease.nodes[lease.committed :]
            for node in reversed(dropped):
                node.pins -= 1
                self._emit(EventKind.PENDING_DROPPED, node, Tier.HOST)
                self._host_drop(node)
                self._index.remove(node)
            self._pending -= len(dropped)
        else:
            for node in lease.nodes:
                node.pins -= 1
        for offset in lease.staged or ():
            self._arena.free(offset)
        if lease.staged:
            lease.entry.group.staged_bytes -= len(lease.staged) * lease.entry.spec.block_bytes
        self._forget_lease(lease, why)
        self._changed.notify_all()

    def _forget_lease(self, lease: Lease, why: str) -> None:
        if lease.owner:
            owned = self._owned.get(lease.owner)
            if owned is not None:
                owned.discard(lease.lease_id)
                if not owned:
                    del self._owned[lease.owner]
        del self._leases[lease.lease_id]
        self._ended[lease.lease_id] = why
        if len(self._ended) > ENDED_LEASES_KEPT:
            del self._ended[next(iter(self._ended))]

    def _expire(self) -> None:
        """Reclaim expired leases and timed priorities; apply a lowered disk capacity."""
        if self._disk is not None and self._disk.drain_shrunk():
            self._shrink_disk(self._disk)
        now = self._clock()
        heap = self._lease_heap
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is None:
                continue
            if lease.expires_at <= now:
                self._end_lease(lease, "expired")
            else:  # renewed (a staging lease): its one entry goes back with the new time
                heapq.heappush(heap, (lease.expires_at, lease_id))
        pheap = self._priority_heap
        while pheap and pheap[0][0] <= now:
            until, _, node = heapq.heappop(pheap)
            if self._priority_until.get(node) == until:
                del self._priority_until[node]
                self._set_node_priority(node, self.config.default_priority)

    def _reap(self) -> None:
        while not self._reaper_stop.wait(0.25):
            with self._lock:
                if self._closed:
                    return
                self._expire()
