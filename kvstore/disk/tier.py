"""The disk tier's façade: the write calls that fill the queue (write, delete, touch,
save_namespace), flush, lifecycle and start-up; reads are :mod:`kvstore.disk.reads`'s,
commits :mod:`kvstore.disk.writer`'s. The protocol is in :mod:`kvstore.disk`."""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

import lmdb

from kvstore.codecs import Codec
from kvstore.disk.files import (
    NO_ROOM,
    allocate_lock_file,
    find_damage,
    free_bytes,
    lock_directory,
    make_reserve,
    move_aside,
    scan_in_child,
)
from kvstore.disk.format import (
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
    unpack_record,
)
from kvstore.disk.reads import DiskReads
from kvstore.disk.state import (
    _DAMAGE_ERRORS,
    _MAP_FACTOR,
    _MAP_HEADROOM,
    _MAX_GROWTH,
    _NS_PREFIX,
    _RESERVE_MAX,
    _RESERVE_MIN,
    DiskState,
    DiskStats,
    _byte_view,
    _copy,
    _Delete,
    _round_up,
    _SaveNamespace,
    _Touch,
    _tune_malloc,
    _Write,
)
from kvstore.disk.writer import DiskWriter

log = logging.getLogger(__name__)

ROOM_POLL_S = 2.0  # a tier waiting for room to create its files looks this often


class DiskTier:
    """One LMDB environment holding block payloads and metadata (see :mod:`kvstore.disk`
    for the protocol): a façade over its state, its read side and its writer thread."""

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
        lazy: bool = False,
        _map_size_override: int | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if queue_bytes <= 0 or batch_bytes <= 0:
            raise ValueError("queue_bytes and batch_bytes must be > 0")
        self.configured_capacity_bytes = capacity_bytes
        self._s = DiskState(
            directory, capacity_bytes, queue_bytes, batch_bytes, metasync, readahead
        )
        self.directory = self._s.directory
        self.data_path = self._s.data_path

        os_page = mmap.PAGESIZE
        if _map_size_override is not None:
            requested = _round_up(_map_size_override, os_page)
        else:
            requested = _round_up(int(capacity_bytes * _MAP_FACTOR) + _MAP_HEADROOM, os_page)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        _tune_malloc()
        self._s.owner_fd = lock_directory(directory)  # one owner at a time (disk.files)

        self._requested = requested
        self._deep_check = deep_check
        self._s.psize = os_page  # LMDB's page size is the OS's (until the open says)
        self._s.capacity = self._s.ceiling = capacity_bytes
        self._s.reserve_bytes = min(_RESERVE_MAX, max(_RESERVE_MIN, capacity_bytes // 64))
        self._s.map_size = 0
        self._s.checked = not lazy  # lazy: the writer waits for open_checked()
        self._room_wait: threading.Thread | None = None  # waiting for room (open_checked)
        self._s.loading = lazy
        try:
            if lazy:  # only what reads no B-tree page now (see open_checked)
                damage = find_damage(directory)
                if damage is not None:
                    self._move_aside(damage)
            else:
                self._open_now(deep_check)
        except BaseException:
            os.close(self._s.owner_fd)
            raise
        self._reads = DiskReads(self._s)
        self._writer = DiskWriter(self._s)
        self._writer.start()
        # the read side's calls, served by the part that owns them
        self.contains = self._reads.contains
        self.contains_all = self._reads.contains_all
        self.read = self._reads.read
        self.read_all = self._reads.read_all
        self.records = self._reads.records
        self.scan_chunks = self._reads.scan_chunks
        self.namespaces = self._reads.namespaces

    # --- accounting -------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """Effective capacity: the configured one, lowered after map-full events."""
        return self._s.capacity

    @property
    def used_bytes(self) -> int:
        return self._s.used

    def footprint(self, size: int) -> int:
        """Bytes a record with a ``size``-byte payload is accounted as (see
        :meth:`DiskState.footprint`)."""
        return self._s.footprint(size)

    def drain_shrunk(self) -> bool:
        """True once after the effective capacity went down (a map-full event, a disk
        fault): the store evicts until used_bytes <= capacity_bytes."""
        return self._s.drain_shrunk()

    def stats(self) -> DiskStats:
        return self._s.stats()

    # --- write side -------------------------------------------------------------
    def write(
        self,
        record: DiskRecord,
        payload: bytes | bytearray | memoryview,
        *,
        wait_s: float = 0.0,
        codec: Codec | None = None,
    ) -> bool:
        """Queue ``payload`` as the block ``record.key`` (replacing any earlier version);
        with ``codec`` the writer thread stores it encoded (the record then says which
        codec, its size and checksum are the encoded bytes': kvstore.codecs).

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
        with self._s.cond:
            self._s.check_accepting()
            while self._s.fault or (
                self._s.queued_bytes and self._s.queued_bytes + size > self._s.queue_limit
            ):
                remaining = deadline - time.monotonic()
                if self._s.fault or remaining <= 0:
                    self._s.refused_writes += 1
                    return False
                self._s.cond.wait(remaining)
                self._s.check_accepting()
            self._s.queued_bytes += size  # reserve before copying, outside the lock
            buf: bytes | bytearray = payload if type(payload) is bytes else self._s.pool_take(size)
        if buf is not payload:  # bytes are immutable: keep a reference, copy anything else
            try:
                _copy(memoryview(buf), src)
            except BaseException:
                with self._s.cond:
                    self._s.queued_bytes -= size
                    self._s.cond.notify_all()
                raise
        key = bytes(record.key)
        with self._s.cond:
            if self._s.stopping:  # close() began while we copied: the writer may be gone
                self._s.queued_bytes -= size
                self._s.cond.notify_all()
                self._s.check_accepting()
            self._s.seq += 1
            op = _Write(self._s.seq, key, record, buf, codec=codec)
            old_size = self._s.sizes.get(key)
            if old_size is not None:
                self._s.used -= self._s.footprint(old_size)
            old = self._s.unflushed.get(key)
            if old is not None:
                old.live = False
                self._s.maybe_release(old)
            self._s.unflushed[key] = op
            stored = size if codec is None else codec.encoded_bytes
            self._s.sizes[key] = stored
            self._s.used += self._s.footprint(stored)
            self._s.set_op(key, op)
            if self._s.loading:
                self._s.touched.add(key)
            return True

    @property
    def nearly_full(self) -> bool:
        """Whether the write queue is more than 7/8 full (a lock-free hint: a put that
        must evict may have to wait for the writer)."""
        return self._s.queued_bytes * 8 > self._s.queue_limit * 7

    def wait_room(self, nbytes: int, timeout: float) -> bool:
        """Wait (up to ``timeout`` seconds) until the write queue has room for
        ``nbytes`` more; False at once when the tier is not writable (:attr:`fault`),
        stopping, or still full at the deadline. Takes no room: a caller that waited
        writes next, and may find it taken again."""
        deadline = time.monotonic() + timeout
        st = self._s
        with st.cond:
            while st.queued_bytes and st.queued_bytes + nbytes > st.queue_limit:
                remaining = deadline - time.monotonic()
                if st.fault or st.stopping or remaining <= 0:
                    return False
                st.cond.wait(remaining)
            return not st.fault and not st.stopping

    def wait_committed(self, keys: Sequence[bytes], timeout: float) -> int:
        """Wait (up to ``timeout`` seconds, never past a fault) until none of ``keys``
        is still queued; how many of them are then committed and live (on disk, in the
        file, not deleted or dropped since). Batches commit in queue order, so the
        writes queued before a key's (its ancestors') are committed with it or before."""
        deadline = time.monotonic() + timeout
        st = self._s
        with st.cond:
            while any(key in st.unflushed for key in keys) and not st.fault and not st.closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._s.cond.wait(remaining)
            return sum(1 for key in keys if key in self._s.sizes and key not in self._s.unflushed)

    def refuse(self) -> None:
        """Count a write its caller did not attempt because :attr:`fault` is set."""
        with self._s.cond:
            self._s.refused_writes += 1

    @property
    def fault(self) -> str:
        """Why the tier takes no writes now ("" when it does): the error of the last
        failed commit. Set by the writer when a commit fails for a reason other than
        map space (ENOSPC, EIO, ...): from then on :meth:`write` refuses, the effective
        capacity is lowered to what is committed (the store evicts down to it: see
        :meth:`drain_shrunk`), and the writer retries the queue every
        ``_FAULT_RETRY_S``. The first commit that succeeds clears it and gives the
        capacity back. Each change is one log line."""
        return self._s.fault

    def delete(self, key: bytes) -> None:
        """Queue the removal of ``key`` (a no-op if it is not live).

        Cancels a queued write of the same key; ``used_bytes`` drops at once and the
        block is no longer readable once this returns.
        """
        with self._s.cond:
            self._s.check_accepting()
            self._s.delete_locked(bytes(key))

    def touch(self, key: bytes, priority: int, last_access: float) -> None:
        """Queue a metadata update (coalesced; committed with the next batch)."""
        if not 0 <= priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be in [0, {MAX_PRIORITY}], got {priority}")
        key = bytes(key)
        with self._s.cond:
            self._s.check_accepting()
            if key not in self._s.sizes:
                return
            op = self._s.ops.get(key)
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
            self._s.seq += 1
            self._s.set_op(key, _Touch(self._s.seq, key, priority, last_access))

    def save_namespace(self, ns_digest: bytes, spec: dict[str, Any]) -> None:
        """Queue a namespace's declared fields for the next commit (does not wait: the
        queue commits in order, so it lands no later than the first block written after
        it, which is all a restart needs)."""
        if len(ns_digest) != DIGEST_SIZE:
            raise ValueError(f"ns_digest must be {DIGEST_SIZE} bytes, got {len(ns_digest)}")
        blob = json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()
        with self._s.cond:
            self._s.check_accepting()
            self._s.seq += 1
            # One queue entry per call (never coalesced): an earlier save may be in flight.
            key = _NS_PREFIX + bytes(ns_digest) + self._s.seq.to_bytes(8, "little")
            self._s.set_op(key, _SaveNamespace(self._s.seq, key, bytes(ns_digest), blob))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything queued before this call is committed, then sync.

        Raises TimeoutError if that takes longer than ``timeout`` seconds, and
        RuntimeError at once while the tier is not writable (:attr:`fault`): a flush
        never waits on a failing disk.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._s.cond:
            target = self._s.seq
            while self._s.min_pending_seq() <= target:
                if not self._writer.is_alive():
                    raise RuntimeError("the disk writer thread has stopped")
                if self._s.fault:
                    raise RuntimeError(f"the disk tier is not writable: {self._s.fault}")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"disk tier flush did not finish in {timeout} s")
                self._s.cond.wait(remaining)
        with self._s.resize.reading():
            if not self._s.closed:
                self._s.env.sync(True)

    # --- a lazy open: the environment, its check and its records, after the start --
    def open_checked(self) -> None:
        """A lazy open's second half (a no-op otherwise or when done): the open as a
        plain one does it (:meth:`_open_now`: the deep check in a child process, since
        a damaged page must not crash this one, a damaged environment moved aside).
        Until then nothing reads the file: writes queue up (and are read from the
        queue), the writer waits."""
        with self._s.close_lock:
            if self._s.checked or self._s.closed:
                return
            with self._s.resize.exclusive():
                try:
                    self._open_now(self._deep_check)
                except OSError as exc:
                    if exc.errno not in NO_ROOM or self.file_bytes() > 2 * self._s.psize:
                        raise
                    self._wait_for_room(os.strerror(exc.errno))  # a fresh one: nothing lost
                    return
                with self._s.cond:
                    self._s.used += self._pages_used()  # exact once the load ends
                    self._s.checked = True
                    self._s.fault = ""  # (set while it waited for room)
                    self._s.cond.notify_all()
            if self._room_wait is not None:
                log.warning(
                    "disk tier attached: %s has room again; it takes writes",
                    self._s.directory, extra={"event": "disk_attached"},
                )  # fmt: skip

    def _wait_for_room(self, reason: str) -> None:
        """A fresh environment could not be created (a full file system): the tier takes
        no writes (:attr:`fault`), reads miss, and a thread tries the open again each
        ROOM_POLL_S once the file system has room for the reserve twice over. One line
        now, one when it attaches."""
        with contextlib.suppress(FileNotFoundError):
            if os.path.getsize(self._s.data_path) == 0:  # else "damaged" next time
                os.unlink(self._s.data_path)
        with self._s.cond:
            self._s.fault = f"no room at {self._s.directory} to create the disk tier ({reason})"
        if self._room_wait is not None:
            return
        log.error(
            "disk tier off: no room at %s to create its files (%s); the daemon runs "
            "without it and attaches it once the file system has room (looked at every "
            "%.0f s)", self._s.directory, reason, ROOM_POLL_S,
            extra={"event": "disk_no_room"},
        )  # fmt: skip
        self._room_wait = threading.Thread(
            target=self._poll_room, name="kvstore-disk-room", daemon=True
        )
        self._room_wait.start()

    def _poll_room(self) -> None:
        need = 2 * self._s.reserve_bytes
        while True:
            with self._s.cond:
                self._s.cond.wait_for(lambda: self._s.stopping, ROOM_POLL_S)
                if self._s.stopping or self._s.checked:
                    return
            try:
                if free_bytes(self._s.directory) >= need:
                    self.open_checked()
            except Exception:
                log.exception("the disk tier could not be opened; it takes no writes")
                self.give_up_open("its open failed after the file system had room")
                return

    def file_bytes(self) -> int:
        """The size of the environment's data file (0 when there is none yet)."""
        try:
            return os.stat(self._s.data_path).st_size
        except FileNotFoundError:
            return 0

    @property
    def opened(self) -> bool:
        """Whether the environment is open (a lazy open: once :meth:`open_checked` ran)."""
        return self._s.checked

    def give_up_open(self, reason: str) -> None:
        """A lazy open failed (:meth:`open_checked` raised): the tier takes no writes
        from now on (:attr:`fault`), and its queue is given up at close."""
        with self._s.cond:
            self._s.fault = f"the disk tier could not be opened: {reason}"
            self._s.closed_unopened = True
            self._s.cond.notify_all()

    def record_count(self) -> int:
        """Records committed in the environment (LMDB's own count: no scan)."""
        with self._s.resize.reading(), self._s.env.begin() as txn:
            return int(txn.stat(self._s.meta)["entries"])

    @property
    def loading(self) -> bool:
        """Whether a lazy open's index load is still under way (until :meth:`end_load`)."""
        return self._s.loading

    def adopt(self, records: Sequence[tuple[bytes, int, bytes]]) -> list[bool]:
        """During a lazy open's load: count committed records (key, payload size,
        namespace digest) as live, except keys written or deleted since the open (their
        record is stale or already counted) and records of a namespace cleared since
        (:meth:`void_unloaded`); which were adopted."""
        with self._s.cond:
            sizes, touched, voided = self._s.sizes, self._s.touched, self._s.voided
            every = None in voided
            taken = [
                key not in touched and key not in sizes and not (every or digest in voided)
                for key, _, digest in records
            ]
            for (key, size, _), take in zip(records, taken, strict=True):
                if take:
                    sizes[key] = size
            return taken

    def delete_unloaded(self, keys: Sequence[bytes]) -> int:
        """Remove ``keys``, blocks the store has not indexed: while the index loads,
        records committed and not reached by its scan yet, or read and waiting for
        their parent (the scan never brings them back); after it, records it did not
        adopt (of a namespace cleared during the load). How many were live or in the
        file."""
        with self._s.cond:
            wanted = [bytes(key) for key in keys]
            unknown = [key for key in wanted if key not in self._s.sizes]
        committed: set[bytes] = set()
        if unknown and self.opened:
            with self._s.resize.reading(), self._s.env.begin() as txn:
                committed = {key for key in unknown if txn.get(key, db=self._s.meta)}
        with self._s.cond:
            found = 0
            for key in wanted:
                found += key in self._s.sizes or key in committed
                self._s.delete_locked(key, committed=key in committed)
            return found

    def void_unloaded(self, digests: Collection[bytes] | None) -> None:
        """While the index loads: the namespaces ``digests`` (None: every one) were
        cleared; none of their records is adopted from now on (the store removes those
        already read: :func:`kvstore.index_load.clear_unloaded`)."""
        with self._s.cond:
            if self._s.loading:
                self._s.voided.update([None] if digests is None else digests)

    def count_codec_mismatches(self, records: int) -> None:
        """``records`` the index load dropped for their codec (kvstore.index_load),
        counted with the reads that found one (``DiskStats.codec_mismatches``)."""
        with self._s.cond:
            self._s.codec_mismatches += records

    def end_load(self) -> None:
        """Every live record is known now: ``used_bytes`` becomes exact."""
        with self._s.cond:
            self._s.loading = False
            self._s.touched.clear()
            self._s.voided.clear()
            footprint = self._s.footprint
            self._s.used = sum(footprint(size) for size in self._s.sizes.values())
            if self._s.used > self._s.capacity:
                self._s.shrunk_pending = True  # the store evicts down to capacity

    # --- lifecycle --------------------------------------------------------------
    def close(self) -> None:
        """Commit everything queued, stop the writer, close the environment (idempotent)."""
        if self._room_wait is not None and not self._s.checked:
            self.give_up_open("it was closed while it waited for room")
        if not self._s.closed_unopened:
            self.open_checked()  # a lazy open never finished: the queue still goes to disk
        with self._s.close_lock:
            with self._s.cond:
                if self._s.closed:
                    return
                self._s.stopping = True  # new writes are refused; the writer drains
                self._s.cond.notify_all()
            self._writer.join()
            if not self._s.checked:  # never opened: nothing to sync or close
                os.close(self._s.owner_fd)
                with self._s.cond:
                    self._s.closed = True
                    self._s.cond.notify_all()
                return
            with self._s.resize.exclusive():
                try:
                    self._s.env.sync(True)
                finally:
                    self._s.env.close()
                    os.close(self._s.read_fd)
                    os.close(self._s.owner_fd)
                    with open_here_lock:
                        open_here.discard(os.path.realpath(self._s.directory))
                    with self._s.cond:
                        self._s.closed = True
                        self._s.cond.notify_all()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals: start-up ------------------------------------------------------
    def _open_now(self, deep_check: bool) -> None:
        """Open the environment, moving a damaged one aside first (see
        :mod:`kvstore.disk.files`): a damaged file never stops the start, it costs the
        blocks it held. ``deep_check`` also walks every B-tree in a child process. Then
        what depends on the open: the map's size and growth limit, the reserve file,
        the descriptor reads use."""
        damage = find_damage(self._s.directory)
        if damage is None and deep_check:
            damage = scan_in_child(self._s.directory)
        if damage is None:
            try:
                self._open_env(self._requested)
                damage = ""
            except _DAMAGE_ERRORS as exc:  # not I/O errors: a full disk is not damage
                damage = f"LMDB could not read it: {exc}"
        if damage:
            self._move_aside(damage)
            if not self._s.loading:  # (a lazy open counts only its queued writes so far)
                self._s.sizes.clear()
                self._s.used = 0
            self._open_env(self._requested)
        st = self._s
        # LMDB keeps an existing file's size if it is larger than what we asked for.
        st.map_size = st.env.info()["map_size"]
        requested = self._requested
        st.max_map_size = max(st.map_size, requested + int(requested * _MAX_GROWTH))
        st.capacity_floor = min(self.configured_capacity_bytes, st.max_map_size // 8)
        make_reserve(st.directory, st.reserve_bytes)  # no room for it: none, for now
        # Committed payloads are read with pread() from here into the caller's buffer:
        # no page faults on the map (a fresh process has mapped none of it), GIL released.
        st.read_fd = os.open(st.data_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        with open_here_lock:
            open_here.add(os.path.realpath(st.directory))

    def _move_aside(self, damage: str) -> None:
        moved = move_aside(self._s.directory)
        log.error(
            "disk tier in %s was damaged (%s); moved it aside to %s and started with an "
            "empty disk tier",
            self._s.directory, damage, moved, extra={"event": "disk_damaged"},
        )  # fmt: skip

    def _open_env(self, map_size: int) -> None:
        """Open LMDB, its databases, check the format and load the size map."""
        allocate_lock_file(self._s.directory)  # (no room: OSError, not SIGBUS)
        self._s.env = lmdb.open(
            self._s.directory,
            map_size=map_size,
            subdir=True,
            mode=0o600,  # data.mdb and lock.mdb; the directory itself is 0o700
            max_dbs=len(DB_NAMES),
            max_spare_txns=8,  # readers from several threads reuse reset txns
            readahead=self._s.readahead,
            sync=True,
            metasync=self._s.metasync,
            writemap=False,
            lock=True,
        )
        try:
            self._s.clear_stale_readers()  # reader slots left by a crashed process
            self._s.meta = self._s.env.open_db(META_DB)
            self._s.payload = self._s.env.open_db(b"payload")
            self._s.ns = self._s.env.open_db(NAMESPACES_DB)
            self._s.info = self._s.env.open_db(b"info")
            self._check_format()
            self._s.psize = self._s.env.stat()["psize"]
            if not self._s.loading:  # lazy: counted by the loader (open_checked, adopt)
                self._load_sizes()
        except BaseException:
            self._s.env.close()
            raise

    def _check_format(self) -> None:
        with self._s.env.begin(write=True) as txn:
            found = txn.get(FORMAT_KEY, db=self._s.info)
            if found is None:
                txn.put(FORMAT_KEY, FORMAT, db=self._s.info)
        if found is not None and found != FORMAT:
            raise ValueError(
                f"{self._s.directory} holds an LMDB disk tier of format {found!r}, "
                f"this build reads {FORMAT!r}"
            )

    def _pages_used(self) -> int:
        """Bytes of the pages the records occupy (a lazy open's ``used_bytes`` until
        its load ends: no record is read for it)."""
        used = 0
        with self._s.env.begin() as txn:
            for db in (self._s.meta, self._s.payload):
                st = txn.stat(db)
                used += (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]) * st["psize"]
        return used

    def _load_sizes(self) -> None:
        """Rebuild the size map and used_bytes from ``meta``; drop malformed records."""
        bad: list[bytes] = []
        with self._s.env.begin() as txn:
            for key, raw in txn.cursor(db=self._s.meta):
                try:
                    record = unpack_record(key, raw)
                except (ValueError, struct.error):
                    bad.append(bytes(key))
                    continue
                self._s.sizes[record.key] = record.size
                self._s.used += self._s.footprint(record.size)
        if bad:
            log.warning("dropping %d malformed disk records in %s", len(bad), self._s.directory)
            with self._s.env.begin(write=True) as txn:
                for key in bad:
                    txn.delete(key, db=self._s.payload)
                    txn.delete(key, db=self._s.meta)
