"""Keeping a coded namespace's host blocks encoded (``codec_tiers`` names ``host``).

The host tier then holds about twice the blocks of an 8-bit codec in the same arena,
and every read of such a block decodes it. :class:`HostCoding` is the host tier's
writer: one thread that encodes the blocks which became ready in host (committed,
promoted), never under the store's lock and never on a request's path.

Protocol, per batch of blocks it was offered:

1. Under the lock: take the blocks that are still ready, in host, exact and held by
   nobody (no pin: no read lease, copy in flight or shared-tier send); pin them, and
   give each a slot of its encoded size (:meth:`Tiers.alloc_host`: evicting as a put
   would, since the arena is full in steady state).
2. Without the lock: encode each block from its slot into its new slot.
3. Under the lock: unpin; each block still unheld at the same slot moves to its new
   slot and frees the old one (which bumps its epoch). A block held meanwhile keeps
   its old slot and is tried again a little later (``RETRY_S``), as is one held at
   step 1.

Newest first: when puts outrun the encoder, the oldest blocks waiting are the next
that eviction takes (least recently used), and encoding them would spend its work, and
the room it evicts for their new slots, on blocks about to go. The queue is bounded
(``QUEUE_BLOCKS``); past it the oldest offers are forgotten and those blocks stay exact.

Why a new slot rather than encoding in place and freeing the slot's tail: a tail is
too small for the next block as the engine writes it (about half of one), so it would
sit empty beside its block until that block went. Freeing the whole exact slot leaves
room for the next put, and encoded slots fill the holes that evictions leave.

What readers see (:mod:`kvstore.store_reads`): ``Node.host_coded`` changes only under
the lock and only for an unpinned block, so it is stable for a pinned reader. A get
decodes into its buffer; an acquire decodes into slots of its own, which its lease
holds and frees when it ends (the client copies from those as from any slot); an
unpinned read (``locate``) is not offered for an encoded block, and one that copied a
slot before it was rewritten fails its epoch check. A block leaves the host tier as it
is there: the disk writer and the shared tier store encoded bytes verbatim, which is
why ``host`` in ``codec_tiers`` needs ``disk`` and ``shared`` too.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from kvstore.index import Node
from kvstore.store_parts import StoreParts

BATCH = 64  # blocks encoded per round (one lock hand-off each way)
RETRY_S = 0.05  # how soon a block that was held is looked at again
QUEUE_BLOCKS = 65_536  # blocks waiting to be encoded; past it the oldest stay exact


class HostCoding:
    """The host tier's encoder thread (see the module docstring)."""

    def __init__(self, parts: StoreParts) -> None:
        self._parts = parts
        self._wake = threading.Condition(parts.lock)
        self._queue: deque[Node] = deque(maxlen=QUEUE_BLOCKS)
        self._held: list[Node] = []  # offered blocks that were held: retried
        self._encoding = 0  # blocks of the batch being encoded
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name="kvstore-host-coding", daemon=True
        )
        self._thread.start()

    def offer(self, nodes: Iterable[Node]) -> None:
        """Blocks that became ready in host; those of coded namespaces are encoded
        soon. Under the lock."""
        added = False
        for node in nodes:
            if node.ns.codec is not None:
                self._queue.append(node)
                added = True
        if added:
            self._wake.notify()

    @property
    def idle(self) -> bool:
        """Whether nothing offered waits to be encoded or is being encoded (held
        blocks count as waiting). Under the lock."""
        return not self._queue and not self._held and not self._encoding

    def close(self) -> None:
        """Stop the thread (blocks not encoded yet stay exact); before the store closes."""
        with self._parts.lock:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    # --- the thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._parts.lock:
                batch = self._take()
                if not batch:
                    return
                self._encoding = len(batch)
            try:
                for node, _, slot in batch:
                    codec = node.ns.codec
                    assert codec is not None  # offer() takes coded namespaces only
                    arena = self._parts.arena
                    codec.encode(
                        arena.view(node.host_offset, node.size),
                        arena.view(slot, codec.encoded_bytes),
                    )
            except BaseException:
                with self._parts.lock:
                    for node, _, slot in batch:
                        node.pins -= 1
                        self._parts.arena.free(slot)
                    self._encoding = 0
                raise
            with self._parts.lock:
                for node, _, _ in batch:
                    node.pins -= 1
                for node, offset, slot in batch:
                    self._place(node, offset, slot)
                self._encoding = 0
                if self.idle:
                    self._parts.changed.notify_all()  # Store.wait_host_coded

    def _take(self) -> list[tuple[Node, int, int]]:
        """The next blocks to encode, pinned, with their slots and new slots; [] when
        stopping. Under the lock."""
        while not self._stopping and not self._parts.closed:
            batch: list[tuple[Node, int, int]] = []
            while self._queue and len(batch) < BATCH:
                node = self._queue.pop()  # newest first (see the module docstring)
                if not _encodable(node):
                    continue
                if node.pins:
                    self._held.append(node)
                    continue
                node.pins += 1  # before alloc_host: it must not evict this block
                codec = node.ns.codec
                assert codec is not None
                slot = self._parts.tiers.alloc_host(codec.encoded_bytes, node.ns.group, tail=True)
                if slot is None:  # every block is held: later
                    node.pins -= 1
                    self._held.append(node)
                    break
                batch.append((node, node.host_offset, slot))
            if batch:
                return batch
            if self._held:
                self._wake.wait(RETRY_S)
                self._queue.extend(self._held)
                self._held.clear()
            else:
                self._wake.wait()
        return []

    def _place(self, node: Node, offset: int, slot: int) -> None:
        """Move one block to its encoded slot, if nobody held it since; otherwise free
        that slot and try the block again later. Under the lock."""
        if not _encodable(node) or node.host_offset != offset or node.pins:
            self._parts.arena.free(slot)
            if _encodable(node):
                self._held.append(node)
            return
        self._parts.tiers.host.recode(node, slot)


def _encodable(node: Node) -> bool:
    return node.ready and node.in_host and not node.host_coded
