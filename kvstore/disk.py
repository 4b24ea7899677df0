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

import json
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import lmdb

from kvstore.disk_files import (
    find_damage,
    lock_directory,
    make_reserve,
    move_aside,
    scan_in_child,
)
from kvstore.disk_format import (
    DB_NAMES,
    DIGEST_SIZE,
    FORMAT,
    FORMAT_KEY,
    MAX_PRIORITY,
    META_DB,
    NAMESPACES_DB,
    DiskRecord,
    check_record,
    open_here,
    open_here_lock,
    open_in_this_process,
    unpack_record,
)
from kvstore.disk_state import (
    _DAMAGE_ERRORS,
    _LIBC,
    _MAP_FACTOR,
    _MAP_HEADROOM,
    _MAX_GROWTH,
    _NS_PREFIX,
    _RESERVE_MAX,
    _RESERVE_MIN,
    DiskStats,
    _byte_view,
    _copy,
    _Delete,
    _EarlyWriteback,
    _Op,
    _ResizeGuard,
    _round_up,
    _SaveNamespace,
    _Touch,
    _tune_malloc,
    _Write,
)
from kvstore.disk_writer import DiskWriter

__all__ = [
    "DiskRecord",
    "DiskStats",
    "DiskTier",
    "open_in_this_process",
]

log = logging.getLogger(__name__)


class DiskTier(DiskWriter):
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
        self.data_path = os.path.join(directory, "data.mdb")
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
            with self._resize.exclusive():
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
