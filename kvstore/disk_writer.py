"""The disk tier's writer: the queue of writes, deletes and touches, and the thread
that commits them to LMDB in batches (faults, map-full handling, early writeback).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import replace

import lmdb

from kvstore.disk_files import (
    drop_reserve,
    make_reserve,
)
from kvstore.disk_format import (
    FORMAT,
    FORMAT_KEY,
    pack_record,
    unpack_record,
)
from kvstore.disk_snapshots import DiskReads
from kvstore.disk_state import (
    _CAPACITY_CUT,
    _CLOSE_RETRIES,
    _FAULT_RETRY_S,
    _MAP_FACTOR,
    _READER_CHECK_S,
    _Delete,
    _Op,
    _round_up,
    _Touch,
    _Write,
)

log = logging.getLogger(__name__)


class DiskWriter(DiskReads):
    """The writer thread (see the module docstring)."""

    # --- internals: the writer thread -------------------------------------------
    def _run_writer(self) -> None:
        failures = 0
        checked_readers = time.monotonic()
        while True:
            batch: list[_Op] = []
            try:
                if time.monotonic() - checked_readers > _READER_CHECK_S:
                    checked_readers = time.monotonic()
                    self._clear_stale_readers()
                    if not self._fault:
                        self._regain_capacity()
                with self._cond:
                    while not self._ops and not self._stopping:
                        self._cond.wait()
                    if not self._ops:
                        return  # stopping and drained
                    if self._stopping and failures >= _CLOSE_RETRIES:
                        self._abandon_locked()
                        return
                    batch = self._take_batch_locked()
                if failures:  # retrying after a fault: what frees space goes first
                    self._commit_piecewise(batch, raise_full=True)
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
                with self._cond:  # woken early by close()
                    if not self._stopping:
                        self._cond.wait(min(0.05 * 2 ** (failures - 1), _FAULT_RETRY_S))

    def _on_fault(self, exc: Exception, failures: int) -> None:
        """A commit failed for a reason other than map space: stop taking writes and
        lower the effective capacity to what is committed (see :attr:`fault`)."""
        reason = f"{type(exc).__name__}: {exc}"
        freed = 0
        with self._cond:
            first = not self._fault
            self._fault = reason
            if first:
                freed = drop_reserve(self.directory)  # so that the evictions can commit
                queued = sum(self.footprint(w.record.size) for w in self._unflushed.values())
                self._capacity = max(0, min(self._capacity, self._used - queued))
                self._shrunk_pending = True
                self._cond.notify_all()  # wake wait_committed: a fault ends the wait
            held = len(self._ops)
        if first:
            log.error(
                "disk tier stopped taking writes: a commit failed (%s); %d operations stay "
                "queued and are retried every %.0f s (deletes first, with the %.0f MiB "
                "reserve given back); effective disk capacity is now %.1f MiB",
                reason,
                held,
                _FAULT_RETRY_S,
                freed / 2**20,
                self._capacity / 2**20,
                extra={"event": "disk_fault"},
            )
        else:
            log.debug("disk commit failed again (attempt %d): %s", failures, reason)

    def _end_fault(self) -> None:
        with self._cond:
            if not self._fault:
                return
            self._fault = ""
            self._cond.notify_all()
        self._regain_capacity()
        log.warning(
            "disk tier takes writes again (a commit succeeded); effective disk capacity "
            "is %.1f MiB",
            self._capacity / 2**20,
            extra={"event": "disk_recovered"},
        )

    def _regain_capacity(self) -> None:
        """After a fault lowered the capacity: take the reserve back when the file
        system has room for it twice over, and raise the capacity by 90% of what is
        free then, up to where it was. Run when a fault ends and every _READER_CHECK_S
        after, so space an operator frees is used again."""
        if self._capacity >= self._ceiling:
            return
        try:
            vfs = os.statvfs(self.directory)
            free = vfs.f_bavail * vfs.f_frsize
            if free > 2 * self._reserve_bytes and make_reserve(self.directory, self._reserve_bytes):
                free -= self._reserve_bytes
        except OSError:
            return
        with self._cond:
            self._capacity = min(self._ceiling, self._used + int(free * 0.9))

    def _take_batch_locked(self) -> list[_Op]:
        batch: list[_Op] = []
        payload = 0
        for op in self._ops.values():
            if isinstance(op, _Write):
                if batch and payload + op.record.size > self._batch_bytes:
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

    def _commit(self, ops: Sequence[_Op]) -> None:
        """Apply ``ops`` in one write transaction (aborted if anything raises)."""
        with self._env.begin(write=True, buffers=True) as txn:
            for op in ops:
                if isinstance(op, _Write):
                    txn.put(op.key, op.buf, db=self._payload)
                    # the new value's overflow run has its page number already (the
                    # header of its dirty copy says it): the file offset it will have
                    stored = txn.get(op.key, db=self._payload)
                    offset = self._file_offset(stored) if stored is not None else None
                    record = replace(op.record, offset=offset or 0)
                    txn.put(op.key, pack_record(record), db=self._meta)
                elif isinstance(op, _Delete):
                    txn.delete(op.key, db=self._payload)
                    txn.delete(op.key, db=self._meta)
                elif isinstance(op, _Touch):
                    raw = txn.get(op.key, db=self._meta)
                    if raw is not None:
                        record = replace(
                            unpack_record(op.key, raw),
                            priority=op.priority,
                            last_access=op.last_access,
                        )
                        txn.put(op.key, pack_record(record), db=self._meta)
                else:
                    txn.put(op.digest, op.blob, db=self._ns)

    def _retire(self, ops: Sequence[_Op]) -> None:
        """After a commit: drop what is now durable from the queue and the readable map."""
        with self._cond:
            for op in ops:
                op.inflight = False
                if self._ops.get(op.key) is op:
                    if isinstance(op, _Write) and op.touched is not None:
                        # Same slot, same seq: the touch stays queued in the write's place.
                        self._ops[op.key] = _Touch(op.seq, op.key, *op.touched)
                    else:
                        del self._ops[op.key]
                if isinstance(op, _Write):
                    self._writes += 1
                    self._bytes_written += op.record.size
                    if self._unflushed.get(op.key) is op:
                        del self._unflushed[op.key]
                        op.live = False
                    self._maybe_release(op)
            self._cond.notify_all()

    def _untake(self, ops: Sequence[_Op]) -> None:
        """After a failed commit: everything stays queued (and readable) for a retry."""
        with self._cond:
            for op in ops:
                op.inflight = False
                if isinstance(op, _Write):
                    if op.touched is not None:
                        priority, last_access = op.touched
                        op.record = replace(op.record, priority=priority, last_access=last_access)
                        op.touched = None
                    self._maybe_release(op)  # frees it if it was cancelled meanwhile
            self._cond.notify_all()

    def _abandon_locked(self) -> None:
        lost = 0
        for op in list(self._ops.values()):
            if isinstance(op, _Write) and self._unflushed.get(op.key) is op:
                lost += 1
                del self._unflushed[op.key]
                size = self._sizes.pop(op.key, None)
                if size is not None:
                    self._used -= self.footprint(size)
                op.live = False
                self._maybe_release(op)
        self._lost_writes += lost
        log.error(
            "disk writer: gave up at close after %d failed commits: %d queued operations, "
            "%d of them block writes, were not persisted (%s)",
            _CLOSE_RETRIES,
            len(self._ops),
            lost,
            self._fault or "no fault recorded",
            extra={"event": "disk_writes_lost"},
        )
        self._ops.clear()
        self._cond.notify_all()

    # --- internals: map full -----------------------------------------------------
    def _clear_stale_readers(self) -> int:
        """Free the reader slots of processes that died inside a read transaction.

        A process killed inside a read transaction (a tool that opened the environment
        read-only, e.g. ``kvctl`` on a stopped daemon's files) leaves its slot, and LMDB
        keeps every page that slot's snapshot can see from being reused, so the file
        would only grow. The writer clears them every _READER_CHECK_S and on a full map."""
        stale: int = self._env.reader_check()
        if stale:
            log.warning("cleared %d stale LMDB reader slots in %s", stale, self.directory)
        return stale

    def _on_map_full(self, batch: list[_Op]) -> None:
        """The batch did not fit in the map: grow it once, lower the effective capacity,
        tell the store, retry. At the growth limit, commit what fits piece by piece."""
        self._clear_stale_readers()  # dead readers' snapshots may be what filled it
        with self._cond:
            self._map_full_events += 1
            self._shrunk_pending = True
            # What this transaction tried to hold: everything committed plus the batch
            # (used_bytes minus the writes still waiting behind it).
            waiting = sum(
                self.footprint(w.record.size) for w in self._unflushed.values() if not w.inflight
            )
            attempted = self._used - waiting
            # Never more than the map could hold with the usual headroom either.
            fits = min(int(attempted * _CAPACITY_CUT), int(self._map_size / _MAP_FACTOR))
            self._capacity = max(self._capacity_floor, min(self._capacity, fits))
            self._ceiling = min(self._ceiling, self._capacity)  # a fault never regains it
        old = self._map_size
        grown = self._grow_map()
        log.warning(
            "LMDB map full at %.1f MiB (%s); effective disk capacity is now %.1f MiB",
            old / 2**20,
            f"grown to {self._map_size / 2**20:.1f} MiB" if grown else "at its growth limit",
            self._capacity / 2**20,
        )
        if grown:
            self._untake(batch)
        else:
            self._commit_piecewise(batch)

    def _grow_map(self, *, emergency: bool = False) -> bool:
        """Grow the map by one bounded step (none open: LMDB requires no live txn)."""
        current = self._map_size
        if current >= self._max_map_size and not emergency:
            return False
        step = min(max(current // 8, 16 * self._psize), 4 << 30)
        new = current + step if emergency else min(current + step, self._max_map_size)
        new = _round_up(new, self._psize)
        with self._resize.exclusive():
            self._env.set_mapsize(new)
        self._map_size = self._env.info()["map_size"]
        return True

    def _commit_piecewise(self, batch: list[_Op], raise_full: bool = False) -> None:
        """Commit deletes and metadata first (they free pages), then each write alone.

        Used with the map at its limit: the first write that still does not fit is
        dropped (and its key deleted), never raised; the writes after it stay queued
        for the next round. And used to retry after a fault (``raise_full``: a map-full
        error is raised, to be handled as a fault, since which error the disk gives
        when full is the file system's choice). An error raised leaves the batch to the
        writer loop, which untakes it (what was committed stays retired)."""
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
        for index, op in enumerate(writes):
            try:
                self._commit([op])
            except lmdb.MapFullError:
                if raise_full:
                    raise  # the writer untakes the batch
                # It does not fit next to what is committed: drop it, and give the store
                # a chance (drain_shrunk) to evict before the rest is tried again.
                self._drop_write(op)
                self._untake(writes[index + 1 :])
                return
            except Exception:
                self._untake(writes[index:])
                raise
            else:
                self._retire([op])

    def _bump(self) -> None:
        """Commit a one-record transaction (rewrites the format marker)."""
        with self._env.begin(write=True) as txn:
            txn.put(FORMAT_KEY, FORMAT, db=self._info)

    def _drop_write(self, op: _Write) -> None:
        with self._cond:
            op.inflight = False
            op.touched = None
            self._dropped_writes += 1
            if self._unflushed.get(op.key) is op:  # still the current version of its key
                self._delete_locked(op.key)  # also drops an older committed version
            self._maybe_release(op)
        log.warning(
            "disk write of %s (%d bytes) does not fit in the LMDB map; dropped",
            op.key.hex(),
            op.record.size,
        )
