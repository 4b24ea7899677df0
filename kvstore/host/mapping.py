"""A process's mapping of the shared host arena: the daemon's own (under
:class:`kvstore.host.arena.HostArena`) and each client's (:func:`map_arena` by path,
:func:`map_fds` for a region handed over as a file descriptor), with the page tables
filled in the background or a range at a time (``MADV_POPULATE_*``) instead of a fault
per page. Clients import this module only, not the allocator.

An arena of several regions (one per tenant: kvstore.host.arena) is several files, and
the daemon sees them as one range of addresses: :func:`map_fds` reserves the range
(``PROT_NONE``, no memory) and maps each file at its place in it (``MAP_FIXED``). A
client maps its one region the same way, at the same offset of a range of its own, so
arena offsets mean the same in every process and nothing translates them; the rest of
its range stays reserved and unreadable."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


MADV_POPULATE_READ = 22  # <linux/mman.h>, Linux 5.14+: map pages in (page-table entries)
MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14+: fault pages in, writable
PREFAULT_CHUNK = 32 << 20  # one madvise call: how long close may wait for the thread


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None


def _load_madvise() -> Callable[[int, int, int], int] | None:
    libc = _libc()
    madvise = getattr(libc, "madvise", None)
    if madvise is None:
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise  # type: ignore[no-any-return]


_madvise = _load_madvise()


class _Prefaulter:
    """Faults a region's pages in on a background thread, PREFAULT_CHUNK at a time
    (the ctypes call releases the GIL, so the daemon keeps serving meanwhile)."""

    def __init__(self, array: np.ndarray, label: str, advice: int) -> None:
        self._stop = threading.Event()
        self._advice = advice
        self._thread = threading.Thread(
            target=self._run, args=(array, label), name="kvstore-prefault", daemon=True
        )
        self._thread.start()

    def _run(self, array: np.ndarray, label: str) -> None:
        if _madvise is None:
            return
        base, size = array.ctypes.data, array.nbytes
        started = time.monotonic()
        for offset in range(0, size, PREFAULT_CHUNK):
            if self._stop.is_set():
                return
            length = min(PREFAULT_CHUNK, size - offset)
            if _madvise(base + offset, length, self._advice) != 0:
                err = ctypes.get_errno()
                if err == errno.EFAULT:  # a page could not be allocated: SIGBUS territory
                    log.warning(
                        "arena %s: only %d of %d MiB could be faulted in: its file system "
                        "holds less than the arena (a container's /dev/shm is often "
                        "64 MiB); set arena_dir to a larger tmpfs or lower host_bytes, "
                        "or the daemon will crash writing past that point",
                        label,
                        offset >> 20,
                        size >> 20,
                    )
                else:
                    log.info(
                        "arena %s: not prefaulted (%s); pages fault in on first use",
                        label,
                        os.strerror(err),
                    )
                return
        log.info(
            "arena %s: %d MiB prefaulted in %.1f s",
            label,
            size >> 20,
            time.monotonic() - started,
        )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class ArenaMapping:
    """One process's mapping of an arena region; what a client gets from :func:`map_arena`.

    ``close`` unmaps. Views and arrays handed out earlier keep the mapping alive until
    they are dropped (unmapping under them would crash the process), so close never
    fails because of them.
    """

    def __init__(
        self, region: mmap.mmap | ctypes.Array[ctypes.c_ubyte], path: str | None, *,
        writable: bool, start: int = 0,
    ) -> None:  # fmt: skip
        """``region``: a file mapped whole (mmap), or a range of :func:`map_fds`;
        ``start``: the first offset mapped (below it the range is reserved only)."""
        self._region: mmap.mmap | ctypes.Array[ctypes.c_ubyte] | None = region
        self._array: np.ndarray | None = np.frombuffer(region, dtype=np.uint8)  # type: ignore[arg-type]
        if not writable:  # a read-only mapping of map_fds still exports a writable buffer
            self._array.flags.writeable = False
        self._buffer: memoryview | None = self._array.data
        self._prefaulter: _Prefaulter | None = None
        self.path = path
        self.start = start
        self.size = len(region)
        self.writable = writable

    def map_in_background(self, *, write: bool = False) -> None:
        """Fill this process's page table for the whole mapping on a background thread
        (``MADV_POPULATE_READ``). Each process that maps the arena pays a page fault on
        its first touch of every page. The daemon's arena does this with ``write``
        (``MADV_POPULATE_WRITE``, which allocates the pages). Clients do not: a whole
        arena mapped in while a new process makes its first calls slowed those calls
        several times over (docs/benchmarks/first-call.md); they map in the ranges
        they write (:meth:`map_in`). :meth:`stop_mapping_in` or
        :meth:`close` stops the thread."""
        if self._prefaulter is None and self._region is not None:
            advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
            self._prefaulter = _Prefaulter(self.array(), self.path or "(anonymous)", advice)

    def map_in(self, offset: int, size: int, *, write: bool) -> None:
        """Fill this process's page table for ``[offset, offset + size)`` now, in one
        call (``MADV_POPULATE_WRITE`` / ``_READ``) instead of a page fault per page: a
        write to pages this process has not touched yet faults on every page (no
        fault-around for writes to a shared file). Best effort: a no-op where the
        kernel lacks it."""
        if _madvise is None or self._region is None or size <= 0:
            return
        start = offset & ~(mmap.PAGESIZE - 1)
        base = self.array().ctypes.data
        _madvise(
            base + start,
            offset + size - start,
            MADV_POPULATE_WRITE if write else MADV_POPULATE_READ,
        )

    def stop_mapping_in(self) -> None:
        """Stop :meth:`map_in_background`'s thread (within one chunk); idempotent."""
        prefaulter, self._prefaulter = self._prefaulter, None
        if prefaulter is not None:
            prefaulter.stop()

    @property
    def closed(self) -> bool:
        return self._region is None

    def view(self, offset: int, size: int) -> memoryview:
        """Zero-copy view of ``region[offset:offset + size]`` (read-only if mapped so)."""
        if self._buffer is None:
            raise ValueError("arena mapping is closed")
        offset, size = operator.index(offset), operator.index(size)
        if offset < self.start or size < 0 or offset + size > self.size:
            raise ValueError(
                f"range [{offset}, {offset + size}) is outside the arena of {self.size} bytes"
            )
        return self._buffer[offset : offset + size]

    def array(self) -> np.ndarray:
        """The whole range as a uint8 array (no copy); offsets below :attr:`start`
        are not mapped."""
        if self._array is None:
            raise ValueError("arena mapping is closed")
        return self._array

    def close(self) -> None:
        """Unmap now, or when the last view handed out is dropped. Idempotent."""
        region, self._region = self._region, None
        if region is None:
            return
        self.stop_mapping_in()  # it must not touch an unmapped region
        if self._buffer is not None:
            self._buffer.release()
            self._buffer = None
        self._array = None
        if not isinstance(region, mmap.mmap):
            return  # map_fds: unmapped when the last view of it is dropped
        try:
            region.close()
        except BufferError:
            log.debug("arena %s: views still alive, unmapped when they are dropped", self.path)

    def __enter__(self) -> ArenaMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def map_arena(path: str, *, writable: bool = True) -> ArenaMapping:
    """Map an existing arena file (created by the daemon's :class:`HostArena`) by path."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size <= 0:
            raise ValueError(f"{path} is empty: not an arena")
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        region = mmap.mmap(fd, size, access=access)
    finally:
        os.close(fd)
    return ArenaMapping(region, path, writable=writable)


# -- several files side by side ----------------------------------------------------------

PROT_NONE, MAP_FIXED, MAP_NORESERVE = 0, 0x10, 0x4000  # <sys/mman.h>; the mmap module lacks them


def _load_mmap() -> tuple[Any, Any] | None:
    libc = _libc()
    if libc is None:
        return None
    mmap_, munmap = libc.mmap, libc.munmap
    mmap_.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
    ]
    mmap_.restype = ctypes.c_void_p
    munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    munmap.restype = ctypes.c_int
    return mmap_, munmap


_MMAP = _load_mmap()
_MAP_FAILED = ctypes.c_void_p(-1).value


def _unmap(address: int, size: int) -> None:
    assert _MMAP is not None
    _MMAP[1](address, size)


def map_fds(
    parts: Sequence[tuple[int, int, int]], size: int, *, writable: bool = True
) -> ctypes.Array[ctypes.c_ubyte]:
    """Reserve ``size`` bytes of addresses and map each ``(fd, offset, length)`` of
    ``parts`` there, ``MAP_SHARED | MAP_FIXED`` at ``offset``; the rest stays reserved
    (``PROT_NONE``). Returns the range as a ctypes byte array for :class:`ArenaMapping`;
    it is unmapped when the last reference to it (views included) goes. OSError when
    the kernel refuses."""
    if _MMAP is None:
        raise OSError(errno.ENOSYS, "mmap is not reachable through ctypes here")
    mmap_, munmap = _MMAP
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    base = mmap_(None, size, PROT_NONE, flags, -1, 0)
    if base in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), f"reserving {size} bytes of addresses")
    prot = mmap.PROT_READ | mmap.PROT_WRITE if writable else mmap.PROT_READ
    try:
        for fd, offset, length in parts:
            if offset < 0 or offset % mmap.PAGESIZE or offset + length > size:
                raise ValueError(f"a part [{offset}, {offset + length}) of a {size}-byte range")
            got = mmap_(base + offset, length, prot, mmap.MAP_SHARED | MAP_FIXED, fd, 0)
            if got != base + offset:
                raise OSError(ctypes.get_errno(), f"mapping {length} bytes at offset {offset}")
    except BaseException:
        munmap(base, size)
        raise
    region = (ctypes.c_ubyte * size).from_address(base)
    weakref.finalize(region, _unmap, base, size)
    return region
