"""Slot epochs: counters that let a reader copy a slot without pinning it, then check.

A pinned read costs the daemon a lease (made, then released) and the client a round
trip before its copy can start. An unpinned read asks where the blocks are, copies
them, and keeps the copy only if no slot changed meanwhile. This module is the check:
a table of uint64 counters in the shared arena file, one per hash bucket of slot
offsets.

Protocol (the daemon writes, under the store's lock; clients only read):

- the counter of a slot goes up by one when the slot is **freed** and when a block in
  it becomes **ready** (committed by a writer, or promoted from disk). A slot's bytes
  are written only between those two events (by the writer that reserved it, or by a
  promotion), so between a "ready" and the next "free" they are final and constant.
- a reader takes the counter of each slot from the daemon's answer (read under the
  lock, when the answer named the slot as holding the block), reads the counter
  itself before and after its copy, and keeps the copy of a block only if all three
  are equal. Counters never go down, so equal values mean no free and no ready
  happened in between: the slot held that block's final bytes the whole time.
- slots share a counter when their offsets hash to the same entry: a bump for one is
  seen by the others, which only makes their check fail (the reader then pins).

Loads must stay in program order for the check to hold (the counter read after the
copy must not be served before the copy's loads): x86-64 guarantees that, so clients
use unpinned reads only there (:data:`READS_IN_ORDER`); elsewhere they pin.

The entry of offset ``o`` is ``((o >> 6) * FIB) mod 2**64 >> (64 - bits)``: Fibonacci
hashing spreads slots of any stride (a plain ``o >> 6`` would put all 256 KiB slots
of a 2 GiB arena in 64 entries).
"""

from __future__ import annotations

import platform
from collections.abc import Sequence

import numpy as np

FIB = np.uint64(0x9E3779B97F4A7C15)
DEFAULT_COUNT = 1 << 18  # at most 2 MiB of counters: collisions are rare below ~50k slots
READS_IN_ORDER = platform.machine().lower() in ("x86_64", "amd64")


def default_count(capacity_bytes: int) -> int:
    """Counters for an arena: one per 4 KiB page (no two slots share one below 4 KiB
    granularity), as a power of two, at least 64 and at most DEFAULT_COUNT."""
    pages = max(capacity_bytes // 4096, 1)
    return min(DEFAULT_COUNT, max(64, 1 << (pages - 1).bit_length()))


def table_bytes(count: int) -> int:
    """Bytes of a table of ``count`` counters, rounded up to whole pages."""
    return -(-count * 8 // 4096) * 4096


class SlotEpochs:
    """The epoch table, over ``count`` uint64 (a power of two) of a shared mapping."""

    def __init__(self, table: np.ndarray) -> None:
        count = table.size
        if count < 2 or count & (count - 1) or table.dtype != np.uint64:
            raise ValueError(f"an epoch table is a power-of-two count of uint64, got {count}")
        self.table = table
        self.count = count
        self._shift = np.uint64(64 - (count.bit_length() - 1))

    @classmethod
    def in_region(cls, region: np.ndarray, offset: int, count: int) -> SlotEpochs:
        """The table of ``count`` counters at byte ``offset`` of a uint8 mapping of the
        arena file (where ServerInfo.slot_epochs_offset/count say it is)."""
        return cls(region[offset : offset + count * 8].view(np.uint64))

    def entries(self, offsets: np.ndarray | Sequence[int]) -> np.ndarray:
        """The table entry of each slot offset (int64 indices)."""
        grains = np.asarray(offsets, dtype=np.uint64) >> np.uint64(6)
        return ((grains * FIB) >> self._shift).astype(np.int64)  # arrays wrap silently

    def read(self, entries: np.ndarray) -> np.ndarray:
        """The counters at ``entries`` now (a copy)."""
        return self.table[entries]

    def bump(self, offsets: Sequence[int]) -> None:
        """Daemon only, under its lock: the slots at ``offsets`` were freed or became
        ready. ``np.add.at``: two offsets of one entry bump it twice."""
        if len(offsets) == 1:
            self.table[self.entries(offsets)[0]] += np.uint64(1)
        elif offsets:
            np.add.at(self.table, self.entries(offsets), np.uint64(1))


class RegionEpochs(SlotEpochs):
    """The epoch tables of an arena of several regions (kvstore.host.arena), as one:
    a slot's counter is in its region's table, at the entry its offset hashes to in a
    table of that region's size. Each region's clients map that one table and find
    the same entry for an offset with a :class:`SlotEpochs` of it."""

    def __init__(self, region: np.ndarray, tables: Sequence[tuple[int, int, int]]) -> None:
        """``region``: the uint8 mapping of the whole arena; ``tables``: (slot base,
        table byte offset, count) of each region, in base order."""
        if any(offset % 8 or count < 2 or count & (count - 1) for _, offset, count in tables):
            raise ValueError(f"epoch tables must be 8-byte aligned powers of two: {tables}")
        self.table = region[: region.size & ~7].view(np.uint64)
        self.count = sum(count for _, _, count in tables)
        self._bases = np.array([base for base, _, _ in tables], dtype=np.uint64)
        self._starts = np.array([offset // 8 for _, offset, _ in tables], dtype=np.int64)
        self._shifts = np.array(
            [64 - (count.bit_length() - 1) for _, _, count in tables], dtype=np.uint64
        )

    def entries(self, offsets: np.ndarray | Sequence[int]) -> np.ndarray:
        at = np.asarray(offsets, dtype=np.uint64)
        which = np.searchsorted(self._bases, at, side="right") - 1
        hashed = ((at >> np.uint64(6)) * FIB) >> self._shifts[which]
        return self._starts[which] + hashed.astype(np.int64)
