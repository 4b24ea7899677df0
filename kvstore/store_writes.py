"""The write side of the store: put, reserve (with staged slots), commit, fill,
abandon, delete, clear and priorities, over the store's parts
(:mod:`kvstore.store_parts`).

A put is reserve -> copy into the reserved host slots -> commit (``put`` does all three
for an inline caller). Reserved blocks are pending: visible to lookups, pinned by the
write lease, ready once committed (each as soon as its own bytes are: a commit may
name the next ``count`` blocks only). Staged slots (a put with no round trip before
its copy): a reserve may also set aside ``stage_more`` empty slots under a staging
lease; the next reserve names them (``staged_offsets``) and its new blocks take them.

Back-pressure: when a reserve needs room that only the disk writer can make (every
block it could evict is due on disk and the writer's queue is full: see
:mod:`kvstore.tiering`), it undoes what it reserved, waits outside the lock for queue
room, and tries again, for up to ``put_wait_ms`` in all. Its last try then refuses what
does not fit (``overflow = wait``: ``Reservation.writer_behind``, counted as
``writer_refused``) or evicts dirty blocks unwritten (``overflow = drop``). Each outcome
is one log line a minute at most.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from kvproto.v1.results import PutResult
from kvstore.errors import (
    InvalidArgument,
    LeaseError,
)
from kvstore.index import READY, NamespaceEntry, Node
from kvstore.index_load import clear_unloaded
from kvstore.keys import BlockKey, run_tokens
from kvstore.leases import Lease
from kvstore.results import (
    EventKind,
    Reservation,
    SlotRef,
    Tier,
)
from kvstore.store_config import DELETE_COMMIT_TIMEOUT_S, check_priority, check_ttl
from kvstore.store_parts import StoreParts
from kvstore.tier_events import HOST

log = logging.getLogger(__name__)

OVERFLOW_LOG_EVERY_S = 60.0  # one log line per this many seconds about back-pressure


class Writes:
    """The write side (see the module docstring)."""

    def __init__(self, parts: StoreParts) -> None:
        self._parts = parts
        self._overflow_logged = -OVERFLOW_LOG_EVERY_S

    # ----------------------------------------------------------------- write side
    def put(
        self,
        ns_id: str,
        keys: Sequence[BlockKey],
        payloads: Sequence[bytes | bytearray | memoryview],
        start: int = 0,
        priority: int | None = None,
    ) -> PutResult:
        entry = self._parts.namespaces.entry(ns_id)
        size = entry.spec.block_bytes
        self._parts.namespaces.check_keys(entry, keys)
        if not 0 <= start <= len(keys) or start + len(payloads) > len(keys):
            raise InvalidArgument(
                f"{len(payloads)} payloads from block {start} do not fit a chain of "
                f"{len(keys)} blocks"
            )
        views = [memoryview(p).cast("B") for p in payloads]
        for i, view in enumerate(views):
            if view.nbytes != size:
                raise InvalidArgument(
                    f"payload {i} is {view.nbytes} bytes; namespace {ns_id} stores "
                    f"blocks of {size} bytes"
                )
        chain = keys[: start + len(views)]
        stored = existing = 0
        at = start  # a chain too long for the host tier comes in windows (see reserve)
        while True:
            reservation = self.reserve(ns_id, chain, at, priority=priority)
            reserved = len(reservation.offsets)
            try:
                array = self._parts.arena.array()
                first = reservation.first_index - start
                for i, offset in enumerate(reservation.offsets):
                    view = views[first + i]
                    array[offset : offset + size] = np.frombuffer(view, dtype=np.uint8)
            except BaseException:
                if reserved:
                    self.abandon(reservation.lease_id)
                raise
            if reserved:
                self.commit(reservation.lease_id)
            stored += reserved
            existing += reservation.existing
            if not (reservation.more and reserved):
                return PutResult(
                    stored, existing, reservation.refused, out_of_space=reservation.out_of_space
                )
            at = reservation.first_index + reserved

    def reserve(
        self,
        ns_id: str,
        keys: Sequence[BlockKey],
        start: int = 0,
        ttl_s: float | None = None,
        priority: int | None = None,
        *,
        stage_lease_id: int = 0,
        staged_offsets: Sequence[int] = (),
        stage_more: int = 0,
    ) -> Reservation:
        """Reserve the blocks ``keys[start:]`` that are not stored yet (pending, each in
        a host slot, under a write lease).

        With ``staged_offsets`` (one per offered block, in chain order; slots of the
        staging lease ``stage_lease_id``) each new block takes its staged slot instead
        of a fresh one; the slots of blocks that turn out to exist stay staged. With
        ``stage_more`` the call also sets aside that many empty slots for the caller's
        next put (fewer when the lease's limit or the room runs out; a new staging
        lease when ``stage_lease_id`` is 0). See the module docstring.
        """
        entry = self._parts.namespaces.entry(ns_id)
        self._parts.namespaces.check_keys(entry, keys)
        if not 0 <= start <= len(keys):
            raise InvalidArgument(f"start={start} is outside a chain of {len(keys)} blocks")
        if staged_offsets and len(staged_offsets) != len(keys) - start:
            raise InvalidArgument(
                f"{len(staged_offsets)} staged slots for {len(keys) - start} offered blocks"
            )
        most = self._parts.config.max_blocks_per_request
        if not 0 <= stage_more <= most:
            raise InvalidArgument(f"stage_more={stage_more} is outside [0, {most}]")
        prio = check_priority(self._parts.config, priority)
        ttl = check_ttl(self._parts.config, ttl_s)
        config, tiers = self._parts.config, self._parts.tiers
        deadline = time.monotonic() + config.put_wait_ms / 1000
        waited = False
        while True:
            with self._parts.lock:
                self._parts.check_open()
                self._parts.expire()
                staging = self._staging_lease(entry, stage_lease_id, staged_offsets)
                last = time.monotonic() >= deadline
                tiers.writer_blocked = tiers.behind_blocked = False
                found = None
                if last or not self._parts.behind_full:
                    tiers.drop_dirty = last and config.overflow == "drop"
                    dropped = self._parts.counters.dirty_dropped
                    try:
                        found = self._reserve_locked(
                            entry, keys, start, prio, ttl, staging, staged_offsets, undo=not last
                        )
                    finally:
                        tiers.drop_dirty = False
                    if found is not None:
                        self._note_overflow(found, self._parts.counters.dirty_dropped - dropped)
                        return self._stage_more(entry, found, staging, stage_more, ttl)
                if not waited:
                    waited = True
                    self._parts.counters.put_waits += 1
                behind = self._parts.behind_full or tiers.behind_blocked
            # only a writer can make the room: wait for it, holding nothing
            self._parts.wait_for_writer(entry.spec.block_bytes, deadline, behind)

    def _note_overflow(self, reservation: Reservation, dropped: int) -> None:
        """Count and log (once a minute at most) what back-pressure cost a reserve."""
        if not (reservation.writer_behind or dropped):
            return
        if reservation.writer_behind:
            self._parts.counters.writer_refused += reservation.refused
        now = time.monotonic()
        if now - self._overflow_logged < OVERFLOW_LOG_EVERY_S:
            return
        self._overflow_logged = now
        c = self._parts.counters
        log.warning(
            "the disk writer is behind (its queue of disk_queue_bytes stayed full for "
            "put_wait_ms=%d): %s; so far %d blocks refused, %d dropped unwritten",
            self._parts.config.put_wait_ms,
            f"{reservation.refused} blocks of a put refused (overflow = wait)"
            if reservation.writer_behind
            else f"{dropped} blocks due on disk evicted unwritten (overflow = drop)",
            c.writer_refused,
            c.dirty_dropped,
            extra={"event": "disk_writer_behind"},
        )

    def _stage_more(
        self,
        entry: NamespaceEntry,
        reservation: Reservation,
        staging: Lease | None,
        stage_more: int,
        ttl: float,
    ) -> Reservation:
        """A reserve's ``stage_more`` part (see :meth:`reserve`), under the lock."""
        if staging is None and stage_more == 0:
            return reservation
        if staging is None:
            staging = self._parts.leases.new(entry, [], write=False, ttl=ttl)
            staging.staged, staging.ttl = set(), ttl
        granted = self._stage(staging, stage_more)
        self._parts.leases.renew(staging)
        return replace(
            reservation,
            stage_lease_id=staging.lease_id,
            staged=tuple(granted),
            stage_ttl_s=staging.ttl,
        )

    def _staging_lease(
        self, entry: NamespaceEntry, lease_id: int, offsets: Sequence[int]
    ) -> Lease | None:
        """The staging lease a reserve names (None for 0), after checking that it is
        one of this namespace and that ``offsets`` are distinct slots it holds."""
        if not lease_id:
            if offsets:
                raise InvalidArgument("staged slots need the staging lease that holds them")
            return None
        lease = self._parts.leases.get(lease_id)
        if lease.staged is None:
            raise LeaseError(f"lease {lease_id} is a {lease.kind} lease, not a staging lease")
        if lease.entry is not entry:
            raise LeaseError(
                f"staging lease {lease_id} holds slots of namespace {lease.entry.spec.ns_id}"
            )
        if offsets:
            unknown = [o for o in offsets if o not in lease.staged]
            if unknown:
                raise InvalidArgument(
                    f"{len(unknown)} of the staged slots (first: offset {unknown[0]}) are not "
                    f"held by staging lease {lease_id}"
                )
            if len(set(offsets)) != len(offsets):
                raise InvalidArgument("a staged slot is named twice")
        return lease

    def _stage(self, lease: Lease, count: int) -> list[int]:
        """Set aside up to ``count`` more empty slots under a staging lease (evicting
        leaves as a put would), within the lease's limit; the offsets granted."""
        assert lease.staged is not None
        size = lease.entry.spec.block_bytes
        room = self._parts.config.staged_bytes_limit // size - len(lease.staged)
        count = max(0, min(count, room))
        group = lease.entry.group
        if count and group.quota.host_bytes:
            count = self._parts.tiers.quota_blocks(group, count, size)
        if count == 0:
            return []
        offsets = self._parts.arena.alloc_run(size, count, group.name)
        group.staged_bytes += len(offsets) * size
        while len(offsets) < count:
            offset = self._parts.tiers.alloc_host(size, group)
            if offset is None:
                break
            offsets.append(offset)
            group.staged_bytes += size
        lease.staged.update(offsets)
        return offsets

    def _reserve_locked(
        self,
        entry: NamespaceEntry,
        keys: Sequence[BlockKey],
        start: int,
        prio: int,
        ttl: float,
        staging: Lease | None,
        staged_offsets: Sequence[int],
        undo: bool,
    ) -> Reservation | None:
        """The reservation (see :meth:`reserve`); None, with nothing reserved, when
        ``undo`` and some block found no room only because the disk writer is behind."""
        walk = self._parts.index.walk(keys)
        offered = len(keys) - start
        if start > 0 and (len(walk) < start or not walk[start - 1].ready):
            return Reservation(0, 0.0, existing=0, refused=offered)
        existing = 0
        for node in walk[start:]:
            if not node.ready:  # another owner is computing it: wait or recompute
                return Reservation(0, 0.0, existing, offered - existing)
            existing += 1
        # The chain is not pinned while room is made: a block of it may leave the host
        # tier (its parent may be on disk only), but not the index. Used first (so it
        # goes last); if making room dropped the parent all the same, nothing attaches.
        tiers = self._parts.tiers
        tiers.touch(walk[-1:] if tiers.host.policy.touch_prefix else walk[start:])
        created: list[Node] = []
        run: list[int] = []
        try:
            parent = walk[-1] if walk else None
            # (a new host block's parent may be on disk only: nothing is promoted here)
            out_of_space = False
            first_new = max(start, len(walk))
            end = len(keys)
            size = entry.spec.block_bytes
            # (staged slots were set aside for these very blocks: no window)
            window = 0 if staged_offsets else self._window_blocks(entry, len(keys), prio)
            if window:
                end = min(end, first_new + window)
            wanted_end = end  # (what a quota cuts below is out of space, not behind)
            if entry.group.quota.host_bytes and end > first_new and not staged_offsets:
                # (blocks going into staged slots were counted when the slots were staged)
                fits = self._parts.tiers.quota_blocks(entry.group, end - first_new, size)
                if not self._attached(parent):
                    fits = 0  # the quota's room was made from the parent itself
                out_of_space = out_of_space or fits < end - first_new
                end = first_new + fits
            # staged slots, or one carve for the whole batch when a free extent holds
            # it (then one pass makes the run's nodes), else slot by slot (evicting)
            if staged_offsets:
                run = list(staged_offsets[first_new - start : end - start])
            elif end > first_new:
                run = self._parts.arena.alloc_run(size, end - first_new, entry.group.name)
            if run:
                created = self._parts.tiers.add_pending_run(
                    entry, keys[first_new:end], parent, prio, run,
                    run_tokens(keys, first_new, first_new + len(run)),
                )  # fmt: skip
                if staging is not None and staging.staged is not None:
                    staging.staged.difference_update(run)
                    staging.entry.group.staged_bytes -= len(run) * size
            for i in range(first_new + len(created), end):
                offset = self._parts.tiers.alloc_host(size, entry.group)
                if offset is not None and not self._attached(parent):  # dropped for room
                    self._parts.arena.free(offset)
                    offset = None
                if offset is None:
                    out_of_space = True
                    break
                created += self._parts.tiers.add_pending_run(
                    entry, keys[i : i + 1], parent, prio, [offset], run_tokens(keys, i, i + 1)
                )
                parent = created[-1]
            if undo and self._parts.tiers.writer_blocked and first_new + len(created) < wanted_end:
                self._unreserve(created)
                return None
        finally:
            if not staged_offsets:
                for offset in run[len(created) :]:  # only if something above raised
                    self._parts.arena.free(offset)
        refused = offered - existing - len(created)
        behind = first_new + len(created) < wanted_end and self._parts.tiers.writer_blocked
        if not created:
            return Reservation(0, 0.0, existing, refused, out_of_space, behind)
        self._parts.tiers.pending += len(created)
        lease = self._parts.leases.new(entry, created, write=True, ttl=ttl)
        first = first_new
        lease.first_index = first
        if window:
            lease.persist = True
            lease.spill = first + len(created) < len(keys)
        return Reservation(
            lease.lease_id,
            lease.expires_at,
            existing,
            refused,
            out_of_space,
            behind,
            first,
            tuple(keys[first : first + len(created)]),
            tuple([node.host_offset for node in created]),
            size,
        )

    def _attached(self, parent: Node | None) -> bool:
        """Whether new blocks may still go under ``parent`` (the chain is not pinned
        while a reserve makes room: see _reserve_locked). Under the lock."""
        return parent is None or self._parts.index.get(parent.key) is parent

    def _unreserve(self, created: list[Node]) -> None:
        """Take back pending blocks made by this call (before its lease exists)."""
        tiers = self._parts.tiers
        for node in reversed(created):
            node.pins -= 1
            tiers.host.drop(node)
            self._parts.index.remove(node)
        created.clear()

    def _window_blocks(self, entry: NamespaceEntry, chain_blocks: int, prio: int) -> int:
        """How many new blocks one reserve of a chain of ``chain_blocks`` takes when
        the chain is too long for the host tier (longer than the tenant's host room)
        and the disk tier can hold it; 0 (no limit) otherwise. Under the lock.

        Such a chain passes through the host tier in windows: each reserve takes one
        window (the caller reserves again from where it ended: a reservation that
        refused blocks without ``out_of_space``), and its commit writes the blocks to
        disk and, unless it is the chain's last window, lets them leave the host tier
        (:meth:`commit_durably`). So a chain of any length is stored whole, and the
        host tier keeps its last window."""
        disk = self._parts.disk
        if disk is None or prio < self._parts.config.disk_min_priority:
            return 0
        room = self._parts.host_room(entry.group)
        size = entry.spec.block_bytes
        if chain_blocks * size <= room:
            return 0
        return max(1, min(self._parts.config.window_bytes, room // 4) // size)

    def commit_writes_disk(self, lease_id: int) -> bool:
        """Whether committing ``lease_id`` may wait on the disk writer (a window of a
        chain too long for the host tier): a caller that must not wait runs it on a
        thread of its own. False for a lease that is not a live write lease."""
        with self._parts.lock:
            try:
                return self._parts.leases.get(lease_id, write=True).persist
            except LeaseError:
                return False

    def commit(self, lease_id: int, count: int | None = None) -> int:
        """Make the next ``count`` (default: all) reserved blocks of a write lease ready;
        how many. See :meth:`commit_durably` for what write-through adds."""
        return self.commit_durably(lease_id, count)[0]

    def commit_durably(self, lease_id: int, count: int | None = None) -> tuple[int, int]:
        """:meth:`commit`, and how many of the committed blocks are durable when it
        returns: with write-through admission the blocks go to the disk writer and this
        waits (lock released, at most ``write_through_wait_s``, never past a disk fault)
        until they are committed to disk; a block the disk tier refused (a fault, no
        room, below ``disk_min_priority``) is stored but not durable. (ready, durable);
        durable is 0 with the other admission modes, which promise nothing on a crash."""
        with self._parts.lock:
            self._parts.expire()
            lease = self._parts.leases.get(lease_id, write=True)
            remaining = len(lease.nodes) - lease.committed
            n = remaining if count is None else count
            if not 0 <= n <= remaining:
                raise InvalidArgument(
                    f"count={count} is outside [0, {remaining}] for lease {lease_id}"
                )
            batch = lease.nodes[lease.committed : lease.committed + n]
            self._parts.arena.epochs.bump([node.host_offset for node in batch])  # final bytes now
            for node in batch:
                node.state = READY
                node.pins -= 1
            self._parts.tiers.pending -= n
            self._parts.counters.host_bytes_in += n * lease.entry.spec.block_bytes
            lease.committed += n
            disk = self._parts.disk
            through = self._parts.config.admission == "write-through" and disk is not None
            if batch:
                self._parts.tiers.insert_used(batch)
                self._parts.events.emit_all(EventKind.STORED, batch, Tier.HOST)
                self._parts.tiers.feed.stored(batch, HOST)
                if self._parts.tiers.coder is not None:
                    self._parts.tiers.coder.offer(batch)
                for queue in self._parts.queues:
                    queue.add(batch)
                if through or lease.persist:
                    for node in batch:
                        self._parts.tiers.write_to_disk(node, admitted=lease.persist)
            if lease.committed == len(lease.nodes):
                self._parts.leases.forget(lease, "committed")
            self._parts.changed.notify_all()
            persist, spill = lease.persist, lease.spill
        if persist and batch:
            self._pass_through(batch, spill)
        with self._parts.lock:
            on_disk = [node.key for node in batch if node.on_disk]
        if not through or not on_disk:
            return n, 0
        assert disk is not None
        return n, disk.wait_committed(on_disk, self._parts.config.write_through_wait_s)

    def _pass_through(self, batch: Sequence[Node], spill: bool) -> None:
        """The committed ``batch`` of a chain too long for the host tier (see
        :meth:`_window_blocks`): queue each block for the disk, waiting for the writer's
        queue as a put waits (``put_wait_ms``, lock released), then with ``spill`` let
        the written blocks leave the host tier. A block still not queued then stays in
        host, where eviction treats it as any other."""
        tiers, disk = self._parts.tiers, self._parts.disk
        assert disk is not None
        deadline = time.monotonic() + self._parts.config.put_wait_ms / 1000
        while True:
            with self._parts.lock:
                todo = [node for node in batch if node.in_host and not node.on_disk]
                for node in todo:
                    if self._parts.index.get(node.key) is node and not tiers.write_to_disk(
                        node, admitted=True
                    ):
                        break
                else:
                    todo = []
                if not todo or not tiers.queue_full or time.monotonic() >= deadline:
                    if spill:
                        tiers.spill(batch)
                    return
            disk.wait_room(batch[0].size, deadline - time.monotonic())

    def claimed_slots(self, lease_id: int, count: int) -> tuple[SlotRef, ...]:
        """The next ``count`` uncommitted blocks of a write lease (chain order), for a
        caller that fills them and then commits ``count``: the arena writer, or the
        daemon delivering an inline Put into a claim."""
        with self._parts.lock:
            self._parts.expire()
            lease = self._parts.leases.get(lease_id, write=True)
            remaining = len(lease.nodes) - lease.committed
            if not 0 < count <= remaining:
                raise InvalidArgument(
                    f"{count} blocks for lease {lease_id}, which has {remaining} left"
                )
            first = lease.first_index + lease.committed
            nodes = lease.nodes[lease.committed : lease.committed + count]
            return tuple(
                SlotRef(first + i, node.key, node.host_offset, node.size)
                for i, node in enumerate(nodes)
            )

    def fill(self, lease_id: int, payloads: Sequence[bytes | bytearray | memoryview]) -> int:
        """Write ``payloads`` into the next reserved blocks of a write lease and commit
        them: the inline twin of "write the arena slots, then commit" for clients that
        cannot map the arena. Returns how many became ready."""
        slots = self.claimed_slots(lease_id, len(payloads)) if payloads else ()
        views = [memoryview(p).cast("B") for p in payloads]
        for i, (view, slot) in enumerate(zip(views, slots, strict=True)):
            if view.nbytes != slot.size:
                raise InvalidArgument(
                    f"payload {i} is {view.nbytes} bytes; the lease's blocks are {slot.size}"
                )
        # the pending blocks stay pinned by the lease while their bytes are copied
        array = self._parts.arena.array()
        for slot, view in zip(slots, views, strict=True):
            array[slot.offset : slot.offset + slot.size] = np.frombuffer(view, dtype=np.uint8)
        return self.commit(lease_id, len(views))

    def abandon(self, lease_id: int) -> int:
        with self._parts.lock:
            self._parts.expire()
            lease = self._parts.leases.get(lease_id, write=True)
            dropped = len(lease.nodes) - lease.committed
            self._parts.end_lease(lease, "abandoned")
            return dropped

    def delete(self, ns_id: str, keys: Sequence[BlockKey], start: int = 0) -> int:
        """Drop block ``start`` of the chain and its descendants (busy ones stay); the
        number dropped. Returns once their deletions from disk are committed."""
        entry = self._parts.namespaces.entry(ns_id)
        self._parts.namespaces.check_keys(entry, keys)
        if not 0 <= start < max(len(keys), 1):
            raise InvalidArgument(f"start={start} is outside a chain of {len(keys)} blocks")

        def drop() -> int:
            walk = self._parts.index.walk(keys)
            removed = self._parts.tiers.delete_subtree(walk[start]) if len(walk) > start else 0
            disk = self._parts.disk
            if disk is not None and disk.loading and len(keys) > len(walk):
                # blocks the index load has not reached: removed on disk, never loaded
                # (their descendants there lose their parent: the load drops them)
                removed += disk.delete_unloaded(keys[max(start, len(walk)) :])
            return removed

        return self._drop_and_commit(drop)

    def clear(self, ns_id: str | None = None) -> int:
        """Drop every block of a namespace (of all when None; busy ones stay); the number
        dropped. Returns once their deletions from disk are committed."""
        entries = [self._parts.namespaces.entry(ns_id)] if ns_id is not None else None
        digests = None if entries is None else {entry.spec.digest for entry in entries}
        disk = self._parts.disk
        loading = False

        def drop() -> int:
            nonlocal loading
            removed = 0
            for entry in entries or list(self._parts.namespaces):
                for key in list(entry.roots):
                    root = self._parts.index.get(key)
                    if root is not None:
                        removed += self._parts.tiers.delete_subtree(root)
            if entries is None and not self._parts.index.nodes:
                self._parts.tiers.feed.cleared()  # (busy blocks that stayed: not all)
            if disk is not None and disk.loading:  # the load adopts none of their records now
                loading = True
                disk.void_unloaded(digests)
            return removed

        removed = self._drop_and_commit(drop)
        if loading:  # and the records it has not reached yet go now
            unloaded = clear_unloaded(self._parts, digests)
            if unloaded:
                self._commit_deletions()
            removed += unloaded
        return removed

    def _drop_and_commit(self, drop: Callable[[], int]) -> int:
        """Run ``drop`` (it removes blocks; returns how many) under the lock, then, once
        the lock is released, wait until the disk deletions it queued are committed: a
        restart does not bring the blocks back."""
        with self._parts.lock:
            self._parts.expire()
            placed = self._parts.tiers.disk
            on_disk = placed.blocks if placed is not None else 0
            removed = drop()
            # (while the index loads, a drop may remove blocks it has not indexed yet)
            fewer = placed is not None and placed.blocks < on_disk
            on_disk_too = placed is not None and (fewer or placed.storage.loading)
        if on_disk_too:
            self._commit_deletions()
        return removed

    def _commit_deletions(self) -> None:
        """Wait (DELETE_COMMIT_TIMEOUT_S at most) until the disk deletions queued so far
        are committed."""
        assert self._parts.disk is not None
        try:
            self._parts.disk.flush(timeout=DELETE_COMMIT_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as exc:  # the blocks are gone from the index
            log.warning("disk deletions not committed yet: %s", exc)

    def set_priority(
        self,
        ns_id: str,
        keys: Sequence[BlockKey],
        priority: int,
        duration_s: float | None = None,
        start: int = 0,
    ) -> int:
        entry = self._parts.namespaces.entry(ns_id)
        self._parts.namespaces.check_keys(entry, keys)
        prio = check_priority(self._parts.config, priority)
        if duration_s is not None and not duration_s > 0:
            raise InvalidArgument(f"duration_s must be > 0 when given, got {duration_s}")
        if not 0 <= start <= len(keys):
            raise InvalidArgument(f"start={start} is outside a chain of {len(keys)} blocks")
        with self._parts.lock:
            self._parts.expire()
            until = self._parts.clock() + duration_s if duration_s else 0.0
            changed = self._parts.index.walk(keys)[start:]
            for node in changed:
                self._parts.tiers.set_priority(node, prio, until)
            return len(changed)
