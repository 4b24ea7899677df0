"""What a client owes the daemon, sent in one batched message: leases it is done with
and reads it served itself.

A get copies its blocks and is done with its read lease at once, but a Release of its
own would double the get's round trips. Reads served from known slots
(:mod:`kvclient.unpinned_reads`) make no call at all, yet the daemon must count them as
hits and touch their blocks for eviction. Both are queued here and sent together in
one ``ReportReads`` (``release_lease_ids`` and ``prefixes``):

- within ``DELAY_S`` of the first queued item, by the driver's timer (a thread for
  the blocking client, ``loop.call_later`` for the asyncio one), woken through the
  ``wake`` hook;
- at once when many prefixes are pending (``wake(now=True)``);
- before any call whose answer a pin or an uncounted read could change (everything
  but Acquire, the lookups and ServerInfo: :data:`UNORDERED`), so a client always sees its
  own releases and reads counted;
- and an Acquire carries the pending releases itself (``release_lease_ids``).

Thread-safe; the lock is never held while anything is sent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1.limits import MAX_READS_PER_PREFIX, MAX_REPORTED_PREFIXES

DELAY_S = 0.05  # the longest a done lease or a read waits to be told
REPORTED_PREFIXES = 1024  # pending prefixes that make the client send them at once
# calls whose answer neither a block still pinned by this client nor a read it has not
# reported can change: they need not wait for the accounting message
UNORDERED = frozenset({"Acquire", "Lookup", "LookupBatch", "ServerInfo"})

# a get request: namespace, digest of its tokens, extra keys, max_blocks
ReadKey = tuple[str, bytes, tuple[bytes, ...], int]


class Accounting:
    """The pending releases and reads of one client."""

    def __init__(self, wake: Callable[[bool], None]) -> None:
        """``wake(now)``: called after work is queued; ``now`` when it is due at once."""
        self._wake = wake
        self._lock = threading.Lock()
        self._done: list[int] = []
        self._reads: dict[ReadKey, pb.PrefixReads] = {}
        self._full: list[pb.PrefixReads] = []  # counts that reached MAX_READS_PER_PREFIX
        self._since = 0.0  # when the oldest pending item was queued
        self.sending = 0  # accounting messages in flight

    def renew(self) -> None:
        """In a forked child: a new lock; the parent's pending work is the parent's."""
        self._lock = threading.Lock()
        self._done, self._reads, self._full, self.sending = [], {}, [], 0

    def _queued(self) -> bool:
        return bool(self._done or self._reads or self._full)

    def pending(self) -> bool:
        """Whether anything is queued or being sent."""
        return self._queued() or bool(self.sending)

    def release_later(self, lease_id: int) -> None:
        with self._lock:
            self._mark()
            self._done.append(lease_id)
        self._wake(False)

    def report_read(self, key: ReadKey, tokens: list[int], n_blocks: int) -> None:
        """Count one read of the first ``n_blocks`` blocks of ``key``'s request."""
        with self._lock:
            self._mark()
            pending = self._reads.get(key)
            if pending is None:
                ns_id, _, extra, _ = key
                pending = pb.PrefixReads(
                    ns_id=ns_id, tokens=tokens, extra_keys=extra, n_blocks=n_blocks
                )
                self._reads[key] = pending
            pending.reads += 1
            if pending.reads >= MAX_READS_PER_PREFIX:  # the most one report may claim
                self._full.append(self._reads.pop(key))
            now = bool(self._full) or len(self._reads) >= REPORTED_PREFIXES
        self._wake(now)

    def take_done(self) -> list[int]:
        """The pending releases, for a request that carries them (an Acquire)."""
        if not self._done:
            return []
        with self._lock:
            done, self._done = self._done, []
        return done

    def take(self) -> pb.ReportReadsRequest | None:
        """The message that tells everything pending (then no longer pending); None
        when nothing is."""
        if not self._queued():
            return None
        with self._lock:
            done, self._done = self._done, []
            prefixes = self._full + list(self._reads.values())
            self._reads = {}
            # the rest (a timer far behind) goes with the next message
            self._full = prefixes[MAX_REPORTED_PREFIXES:]
        return pb.ReportReadsRequest(
            release_lease_ids=done, prefixes=prefixes[:MAX_REPORTED_PREFIXES]
        )

    def due_in(self) -> float | None:
        """Seconds until the pending work is due (<= 0: now); None when there is none."""
        if not self._queued():
            return None
        return self._since + DELAY_S - time.monotonic()

    def _mark(self) -> None:
        """Under the lock, before queueing: start the delay if nothing was queued."""
        if not self._queued():
            self._since = time.monotonic()
