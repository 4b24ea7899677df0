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
from kvstore.arena import ArenaMapping

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
    """The daemon's disk tier file, open read-only."""

    def __init__(self, fd: int, path: str) -> None:
        self._fd = fd
        self.path = path

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

    def read(self, blocks: np.ndarray, extents: DiskExtents) -> bool:
        """Read every extent into ``blocks[position]`` (uint8 ``[n, block_bytes]``, C
        order) and check it; False when any block came back short or failed its
        checksum (what landed in ``blocks`` is then not to be used)."""
        rows = list(zip(extents.positions, extents.offsets, extents.checksums, strict=True))
        if COPY_THREADS < 2 or len(rows) < 2 or blocks[0].nbytes * len(rows) < PARALLEL_COPY_BYTES:
            return self._read_rows(blocks, rows)
        share = -(-len(rows) // COPY_THREADS)
        parts = [rows[k : k + share] for k in range(0, len(rows), share)]
        futures: list[Future[bool]] = [
            copy_pool().submit(self._read_rows, blocks, part) for part in parts[1:]
        ]
        mine = self._read_rows(blocks, parts[0])
        return all([future.result() for future in futures]) and mine

    def _read_rows(self, blocks: np.ndarray, rows: list[tuple[int, int, int]]) -> bool:
        size = blocks.shape[1]
        for position, offset, checksum in rows:
            row = blocks[position]
            if os.preadv(self._fd, [row], offset) != size:
                return False
            if xxhash.xxh3_64_intdigest(row) != checksum:
                return False
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


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
