"""The disk tier's writer: the one thread that commits the queue of writes, deletes and
touches to LMDB in batches (faults, map-full handling, early writeback). The queue is
filled by :class:`kvstore.disk.DiskTier`'s write calls; both hold one
:class:`kvstore.disk.state.DiskState`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import lmdb
import xxhash

from kvstore import codecs
from kvstore.disk.files import (
    drop_reserve,
    free_bytes,
    has_reserve,
    make_reserve,
)
from kvstore.disk.format import (
    FORMAT,
    FORMAT_KEY,
    DiskRecord,
    pack_record,
    unpack_record,
)
from kvstore.disk.state import (
    _CAPACITY_CUT,
    _CLOSE_RETRIES,
    _DROP_AFTER,
    _FAULT_RETRY_S,
    _LIBC,
    _MAP_FACTOR,
    _READER_CHECK_S,
    _ROOM_SLACK,
    _ROOM_SLACK_MAX,
    DiskState,
    _Delete,
    _EarlyWriteback,
    _Op,
    _round_up,
    _Touch,
    _Write,
)

log = logging.getLogger(__name__)


class DiskWriter:
    """The writer thread (see the module docstring); :meth:`start` it once the
    environment is open, :meth:`join` it after setting ``stopping``."""

    def __init__(self, state: DiskState) -> None:
        self._s = state
        self._writeback: _EarlyWriteback | None = None  # opened with the environment
        self._scratch = bytearray()  # encoded payloads (kvstore.codecs), reused
        self._thread = threading.Thread(
            target=self._run_writer, name="kvstore-disk-writer", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> None:
        """Wait for the thread to drain the queue and end (``stopping`` is set)."""
        self._thread.join()
        if self._writeback is not None:
            self._writeback.close()

    # --- internals: the writer thread -------------------------------------------
    def _run_writer(self) -> None:
        with self._s.cond:  # a lazy open: nothing is committed before the deep check
            while not self._s.checked and not self._s.stopping:
                self._s.cond.wait()
            if not self._s.checked:  # it never opened (DiskTier.give_up_open)
                self._abandon_locked()
                return
        if _LIBC is not None:
            try:
                self._writeback = _EarlyWriteback(self._s.data_path)
            except OSError:
                log.warning("early writeback off: cannot open data.mdb", exc_info=True)
        failures = 0
        checked_readers = time.monotonic()
        while True:
            batch: list[_Op] = []
            try:
                if time.monotonic() - checked_readers > _READER_CHECK_S:
                    checked_readers = time.monotonic()
                    self._s.clear_stale_readers()
                    if not self._s.fault:
                        self._regain_capacity()
                with self._s.cond:
                    while not self._s.ops and not self._s.stopping:
                        self._s.cond.wait()
                    if not self._s.ops:
                        return  # stopping and drained
                    if self._s.stopping and failures >= _CLOSE_RETRIES:
                        self._abandon_locked()
                        return
                    batch = self._take_batch_locked()
                if failures:  # retrying after a fault: what frees space goes first
                    # (never while closing: what close cannot write is counted lost)
                    drop = failures >= _DROP_AFTER and not self._s.stopping
                    self._commit_piecewise(batch, raise_full=True, drop_failing=drop)
                    self._end_fault()
                    failures = 0
                    continue
                try:
                    self._commit_early(batch)
                except lmdb.MapFullError:
                    self._on_map_full(batch)
                    continue
                self._retire(batch)
            except Exception as exc:
                failures += 1
                self._untake(batch)
                self._on_fault(exc, failures)
                with self._s.cond:  # woken early by close()
                    if not self._s.stopping:
                        self._s.cond.wait(min(0.05 * 2 ** (failures - 1), _FAULT_RETRY_S))

    def _on_fault(self, exc: Exception, failures: int) -> None:
        """A commit failed for a reason other than map space: stop taking writes and
        lower the effective capacity to what is committed (see :attr:`fault`)."""
        reason = f"{type(exc).__name__}: {exc}"
        freed = 0
        with self._s.cond:
            first = not self._s.fault
            self._s.fault = reason
            if first:
                freed = drop_reserve(self._s.directory)  # so that the evictions can commit
                # each fault keeps 10% more of the file free (up to half): the slack
                # before it did not hold the copy-on-write pages of the writes
                share = max(1.0 - _ROOM_SLACK_MAX, self._s.room_share - _ROOM_SLACK)
                self._s.room_share = share
                try:  # the baseline _regain_capacity counts gains from
                    self._s.fs_free_at_fault = free_bytes(self._s.directory)
                    room = int(os.path.getsize(self._s.data_path) * share)
                except OSError:
                    self._s.fs_free_at_fault, room = 0, 0
                queued = sum(self._s.footprint(w.record.size) for w in self._s.unflushed.values())
                committed = self._s.used - queued
                self._s.capacity = max(0, min(self._s.capacity, committed, room))
                self._s.shrunk_pending = True
                self._s.cond.notify_all()  # wake wait_committed: a fault ends the wait
            held = len(self._s.ops)
        if first:
            log.error(
                "disk tier stopped taking writes: a commit failed (%s); %d operations stay "
                "queued and are retried every %.0f s (deletes first, with the %.0f MiB "
                "reserve given back); effective disk capacity is now %.1f MiB",
                reason,
                held,
                _FAULT_RETRY_S,
                freed / 2**20,
                self._s.capacity / 2**20,
                extra={"event": "disk_fault"},
            )
        else:
            log.debug("disk commit failed again (attempt %d): %s", failures, reason)

    def _end_fault(self) -> None:
        with self._s.cond:
            if not self._s.fault:
                return
            self._s.fault = ""
            self._s.cond.notify_all()
        self._regain_capacity()
        log.warning(
            "disk tier takes writes again (a commit succeeded); effective disk capacity "
            "is %.1f MiB",
            self._s.capacity / 2**20,
            extra={"event": "disk_recovered"},
        )

    def _regain_capacity(self) -> None:
        """After a fault lowered the capacity: raise it to ``room_share`` (90% after one
        fault, 10% less after each next one, down to half) of the room the tier has
        proven, up to where it was. That room is ``data.mdb`` itself (it never shrinks,
        and LMDB reuses the pages that evictions free in it) plus what the file system
        gained since the fault began, less the reserve, taken back once the gain holds
        it twice over. Not the file system's free space itself: a limit statvfs does not
        show (a quota, a file size limit, a failing device) would let the capacity
        straight back to the fault, and the tier would go off and on with every batch.
        Run when a fault ends and every _READER_CHECK_S after, so space an operator
        frees is used again."""
        if self._s.capacity >= self._s.ceiling:
            self._s.room_share = 1.0  # all of it is back: the next fault starts afresh
            return
        try:
            gained = max(0, free_bytes(self._s.directory) - self._s.fs_free_at_fault)
            reserve = self._s.reserve_bytes
            retake = gained > 2 * reserve and not has_reserve(self._s.directory)
            if retake and make_reserve(self._s.directory, reserve):
                gained -= reserve
            room = int((os.path.getsize(self._s.data_path) + gained) * self._s.room_share)
        except OSError:
            return
        with self._s.cond:
            self._s.capacity = max(self._s.capacity, min(self._s.ceiling, room))

    def _take_batch_locked(self) -> list[_Op]:
        batch: list[_Op] = []
        payload = 0
        for op in self._s.ops.values():
            if isinstance(op, _Write):
                if batch and payload + op.record.size > self._s.batch_bytes:
                    break
                payload += op.record.size
            op.inflight = True
            batch.append(op)
        return batch

    def _commit_early(self, ops: Sequence[_Op]) -> None:
        """``_commit`` with early writeback of the batch's pages (see _EarlyWriteback)."""
        if self._writeback is None:
            self._commit(ops)
            return
        with self._writeback.during():
            self._commit(ops)

    def _stored_form(self, op: _Write) -> tuple[bytes | bytearray | memoryview, DiskRecord]:
        """What a queued write stores: its payload and record, or, with a codec, the
        payload encoded here (the writer's thread, never a caller's) and a record that
        says so, its size and checksum the encoded bytes'."""
        if op.codec is None:
            return op.buf, op.record
        need = op.codec.encoded_bytes
        if len(self._scratch) < need:
            self._scratch = bytearray(need)
        value = op.codec.encode(op.buf, memoryview(self._scratch))
        record = replace(
            op.record, size=need, checksum=xxhash.xxh3_64_intdigest(value),
            codec=op.codec.code_id, codec_version=codecs.VERSION,
        )  # fmt: skip
        return value, record

    def _commit(self, ops: Sequence[_Op]) -> None:
        """Apply ``ops`` in one write transaction (aborted if anything raises)."""
        with self._s.env.begin(write=True, buffers=True) as txn:
            for op in ops:
                if isinstance(op, _Write):
                    value, record = self._stored_form(op)
                    txn.put(op.key, value, db=self._s.payload)
                    # the new value's overflow run has its page number already (the
                    # header of its dirty copy says it): the file offset it will have
                    stored = txn.get(op.key, db=self._s.payload)
                    offset = self._s.file_offset(stored) if stored is not None else None
                    record = replace(record, offset=offset or 0)
                    txn.put(op.key, pack_record(record), db=self._s.meta)
                elif isinstance(op, _Delete):
                    txn.delete(op.key, db=self._s.payload)
                    txn.delete(op.key, db=self._s.meta)
                elif isinstance(op, _Touch):
                    raw = txn.get(op.key, db=self._s.meta)
                    if raw is not None:
                        record = replace(
                            unpack_record(op.key, raw),
                            priority=op.priority,
                            last_access=op.last_access,
                        )
                        txn.put(op.key, pack_record(record), db=self._s.meta)
                else:
                    txn.put(op.digest, op.blob, db=self._s.ns)

    def _retire(self, ops: Sequence[_Op]) -> None:
        """After a commit: drop what is now durable from the queue and the readable map."""
        with self._s.cond:
            for op in ops:
                op.inflight = False
                if self._s.ops.get(op.key) is op:
                    if isinstance(op, _Write) and op.touched is not None:
                        # Same slot, same seq: the touch stays queued in the write's place.
                        self._s.ops[op.key] = _Touch(op.seq, op.key, *op.touched)
                    else:
                        del self._s.ops[op.key]
                if isinstance(op, _Write):
                    self._s.writes += 1
                    self._s.bytes_written += op.record.size
                    if self._s.unflushed.get(op.key) is op:
                        del self._s.unflushed[op.key]
                        op.live = False
                    self._s.maybe_release(op)
            self._s.cond.notify_all()

    def _untake(self, ops: Sequence[_Op]) -> None:
        """After a failed commit: everything stays queued (and readable) for a retry."""
        with self._s.cond:
            for op in ops:
                op.inflight = False
                if isinstance(op, _Write):
                    if op.touched is not None:
                        priority, last_access = op.touched
                        op.record = replace(op.record, priority=priority, last_access=last_access)
                        op.touched = None
                    self._s.maybe_release(op)  # frees it if it was cancelled meanwhile
            self._s.cond.notify_all()

    def _abandon_locked(self) -> None:
        lost = 0
        for op in list(self._s.ops.values()):
            if isinstance(op, _Write) and self._s.unflushed.get(op.key) is op:
                lost += 1
                del self._s.unflushed[op.key]
                size = self._s.sizes.pop(op.key, None)
                if size is not None:
                    self._s.used -= self._s.footprint(size)
                op.live = False
                self._s.maybe_release(op)
        self._s.lost_writes += lost
        log.error(
            "disk writer: gave up at close after %d failed commits: %d queued operations, "
            "%d of them block writes, were not persisted (%s)",
            _CLOSE_RETRIES,
            len(self._s.ops),
            lost,
            self._s.fault or "no fault recorded",
            extra={"event": "disk_writes_lost"},
        )
        self._s.ops.clear()
        self._s.cond.notify_all()

    # --- internals: map full -----------------------------------------------------
    def _on_map_full(self, batch: list[_Op]) -> None:
        """The batch did not fit in the map: grow it once, lower the effective capacity,
        tell the store, retry. At the growth limit, commit what fits piece by piece."""
        self._s.clear_stale_readers()  # dead readers' snapshots may be what filled it
        with self._s.cond:
            self._s.map_full_events += 1
            self._s.shrunk_pending = True
            # What this transaction tried to hold: everything committed plus the batch
            # (used_bytes minus the writes still waiting behind it).
            unflushed = self._s.unflushed.values()
            waiting = sum(self._s.footprint(w.record.size) for w in unflushed if not w.inflight)
            attempted = self._s.used - waiting
            # Never more than the map could hold with the usual headroom either.
            fits = min(int(attempted * _CAPACITY_CUT), int(self._s.map_size / _MAP_FACTOR))
            self._s.capacity = max(self._s.capacity_floor, min(self._s.capacity, fits))
            self._s.ceiling = min(self._s.ceiling, self._s.capacity)  # a fault never regains it
        old = self._s.map_size
        grown = self._grow_map()
        log.warning(
            "LMDB map full at %.1f MiB (%s); effective disk capacity is now %.1f MiB",
            old / 2**20,
            f"grown to {self._s.map_size / 2**20:.1f} MiB" if grown else "at its growth limit",
            self._s.capacity / 2**20,
        )
        if grown:
            self._untake(batch)
        else:
            self._commit_piecewise(batch)

    def _grow_map(self, *, emergency: bool = False) -> bool:
        """Grow the map by one bounded step (none open: LMDB requires no live txn)."""
        current = self._s.map_size
        if current >= self._s.max_map_size and not emergency:
            return False
        step = min(max(current // 8, 16 * self._s.psize), 4 << 30)
        new = current + step if emergency else min(current + step, self._s.max_map_size)
        new = _round_up(new, self._s.psize)
        with self._s.resize.exclusive():
            self._s.env.set_mapsize(new)
        self._s.map_size = self._s.env.info()["map_size"]
        return True

    def _commit_piecewise(
        self, batch: list[_Op], raise_full: bool = False, drop_failing: bool = False
    ) -> None:
        """Commit deletes and metadata first (they free pages), then each write alone.

        Used with the map at its limit: the first write that still does not fit is
        dropped (and its key deleted), never raised; the writes after it stay queued
        for the next round. And used to retry after a fault (``raise_full``: a map-full
        error is raised, to be handled as a fault, since which error the disk gives
        when full is the file system's choice). An error raised leaves the batch to the
        writer loop, which untakes it (what was committed stays retired). With
        ``drop_failing`` (a fault's retries failed _DROP_AFTER times) a write that still
        fails is dropped instead: its room is what the file cannot give, and without
        the drop the queue would stay stuck behind it until a new eviction came."""
        small = [op for op in batch if not isinstance(op, _Write)]
        writes = [op for op in batch if isinstance(op, _Write)]
        try:
            if small:
                self._commit(small)
                self._retire(small)
            # Pages freed by transaction N are reusable from N + 2 on (LMDB keeps the
            # previous snapshot intact), so one cheap commit makes those deletes count.
            self._bump()
        except lmdb.MapFullError:
            if raise_full:
                raise  # the writer untakes the batch
            # Not even deletes fit: grow past the limit by one small step.
            log.warning("LMDB map too full to delete; growing past the limit")
            self._grow_map(emergency=True)
            self._untake(batch)
            return
        dropped = 0
        for index, op in enumerate(writes):
            try:
                self._commit([op])
            except Exception as exc:
                if drop_failing:
                    self._drop_write(op)
                    dropped += 1
                    continue
                if raise_full or not isinstance(exc, lmdb.MapFullError):
                    self._untake(writes[index:])
                    raise
                # It does not fit next to what is committed: drop it, and give the store
                # a chance (drain_shrunk) to evict before the rest is tried again.
                self._drop_write(op)
                log.warning(
                    "disk write of %s (%d bytes) does not fit in the LMDB map; dropped",
                    op.key.hex(),
                    op.record.size,
                )
                self._untake(writes[index + 1 :])
                return
            else:
                self._retire([op])
        if dropped:
            log.warning(
                "dropped %d queued disk writes whose commits kept failing (%s)",
                dropped,
                self._s.fault,
            )

    def _bump(self) -> None:
        """Commit a one-record transaction (rewrites the format marker)."""
        with self._s.env.begin(write=True) as txn:
            txn.put(FORMAT_KEY, FORMAT, db=self._s.info)

    def _drop_write(self, op: _Write) -> None:
        with self._s.cond:
            op.inflight = False
            op.touched = None
            self._s.dropped_writes += 1
            if self._s.unflushed.get(op.key) is op:  # still the current version of its key
                self._s.delete_locked(op.key)  # also drops an older committed version
            self._s.maybe_release(op)
