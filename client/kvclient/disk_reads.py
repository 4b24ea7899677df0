"""Disk-tier blocks read straight from the daemon's data file (same-host clients).

A block on disk only costs the daemon a read into a host slot (a promotion) and the
client a copy out of that slot, plus the daemon's time in between. An arena get asks
its Acquire with ``disk_direct`` instead: the daemon answers disk-only blocks that are
on their first read as *extents* of its disk tier's file (``ServerInfo.disk_path``:
offset and xxh3-64 of each block's bytes) under the read lease, whose LMDB snapshot
keeps those bytes in place until the lease is released. The client preads each
extent into the caller's buffer (from the page cache when warm: one copy in all, GIL
released) and keeps a block only if its checksum matches. A mismatch means damage on
disk or a file that is not the daemon's any more: the get then asks again without
``disk_direct``, so the daemon reads the block itself, and drops it if it is damaged.

The file is opened read-only once per daemon (:meth:`DiskFile.open`); a client that
may not open it (another user: the file is the daemon's user's only) simply never
asks for extents.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import xxhash

from kvclient.arena_path import (
    COPY_THREADS,
    PARALLEL_COPY_BYTES,
    SlotTable,
    copy_pool,
    read_slots,
)
from kvclient.disk_index import DiskFirstReads, DiskIndex
from kvclient.payloads import output_array
from kvstore.arena_mapping import ArenaMapping
from kvstore.disk_format import DiskExtent
from kvstore.errors import StoreError
from kvstore.keys import chain_keys

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DiskExtents:
    """The disk_direct part of an Acquire answer: chain positions of the blocks to
    read from the disk file, each one's byte offset there and its xxh3-64."""

    positions: list[int]
    offsets: list[int]
    checksums: list[int]

    def __len__(self) -> int:
        return len(self.positions)


class DiskFile:
    """The daemon's disk tier file, open read-only, and its index where this process
    can read that too (:mod:`kvclient.disk_index`: disk hits with no call)."""

    def __init__(self, fd: int, path: str) -> None:
        self._fd = fd
        self.path = path
        self._nowait = hasattr(os, "RWF_NOWAIT")  # False once the file system says no
        self._index: DiskIndex | None = None
        self._index_pid = 0  # the process _index was opened in (0: not tried yet)

    @classmethod
    def open(cls, path: str) -> DiskFile | None:
        """None when the daemon names no file or this process may not read it."""
        if not path:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            log.info("disk blocks go through the daemon: cannot open %s (%s)", path, exc)
            return None
        return cls(fd, path)

    @property
    def index(self) -> DiskIndex | None:
        """The disk tier's index for reads with no call (:mod:`kvclient.disk_index`),
        opened on first use in each process; None where it cannot be read, or when
        ``KVCLIENT_DISK_INDEX=0`` turns those reads off."""
        pid = os.getpid()
        if self._index_pid != pid:  # first use, or a forked child: never the parent's
            self._index_pid = pid
            off = os.environ.get("KVCLIENT_DISK_INDEX", "1") == "0"
            self._index = None if off or self._fd < 0 else DiskIndex.open(self.path)
        return self._index

    def open_index_now(self) -> None:
        """Open this process's index at connect rather than in its first read."""
        _ = self.index

    def read(self, blocks: np.ndarray, extents: DiskExtents) -> bool:
        """Read every extent into ``blocks[position]`` (uint8 ``[n, block_bytes]``, C
        order) and check it; False when any block came back short or failed its
        checksum (what landed in ``blocks`` is then not to be used)."""
        rows = list(zip(extents.positions, extents.offsets, extents.checksums, strict=True))
        return self._read_split(blocks, rows, 0)

    def read_cached(self, blocks: np.ndarray, extents: Sequence[DiskExtent]) -> bool:
        """:meth:`read` of ``extents[i]`` into ``blocks[i]``, from the page cache only
        (``RWF_NOWAIT``): False as soon as a block would need disk I/O."""
        if not self._nowait:
            return False
        rows = [(i, extent.offset, extent.checksum) for i, extent in enumerate(extents)]
        return self._read_split(blocks, rows, os.RWF_NOWAIT)

    def _read_split(self, blocks: np.ndarray, rows: list[tuple[int, int, int]], flags: int) -> bool:
        if COPY_THREADS < 2 or len(rows) < 2 or blocks[0].nbytes * len(rows) < PARALLEL_COPY_BYTES:
            return self._read_rows(blocks, rows, flags)
        share = -(-len(rows) // COPY_THREADS)
        parts = [rows[k : k + share] for k in range(0, len(rows), share)]
        futures: list[Future[bool]] = [
            copy_pool().submit(self._read_rows, blocks, part, flags) for part in parts[1:]
        ]
        mine = self._read_rows(blocks, parts[0], flags)
        return all([future.result() for future in futures]) and mine

    def _read_rows(self, blocks: np.ndarray, rows: list[tuple[int, int, int]], flags: int) -> bool:
        size = blocks.shape[1]
        for position, offset, checksum in rows:
            row = blocks[position]
            try:
                if os.preadv(self._fd, [row], offset, flags) != size:
                    return False
            except BlockingIOError:  # RWF_NOWAIT: not in the page cache
                return False
            except OSError as exc:
                if not flags:
                    raise
                self._nowait = False  # e.g. EOPNOTSUPP: this file system cannot tell
                log.info(
                    "disk hits go through the daemon: %s cannot be read without waiting (%s)",
                    self.path,
                    exc,
                )
                return False
            if xxhash.xxh3_64_intdigest(row) != checksum:
                return False
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        index, self._index = self._index, None
        if index is not None and self._index_pid == os.getpid():
            index.close()


def read_answer(
    mapping: ArenaMapping,
    slots: SlotTable,
    extents: DiskExtents | None,
    disk: DiskFile | None,
    blocks: np.ndarray,
    block_bytes: int,
) -> bool:
    """Fill ``blocks`` from a pinned Acquire answer: its host ``slots`` copied out of the
    arena, its disk ``extents`` read from ``disk``. False when a disk block could not be
    read or failed its check (then ask again without disk_direct)."""
    if len(slots):
        read_slots(mapping, slots, blocks, block_bytes)
    if extents is None:
        return True
    return disk is not None and disk.read(blocks, extents)


def read_first_from_file(
    disk: DiskFile | None,
    first_reads: DiskFirstReads,
    ns_id: str,
    key: Hashable,
    tokens: np.ndarray,
    extra: list[bytes],
    out: np.ndarray | None,
    block_bytes: int,
    wanted: int,
) -> np.ndarray | None:
    """The ``wanted`` blocks of a get read from the disk file with no call, when this
    is the client's first read of the prefix (``key``) and every rule of
    :mod:`kvclient.disk_index` holds; None (ask the daemon) otherwise. ``out`` as for
    a get (its rows may be written either way)."""
    index = disk.index if disk is not None else None
    if index is None or wanted == 0 or not first_reads.first(key):
        return None
    spec = index.spec(ns_id)
    if spec is None or spec.block_bytes != block_bytes:
        return None
    try:
        keys = chain_keys(spec, tokens, extra, max_blocks=wanted)
    except StoreError:  # bad tokens: the daemon's answer says what is wrong
        return None
    if len(keys) < wanted:
        return None
    blocks = output_array(out, wanted, block_bytes)
    return blocks if index.read(keys, blocks, disk) else None
