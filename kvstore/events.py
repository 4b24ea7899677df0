"""What a store tells about itself: its counters and its event log.

:class:`Counters` are plain integers the store's parts add to under the store's lock.
:class:`EventLog` keeps the newest events (one per block stored, promoted, demoted,
removed...) in bounded rings with increasing sequence numbers; a reader asks for the
events after the last one it saw (:meth:`EventLog.since`) and may wait on the store's
condition, which every emit notifies.

One ring holds every event (the admin's, and a daemon's without tenants), and each
tenant has a ring of its own, numbered on its own: a tenant's numbers do not count
another's blocks, and another's churn never pushes its events out.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvproto.v1.results import Event
from kvstore.index import Node
from kvstore.keys import BlockKey
from kvstore.results import EventKind


@dataclass(slots=True)
class Counters:
    host_hits: int = 0
    host_misses: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    host_evictions: int = 0
    disk_evictions: int = 0
    host_bytes_in: int = 0
    host_bytes_out: int = 0
    disk_bytes_in: int = 0
    disk_bytes_out: int = 0
    demotions: int = 0
    promotions: int = 0
    dropped: int = 0
    lost_on_disk: int = 0
    known_slot_gets: int = 0  # gets clients served from slots they knew (note_reads)
    # gets read again, pinned, after an unpinned copy failed its slot epoch check
    repeated_gets: int = 0
    # back-pressure from the disk writer (kvstore.tiering, kvstore.store_writes)
    put_waits: int = 0  # puts that waited for the writer to make room
    writer_refused: int = 0  # blocks refused after put_wait_ms (overflow = wait)
    dirty_dropped: int = 0  # blocks evicted before written to disk (overflow = drop)
    # acquires refused: no host slot for their window within put_wait_ms (store_reads)
    room_refused: int = 0
    # blocks that entered the host tier without their tokens: index_tokens_bytes was
    # reached (kvstore.host.placement)
    tokens_not_kept: int = 0


Row = tuple[int, EventKind, str, BlockKey, str, float]  # Event's fields, in order


class _Ring:
    """The newest ``capacity`` events of one stream, numbered from 1."""

    __slots__ = ("rows", "seq")

    def __init__(self, capacity: int) -> None:
        self.rows: deque[Row] = deque(maxlen=capacity)
        self.seq = 0  # the newest event's number (0 before the first)

    def extend(self, kind: EventKind, nodes: Sequence[Node], tier: str, now: float) -> None:
        seq = self.seq
        self.rows.extend(
            [
                (seq + i, kind, node.ns.spec.ns_id, node.key, tier, now)
                for i, node in enumerate(nodes, 1)
            ]
        )
        self.seq = seq + len(nodes)

    def since(self, seq: int, limit: int) -> list[Event]:
        if not self.rows:
            return []
        begin = max(seq + 1 - self.rows[0][0], 0)
        return [Event._make(e) for e in itertools.islice(self.rows, begin, begin + limit)]


class EventLog:
    """Every event, and each tenant's (see the module docstring); every emit notifies
    ``changed`` (the store's condition: the caller holds its lock). Events are plain
    tuples in Event's field order (Event._make when read: a block stored makes one,
    under the lock, and a plain tuple costs half a NamedTuple)."""

    def __init__(
        self, capacity: int, changed: threading.Condition, wall: Callable[[], float]
    ) -> None:
        self._capacity = capacity
        self._all = _Ring(capacity)
        self._tenants: dict[str, _Ring] = {}
        self._changed = changed
        self._wall = wall

    def emit(self, kind: EventKind, node: Node, tier: str) -> None:
        self.emit_all(kind, (node,), tier)

    def emit_all(self, kind: EventKind, nodes: Sequence[Node], tier: str) -> None:
        """One event per node, in order, in ``tier`` (a Tier, or "" when it left the
        store), in every event's ring and in its tenant's; waiters are woken once."""
        if not nodes:
            return
        now = self._wall()
        self._all.extend(kind, nodes, tier, now)
        for tenant, run in itertools.groupby(nodes, key=lambda node: node.ns.group.name):
            if tenant:  # (no tenant: in the ring of every event only)
                ring = self._tenants.get(tenant)
                if ring is None:
                    ring = self._tenants[tenant] = _Ring(self._capacity)
                ring.extend(kind, list(run), tier, now)
        self._changed.notify_all()

    def seq(self, tenant: str | None = None) -> int:
        """The newest event's number: of every event (None), or of ``tenant``'s."""
        ring = self._ring(tenant)
        return 0 if ring is None else ring.seq

    def since(self, seq: int, limit: int, tenant: str | None = None) -> list[Event]:
        """The kept events after number ``seq``, at most ``limit``, oldest first: of
        every event (None), or of ``tenant``'s, in its numbers."""
        ring = self._ring(tenant)
        return [] if ring is None else ring.since(seq, limit)

    def _ring(self, tenant: str | None) -> _Ring | None:
        """Every event's ring (None), or ``tenant``'s (None before its first event)."""
        return self._all if tenant is None else self._tenants.get(tenant)
