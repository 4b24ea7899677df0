"""The lease table: who holds which blocks and slots, until when.

A read lease pins a ready prefix; a write lease holds pending blocks until they are
committed or abandoned; a staging lease holds empty slots for a client's next puts.
Each has a TTL and may have an owner (a client connection, whose end ends its leases).

:class:`LeaseTable` is the bookkeeping alone: ids, expiry times, owners, and why a
lease ended (for precise errors). What ending a lease does to blocks and slots (unpin,
drop pending blocks, free staged slots) is the store's (:mod:`kvstore.store_parts`),
which calls :meth:`LeaseTable.forget` after it. No lock of its own: the store's lock
guards it.
"""

from __future__ import annotations

import array
import heapq
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvstore.errors import LeaseError
from kvstore.index import NamespaceEntry, Node


@dataclass(slots=True, eq=False)
class Lease:
    lease_id: int
    write: bool
    entry: NamespaceEntry
    nodes: list[Node]  # read: pinned ready prefix; write: reserved blocks in chain order
    expires_at: float
    committed: int = 0  # write leases: nodes[:committed] are ready
    first_index: int = 0  # write leases: chain position of nodes[0]
    staged: set[int] | None = None  # staging leases: the empty slots set aside (offsets)
    # read leases: slots holding decoded copies of blocks kept encoded in host
    # (kvstore.host_coding), freed when the lease ends
    decoded: list[int] | None = None
    ttl: float = 0.0  # staging leases: each reserve that uses the lease renews it by this
    owner: str = ""  # the client connection it ends with (see Store.own), "" for none
    # write leases of a chain too long for the host tier (kvstore.store_writes): its
    # blocks go to disk as they are committed, and with ``spill`` leave the host tier
    persist: bool = False
    spill: bool = False

    @property
    def kind(self) -> str:
        if self.staged is not None:
            return "staging"
        return "write (reserve)" if self.write else "read (acquire)"


ENDED_LEASES_KEPT = 4096


class LeaseIds:
    """Lease ids: 62 random bits plus one (never 0), unguessable by another client.
    Drawn from ``os.urandom`` 512 at a time: one system call per 512 leases, where
    ``secrets.randbits`` makes one per lease (a put makes a lease, often two)."""

    def __init__(self) -> None:
        self._ids: list[int] = []

    def next(self) -> int:
        if not self._ids:
            self._ids = [(word >> 2) + 1 for word in array.array("Q", os.urandom(4096))]
        return self._ids.pop()


class LeaseTable:
    """Live leases by id, their expiry heap, their owners, and the recently ended."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._leases: dict[int, Lease] = {}
        self._owned: dict[str, set[int]] = {}  # owner -> its leases (see own)
        self._ids = LeaseIds()
        self._heap: list[tuple[float, int]] = []
        # recently ended lease id -> (why, its namespace)
        self._ended: dict[int, tuple[str, str]] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._leases.values()))

    def new(self, entry: NamespaceEntry, nodes: list[Node], write: bool, ttl: float) -> Lease:
        """A new lease that runs out ``ttl`` seconds from now."""
        lease_id = self._ids.next()
        while lease_id in self._leases or lease_id in self._ended:
            lease_id = self._ids.next()
        lease = Lease(lease_id, write, entry, nodes, self._clock() + ttl)
        self._leases[lease_id] = lease
        heapq.heappush(self._heap, (lease.expires_at, lease_id))
        return lease

    def get(self, lease_id: int, write: bool | None = None) -> Lease:
        """The live lease ``lease_id`` (a write or read one, when ``write`` says);
        LeaseError naming why otherwise (unknown, ended and why, another kind)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            ended = self._ended.get(lease_id)
            if ended is None:
                raise LeaseError(f"unknown lease {lease_id}")
            raise LeaseError(f"lease {lease_id} has ended ({ended[0]})")
        if write is not None and (lease.write != write or lease.staged is not None):
            raise LeaseError(f"lease {lease_id} is a {lease.kind} lease")
        return lease

    def namespace_of(self, lease_id: int) -> str | None:
        """The namespace a live or recently ended lease was held for; None if unknown."""
        lease = self._leases.get(lease_id)
        if lease is not None:
            return lease.entry.spec.ns_id
        ended = self._ended.get(lease_id)
        return None if ended is None else ended[1]

    def renew(self, lease: Lease) -> None:
        """Push a staging lease's end ``lease.ttl`` on from now (its heap entry is
        pushed back when it comes due)."""
        lease.expires_at = self._clock() + lease.ttl

    def due(self) -> list[Lease]:
        """The leases whose time ran out (still live: the caller ends them)."""
        now = self._clock()
        heap = self._heap
        out = []
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is None:
                continue
            if lease.expires_at <= now:
                out.append(lease)
            else:  # renewed (a staging lease): its one entry goes back with the new time
                heapq.heappush(heap, (lease.expires_at, lease_id))
        return out

    def own(self, owner: str, lease_ids: Sequence[int]) -> None:
        """Tie leases to ``owner``; ids that are 0 or no longer live are skipped."""
        for lease_id in lease_ids:
            lease = self._leases.get(lease_id)
            if lease is None or lease.owner == owner:
                continue
            if lease.owner:
                self._owned[lease.owner].discard(lease_id)
            lease.owner = owner
            self._owned.setdefault(owner, set()).add(lease_id)

    def take_owned(self, owner: str) -> list[Lease]:
        """The live leases of ``owner``, no longer tied to it (the caller ends them)."""
        leases = []
        for lease_id in self._owned.pop(owner, set()):
            lease = self._leases.get(lease_id)
            if lease is not None:
                lease.owner = ""
                leases.append(lease)
        return leases

    def forget(self, lease: Lease, why: str) -> None:
        """The lease has ended (``why``, for the errors of later calls that name it)."""
        if lease.owner:
            owned = self._owned.get(lease.owner)
            if owned is not None:
                owned.discard(lease.lease_id)
                if not owned:
                    del self._owned[lease.owner]
        del self._leases[lease.lease_id]
        self._ended[lease.lease_id] = (why, lease.entry.spec.ns_id)
        if len(self._ended) > ENDED_LEASES_KEPT:
            del self._ended[next(iter(self._ended))]
