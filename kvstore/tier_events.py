"""What a router needs to know: every block that enters or leaves a tier (:class:`TierFeed`).

A prefix-aware router (llm-d, NVIDIA Dynamo) keeps an index of which node holds which
block, fed by each node's KV events. The store's parts tell this feed, under the
store's lock, each time a ready block enters a tier (committed or promoted into host,
queued for disk, sent to the shared tier, found on disk at start) or leaves one; the
daemon's publisher (:mod:`kvstored.kv_events`) takes the changes in order and sends
them in vLLM's wire format. Pending blocks are never told: they are not usable.

A change is one plain tuple per block, with what it carried at that moment (its key,
its parent's key and its tokens), so a publisher reads no node. The feed is bounded,
in changes and in bytes (a change of a block of many tokens is large): when the
publisher falls behind by ``capacity`` changes or ``capacity_bytes`` bytes, new ones are
dropped and counted (``dropped``), never waited for under the lock. A part that can wait (the
index load at start) waits for room with :meth:`wait_room` outside the lock.

Off by default (``on`` False): then every method returns at once, at the cost of one
attribute test per call. The daemon makes the feed and starts its publisher before the
store, so the blocks a start finds on disk are told too (changes carry their namespace,
not a name the publisher would look up in the store).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvstore.index import Node
from kvstore.keys import NamespaceSpec

# the tiers as routers name them (vLLM's medium, plus where the tier is)
HOST = "CPU"
DISK = "STORAGE"
SHARED = "SHARED"  # vLLM's STORAGE with locality REMOTE: the cluster every node reads

STORED = 0
REMOVED = 1
CLEARED = 2


class TierChange(NamedTuple):
    """One block that entered (STORED) or left (REMOVED) ``tier``, or a CLEARED
    (every block of every tier left; ``ns`` None)."""

    op: int
    ns: NamespaceSpec | None
    tier: str
    key: bytes
    parent: bytes | None
    tokens: bytes | None  # packed little-endian uint32; None: not known


CHANGE_BYTES = 200  # what one change takes, besides its tokens (a tuple of six)


def change_bytes(change: TierChange) -> int:
    """What a change held in the feed takes, about."""
    return tokens_change_bytes(change.tokens)


def tokens_change_bytes(tokens: bytes | None) -> int:
    """What a change that carries ``tokens`` takes in the feed, about."""
    return CHANGE_BYTES + (len(tokens) if tokens else 0)


class TierFeed:
    """The bounded, ordered feed of tier changes (see the module docstring)."""

    def __init__(self, capacity: int, on: bool = False, capacity_bytes: int = 64 << 20) -> None:
        self.on = on
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.dropped = 0  # changes lost because the publisher was behind
        self._changes: deque[TierChange] = deque()
        self._bytes = 0  # what the changes held take (guarded by _room's lock)
        self._room = threading.Condition(threading.Lock())

    def __len__(self) -> int:
        return len(self._changes)

    def stored(
        self, nodes: Iterable[Node], tier: str, tokens: Sequence[bytes | None] | None = None
    ) -> None:
        """``nodes`` entered ``tier`` (parents first); ``tokens`` overrides theirs."""
        if not self.on:
            return
        changes = [
            TierChange(
                STORED,
                node.ns.spec,
                tier,
                node.key,
                None if node.parent is None else node.parent.key,
                node.tokens if tokens is None else tokens[i],
            )
            for i, node in enumerate(nodes)
        ]
        self._add(changes)

    def removed(self, node: Node, tier: str) -> None:
        if self.on and node.ready:  # (a pending block was never told)
            self._add([TierChange(REMOVED, node.ns.spec, tier, node.key, None, None)])

    def cleared(self, specs: Iterable[NamespaceSpec] | None = None) -> None:
        """Every block of these namespaces left every tier (of all: None)."""
        if self.on:
            targets: Iterable[NamespaceSpec | None] = [None] if specs is None else specs
            self._add([TierChange(CLEARED, spec, "", b"", None, None) for spec in targets])

    def _add(self, changes: list[TierChange]) -> None:
        room = max(self.capacity - len(self._changes), 0)
        with self._room:
            taken = 0
            for change in changes[:room]:
                size = change_bytes(change)
                if self._bytes + size > self.capacity_bytes:
                    break
                self._bytes += size
                taken += 1
        self.dropped += len(changes) - taken
        self._changes.extend(changes[:taken])

    @property
    def queued_bytes(self) -> int:
        """What the changes held take (at most ``capacity_bytes``)."""
        return self._bytes

    def take(self, limit: int, max_bytes: int | None = None) -> list[TierChange]:
        """The oldest changes, at most ``limit`` and, past the first, at most
        ``max_bytes`` of them, taken off the feed (the publisher's thread; deque ends
        are thread-safe, so it takes no store lock). ``max_bytes`` bounds what the
        taker makes of them at once (token lists as Python ints: 9x their bytes)."""
        out: list[TierChange] = []
        taken = 0
        changes = self._changes
        while changes and len(out) < limit:
            size = change_bytes(changes[0])
            if out and max_bytes is not None and taken + size > max_bytes:
                break
            out.append(changes.popleft())
            taken += size
        if out:
            with self._room:
                self._bytes -= taken
                self._room.notify_all()
        return out

    def wait_room(self, n: int, timeout: float, nbytes: int = 0) -> bool:
        """Wait (never under the store's lock) until ``n`` more changes of ``nbytes``
        in all fit (both bounds); False when the time ran out first."""
        if not self.on:
            return True
        with self._room:
            return self._room.wait_for(
                lambda: len(self._changes) + n <= self.capacity
                and self._bytes + nbytes <= self.capacity_bytes,
                timeout,
            )
