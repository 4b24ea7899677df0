"""The read side of the store: lookup, read, acquire, locate and the reads clients
report, over the store's parts (:mod:`kvstore.store_parts`).

Copies of block bytes happen outside the lock: the blocks involved are pinned (their
pin count) while the lock is released, so eviction cannot free a slot under a reader.
A read of disk-only blocks reserves host slots for them under the lock, reads them
into the slots without it (the blocks of one share in one LMDB read transaction), and
publishes the promotions under the lock again. A block kept encoded in host
(:mod:`kvstore.host_coding`) is decoded: by a read into its buffer, by an acquire into a
slot of its own that the read lease holds.

Big promotions are read in shares and the next window of a long prefix is read ahead
on threads arranged so that none waits on work queued behind itself
(:mod:`kvstore.read_threads`). A long read that finds no host room for a single block
of its window waits for room (``put_wait_ms``) as a put waits for the writer, then is
refused with the reason (OutOfSpace), never answered with an empty window that would
read as the prefix's end (``wait_room``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn, overload

import numpy as np

from kvstore.errors import (
    InvalidArgument,
    NoRoom,
    StoreError,
)
from kvstore.index import READY, Index, NamespaceEntry, Node
from kvstore.keys import BlockKey, run_tokens
from kvstore.misses import MissReason, explain
from kvstore.read_threads import ReadThreads
from kvstore.results import (
    Acquisition,
    Located,
    ReadyPrefix,
)
from kvstore.store_config import (
    PARALLEL_PROMOTE_BYTES,
    PROMOTE_THREADS,
    QUICK_PROMOTE_BYTES,
    check_ttl,
)
from kvstore.store_parts import StoreParts

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pinned:
    """What :meth:`Reads._pin_prefix` pinned: the nodes, {position: fresh host slot}
    for blocks to read from disk or decode, the positions among those of blocks encoded
    in host (decoded, not promoted; fixed at pin time: a block another reader promotes
    meanwhile is still read here, and its slot freed), and the ready prefix's length."""

    nodes: list[Node]
    fresh: dict[int, int]
    decode: frozenset[int]
    ready: int


def ready_prefix(index: Index, keys: Sequence[BlockKey]) -> ReadyPrefix:
    """How much of ``keys``' chain is ready (in each tier) and pending after that.
    Under the lock."""
    walk = index.walk(keys)
    ready = host = 0
    for node in walk:  # attributes, not the properties: this runs per block per call
        if node.state != READY:
            break
        ready += 1
        if node.host_offset >= 0:
            host += 1
    pending = tuple(
        node.key for node in itertools.takewhile(lambda n: not n.ready, walk[ready:])
    )
    return ReadyPrefix(ready, host, ready - host, pending)


class Reads:
    """The read side (see the module docstring)."""

    def __init__(self, parts: StoreParts) -> None:
        self._parts = parts
        self._threads = ReadThreads(parts.config.put_wait_ms / 1000)

    def close(self) -> None:
        """Stop the promotion and read-ahead threads (after the store closed)."""
        self._threads.close()

    # ------------------------------------------------------------------ read side
    def lookup(self, ns_id: str, keys: Sequence[BlockKey]) -> ReadyPrefix:
        return self.lookup_many(ns_id, [keys])[0]

    def lookup_many(self, ns_id: str, chains: Sequence[Sequence[BlockKey]]) -> list[ReadyPrefix]:
        """:meth:`lookup` of each of ``chains`` (independent chains of one namespace),
        under one hold of the lock: a batch costs one acquisition, not one per chain."""
        entry = self._parts.namespaces.entry(ns_id)
        for keys in chains:
            self._parts.namespaces.check_keys(entry, keys)
        with self._parts.lock:
            self._parts.expire()
            return [ready_prefix(self._parts.index, keys) for keys in chains]

    def why(self, ns_id: str, keys: Sequence[BlockKey]) -> MissReason:
        """Why ``keys`` are not served whole: the first block that is not, and the
        reason the store knows (kvstore.misses)."""
        entry = self._parts.namespaces.entry(ns_id)
        self._parts.namespaces.check_keys(entry, keys)
        with self._parts.lock:
            return explain(self._parts.index, self._parts.tiers.losses, keys)

    def read(
        self,
        ns_id: str,
        keys: Sequence[BlockKey],
        out: memoryview | None = None,
        start: int = 0,
    ) -> tuple[int, memoryview]:
        """Copy ready blocks ``keys[start:]`` of the longest ready prefix into ``out`` (or
        a new buffer) -> (blocks copied, view of the bytes written). Blocks before
        ``start`` are not copied (the caller has them) but must be ready too. Disk hits
        are verified and promoted into the host tier (parents first) when room can be
        made. Raises InvalidArgument if ``out`` cannot hold len(keys) - start blocks."""
        entry = self._parts.namespaces.entry(ns_id)
        self._parts.namespaces.check_keys(entry, keys)
        size = entry.spec.block_bytes
        if not 0 <= start <= len(keys):
            raise InvalidArgument(f"start={start} is outside a chain of {len(keys)} blocks")
        wanted = len(keys) - start
        if out is not None:
            out = memoryview(out).cast("B")
            if out.readonly or out.nbytes < wanted * size:
                raise InvalidArgument(
                    f"out must be a writable buffer of >= {wanted * size} bytes "
                    f"({wanted} blocks x {size}), got {out.nbytes}"
                    + (" (read-only)" if out.readonly else "")
                )
        pinned = self._pin_prefix(entry, keys, promote_all=False, start=start)
        assert pinned is not None  # None only for host_only
        nodes, fresh = pinned.nodes, pinned.fresh
        if out is None:
            out = memoryview(bytearray(max(len(nodes) - start, 0) * size))
        ok = len(nodes)
        try:
            ok = self._copy_out(nodes, fresh, out, size, start)
        finally:
            self._finish_pinned(entry, keys, nodes, fresh, ok, keep_pins=False, start=start)
        copied = max(ok - start, 0)
        return copied, out[: copied * size]

    @overload
    def acquire(
        self, ns_id: str, keys: Sequence[BlockKey], ttl_s: float | None = None
    ) -> Acquisition: ...

    @overload
    def acquire(
        self,
        ns_id: str,
        keys: Sequence[BlockKey],
        ttl_s: float | None,
        host_only: bool,
        count: bool = True,
        start: int = 0,
        wait_room: float | None = None,
    ) -> Acquisition | None: ...

    def acquire(
        self,
        ns_id: str,
        keys: Sequence[BlockKey],
        ttl_s: float | None = None,
        host_only: bool = False,
        count: bool = True,
        start: int = 0,
        wait_room: float | None = None,
    ) -> Acquisition | None:
        """Pin the ready prefix of ``keys`` in host slots under a read lease, promoting
        its disk-only blocks. With ``start`` only its blocks from ``start`` on are
        pinned (those before it must be ready, in any tier, and are neither pinned nor
        promoted): one window of a prefix longer than the host tier, read window by
        window. ``host_only`` (for a caller that must not wait on the
        disk): disk-only blocks are promoted only when they are at most
        QUICK_PROMOTE_BYTES, fit the arena's free room (nothing is evicted) and are all
        in the page cache; otherwise None, having changed nothing.

        ``count=False`` for a read counted already (the same get acquiring again): no
        hits or misses are counted, the blocks are touched as by any read.

        ``wait_room`` (seconds, for a client that would take an empty answer for the
        end of the prefix: the daemon's Acquire): when not one block of the window gets
        a host slot (the room is held by other reads' leases or pending puts) while the
        prefix goes on, wait that long for room, then raise NoRoom with the reason,
        having changed nothing. None: answer the blocks that got slots, none at all."""
        entry = self._parts.namespaces.entry(ns_id)
        self._parts.namespaces.check_keys(entry, keys)
        ttl = check_ttl(self._parts.config, ttl_s)
        if not 0 <= start <= len(keys):
            raise InvalidArgument(f"start={start} is outside a chain of {len(keys)} blocks")
        # at most what the tenant's host room holds: a prefix longer than that is pinned
        # one window at a time (its own blocks held in host would else leave no room for
        # the rest); a later window at most half of it, so that the next one may be read
        # ahead meanwhile
        room = self._parts.host_room(entry.group) // entry.spec.block_bytes
        limit = start + (self._half_room_blocks(entry) if start else room)
        first = keys[start] if start < min(limit, len(keys)) else None
        if first is not None and not self._threads.take(first, wait=not host_only):
            return None  # (host_only: a read-ahead of this window is still reading)
        pinned = self._pin_prefix(
            entry, keys, promote_all=True, host_only=host_only, start=start, limit=limit,
            wait_room=wait_room,
        )  # fmt: skip
        if pinned is None:
            return None
        nodes, fresh, ready = pinned.nodes, pinned.fresh, pinned.ready
        if wait_room is not None and len(nodes) <= start < min(ready, limit):
            self._refuse_for_room(entry, start, ready, wait_room)
        keys = keys[:limit]
        try:
            ok = self._fill_promotions(nodes, fresh, pinned.decode, nowait=host_only)
        except BlockingIOError:  # host_only: a block is not in the page cache
            with self._parts.lock:
                for offset in fresh.values():
                    self._parts.arena.free(offset)
                for node in nodes[start:]:
                    node.pins -= 1
            return None
        except BaseException:
            self._finish_pinned(
                entry, keys, nodes, fresh, 0, keep_pins=True, start=start, count=count
            )
            raise
        if not count:  # here: a quick attempt that went to the pool is not a get
            with self._parts.lock:
                self._parts.counters.repeated_gets += 1
        # decoded copies of blocks encoded in host: the lease's, not promotions
        decoded = {i: fresh.pop(i) for i in pinned.decode}
        self._finish_pinned(
            entry, keys, nodes, fresh, ok, keep_pins=True, start=start, count=count
        )
        kept = nodes[start:ok]
        with self._parts.lock:
            size = entry.spec.block_bytes
            for i in [i for i in decoded if i >= ok]:
                self._parts.arena.free(decoded.pop(i))
            longer = ready if ready > start + len(kept) else 0  # (see Acquisition)
            if not kept:
                return Acquisition(0, 0.0, (), (), size, start, longer)
            lease = self._parts.leases.new(entry, kept, write=False, ttl=ttl)
            if decoded:
                lease.decoded = list(decoded.values())
            keys = tuple([node.key for node in kept])
            offsets = tuple(
                [decoded.get(start + i, node.host_offset) for i, node in enumerate(kept)]
            )
            return Acquisition(
                lease.lease_id, lease.expires_at, keys, offsets, size, start, longer
            )

    def read_ahead(self, ns_id: str, keys: Sequence[BlockKey], start: int) -> bool:
        """Start promoting the window of ``keys`` from ``start`` on (at most half the
        tenant's host room; its disk-only blocks) into the host tier on a promotion
        thread, for a caller that reads a long prefix window by window: the disk reads
        of its next window overlap its copy of the last one. An acquire of that window
        waits for the read-ahead first. Nothing is leased, nothing is counted: the
        blocks are ordinary host blocks once read (evictable as any). False when there
        is nothing to read ahead (no disk tier, ``start`` past the chain, a read-ahead
        of that window in flight already, or every read-ahead thread busy: a hint that
        would wait in a queue is skipped)."""
        entry = self._parts.namespaces.entry(ns_id)
        self._parts.namespaces.check_keys(entry, keys)
        if self._parts.disk is None or not 0 <= start < len(keys):
            return False
        window = list(keys[: start + self._half_room_blocks(entry)])
        work = functools.partial(self._read_ahead, entry, window, start)
        return self._threads.read_ahead(keys[start], work)

    def _read_ahead(self, entry: NamespaceEntry, keys: list[BlockKey], start: int) -> None:
        """:meth:`read_ahead`'s work, on a read-ahead thread."""
        try:
            pinned = self._pin_prefix(entry, keys, promote_all=True, start=start)
            if pinned is not None:
                nodes, fresh = pinned.nodes, pinned.fresh
                try:
                    ok = self._fill_promotions(nodes, fresh, pinned.decode)
                except Exception:  # a hint only: the acquire reads what is missing
                    log.debug("read-ahead of a window failed", exc_info=True)
                    ok = start
                self._finish_pinned(
                    entry, keys, nodes, fresh, ok, keep_pins=False, start=start, count=False
                )
        except StoreError:  # closed meanwhile
            pass

    def _refuse_for_room(
        self, entry: NamespaceEntry, start: int, ready: int, waited_s: float
    ) -> NoReturn:
        """Refuse an acquire whose window got no host slot within ``waited_s`` (see
        :meth:`acquire`): raised with the reason, counted when it waited (a caller that
        did not wait asks again, waiting). Nothing is pinned."""
        if waited_s > 0:
            with self._parts.lock:
                self._parts.counters.room_refused += 1
        raise NoRoom(
            f"no host room for a window of this prefix: block {start} (of {ready} ready) "
            f"needs a host slot, and all {self._parts.host_room(entry.group)} bytes of "
            f"the host room stayed held by other reads' leases or pending puts for "
            f"{waited_s:g} s; read it again later, or inline (Get)"
        )

    def _half_room_blocks(self, entry: NamespaceEntry) -> int:
        """Blocks one acquire pins at most: half the tenant's host room (one window
        pinned, the next read ahead)."""
        return max(1, self._parts.host_room(entry.group) // 2 // entry.spec.block_bytes)

    def locate(self, ns_id: str, keys: Sequence[BlockKey]) -> Located | None:
        """The host slots of the ready prefix of ``keys`` and their epochs, pinning
        nothing (an unpinned read: see :mod:`kvstore.host.slot_epochs`). Counts the hits and
        touches the prefix as a read does. None, having changed nothing, when a block of
        the prefix is on disk only or encoded in host (the caller acquires instead)."""
        entry = self._parts.namespaces.entry(ns_id)
        self._parts.namespaces.check_keys(entry, keys)
        with self._parts.lock:
            self._parts.check_open()
            self._parts.expire()
            nodes, elsewhere = self._host_prefix(keys)
            if elsewhere:
                return None
            self._count_reads(entry, nodes, len(keys), reads=1, host_hits=len(nodes))
            offsets = [node.host_offset for node in nodes]
            epochs = self._parts.arena.epochs.read(self._parts.arena.epochs.entries(offsets))
            return Located(tuple(offsets), epochs, entry.spec.block_bytes)

    def note_reads(self, ns_id: str, keys: Sequence[BlockKey], reads: int) -> int:
        """Count ``reads`` reads of the prefix ``keys`` that a client served itself, with
        no call of its own: hits, and a touch for eviction, as :meth:`locate` gives each
        read. From slots it knew (checked by their epochs): blocks that left the host
        tier since (and all after them) are not counted. Returns blocks counted per
        read."""
        entry = self._parts.namespaces.entry(ns_id)
        self._parts.namespaces.check_keys(entry, keys)
        if reads <= 0:
            return 0
        with self._parts.lock:
            self._parts.check_open()
            self._parts.counters.known_slot_gets += reads
            nodes, _ = self._host_prefix(keys)
            if nodes:
                self._count_reads(entry, nodes, len(nodes), reads, len(nodes))
            return len(nodes)

    def note_misses(self, ns_id: str, blocks: int) -> None:
        """Count ``blocks`` asked for and not found, for a caller that read only the
        ready prefix it had looked up (the daemon's Get): hit rates stay honest."""
        if blocks <= 0:
            return
        entry = self._parts.namespaces.entry(ns_id)
        with self._parts.lock:
            entry.misses += blocks
            self._parts.counters.host_misses += blocks
            self._parts.counters.disk_misses += blocks

    # --- pinned reads -----------------------------------------------------------
    def _pin_prefix(
        self,
        entry: NamespaceEntry,
        keys: Sequence[BlockKey],
        promote_all: bool,
        host_only: bool = False,
        start: int = 0,
        limit: int | None = None,
        wait_room: float | None = None,
    ) -> _Pinned | None:
        """Pin the ready prefix and reserve host slots for its disk-only blocks, from
        ``start`` on (the caller does not read the blocks before it) up to ``limit``.

        Returns the pinned nodes, {position: fresh host offset} for blocks to promote
        and, with ``promote_all``, for blocks encoded in host to decode into, and how
        long the ready prefix is (past ``limit`` too: one walk of the chain): _Pinned.
        With ``promote_all`` the prefix is cut at the first block that gets no slot
        (acquire needs every block in host); otherwise that block is read from disk.
        With ``host_only``, slots come from free room only, for at most
        QUICK_PROMOTE_BYTES of disk-only blocks; None (nothing pinned or reserved) when
        they do not.

        Room that only a writer can make (see :mod:`kvstore.tiering`) is waited for as
        a put waits (:meth:`StoreParts.wait_for_writer`, up to ``put_wait_ms``): the
        blocks are on disk, and a read that gave up on them would be a miss. So is room
        that only other reads' leases hold, for ``wait_room`` seconds (see
        :meth:`acquire`): until then a window that would get no block is not cut to
        nothing.
        """
        now = time.monotonic()
        deadline = now + self._parts.config.put_wait_ms / 1000
        room_by = None if wait_room is None else now + wait_room
        while True:
            with self._parts.lock:
                self._parts.check_open()
                self._parts.expire()
                nodes = self._ready_prefix(keys)
                ready = len(nodes)
                if limit is not None:
                    del nodes[limit:]
                in_place = not any(_needs_slot(node, promote_all) for node in nodes[start:])
                if host_only and not in_place:
                    fresh_room = self._free_room_slots(nodes, start)
                    if fresh_room is None:
                        return None
                    for node in nodes[start:]:
                        node.pins += 1
                    return _pinned(nodes, fresh_room, ready)
                # (a block before start, left unpinned, has its children indexed: it
                # may leave the host tier meanwhile, never the index)
                for node in nodes[start:]:
                    node.pins += 1
                if in_place:
                    return _pinned(nodes, {}, ready)
                fresh = self._promotion_slots(nodes, promote_all, deadline, start, room_by)
                if fresh is not None:
                    return _pinned(nodes, fresh, ready)
                tiers = self._parts.tiers
                # None without ``room_by`` is always the writer behind (decided by
                # _promotion_slots' own clock: not read again here, where the deadline
                # may have passed since); with ``room_by`` it may be either
                if room_by is not None and (
                    not tiers.writer_blocked or time.monotonic() >= deadline
                ):  # room held by leases: freed as they end (each end notifies ``changed``)
                    self._parts.changed.wait(max(0.0, min(0.05, room_by - time.monotonic())))
                    continue
                behind = tiers.behind_blocked
            self._parts.wait_for_writer(nodes[0].size, deadline, behind)

    def _promotion_slots(
        self,
        nodes: list[Node],
        promote_all: bool,
        deadline: float,
        start: int = 0,
        room_by: float | None = None,
    ) -> dict[int, int] | None:
        """Host slots for the disk-only blocks of the pinned ``nodes`` from ``start`` on
        (see :meth:`_pin_prefix`); None, with ``nodes`` unpinned and nothing allocated,
        when the disk writer is behind and ``deadline`` has not passed, or when not one
        block from ``start`` gets a slot and ``room_by`` has not passed. Under the
        lock."""
        tiers = self._parts.tiers
        tiers.writer_blocked = tiers.behind_blocked = False
        fresh: dict[int, int] = {}
        for i in range(start, len(nodes)):
            node = nodes[i]
            if not _needs_slot(node, promote_all):
                continue
            offset = tiers.alloc_host(node.size, node.ns.group)
            if offset is not None:
                fresh[i] = offset
                continue
            now = time.monotonic()
            behind = tiers.writer_blocked and now < deadline
            no_room = room_by is not None and promote_all and i == start and now < room_by
            if behind or no_room:
                for taken in fresh.values():
                    self._parts.arena.free(taken)
                for late in nodes[start:]:
                    late.pins -= 1
                return None
            if promote_all:
                for late in nodes[i:]:
                    late.pins -= 1
                del nodes[i:]
            break
        return fresh

    def _free_room_slots(self, nodes: list[Node], start: int = 0) -> dict[int, int] | None:
        """Host slots for the disk-only blocks of ``nodes`` (and those encoded in host)
        from the arena's free room (no eviction, within the tenant's quota), when they
        are at most QUICK_PROMOTE_BYTES; None, with nothing allocated, otherwise. Under
        the lock."""
        on_disk = [i for i in range(start, len(nodes)) if _needs_slot(nodes[i], True)]
        if sum(nodes[i].size for i in on_disk) > QUICK_PROMOTE_BYTES:
            return None
        fresh: dict[int, int] = {}
        for i in on_disk:
            node = nodes[i]
            quota = node.ns.group.quota.host_bytes
            held = node.ns.group.host_held + sum(nodes[j].size for j in fresh)
            over_quota = quota and held + node.size > quota
            tenant = node.ns.group.name
            offset = None if over_quota else self._parts.arena.alloc(node.size, False, tenant)
            if offset is None:
                for taken in fresh.values():
                    self._parts.arena.free(taken)
                return None
            fresh[i] = offset
        return fresh

    def _copy_out(
        self, nodes: list[Node], fresh: dict[int, int], out: memoryview, size: int, start: int
    ) -> int:
        """Copy pinned blocks ``nodes[start:]`` into ``out`` and fill the promotion slots
        of all of them (no lock held); returns how many of ``nodes`` are good."""
        array = self._parts.arena.array()
        dst = np.frombuffer(out, dtype=np.uint8)
        for i, node in enumerate(nodes):
            target = dst[(i - start) * size : (i - start + 1) * size] if i >= start else None
            if node.in_host:
                if target is not None and node.host_coded:
                    self._decode(node, target.data)
                elif target is not None:
                    target[:] = array[node.host_offset : node.host_offset + size]
                continue
            placement = self._parts.tiers.disk
            assert self._parts.disk is not None and placement is not None
            codec = placement.codec(node.ns)  # how it keeps them (a record of another: a miss)
            if i in fresh:
                slot = self._parts.arena.view(fresh[i], size)
                if self._parts.disk.read(node.key, out=slot, codec=codec) is None:
                    return i
                if target is not None:
                    target[:] = array[fresh[i] : fresh[i] + size]
            elif target is not None:
                window = out[(i - start) * size : (i - start + 1) * size]
                if self._parts.disk.read(node.key, out=window, codec=codec) is None:
                    return i
        return len(nodes)

    def _fill_promotions(
        self,
        nodes: list[Node],
        fresh: dict[int, int],
        decode: frozenset[int],
        nowait: bool = False,
    ) -> int:
        """Read disk-only blocks into their fresh host slots, and decode the blocks
        encoded in host at ``decode`` into theirs (no lock held); the number of leading
        ``nodes`` that are good.

        The blocks of one share are read in one LMDB read transaction. A disk read is
        a pread and a checksum pass, both without the GIL: promotions of
        ``PARALLEL_PROMOTE_BYTES`` or more run on PROMOTE_THREADS threads at once
        (:meth:`ReadThreads.shares`: this thread never waits on a share still queued).
        ``nowait``: on this thread, BlockingIOError when a block is not in the page
        cache (see :meth:`acquire`)."""
        disk = self._parts.disk
        for i in decode:  # encoded in host: decoded into a slot of the reader's
            self._decode(nodes[i], self._parts.arena.view(fresh[i], nodes[i].size))
        todo = sorted(i for i in fresh if i not in decode)
        if not todo:
            return len(nodes)

        def fill_all(part: list[int]) -> int | None:
            """The first block of ``part`` that failed, or None."""
            placement = self._parts.tiers.disk
            assert disk is not None and placement is not None
            slots = [self._parts.arena.view(fresh[i], nodes[i].size) for i in part]
            codec = placement.codec(nodes[part[0]].ns)  # (one namespace)
            good = disk.read_all([nodes[i].key for i in part], slots, nowait, codec)
            return None if good == len(part) else part[good]

        big = sum(nodes[i].size for i in todo) >= PARALLEL_PROMOTE_BYTES
        if len(todo) > 1 and big and not nowait:
            # one share per thread (a hand-off per block would cost more than it saves)
            share = -(-len(todo) // PROMOTE_THREADS)
            parts = [todo[k : k + share] for k in range(0, len(todo), share)]
            failed = self._threads.shares(fill_all, parts)
            bad = [i for i in failed if i is not None]
            return min(bad) if bad else len(nodes)
        first_bad = fill_all(todo)
        return len(nodes) if first_bad is None else first_bad

    def _decode(self, node: Node, out: memoryview) -> None:
        """Decode a pinned block kept encoded in host into ``out`` (no lock held)."""
        codec = node.ns.codec
        assert codec is not None and node.host_coded
        codec.decode(self._parts.arena.view(node.host_offset, codec.encoded_bytes), out)

    def _finish_pinned(
        self,
        entry: NamespaceEntry,
        keys: Sequence[BlockKey],
        nodes: list[Node],
        fresh: dict[int, int],
        ok: int,
        keep_pins: bool,
        start: int = 0,
        count: bool = True,
    ) -> None:
        """Publish promotions of nodes[:ok], fix blocks lost on disk, count hits of the
        blocks the caller asked for (``start`` on; not with ``count=False``), unpin."""
        with self._parts.lock:
            host_hits = sum(1 for node in nodes[start:ok] if node.host_offset >= 0)
            promoted = 0  # served blocks read into a fresh slot (the rest came from host)
            for i, offset in fresh.items():
                node = nodes[i]
                if start <= i < ok and not node.in_host:
                    promoted += 1
                if i < ok and not node.in_host and not self._parts.closed:
                    tokens = run_tokens(keys, i, i + 1)[0]
                    self._parts.tiers.publish_promotion(node, offset, tokens)
                else:
                    self._parts.arena.free(offset)
            for node in nodes[max(ok, start) :] if keep_pins else nodes[start:]:
                node.pins -= 1
            if ok < len(nodes) and nodes[ok].on_disk:
                self._parts.tiers.lost_on_disk(nodes[ok])
            if count:
                self._count_served(
                    entry, len(keys) - start, max(ok - start, 0), host_hits, promoted
                )
                for node in nodes[:ok]:
                    node.hits += 1
            # blocks deleted while pinned are not touched: their subtrees went with them,
            # so the still indexed ones are a prefix of the chain
            end = ok
            while end and self._parts.index.get(nodes[end - 1].key) is not nodes[end - 1]:
                end -= 1
            self._parts.tiers.touch(nodes[:end])

    def _count_served(
        self, entry: NamespaceEntry, wanted: int, served: int, host_hits: int, promoted: int = 0
    ) -> None:
        """Hit and miss counters of a read that asked for ``wanted`` blocks and served
        ``served`` (``host_hits`` of them from host, ``promoted`` read into a fresh host
        slot, the rest straight from disk). Under the lock."""
        c = self._parts.counters
        c.host_hits += host_hits
        c.host_misses += wanted - host_hits
        c.disk_hits += served - host_hits
        c.disk_misses += wanted - served
        c.host_bytes_out += host_hits * entry.spec.block_bytes
        direct = served - host_hits - promoted  # read from disk without promoting
        c.disk_bytes_out += direct * entry.spec.block_bytes  # promotions counted above
        entry.hits += served
        entry.misses += wanted - served

    def _ready_prefix(self, keys: Sequence[BlockKey]) -> list[Node]:
        """The ready blocks of ``keys``' prefix, in any tier. Under the lock."""
        nodes: list[Node] = []
        for node in self._parts.index.walk(keys):
            if node.state != READY:
                break
            nodes.append(node)
        return nodes

    def _host_prefix(self, keys: Sequence[BlockKey]) -> tuple[list[Node], bool]:
        """(the ready blocks of ``keys``' prefix up to the first one not readable in
        place in its host slot, whether that one is ready all the same: on disk only or
        encoded in host). Under the lock."""
        nodes: list[Node] = []
        for node in self._parts.index.walk(keys):
            if node.state != READY:
                break
            if node.host_offset < 0 or node.host_coded:
                return nodes, True
            nodes.append(node)
        return nodes, False

    def _count_reads(
        self, entry: NamespaceEntry, nodes: list[Node], wanted: int, reads: int, host_hits: int
    ) -> None:
        """Count ``reads`` reads that asked for ``wanted`` blocks each and were served
        ``nodes`` (``host_hits`` of them from host slots, the rest straight from disk),
        and touch them as used. Under the lock."""
        n = len(nodes)
        self._count_served(entry, wanted * reads, n * reads, host_hits * reads)
        for node in nodes:
            node.hits += reads
        self._parts.tiers.touch(nodes)


def _pinned(nodes: list[Node], fresh: dict[int, int], ready: int) -> _Pinned:
    """What :meth:`Reads._pin_prefix` pinned, under the lock it pinned in: the slots
    of blocks encoded in host are known now (they stay in host while pinned)."""
    decode = frozenset(i for i in fresh if nodes[i].in_host)
    return _Pinned(nodes, fresh, decode, ready)


def _needs_slot(node: Node, decode: bool) -> bool:
    """Whether a read needs a fresh host slot for ``node``: it is on disk only, or
    (``decode``: a reader that copies from slots) kept encoded in host."""
    return not node.in_host or (decode and node.host_coded)
