"""The LMDB disk tier: block payloads and their metadata in one LMDB environment.

Storage only. The store owns the index and the eviction policy; this module keeps
bytes and the metadata needed to rebuild that index after a restart.

Protocol (who calls what):

- The store calls :meth:`DiskTier.write` when it demotes or writes through a block,
  :meth:`~DiskTier.read` on a disk hit, :meth:`~DiskTier.delete` when it evicts a disk
  leaf, :meth:`~DiskTier.touch` when a disk block is used or re-prioritised, and
  :meth:`~DiskTier.save_namespace` when a namespace is opened. At start-up it rebuilds
  its index from :meth:`~DiskTier.records` and :meth:`~DiskTier.namespaces`.
- ``used_bytes`` is logical accounting: the sum of :meth:`~DiskTier.footprint` over the
  live records, queued writes included, and it changes the moment a call returns. The
  store keeps it at or below ``capacity_bytes`` by deleting leaves.
- ``capacity_bytes`` is the *effective* capacity. It starts at the configured value and
  only goes down: when LMDB runs out of map space (its real footprint, with free-list
  fragmentation and pages pinned by old readers, outgrew our accounting), the writer
  aborts the batch, grows the map once by a bounded step (1/8 of the map, never beyond
  1.5x its initial size), lowers the effective capacity, raises a flag that
  :meth:`~DiskTier.drain_shrunk` returns (once) and retries; the store then evicts
  until ``used_bytes <= capacity_bytes``. At the growth limit the writer commits deletes
  first and then the writes one at a time; a write that still does not fit next to the
  committed data is dropped (its key deleted, ``dropped_writes`` counted), exactly as if
  it had been evicted: ``contains`` turns False and ``read`` misses. Running out of space
  never raises to the caller.

Threading model: any thread may call any method. Writes, deletes and metadata touches
are queued (coalesced per key) and ONE writer thread drains the queue into one write
transaction per batch (up to ``batch_bytes`` of payload), commits, and only then drops
the committed writes from the "readable from queue" map, so a block is readable from the
moment ``write`` returns. LMDB allows one write transaction at a time anyway; a single
writer turns many small commits (each an fdatasync) into a few large ones and is the only
thread that ever resizes the map. The queue is bounded by bytes (``queue_bytes``):
``write`` refuses (returns 0) when it is full instead of waiting, since its caller holds
the store's lock and every call would wait behind the disk. A batch that fails for any
other reason than map space (ENOSPC, EIO: :attr:`~DiskTier.fault`) stops the tier's
writes until a retry commits; its items stay queued and readable meanwhile.

Who opens the directory: one process at a time (``kvstored.lock``, see
:mod:`kvstore.disk_files`); a damaged ``data.mdb`` is moved aside at open and the tier
starts empty, and a page found damaged at run time makes that read a miss.
Readers run their own read transactions concurrently with the writer (MVCC); a small
shared/exclusive lock keeps every read transaction closed while the writer calls
``set_mapsize``, which LMDB requires.

On-disk format (one environment at ``directory``, files ``data.mdb`` + ``lock.mdb``):

- named db ``payload``: BlockKey (16 or 32 bytes) -> the block's bytes, verbatim.
- named db ``meta``: BlockKey -> ``struct "<B32sB32sQQBdQ"``: record version (2),
  namespace digest, parent length + parent key (zero-padded to 32), payload size,
  xxh3-64 checksum of the payload, priority, last access (``time.time()`` seconds), and
  the byte offset of the payload in ``data.mdb`` (0: not known). Version 1 records
  (written before the offset was kept: the same without it) are still read.
- named db ``namespaces``: namespace digest (32 bytes) -> ``NamespaceSpec.to_dict()`` as
  UTF-8 JSON with sorted keys. ``meta`` and ``payload`` are always changed together in
  the same transaction, so a restart never sees one without the other.
- named db ``info``: ``b"format"`` -> ``b"kvstore.disk.v1"`` (checked at open).

Durability: ``sync=True, metasync=False`` -- every commit fdatasyncs the data pages
once; the meta page is flushed by the next commit, so a power loss may undo the last
committed batch but cannot corrupt the environment. ``flush()`` forces the meta page
too (``env.sync(True)``). A crash of the process alone loses nothing committed.
``readahead`` is on by default although access is random: values are large (hundreds of
KiB to tens of MiB, stored as contiguous overflow pages) and always read whole, and
without kernel readahead every 4 KiB page of a cold value is its own synchronous I/O
(measured: 0.08 GB/s cold without readahead, 1.0-1.2 GB/s with it; see
``docs/benchmarks/disk.md``). ``writemap`` stays off: writes measured 35-50% slower with it.

Write-back speed (see ``docs/benchmarks/disk.md``): copies of megabytes (``write`` into
the queue, reads into the caller's buffer) release the GIL, so the writer thread is not
stalled waiting for the interpreter between its LMDB calls; the first DiskTier of a
process raises glibc's mmap and trim thresholds (:func:`_tune_malloc`) so that the dirty
pages LMDB mallocs per batch are reused instead of faulted in again; and while a commit
runs, a helper thread starts writeback of the file's dirty pages
(:class:`_EarlyWriteback`) so that the device works while LMDB is still writing the batch
and the commit's fdatasync waits only for the tail. None of this changes what is durable
when: LMDB still fdatasyncs the data pages before it writes the meta page.

Committed payloads are read with ``pread`` at the value's file offset (from its overflow
page header, inside the read transaction that keeps those pages allocated) straight into
the caller's buffer: no faults on a freshly mapped map, GIL released.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import math
import mmap
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import lmdb
import numpy as np
import xxhash

from kvstore.disk_files import (
    drop_reserve,
    find_damage,
    lock_directory,
    make_reserve,
    move_aside,
    scan_in_child,
)
from kvstore.disk_format import (
    DB_NAMES,
    DIGEST_SIZE,
    EXTENT,
    EXTENT_AT,
    FORMAT,
    FORMAT_KEY,
    MAX_PRIORITY,
    META,
    META_DB,
    META_V1,
    NAMESPACES_DB,
    DiskExtent,
    DiskRecord,
    check_record,
    committed_extent,
    open_here,
    open_here_lock,
    pack_record,
    unpack_record,
)

log = logging.getLogger(__name__)

MAX_SNAPSHOTS = 64  # read transactions open for readers in other processes, at most
_PAGE_HEADER = 16  # LMDB's header in front of an overflow run (PAGEHDRSZ)
_MAP_HEADROOM = 64 << 20  # fixed headroom: meta pages, B-tree branches, free list
_MAP_FACTOR = 1.25  # proportional headroom: copy-on-write and free-list fragmentation
_MAX_GROWTH = 0.5  # the map may grow by at most this fraction of its initial size
_CAPACITY_CUT = 0.9  # on map full: effective capacity <= this fraction of what failed to fit
_NS_PREFIX = b"ns:"  # queue keys of namespace saves: prefix + digest + seq (43 bytes)
_SCAN_CHUNK = 1024  # records() reads this many records per read transaction
_CLOSE_RETRIES = 5  # failed batches tolerated while closing before giving up
_FAULT_RETRY_S = 1.0  # while commits fail: the writer retries the queue this often
_RESERVE_MIN, _RESERVE_MAX = 4 << 20, 64 << 20  # disk space kept aside (disk_files)
_WRITEBACK_POLL_S = 0.002  # while a commit runs: start writeback of its pages this often
_READER_CHECK_S = 30.0  # the writer frees reader slots of dead processes this often
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait
_OVERFLOW_HEADER = struct.Struct("<QHHI")  # MDB_page of an overflow run: pgno, pad, flags, pages
_P_OVERFLOW = 0x04
_M_TRIM_THRESHOLD = -1  # <malloc.h> mallopt parameters
_M_MMAP_THRESHOLD = -3
_MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's maximum (HEAP_MAX_SIZE / 2 on 64-bit)
_MALLOC_TRIM_THRESHOLD = 128 << 20  # above a thread arena's 64 MiB heap: never shrunk
# what LMDB raises for an environment that is damaged (as opposed to I/O failing)
_DAMAGE_ERRORS = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.VersionMismatchError,
    lmdb.PanicError,
    lmdb.BadValsizeError,
)


@dataclass(frozen=True, slots=True)
class DiskStats:
    """Counters since this tier was opened, and occupancy now."""

    capacity_bytes: int  # effective capacity (lowered after map-full events)
    used_bytes: int
    records: int
    queue_bytes: int  # payload bytes held by the write queue right now
    writes: int  # payloads committed
    bytes_written: int
    reads: int  # reads that returned a payload
    bytes_read: int
    corrupt_reads: int
    map_full_events: int
    read_misses: int = 0
    dropped_writes: int = 0  # queued writes that could not fit even after growing the map
    map_size_bytes: int = 0
    revoked_snapshots: int = 0  # open snapshots a map resize ended (see DiskSnapshot)
    fault: str = ""  # why the tier takes no writes now (disk full, I/O errors); "" if it does
    refused_writes: int = 0  # writes refused: not writable, or no room in the queue
    lost_writes: int = 0  # queued writes given up at close (never committed)

    @property
    def writable(self) -> bool:
        return not self.fault


class DiskSnapshot:
    """One open LMDB read transaction, handed out with the extents read in it.

    LMDB never reuses a page that an open read transaction can see, so the bytes at
    those extents stay what they were for as long as the snapshot is open, whatever is
    deleted or written meanwhile: another process may pread them from ``data.mdb``.
    :meth:`close` ends it (idempotent, any thread).

    A map resize needs every read transaction closed, and does not wait for snapshots:
    it revokes them (closes them itself, counted in ``revoked_snapshots``). A holder may
    have crashed (its read lease would hold the writer, and every put that demotes
    behind it, until the lease's TTL). After a revocation the pages behind the extents
    may be reused by later commits, so a reader must check each block's checksum after
    reading it, and drop the block on a mismatch, as :mod:`kvclient.disk_reads` does.
    """

    def __init__(self, tier: DiskTier, txn: Any) -> None:
        self._tier = tier
        self._txn: Any = txn

    def close(self) -> None:
        self._tier._close_snapshot(self)


# --- queue operations ------------------------------------------------------------
# One pending operation per key (later calls coalesce into it). ``seq`` orders them:
# the queue dict is kept in seq order, so flush() can tell when everything it saw
# is committed.


@dataclass(slots=True, eq=False)
class _Write:
    seq: int
    key: bytes
    record: DiskRecord
    buf: bytes | bytearray  # the payload: our copy, or the caller's immutable bytes
    inflight: bool = False  # taken by the writer for the current batch
    touched: tuple[int, float] | None = None  # touch that arrived while in flight
    live: bool = True  # still the readable copy of its key (in _unflushed)
    pins: int = 0  # readers copying out of buf right now
    released: bool = False  # buf handed back (queue accounting dropped)


@dataclass(slots=True, eq=False)
class _Delete:
    seq: int
    key: bytes
    inflight: bool = False


@dataclass(slots=True, eq=False)
class _Touch:
    seq: int
    key: bytes
    priority: int
    last_access: float
    inflight: bool = False


@dataclass(slots=True, eq=False)
class _SaveNamespace:
    seq: int
    key: bytes
    digest: bytes
    blob: bytes
    inflight: bool = False


_Op = _Write | _Delete | _Touch | _SaveNamespace


class _ResizeGuard:
    """Many read transactions at once, or one map resize with none open."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._exclusive = False

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            self.leave()

    def try_enter(self) -> bool:
        """Count one more reader unless a resize is waiting or running (no waiting)."""
        with self._cond:
            if self._exclusive:
                return False
            self._readers += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self, on_waiting: Callable[[], object] | None = None) -> Iterator[None]:
        """Wait until no reader is in, then hold them all out. ``on_waiting`` runs once
        new readers are held out and before the wait (it may make readers leave)."""
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True  # new readers wait from here on
        if on_waiting is not None:
            on_waiting()
        with self._cond:
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _byte_view(buffer: bytes | bytearray | memoryview) -> memoryview:
    """A flat unsigned-byte view of ``buffer`` (which must be C-contiguous)."""
    view = memoryview(buffer)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def _copy(dst: memoryview, src: bytes | bytearray | memoryview) -> None:
    """``dst[:] = src`` for flat byte buffers, with the GIL released (numpy drops it for
    large copies): the writer thread and readers copy megabytes while other threads
    need the interpreter, and a copy under the GIL stalls them by up to a switch
    interval (5 ms) each time they want it back."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        sync_file_range = libc.sync_file_range
        sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        sync_file_range.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _load_libc()
_malloc_tuned = False


def _tune_malloc() -> None:
    """Let glibc keep the memory LMDB's writer frees (process-wide, once).

    Without MDB_WRITEMAP, LMDB malloc()s the dirty overflow pages of every value in a
    write transaction and frees them at commit. The writer thread allocates from its
    own glibc arena, whose heaps glibc shrinks (MADV_DONTNEED) once the free top exceeds
    the trim threshold, and large chunks above the mmap threshold are fresh mmap()s; so
    every batch faulted all its pages in again (~1 ms/MiB on a VM: half the write-back
    time, see ``docs/benchmarks/disk.md``). A fixed mmap threshold of 32 MiB (glibc's
    maximum) and a trim threshold above a thread heap's size (64 MiB) keep freed pages
    for the next batch. Values of 32 MiB or more still get their own mappings. Not
    applied when the operator set either threshold in the environment.
    """
    global _malloc_tuned
    if _malloc_tuned or _LIBC is None:
        return
    _malloc_tuned = True
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is None:  # not glibc
        return
    mallopt(_M_MMAP_THRESHOLD, _MALLOC_MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, _MALLOC_TRIM_THRESHOLD)


class _EarlyWriteback:
    """While the writer commits, keep asking the kernel to start writing the data
    file's dirty pages (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait).

    LMDB's commit writes the batch's pages into the page cache and then fdatasyncs;
    without help the device sits idle until that fdatasync, then the commit waits for
    all of it. Started early, most of the batch is on its way while LMDB is still
    writing it, and the fdatasync waits only for the tail. This changes nothing about
    durability or ordering: the kernel may write dirty pages back at any moment anyway,
    LMDB's own fdatasync still decides what is durable, and the meta page is still
    written only after the data pages are synced.
    """

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._cond = threading.Condition()
        self._active = False
        self._stopped = False
        self._thread = threading.Thread(
            target=self._run, name="kvstore-disk-writeback", daemon=True
        )
        self._thread.start()

    @contextmanager
    def during(self) -> Iterator[None]:
        with self._cond:
            self._active = True
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._active = False

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()
        os.close(self._fd)

    def _run(self) -> None:
        sync_file_range = _LIBC.sync_file_range
        while True:
            with self._cond:
                while not self._active and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
            if sync_file_range(self._fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:
                log.warning(
                    "sync_file_range failed (%s); early writeback off",
                    os.strerror(ctypes.get_errno()),
                )
                return
            time.sleep(_WRITEBACK_POLL_S)


class DiskTier:
    """One LMDB environment holding block payloads and metadata; see the module docstring."""

    def __init__(
        self,
        directory: str,
        capacity_bytes: int,
        *,
        queue_bytes: int = 256 << 20,
        batch_bytes: int = 64 << 20,
        readahead: bool = True,
        metasync: bool = False,
        deep_check: bool = False,
        _map_size_override: int | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if queue_bytes <= 0 or batch_bytes <= 0:
            raise ValueError("queue_bytes and batch_bytes must be > 0")
        self.directory = directory
        self.data_path = os.path.join(directory, "data.mdb")  # what extents() point into
        self.configured_capacity_bytes = capacity_bytes
        self._queue_limit = queue_bytes
        self._batch_bytes = batch_bytes

        os_page = mmap.PAGESIZE
        if _map_size_override is not None:
            requested = _round_up(_map_size_override, os_page)
        else:
            requested = _round_up(int(capacity_bytes * _MAP_FACTOR) + _MAP_HEADROOM, os_page)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        _tune_malloc()
        self._metasync = metasync
        self._readahead = readahead
        self._owner_fd = lock_directory(directory)  # one owner at a time (disk_files)

        self._resize = _ResizeGuard()
        self._snapshots: set[DiskSnapshot] = set()  # open ones (see extents())
        self._revoked_snapshots = 0
        self._cond = threading.Condition()  # guards everything below
        self._ops: dict[bytes, _Op] = {}  # pending operation per key, in seq order
        self._unflushed: dict[bytes, _Write] = {}  # written, not committed yet: read from here
        self._sizes: dict[bytes, int] = {}  # every live record (committed or queued): size
        self._used = 0
        self._queued_bytes = 0
        self._pool: dict[int, list[bytearray]] = {}  # recycled payload buffers by size
        self._pool_bytes = 0
        self._seq = 0
        self._shrunk_pending = False
        self._stopping = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._writes = self._bytes_written = 0
        self._reads = self._bytes_read = self._read_misses = 0
        self._corrupt_reads = self._map_full_events = self._dropped_writes = 0
        self._fault = ""  # see the fault property
        self._refused_writes = self._lost_writes = 0
        try:
            self._open_sound(requested, deep_check)
        except BaseException:
            os.close(self._owner_fd)
            raise
        # LMDB keeps an existing file's size if it is larger than what we asked for.
        self._map_size = self._env.info()["map_size"]
        self._max_map_size = max(self._map_size, requested + int(requested * _MAX_GROWTH))
        self._capacity_floor = min(capacity_bytes, self._max_map_size // 8)
        self._capacity = capacity_bytes
        self._reserve_bytes = min(_RESERVE_MAX, max(_RESERVE_MIN, capacity_bytes // 64))
        make_reserve(directory, self._reserve_bytes)  # no room for it: none, for now
        # the most the capacity may be: configured, lowered for good by map-full events;
        # a fault lowers the capacity below it until space comes back (_regain_capacity)
        self._ceiling = capacity_bytes

        # Committed payloads are read with pread() from here into the caller's buffer:
        # no page faults on the map (a fresh process has mapped none of it), GIL released.
        self._read_fd = os.open(self.data_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._writeback: _EarlyWriteback | None = None
        if _LIBC is not None:
            try:
                self._writeback = _EarlyWriteback(self.data_path)
            except OSError:
                log.warning("early writeback off: cannot open data.mdb", exc_info=True)
        with open_here_lock:
            open_here.add(os.path.realpath(directory))
        self._writer = threading.Thread(
            target=self._run_writer, name="kvstore-disk-writer", daemon=True
        )
        self._writer.start()

    # --- accounting ------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """Effective capacity: the configured one, lowered after map-full events."""
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def footprint(self, size: int) -> int:
        """Bytes a record with a ``size``-byte payload is accounted as.

        The payload's overflow pages (LMDB puts a 16-byte header in front of the run, so
        a 2 MiB payload needs 513 pages of 4 KiB) plus one page for the key, the
        metadata record and the B-tree nodes that point at them.
        """
        pages = -(-(size + _PAGE_HEADER) // self._psize)
        return (pages + 1) * self._psize

    @property
    def open_snapshots(self) -> int:
        """Snapshots handed out by :meth:`extents` and not closed yet."""
        with self._cond:
            return len(self._snapshots)

    def drain_shrunk(self) -> bool:
        """True once after the effective capacity went down (a map-full event, a disk
        fault): the store evicts until used_bytes <= capacity_bytes."""
        with self._cond:
            pending, self._shrunk_pending = self._shrunk_pending, False
            return pending

    def stats(self) -> DiskStats:
        with self._cond:
            return DiskStats(
                capacity_bytes=self._capacity,
                used_bytes=self._used,
                records=len(self._sizes),
                queue_bytes=self._queued_bytes,
                writes=self._writes,
                bytes_written=self._bytes_written,
                reads=self._reads,
                bytes_read=self._bytes_read,
                corrupt_reads=self._corrupt_reads,
                map_full_events=self._map_full_events,
                read_misses=self._read_misses,
                dropped_writes=self._dropped_writes,
                map_size_bytes=self._map_size,
                revoked_snapshots=self._revoked_snapshots,
                fault=self._fault,
                refused_writes=self._refused_writes,
                lost_writes=self._lost_writes,
            )

    # --- write side -------------------------------------------------------------
    def write(
        self,
        record: DiskRecord,
        payload: bytes | bytearray | memoryview,
        *,
        wait_s: float = 0.0,
    ) -> bool:
        """Queue ``payload`` as the block ``record.key`` (replacing any earlier version).

        Returns False when the write is refused: the tier is not writable
        (:attr:`fault`), or the queue has no room for it (more than ``queue_bytes``
        held; a single payload larger than that is taken when the queue is empty). A
        refused write changes nothing. By default this never waits, so a caller holding
        a lock (the store) is never stalled by the disk; ``wait_s`` waits that long for
        room (callers that hold nothing).

        The payload is copied before this returns, so the caller may reuse its buffer;
        the block is readable at once. ``record.checksum`` must be
        ``xxh3_64_intdigest(payload)``: it is what every read verifies against.
        """
        check_record(record)
        src = _byte_view(payload)
        size = src.nbytes
        if size != record.size:
            raise ValueError(f"record.size is {record.size} but the payload has {size} bytes")
        deadline = time.monotonic() + wait_s
        with self._cond:
            self._check_accepting()
            while self._fault or (
                self._queued_bytes and self._queued_bytes + size > self._queue_limit
            ):
                remaining = deadline - time.monotonic()
                if self._fault or remaining <= 0:
                    self._refused_writes += 1
                    return False
                self._cond.wait(remaining)
                self._check_accepting()
            self._queued_bytes += size  # reserve before copying, outside the lock
            buf: bytes | bytearray = payload if type(payload) is bytes else self._pool_take(size)
        if buf is not payload:  # bytes are immutable: keep a reference, copy anything else
            try:
                _copy(memoryview(buf), src)
            except BaseException:
                with self._cond:
                    self._queued_bytes -= size
                    self._cond.notify_all()
                raise
        key = bytes(record.key)
        with self._cond:
            if self._stopping:  # close() began while we copied: the writer may be gone
                self._queued_bytes -= size
                self._cond.notify_all()
                self._check_accepting()
            self._seq += 1
            op = _Write(self._seq, key, record, buf)
            old_size = self._sizes.get(key)
            if old_size is not None:
                self._used -= self.footprint(old_size)
            old = self._unflushed.get(key)
            if old is not None:
                old.live = False
                self._maybe_release(old)
            self._unflushed[key] = op
            self._sizes[key] = size
            self._used += self.footprint(size)
            self._set_op(key, op)
            return True

    def wait_committed(self, keys: Sequence[bytes], timeout: float) -> int:
        """Wait (up to ``timeout`` seconds, never past a fault) until none of ``keys``
        is still queued; how many of them are then committed and live (on disk, in the
        file, not deleted or dropped since). Batches commit in queue order, so the
        writes queued before a key's (its ancestors') are committed with it or before."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (
                any(key in self._unflushed for key in keys) and not self._fault and not self._closed
            ):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return sum(1 for key in keys if key in self._sizes and key not in self._unflushed)

    def refuse(self) -> None:
        """Count a write its caller did not attempt because :attr:`fault` is set."""
        with self._cond:
            self._refused_writes += 1

    @property
    def fault(self) -> str:
        """Why the tier takes no writes now ("" when it does): the error of the last
        failed commit. Set by the writer when a commit fails for a reason other than
        map space (ENOSPC, EIO, ...): from then on :meth:`write` refuses, the effective
        capacity is lowered to what is committed (the store evicts down to it: see
        :meth:`drain_shrunk`), and the writer retries the queue every
        ``_FAULT_RETRY_S``. The first commit that succeeds clears it and gives the
        capacity back. Each change is one log line."""
        return self._fault

    def delete(self, key: bytes) -> None:
        """Queue the removal of ``key`` (a no-op if it is not live).

        Cancels a queued write of the same key; ``used_bytes`` drops at once and the
        block is no longer readable once this returns.
        """
        with self._cond:
            self._check_accepting()
            self._delete_locked(bytes(key))

    def touch(self, key: bytes, priority: int, last_access: float) -> None:
        """Queue a metadata update (coalesced; committed with the next batch)."""
        if not 0 <= priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be in [0, {MAX_PRIORITY}], got {priority}")
        key = bytes(key)
        with self._cond:
            self._check_accepting()
            if key not in self._sizes:
                return
            op = self._ops.get(key)
            if isinstance(op, _Write):
                if op.inflight:  # applied after its commit (or folded in on a retry)
                    op.touched = (priority, last_access)
                else:
                    op.record = replace(op.record, priority=priority, last_access=last_access)
                return
            if isinstance(op, _Touch) and not op.inflight:
                op.priority, op.last_access = priority, last_access
                return
            if isinstance(op, _Delete):
                return
            self._seq += 1
            self._set_op(key, _Touch(self._seq, key, priority, last_access))

    def save_namespace(self, ns_digest: bytes, spec: dict[str, Any]) -> None:
        """Queue a namespace's declared fields for the next commit (does not wait: the
        queue commits in order, so it lands no later than the first block written after
        it, which is all a restart needs)."""
        if len(ns_digest) != DIGEST_SIZE:
            raise ValueError(f"ns_digest must be {DIGEST_SIZE} bytes, got {len(ns_digest)}")
        blob = json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()
        with self._cond:
            self._check_accepting()
            self._seq += 1
            # One queue entry per call (never coalesced): an earlier save may be in flight.
            key = _NS_PREFIX + bytes(ns_digest) + self._seq.to_bytes(8, "little")
            self._set_op(key, _SaveNamespace(self._seq, key, bytes(ns_digest), blob))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything queued before this call is committed, then sync.

        Raises TimeoutError if that takes longer than ``timeout`` seconds, and
        RuntimeError at once while the tier is not writable (:attr:`fault`): a flush
        never waits on a failing disk.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._seq
            while self._min_pending_seq() <= target:
                if not self._writer.is_alive():
                    raise RuntimeError("the disk writer thread has stopped")
                if self._fault:
                    raise RuntimeError(f"the disk tier is not writable: {self._fault}")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"disk tier flush did not finish in {timeout} s")
                self._cond.wait(remaining)
        with self._resize.reading():
            if not self._closed:
                self._env.sync(True)

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

    # --- lifecycle --------------------------------------------------------------
    def close(self) -> None:
        """Commit everything queued, stop the writer, close the environment (idempotent)."""
        with self._close_lock:
            with self._cond:
                if self._closed:
                    return
                self._stopping = True  # new writes are refused; the writer drains
                self._cond.notify_all()
            self._writer.join()
            if self._writeback is not None:
                self._writeback.close()
            with self._resize.exclusive(on_waiting=self._close_snapshots):
                try:
                    self._env.sync(True)
                finally:
                    self._env.close()
                    os.close(self._read_fd)
                    os.close(self._owner_fd)
                    with open_here_lock:
                        open_here.discard(os.path.realpath(self.directory))
                    with self._cond:
                        self._closed = True
                        self._cond.notify_all()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals: queue --------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"disk tier at {self.directory} is closed")

    def _check_accepting(self) -> None:
        if self._stopping or self._closed:
            raise RuntimeError(f"disk tier at {self.directory} is closed")

    def _set_op(self, key: bytes, op: _Op) -> None:
        """Make ``op`` the pending operation of ``key``, at the end of the queue."""
        self._ops.pop(key, None)
        self._ops[key] = op
        self._cond.notify_all()

    def _delete_locked(self, key: bytes) -> None:
        size = self._sizes.pop(key, None)
        if size is None:
            return
        self._used -= self.footprint(size)
        queued = self._unflushed.pop(key, None)
        if queued is not None:
            queued.live = False
            self._maybe_release(queued)
        # Always queue the delete: an older version may be committed under this key.
        self._seq += 1
        self._set_op(key, _Delete(self._seq, key))

    def _min_pending_seq(self) -> float:
        # The queue is in seq order, and an operation superseded while in flight is
        # superseded by a later one that flush() waits for anyway.
        first = next(iter(self._ops.values()), None)
        return math.inf if first is None else first.seq

    def _pool_take(self, size: int) -> bytearray:
        """A buffer of exactly ``size`` bytes, recycled when possible: fresh memory costs
        far more to fault in than to copy into."""
        free = self._pool.get(size)
        if free:
            self._pool_bytes -= size
            buf = free.pop()
            if not free:
                del self._pool[size]
            return buf
        if self._pool:  # the pooled sizes are not the ones in use now: shrink the pool
            stale_size, stale = next(iter(self._pool.items()))
            stale.pop()
            self._pool_bytes -= stale_size
            if not stale:
                del self._pool[stale_size]
        return bytearray(size)

    def _maybe_release(self, op: _Write) -> None:
        """Hand a write's buffer back once nothing needs it (not readable, not being
        committed, not being copied by a reader)."""
        if op.released or op.live or op.inflight or op.pins:
            return
        op.released = True
        size = len(op.buf)
        self._queued_bytes -= size
        # Keep it while the queue plus the pool stay within queue_bytes.
        if (
            isinstance(op.buf, bytearray)
            and self._pool_bytes + self._queued_bytes + size <= self._queue_limit
        ):
            self._pool.setdefault(size, []).append(op.buf)
            self._pool_bytes += size
        self._cond.notify_all()

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

        Clients on this host read the environment under their own transactions
        (kvclient.disk_index); one killed inside a read leaves its slot, and LMDB keeps
        every page that slot's snapshot can see from being reused, so the file would
        only grow. The writer clears them every _READER_CHECK_S and on a full map."""
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
        with self._resize.exclusive(on_waiting=self._revoke_snapshots):
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

    # --- internals: start-up ------------------------------------------------------
    def _open_sound(self, map_size: int, deep_check: bool) -> None:
        """Open the environment, moving a damaged one aside first (see
        :mod:`kvstore.disk_files`): a damaged file never stops the start, it costs the
        blocks it held. ``deep_check`` also walks every B-tree in a child process."""
        damage = find_damage(self.directory)
        if damage is None and deep_check:
            damage = scan_in_child(self.directory)
        if damage is None:
            try:
                self._open_env(map_size)
                return
            except _DAMAGE_ERRORS as exc:  # not I/O errors: a full disk is not damage
                damage = f"LMDB could not read it: {exc}"
        moved = move_aside(self.directory)
        log.error(
            "disk tier in %s was damaged (%s); moved it aside to %s and started with an "
            "empty disk tier",
            self.directory,
            damage,
            moved,
            extra={"event": "disk_damaged"},
        )
        self._sizes.clear()
        self._used = 0
        self._open_env(map_size)

    def _open_env(self, map_size: int) -> None:
        """Open LMDB, its databases, check the format and load the size map."""
        self._env = lmdb.open(
            self.directory,
            map_size=map_size,
            subdir=True,
            mode=0o600,  # data.mdb and lock.mdb; the directory itself is 0o700
            max_dbs=len(DB_NAMES),
            max_spare_txns=8,  # readers from several threads reuse reset txns
            readahead=self._readahead,
            sync=True,
            metasync=self._metasync,
            writemap=False,
            lock=True,
        )
        try:
            self._clear_stale_readers()  # reader slots left by a crashed process
            self._meta = self._env.open_db(META_DB)
            self._payload = self._env.open_db(b"payload")
            self._ns = self._env.open_db(NAMESPACES_DB)
            self._info = self._env.open_db(b"info")
            self._check_format()
            self._psize = self._env.stat()["psize"]
            self._load_sizes()
        except BaseException:
            self._env.close()
            raise

    def _check_format(self) -> None:
        with self._env.begin(write=True) as txn:
            found = txn.get(FORMAT_KEY, db=self._info)
            if found is None:
                txn.put(FORMAT_KEY, FORMAT, db=self._info)
        if found is not None and found != FORMAT:
            raise ValueError(
                f"{self.directory} holds an LMDB disk tier of format {found!r}, "
                f"this build reads {FORMAT!r}"
            )

    def _load_sizes(self) -> None:
        """Rebuild the size map and used_bytes from ``meta``; drop malformed records."""
        bad: list[bytes] = []
        with self._env.begin() as txn:
            for key, raw in txn.cursor(db=self._meta):
                try:
                    record = unpack_record(key, raw)
                except (ValueError, struct.error):
                    bad.append(bytes(key))
                    continue
                self._sizes[record.key] = record.size
                self._used += self.footprint(record.size)
        if bad:
            log.warning("dropping %d malformed disk records in %s", len(bad), self.directory)
            with self._env.begin(write=True) as txn:
                for key in bad:
                    txn.delete(key, db=self._payload)
                    txn.delete(key, db=self._meta)
