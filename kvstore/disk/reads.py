"""The disk tier's read side: payload reads (one, or a batch in one read transaction),
and the records and namespaces the store rebuilds its index from at start-up.

Reads run their own LMDB read transactions concurrently with the writer (MVCC); a block
still in the write queue is copied from its queued buffer (pinned while copied). Every
read verifies the block's xxh3-64; a mismatch or a damaged page drops the record and
is a miss, never bytes.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import lmdb
import xxhash

from kvstore import codecs
from kvstore.codecs import Codec, DamagedBlock
from kvstore.disk.format import DiskRecord, unpack_record
from kvstore.disk.state import (
    _SCAN_CHUNK,
    DiskState,
    _byte_view,
    _copy,
    _Delete,
    _Touch,
    _Write,
)

log = logging.getLogger(__name__)

# preadv2 flag: fail with EAGAIN instead of waiting for the device (Linux >= 4.14)
NOWAIT_FLAG: int | None = getattr(os, "RWF_NOWAIT", None)


class DiskReads:
    """Reads (see the module docstring)."""

    def __init__(self, state: DiskState) -> None:
        self._s = state
        self._scratch = threading.local()  # each reading thread's encoded payload
        self._foreign_codecs: set[tuple[int, int]] = set()  # logged already
        # cleared when the file system refuses RWF_NOWAIT (tmpfs, some network ones):
        # reads that must not wait then read plainly (see _copy_value)
        self._nowait_works = True

    # --- read side --------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        with self._s.cond:
            return bytes(key) in self._s.sizes

    def contains_all(self, keys: Sequence[bytes]) -> list[bool]:
        """:meth:`contains` of each of ``keys``, under one hold of the lock."""
        with self._s.cond:
            return [bytes(key) in self._s.sizes for key in keys]

    def read(
        self, key: bytes, out: memoryview | None = None, codec: Codec | None = None
    ) -> bytes | memoryview | None:
        """The payload of ``key``, or None on a miss or a checksum failure.

        With ``out`` the bytes are copied into it and ``out[:size]`` is returned
        (``out`` must be writable, C-contiguous and large enough). Every read verifies
        the xxh3-64 checksum; a mismatch deletes the record and counts a corrupt read.
        ``codec`` is the one the block's namespace keeps its disk blocks with (None:
        as they are). A payload stored encoded is checked, then decoded with it; a
        record of another codec or version, or raw where ``codec`` is given, is a miss
        (counted, logged once per kind): its bytes are not the namespace's block.
        """
        key = bytes(key)
        dst = None if out is None else _byte_view(out)
        with self._s.cond:
            self._s.check_open()
            if key not in self._s.sizes:  # never written, or deleted (maybe still queued)
                self._s.read_misses += 1
                return None
            queued = self._s.unflushed.get(key)
            if queued is not None:
                queued.pins += 1  # keeps the buffer out of the pool while we copy
        if queued is not None:
            return self._read_queued(key, queued, dst, codec)
        try:
            with self._s.resize.reading():
                self._s.check_open()
                with self._s.env.begin(buffers=True) as txn:
                    found = self._read_in(txn, key, dst, codec=codec)
        except lmdb.Error:  # a damaged page: the block is lost, not the call
            self._discard_corrupt(key, None)
            return None
        return self._verified(key, found, None)

    def read_all(
        self,
        keys: Sequence[bytes],
        outs: Sequence[memoryview],
        nowait: bool = False,
        codec: Codec | None = None,
    ) -> int:
        """Copy the payloads of ``keys`` into ``outs`` (as :meth:`read` with ``out``),
        the committed ones in one read transaction (one record lookup after another,
        no transaction each); the number of leading keys read and verified.

        ``nowait`` (a caller that must not wait on the device): BlockingIOError, with
        nothing kept, when a payload is not all in the page cache."""
        wanted = [bytes(key) for key in keys]
        dsts = [_byte_view(out) for out in outs]
        queued: dict[int, _Write] = {}
        with self._s.cond:
            self._s.check_open()
            for i, key in enumerate(wanted):
                if key not in self._s.sizes:
                    self._s.read_misses += 1
                    wanted = wanted[:i]
                    break
                write = self._s.unflushed.get(key)
                if write is not None:
                    write.pins += 1
                    queued[i] = write
        found: list[tuple[bytes | memoryview, int | None] | None] = [None] * len(wanted)
        damaged = False
        try:
            with self._s.resize.reading():
                self._s.check_open()
                with self._s.env.begin(buffers=True) as txn:
                    for i, key in enumerate(wanted):
                        if i not in queued:
                            found[i] = self._read_in(txn, key, dsts[i], nowait, codec)
        except lmdb.Error:
            damaged = True  # read() below finds out which block, and drops it
        except BaseException:  # BlockingIOError (nowait), or anything unexpected
            for write in queued.values():
                self._unpin(write)
            raise
        for i, key in enumerate(wanted):
            write = queued.pop(i, None)
            if write is not None:
                data = self._read_queued(key, write, dsts[i], codec)
            elif damaged:
                data = self.read(key, dsts[i], codec)
            else:
                data = self._verified(key, found[i], None)
            if data is None:
                for late in queued.values():
                    self._unpin(late)
                return i
        return len(wanted)

    def _read_queued(
        self, key: bytes, queued: _Write, dst: memoryview | None, codec: Codec | None
    ) -> bytes | memoryview | None:
        """Copy a payload still in the write queue (pinned by the caller, unpinned here).
        One queued encoded already (a block kept encoded in host: its record says so)
        is checked, then decoded with ``codec``."""
        try:
            size = queued.record.size
            if queued.record.codec:
                if not self._decodes(key, queued.record, codec):
                    return None
                assert codec is not None
                encoded = memoryview(queued.buf)[:size]
                found = self._checked_decode(encoded, queued.record, dst, codec)
                return self._verified(key, found, queued)
            if dst is not None:
                self._check_out(dst, size)
                _copy(dst[:size], queued.buf)
                data: bytes | memoryview = dst[:size]
            else:
                data = bytes(queued.buf)
        finally:
            self._unpin(queued)
        return self._verified(key, (data, queued.record.checksum), queued)

    def _unpin(self, queued: _Write) -> None:
        with self._s.cond:
            queued.pins -= 1
            self._s.maybe_release(queued)

    def _verified(
        self, key: bytes, found: tuple[bytes | memoryview, int | None] | None, queued: _Write | None
    ) -> bytes | memoryview | None:
        """A payload read, if its checksum holds (counted); None for a miss, and for
        damage (the record is dropped)."""
        if found is None:
            with self._s.cond:
                self._s.read_misses += 1
            return None
        data, checksum = found
        if checksum is not None and xxhash.xxh3_64_intdigest(data) != checksum:
            self._discard_corrupt(key, queued)
            return None
        with self._s.cond:
            self._s.reads += 1
            self._s.bytes_read += len(data)
        return data

    def _read_in(
        self,
        txn: Any,
        key: bytes,
        dst: memoryview | None,
        nowait: bool = False,
        codec: Codec | None = None,
    ) -> tuple[bytes | memoryview, int | None] | None:
        """Copy a committed payload out inside the read transaction ``txn`` (views die
        with it): (its bytes, the checksum they must have, None when checked here);
        None when not there."""
        raw = txn.get(key, db=self._s.meta)
        if raw is None:
            return None
        try:
            record = unpack_record(key, raw)
        except (ValueError, struct.error):
            record = None
        view = txn.get(key, db=self._s.payload)
        if record is None or view is None or len(view) != record.size:
            return b"", -1  # fails the checksum check
        if record.codec:
            return self._decoded(key, record, view, dst, nowait, codec)
        if codec is not None:  # raw, where the namespace keeps its blocks encoded
            self._note_foreign_codec(key, record)
            return None
        if dst is not None:
            self._check_out(dst, record.size)
            self._copy_value(view, dst[: record.size], nowait)
            return dst[: record.size], record.checksum
        return bytes(view), record.checksum

    def _decoded(
        self,
        key: bytes,
        record: DiskRecord,
        view: memoryview,
        dst: memoryview | None,
        nowait: bool,
        codec: Codec | None,
    ) -> tuple[bytes | memoryview, int | None] | None:
        """An encoded payload, copied out into this thread's scratch, checked against
        its record's checksum, then decoded into ``dst`` (see :meth:`read`)."""
        if not self._decodes(key, record, codec):
            return None
        assert codec is not None
        scratch = getattr(self._scratch, "buf", None)
        if scratch is None or len(scratch) < record.size:
            scratch = self._scratch.buf = bytearray(record.size)
        encoded = memoryview(scratch)[: record.size]
        self._copy_value(view, encoded, nowait)
        return self._checked_decode(encoded, record, dst, codec)

    def _checked_decode(
        self, encoded: memoryview, record: DiskRecord, dst: memoryview | None, codec: Codec
    ) -> tuple[bytes | memoryview, int | None]:
        """``encoded`` (a copy the caller holds) checked against its record's checksum,
        then decoded into ``dst`` (or a buffer of its own): the found tuple
        :meth:`_verified` takes, one that fails its check when the checksum does not hold."""
        if xxhash.xxh3_64_intdigest(encoded) != record.checksum:
            return b"", -1  # fails the checksum check
        out = memoryview(bytearray(codec.block_bytes)) if dst is None else dst
        self._check_out(out, codec.block_bytes)
        try:
            codec.decode(encoded, out)
        except DamagedBlock:  # checksummed, yet no encoder made it: a crafted record
            return b"", -1  # fails the checksum check: dropped, counted as damage
        return out[: codec.block_bytes], None

    def _decodes(self, key: bytes, record: DiskRecord, codec: Codec | None) -> bool:
        """Whether ``codec`` (the namespace's) decodes an encoded ``record``; a record of
        another codec or version is a miss, logged once per kind."""
        if (
            codec is not None
            and record.codec == codec.code_id
            and record.codec_version == codecs.VERSION
            and record.size == codec.encoded_bytes
        ):
            return True
        self._note_foreign_codec(key, record)
        return False

    def _note_foreign_codec(self, key: bytes, record: DiskRecord) -> None:
        """A payload not of the codec its namespace keeps on disk (encoded by another
        codec or version, or raw): a miss, counted, logged once per kind."""
        kind = (record.codec, record.codec_version)
        with self._s.cond:
            self._s.codec_mismatches += 1
            if kind in self._foreign_codecs:
                return
            self._foreign_codecs.add(kind)
        log.warning(
            "disk record %s is of codec %d version %d (0: raw), which is not how its "
            "namespace keeps its disk blocks (this daemon decodes version %d): served "
            "as a miss", key.hex(), record.codec, record.codec_version, codecs.VERSION,
        )  # fmt: skip

    def _copy_value(self, view: memoryview, dst: memoryview, nowait: bool = False) -> None:
        """Copy a value the open read transaction holds (``view``, into LMDB's map) to
        ``dst``. A value stored as an overflow run (every payload above ~2 KiB) is read
        with pread() at its file offset; the pages stay allocated while the transaction
        lives, and the page cache is the same one the map shows. Anything else is
        copied from the map (its page is the one the lookup just read). The caller
        verifies the checksum of what lands in ``dst`` either way. ``nowait``:
        BlockingIOError when the run is not all in the page cache (``RWF_NOWAIT``)."""
        size = len(view)
        offset = self._s.file_offset(view)
        if offset is not None:
            if nowait and NOWAIT_FLAG is None:
                raise BlockingIOError("reads that never wait need preadv2 RWF_NOWAIT")
            nowait = nowait and self._nowait_works
            if nowait:
                assert NOWAIT_FLAG is not None
                try:
                    got = os.preadv(self._s.read_fd, [dst], offset, NOWAIT_FLAG)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
                    self._nowait_unsupported(e)
                    got = os.preadv(self._s.read_fd, [dst], offset)
            else:
                got = os.preadv(self._s.read_fd, [dst], offset)
            if got == size:
                return
            if nowait:  # part of it is not cached: the map would fault it in
                raise BlockingIOError("a payload is not all in the page cache")
        _copy(dst, view)

    def _nowait_unsupported(self, error: OSError) -> None:
        """The disk tier's file system refuses ``RWF_NOWAIT`` (tmpfs, a memory-backed
        volume, some network file systems): from now on a read that must not wait reads
        plainly, which on a memory-backed file system never waits on a device anyway.
        Logged once."""
        if not self._nowait_works:
            return
        self._nowait_works = False
        log.info(
            "the disk tier's file system does not support RWF_NOWAIT reads (%s): "
            "quick reads read plainly",
            error.strerror,
        )

    @staticmethod
    def _check_out(dst: memoryview, size: int) -> None:
        if dst.readonly:
            raise ValueError("out must be writable")
        if dst.nbytes < size:
            raise ValueError(f"out has {dst.nbytes} bytes, the payload needs {size}")

    def _discard_corrupt(self, key: bytes, queued: _Write | None) -> None:
        with self._s.cond:
            self._s.corrupt_reads += 1
            # Delete the bad copy only if it is still the current version of its key:
            # a write queued since then supersedes it.
            if queued is not None:
                current = self._s.unflushed.get(key) is queued
            else:
                current = key not in self._s.unflushed
            if current:
                self._s.delete_locked(key)
        log.warning("disk record %s is damaged (checksum or page); dropped", key.hex())

    def scan_chunks(self, chunk: int) -> Iterator[list[tuple[bytes, bytes]]]:
        """The committed records as (key, raw meta value), in key order, ``chunk`` at a
        time, each chunk read in one short read transaction (nothing stays open while
        the caller works)."""
        last: bytes | None = None
        while True:
            found: list[tuple[bytes, bytes]] = []
            with self._s.resize.reading():
                self._s.check_open()
                with self._s.env.begin() as txn:
                    cursor = txn.cursor(db=self._s.meta)
                    ok = cursor.first() if last is None else cursor.set_range(last)
                    if ok and last is not None and cursor.key() == last:
                        ok = cursor.next()
                    while ok and len(found) < chunk:
                        found.append((cursor.key(), cursor.value()))
                        ok = cursor.next()
            if not found:
                return
            last = found[-1][0]
            yield found

    def records(self) -> Iterator[DiskRecord]:
        """Every live record: the committed ones (queued touches applied, queued deletes
        left out) and the queued writes. Reads LMDB in chunks (:meth:`scan_chunks`)."""
        with self._s.cond:
            pending = dict(self._s.ops)
        for chunk in self.scan_chunks(_SCAN_CHUNK):
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
        for op in pending.values():
            if isinstance(op, _Write):
                if op.touched is not None:
                    priority, last_access = op.touched
                    yield replace(op.record, priority=priority, last_access=last_access)
                else:
                    yield op.record

    def namespaces(self) -> dict[bytes, dict[str, Any]]:
        """Every saved namespace: digest -> the dict given to save_namespace."""
        with self._s.resize.reading():
            self._s.check_open()
            with self._s.env.begin() as txn:
                saved = txn.cursor(db=self._s.ns)
                return {bytes(digest): json.loads(blob) for digest, blob in saved}
