"""The disk tier's shared state, its queue operations and the helpers its parts share.

A :class:`kvstore.disk.DiskTier` is a façade over three parts that hold one
:class:`DiskState`: :class:`kvstore.disk.reads.DiskReads` (reads and the start-up
scan), :class:`kvstore.disk.writer.DiskWriter` (the thread that commits the queue to
LMDB in batches: faults, map-full handling, early writeback) and the tier itself (the
write calls that fill the queue, lifecycle, start-up). The protocol is in
:mod:`kvstore.disk`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import struct
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lmdb
import numpy as np

from kvstore.codecs import Codec
from kvstore.disk.format import DiskRecord

log = logging.getLogger(__name__)


_PAGE_HEADER = 16  # LMDB's header in front of an overflow run (PAGEHDRSZ)
_MAP_HEADROOM = 64 << 20  # fixed headroom: meta pages, B-tree branches, free list
_MAP_FACTOR = 1.25  # proportional headroom: copy-on-write and free-list fragmentation
_MAX_GROWTH = 0.5  # the map may grow by at most this fraction of its initial size
_CAPACITY_CUT = 0.9  # on map full: effective capacity <= this fraction of what failed to fit
_ROOM_SLACK, _ROOM_SLACK_MAX = 0.1, 0.5  # after faults: share of the proven room kept free
_DROP_AFTER = 3  # while commits fail: retries of a queued write before it is dropped
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
    dropped_writes: int = 0  # queued writes that did not fit the map, or failed _DROP_AFTER times
    map_size_bytes: int = 0
    fault: str = ""  # why the tier takes no writes now (disk full, I/O errors); "" if it does
    refused_writes: int = 0  # writes refused: not writable, or no room in the queue
    lost_writes: int = 0  # queued writes given up at close (never committed)
    # records not of the codec their namespace keeps on disk (another codec, another
    # version, or raw where it keeps them encoded, and the reverse): misses, never served
    codec_mismatches: int = 0

    @property
    def writable(self) -> bool:
        return not self.fault


# --- queue operations ------------------------------------------------------------
# One pending operation per key (later calls coalesce into it). ``seq`` orders them:
# the queue dict is kept in seq order, so flush() can tell when everything it saw
# is committed.


@dataclass(slots=True, eq=False)
class _Queued:
    seq: int
    key: bytes
    inflight: bool = field(default=False, kw_only=True)  # taken by the writer's batch


@dataclass(slots=True, eq=False)
class _Write(_Queued):
    record: DiskRecord
    buf: bytes | bytearray  # the payload: our copy, or the caller's immutable bytes
    codec: Codec | None = None  # the writer stores it encoded so (kvstore.codecs)
    touched: tuple[int, float] | None = None  # touch that arrived while in flight
    live: bool = True  # still the readable copy of its key (in _unflushed)
    pins: int = 0  # readers copying out of buf right now
    released: bool = False  # buf handed back (queue accounting dropped)


@dataclass(slots=True, eq=False)
class _Delete(_Queued):
    pass


@dataclass(slots=True, eq=False)
class _Touch(_Queued):
    priority: int
    last_access: float


@dataclass(slots=True, eq=False)
class _SaveNamespace(_Queued):
    digest: bytes
    blob: bytes


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

    def leave(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Wait until no reader is in, then hold them all out."""
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True  # new readers wait from here on
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


class DiskState:
    """What the disk tier's parts share: its settings, the LMDB environment, the queue
    of pending operations and the accounting, all guarded by ``cond`` (see the module
    docstring). The tier fills in the fields below when it opens the environment."""

    owner_fd: int
    map_size: int
    max_map_size: int
    capacity_floor: int
    capacity: int
    reserve_bytes: int
    ceiling: int
    read_fd: int
    env: Any  # lmdb.Environment
    meta: Any  # its named databases
    payload: Any
    ns: Any
    info: Any
    psize: int

    def __init__(
        self,
        directory: str,
        capacity_bytes: int,
        queue_bytes: int,
        batch_bytes: int,
        metasync: bool,
        readahead: bool,
    ) -> None:
        self.directory = directory
        self.data_path = os.path.join(directory, "data.mdb")
        self.queue_limit = queue_bytes
        self.batch_bytes = batch_bytes
        self.metasync = metasync
        self.readahead = readahead
        self.resize = _ResizeGuard()
        self.cond = threading.Condition()  # guards everything below
        self.ops: dict[bytes, _Op] = {}  # pending operation per key, in seq order
        self.unflushed: dict[bytes, _Write] = {}  # written, not committed yet: read from here
        self.sizes: dict[bytes, int] = {}  # every live record (committed or queued): size
        self.used = 0
        self.queued_bytes = 0
        self.pool: dict[int, list[bytearray]] = {}  # recycled payload buffers by size
        self.pool_bytes = 0
        self.seq = 0
        self.shrunk_pending = False
        self.fs_free_at_fault = 0  # the file system's free bytes when the last fault began
        self.room_share = 1.0  # of the proven room, what the capacity may regain (faults)
        self.stopping = False
        self.closed = False
        self.close_lock = threading.Lock()
        self.writes = self.bytes_written = 0
        self.reads = self.bytes_read = self.read_misses = 0
        self.corrupt_reads = self.map_full_events = self.dropped_writes = 0
        self.fault = ""  # see DiskTier.fault
        self.refused_writes = self.lost_writes = 0
        self.codec_mismatches = 0
        # a lazy open (DiskTier(lazy=True)): the writer commits nothing until the deep
        # check passed (``checked``); until the index load ends (``loading``), ``sizes``
        # holds only what was adopted or written, ``used`` is LMDB's page count, and
        # ``touched`` names the keys written or deleted since the open, ``voided`` the
        # namespaces (digests; None: all) cleared since: their records are not adopted
        self.checked = True
        self.closed_unopened = False  # a lazy open failed: see DiskTier.give_up_open
        self.loading = False
        self.touched: set[bytes] = set()
        self.voided: set[bytes | None] = set()


    # --- the environment -------------------------------------------------------
    def clear_stale_readers(self) -> int:
        """Free the reader slots of processes that died inside a read transaction.

        A process killed inside a read transaction (a tool that opened the environment
        read-only, e.g. ``kvctl`` on a stopped daemon's files) leaves its slot, and LMDB
        keeps every page that slot's snapshot can see from being reused, so the file
        would only grow. The writer clears them every _READER_CHECK_S and on a full map."""
        stale: int = self.env.reader_check()
        if stale:
            log.warning("cleared %d stale LMDB reader slots in %s", stale, self.directory)
        return stale

    def file_offset(self, view: memoryview) -> int | None:
        """The byte offset in ``data.mdb`` of a value an open read transaction holds
        (``view``, into LMDB's map), found from the header of its overflow run; None
        for a value that is not stored as one (small values share a page)."""
        size = len(view)
        if size <= self.psize:
            return None
        addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
        header = (ctypes.c_char * _OVERFLOW_HEADER.size).from_address(addr - _PAGE_HEADER)
        pgno, _, flags, pages = _OVERFLOW_HEADER.unpack(bytes(header))
        if not flags & _P_OVERFLOW or pages * self.psize < size + _PAGE_HEADER:
            return None
        return int(pgno * self.psize + _PAGE_HEADER)

    # --- accounting ------------------------------------------------------------
    def footprint(self, size: int) -> int:
        """Bytes a record with a ``size``-byte payload is accounted as.

        The payload's overflow pages (LMDB puts a 16-byte header in front of the run, so
        a 2 MiB payload needs 513 pages of 4 KiB) plus one page for the key, the
        metadata record and the B-tree nodes that point at them.
        """
        pages = -(-(size + _PAGE_HEADER) // self.psize)
        return (pages + 1) * self.psize

    def drain_shrunk(self) -> bool:
        """True once after the effective capacity went down (a map-full event, a disk
        fault): the store evicts until used_bytes <= capacity_bytes."""
        with self.cond:
            pending, self.shrunk_pending = self.shrunk_pending, False
            return pending

    def stats(self) -> DiskStats:
        with self.cond:
            return DiskStats(
                capacity_bytes=self.capacity,
                used_bytes=self.used,
                records=len(self.sizes),
                queue_bytes=self.queued_bytes,
                writes=self.writes,
                bytes_written=self.bytes_written,
                reads=self.reads,
                bytes_read=self.bytes_read,
                corrupt_reads=self.corrupt_reads,
                map_full_events=self.map_full_events,
                read_misses=self.read_misses,
                dropped_writes=self.dropped_writes,
                map_size_bytes=self.map_size,
                fault=self.fault,
                refused_writes=self.refused_writes,
                lost_writes=self.lost_writes,
                codec_mismatches=self.codec_mismatches,
            )

    # --- internals: queue --------------------------------------------------------
    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"disk tier at {self.directory} is closed")

    def check_accepting(self) -> None:
        if self.stopping or self.closed:
            raise RuntimeError(f"disk tier at {self.directory} is closed")

    def set_op(self, key: bytes, op: _Op) -> None:
        """Make ``op`` the pending operation of ``key``, at the end of the queue."""
        self.ops.pop(key, None)
        self.ops[key] = op
        self.cond.notify_all()

    def delete_locked(self, key: bytes, committed: bool = False) -> None:
        """Queue the removal of ``key``: a no-op if it is not live, unless ``committed``
        (the caller found its record in the file). While the index loads, a key not
        adopted yet may be committed all the same: its removal is queued and the key
        is never adopted (the load's scan does not bring it back)."""
        size = self.sizes.pop(key, None)
        if size is None and not (committed or (self.loading and key not in self.touched)):
            return
        if self.loading:
            self.touched.add(key)
        if size is not None:
            self.used -= self.footprint(size)
        queued = self.unflushed.pop(key, None)
        if queued is not None:
            queued.live = False
            self.maybe_release(queued)
        # Always queue the delete: an older version may be committed under this key.
        self.seq += 1
        self.set_op(key, _Delete(self.seq, key))

    def min_pending_seq(self) -> float:
        # The queue is in seq order, and an operation superseded while in flight is
        # superseded by a later one that flush() waits for anyway.
        first = next(iter(self.ops.values()), None)
        return math.inf if first is None else first.seq

    def pool_take(self, size: int) -> bytearray:
        """A buffer of exactly ``size`` bytes, recycled when possible: fresh memory costs
        far more to fault in than to copy into."""
        free = self.pool.get(size)
        if free:
            self.pool_bytes -= size
            buf = free.pop()
            if not free:
                del self.pool[size]
            return buf
        if self.pool:  # the pooled sizes are not the ones in use now: shrink the pool
            stale_size, stale = next(iter(self.pool.items()))
            stale.pop()
            self.pool_bytes -= stale_size
            if not stale:
                del self.pool[stale_size]
        return bytearray(size)

    def maybe_release(self, op: _Write) -> None:
        """Hand a write's buffer back once nothing needs it (not readable, not being
        committed, not being copied by a reader)."""
        if op.released or op.live or op.inflight or op.pins:
            return
        op.released = True
        size = len(op.buf)
        self.queued_bytes -= size
        # Keep it while the queue plus the pool stay within queue_bytes.
        if (
            isinstance(op.buf, bytearray)
            and self.pool_bytes + self.queued_bytes + size <= self.queue_limit
        ):
            self.pool.setdefault(size, []).append(op.buf)
            self.pool_bytes += size
        self.cond.notify_all()
