"""What a store tells about itself: its counters and its event log.

:class:`Counters` are plain integers the store's parts add to under the store's lock.
:class:`EventLog` keeps the newest events (one per block stored, promoted, demoted,
removed...) in a bounded ring with increasing sequence numbers; a reader asks for the
events after the last one it saw (:meth:`EventLog.since`) and may wait on the store's
condition, which every emit notifies.
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


class EventLog:
    """The newest ``capacity`` events, numbered from 1; every emit notifies ``changed``
    (the store's condition: the caller holds its lock)."""

    def __init__(
        self, capacity: int, changed: threading.Condition, wall: Callable[[], float]
    ) -> None:
        # plain tuples in Event's field order (Event._make when read: a block stored
        # makes one, under the lock, and a plain tuple costs half a NamedTuple)
        self._events: deque[tuple[int, EventKind, str, BlockKey, str, float]] = deque(
            maxlen=capacity
        )
        self._changed = changed
        self._wall = wall
        self.seq = 0  # the newest event's number (0 before the first)

    def emit(self, kind: EventKind, node: Node, tier: str) -> None:
        self.emit_all(kind, (node,), tier)

    def emit_all(self, kind: EventKind, nodes: Sequence[Node], tier: str) -> None:
        """One event per node, in order, in ``tier`` (a Tier, or "" when it left the
        store); waiters are woken once."""
        now = self._wall()
        seq = self.seq
        self._events.extend(
            [
                (seq + i, kind, node.ns.spec.ns_id, node.key, tier, now)
                for i, node in enumerate(nodes, 1)
            ]
        )
        self.seq = seq + len(nodes)
        self._changed.notify_all()

    def since(self, seq: int, limit: int) -> list[Event]:
        """The kept events after number ``seq``, at most ``limit``, oldest first."""
        if not self._events:
            return []
        first = self._events[0][0]
        begin = max(seq + 1 - first, 0)
        return [Event._make(e) for e in itertools.islice(self._events, begin, begin + limit)]
