"""The disk tier's read side: payload reads, records at start-up, and snapshots whose
extents another process may pread (see :class:`kvstore.disk_state.DiskSnapshot`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import lmdb
import numpy as np
import xxhash

from kvstore.disk_format import (
    EXTENT,
    EXTENT_AT,
    META,
    META_V1,
    DiskExtent,
    DiskRecord,
    committed_extent,
    unpack_record,
)
from kvstore.disk_state import (
    _OVERFLOW_HEADER,
    _P_OVERFLOW,
    _PAGE_HEADER,
    _SCAN_CHUNK,
    MAX_SNAPSHOTS,
    DiskSnapshot,
    DiskState,
    _byte_view,
    _copy,
    _Delete,
    _Touch,
    _Write,
)

log = logging.getLogger(__name__)


class DiskReads(DiskState):
    """Reads and snapshots (see the module docstring)."""

    # --- read side --------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        with self._cond:
            return bytes(key) in self._sizes

    def read(self, key: bytes, out: memoryview | None = None) -> bytes | memoryview | None:
        """The payload of ``key``, or None on a miss or a checksum failure.

        With ``out`` the bytes are copied into it and ``out[:size]`` is returned
        (``out`` must be writable, C-contiguous and large enough). Every read verifies
        the xxh3-64 checksum; a mismatch deletes the record and counts a corrupt read.
        """
        key = bytes(key)
        dst = None if out is None else _byte_view(out)
        with self._cond:
            self._check_open()
            if key not in self._sizes:  # never written, or deleted (maybe still queued)
                self._read_misses += 1
                return None
            queued = self._unflushed.get(key)
            if queued is not None:
                queued.pins += 1  # keeps the buffer out of the pool while we copy
        if queued is not None:
            try:
                size = queued.record.size
                if dst is not None:
                    self._check_out(dst, size)
                    _copy(dst[:size], queued.buf)
                    data: bytes | memoryview = dst[:size]
                else:
                    data = bytes(queued.buf)
            finally:
                with self._cond:
                    queued.pins -= 1
                    self._maybe_release(queued)
            checksum = queued.record.checksum
        else:
            try:
                found = self._read_committed(key, dst)
            except lmdb.Error:  # a damaged page: the block is lost, not the call
                self._discard_corrupt(key, None)
                return None
            if found is None:
                with self._cond:
                    self._read_misses += 1
                return None
            data, checksum = found
        if xxhash.xxh3_64_intdigest(data) != checksum:
            self._discard_corrupt(key, queued)
            return None
        with self._cond:
            self._reads += 1
            self._bytes_read += len(data)
        return data

    def _read_committed(
        self, key: bytes, dst: memoryview | None
    ) -> tuple[bytes | memoryview, int] | None:
        """Copy a committed payload out inside one read transaction (views die with it)."""
        with self._resize.reading():
            self._check_open()
            with self._env.begin(buffers=True) as txn:
                raw = txn.get(key, db=self._meta)
                if raw is None:
                    return None
                try:
                    record = unpack_record(key, raw)
                except (ValueError, struct.error):
                    record = None
                view = txn.get(key, db=self._payload)
                if record is None or view is None or len(view) != record.size:
                    data: bytes | memoryview = b""  # fails the checksum below
                    checksum = -1
                elif dst is not None:
                    self._check_out(dst, record.size)
                    self._copy_value(view, dst[: record.size])
                    data, checksum = dst[: record.size], record.checksum
                else:
                    data, checksum = bytes(view), record.checksum
        return data, checksum

    def _copy_value(self, view: memoryview, dst: memoryview) -> None:
        """Copy a value the open read transaction holds (``view``, into LMDB's map) to
        ``dst``. A value stored as an overflow run (every payload above ~2 KiB) is read
        with pread() at its file offset; the pages stay allocated while the transaction
        lives, and the page cache is the same one the map shows. Anything else is
        copied from the map. The caller verifies the checksum of what lands in ``dst``
        either way."""
        size = len(view)
        offset = self._file_offset(view)
        if offset is not None and os.preadv(self._read_fd, [dst], offset) == size:
            return
        _copy(dst, view)

    def _file_offset(self, view: memoryview) -> int | None:
        """The byte offset in ``data.mdb`` of a value the open read transaction holds
        (``view``, into LMDB's map), found from the header of its overflow run; None
        for a value that is not stored as one (small values share a page)."""
        size = len(view)
        if size <= self._psize:
            return None
        addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
        header = (ctypes.c_char * _OVERFLOW_HEADER.size).from_address(addr - _PAGE_HEADER)
        pgno, _, flags, pages = _OVERFLOW_HEADER.unpack(bytes(header))
        if not flags & _P_OVERFLOW or pages * self._psize < size + _PAGE_HEADER:
            return None
        return int(pgno * self._psize + _PAGE_HEADER)

    def extents(self, keys: Sequence[bytes]) -> tuple[DiskSnapshot, list[DiskExtent]] | None:
        """Where the committed payloads of ``keys`` lie in ``data.mdb``, for a reader in
        another process that preads them itself, and the snapshot that keeps them
        there until it is closed (see :class:`DiskSnapshot`).

        None, with nothing kept open, when any key is not readable that way: not
        written, deleted, still in the write queue (not in the file yet), not stored
        as an overflow run; or when MAX_SNAPSHOTS are open or a map resize is waiting
        (this never waits for one). The caller then reads the blocks with :meth:`read`.
        Counted as reads of the payloads' bytes.
        """
        wanted = [bytes(key) for key in keys]
        with self._cond:
            self._check_open()
            if len(self._snapshots) >= MAX_SNAPSHOTS:
                return None
            if any(key not in self._sizes or key in self._unflushed for key in wanted):
                return None
        if not self._resize.try_enter():
            return None
        txn = None
        try:
            txn = self._env.begin(buffers=True)
            try:
                found = [self._extent(txn, key) for key in wanted]
            except lmdb.Error:  # a damaged page: read() finds out which block and drops it
                return None
            if any(extent is None for extent in found):
                return None
            extents = [extent for extent in found if extent is not None]
            snapshot = DiskSnapshot(self, txn)
            with self._cond:
                self._snapshots.add(snapshot)
                self._reads += len(extents)
                self._bytes_read += sum(extent.size for extent in extents)
            txn = None  # the snapshot owns it now
            return snapshot, extents
        finally:
            if txn is not None:
                txn.abort()
                self._resize.leave()

    def _extent(self, txn: Any, key: bytes) -> DiskExtent | None:
        """From the key's meta record: meta and payload change together, so the offset
        in this snapshot's record is where this snapshot's payload lies. Records
        without one (version 1) are looked up in ``payload``."""
        raw = txn.get(key, db=self._meta)
        if raw is None or len(raw) not in (META.size, META_V1.size):
            return None
        extent = committed_extent(raw)
        if extent is not None:
            return extent
        size, checksum = EXTENT.unpack_from(raw, EXTENT_AT)
        view = txn.get(key, db=self._payload)
        if view is None or len(view) != size:
            return None
        found = self._file_offset(view)
        return None if found is None else DiskExtent(found, size, checksum)

    def _close_snapshots(self) -> int:
        """Close every open snapshot (their holders' own close() is then a no-op)."""
        with self._cond:
            open_snapshots = list(self._snapshots)
        for snapshot in open_snapshots:
            self._close_snapshot(snapshot)
        return len(open_snapshots)

    def _revoke_snapshots(self) -> None:
        """Close every open snapshot for a map resize, counted (see DiskSnapshot)."""
        revoked = self._close_snapshots()
        if revoked:
            with self._cond:
                self._revoked_snapshots += revoked
            log.info("map resize: revoked %d open disk snapshots", revoked)

    def _close_snapshot(self, snapshot: DiskSnapshot) -> None:
        with self._cond:
            if snapshot not in self._snapshots:
                return
            self._snapshots.discard(snapshot)
            txn, snapshot._txn = snapshot._txn, None
        txn.abort()
        self._resize.leave()

    @staticmethod
    def _check_out(dst: memoryview, size: int) -> None:
        if dst.readonly:
            raise ValueError("out must be writable")
        if dst.nbytes < size:
            raise ValueError(f"out has {dst.nbytes} bytes, the payload needs {size}")

    def _discard_corrupt(self, key: bytes, queued: _Write | None) -> None:
        with self._cond:
            self._corrupt_reads += 1
            # Delete the bad copy only if it is still the current version of its key:
            # a write queued since then supersedes it.
            if queued is not None:
                current = self._unflushed.get(key) is queued
            else:
                current = key not in self._unflushed
            if current:
                self._delete_locked(key)
        log.warning("disk record %s is damaged (checksum or page); dropped", key.hex())

    def records(self) -> Iterator[DiskRecord]:
        """Every live record: the committed ones (queued touches applied, queued deletes
        left out) and the queued writes. Reads LMDB in chunks, one short read
        transaction each, so nothing stays open while the caller iterates."""
        with self._cond:
            pending = dict(self._ops)
        last: bytes | None = None
        while True:
            chunk: list[tuple[bytes, bytes]] = []
            with self._resize.reading():
                self._check_open()
                with self._env.begin() as txn:
                    cursor = txn.cursor(db=self._meta)
                    ok = cursor.first() if last is None else cursor.set_range(last)
                    if ok and last is not None and cursor.key() == last:
                        ok = cursor.next()
                    while ok and len(chunk) < _SCAN_CHUNK:
                        chunk.append((cursor.key(), cursor.value()))
                        ok = cursor.next()
            for key, raw in chunk:
                op = pending.get(key)
                if isinstance(op, _Write | _Delete):
                    continue  # deleted, or yielded below in its queued version
                try:
                    record = unpack_record(key, raw)
                except (ValueError, struct.error):
                    log.warning("skipping malformed disk metadata for %s", key.hex())
                    continue
                if isinstance(op, _Touch):
                    record = replace(record, priority=op.priority, last_access=op.last_access)
                yield record
            if len(chunk) < _SCAN_CHUNK:
                break
            last = chunk[-1][0]
        for op in pending.values():
            if isinstance(op, _Write):
                if op.touched is not None:
                    priority, last_access = op.touched
                    yield replace(op.record, priority=priority, last_access=last_access)
                else:
                    yield op.record

    def namespaces(self) -> dict[bytes, dict[str, Any]]:
        """Every saved namespace: digest -> the dict given to save_namespace."""
        with self._resize.reading():
            self._check_open()
            with self._env.begin() as txn:
                return {bytes(digest): json.loads(blob) for digest, blob in txn.cursor(db=self._ns)}
