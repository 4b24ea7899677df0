"""Unpinned arena gets: copy while the Acquire is in flight, then check the slot epochs.

A pinned get is strictly sequential: Acquire (a round trip, and a lease the daemon
makes and later releases), then the copy. An unpinned get overlaps the two:

1. Before sending, the client looks up the slots the daemon named the last time this
   client asked for the same prefix (:class:`LastSlots`, keyed by namespace, tokens,
   extra keys and max_blocks), reads their epoch counters, and sends an
   ``Acquire(unpinned=True)``.
2. While the daemon answers, it copies those slots into the output rows.
3. The answer names the slots (authoritative: the current ready prefix) with their
   epochs at answer time. Rows whose slot is the one copied, with the epoch read
   before the copy equal to the answer's, are kept; the others are copied now.
4. After every copy it reads the counters again: if any differs from the answer's
   epoch the get is not trusted and the caller acquires again, pinned (the usual path).

Why that is safe is in :mod:`kvstore.slot_epochs`. The answer, not the remembered
slots, says which blocks the prefix has, so a prefix that grew or shrank is seen at
once; the remembered slots only decide what can be copied early.

Rows of ``out`` past the blocks returned may be overwritten by the early copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from kvclient.arena_path import ClientArena, Run, SlotTable, read_runs, slot_runs
from kvclient.payloads import output_array
from kvclient.results import ServerInfo
from kvproto.v1 import kvstore_pb2 as pb
from kvstore.slot_epochs import READS_IN_ORDER, SlotEpochs

LAST_SLOTS_ENTRIES = 4096  # prefixes remembered per client (a few KiB each at most)
# An early copy of at least this many bytes is split over threads like any other; a
# smaller one runs on one thread, the daemon's answer taking the other core (measured
# back to back, 16 blocks: 4 MiB 0.59-0.74 ms on one thread vs 0.64-0.77 on two; 16 MiB
# 2.6-3.1 ms vs 1.3-1.9).
EARLY_PARALLEL_BYTES = 8 << 20

_Key = tuple[str, bytes, tuple[bytes, ...], int]


def epoch_table(arena: ClientArena, info: ServerInfo) -> SlotEpochs | None:
    """The daemon's slot epoch table in this mapping; None when unpinned reads are not
    possible (no table, or a CPU that may reorder loads)."""
    count, offset = info.slot_epochs_count, info.slot_epochs_offset
    if not READS_IN_ORDER or count <= 0 or offset % 8:
        return None
    array = arena.mapping.array()
    if offset + count * 8 > array.size:
        return None
    try:
        return SlotEpochs.in_region(array, offset, count)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Slots:
    """The slots of one unpinned answer, with what copying and checking them needs."""

    offsets: np.ndarray  # int64, block i of the prefix first
    entries: np.ndarray  # their epoch table entries
    runs: list[Run]  # their copy runs (arena_path.slot_runs)

    @classmethod
    def of(cls, offsets: np.ndarray, epochs: SlotEpochs, block_bytes: int) -> Slots:
        return cls(offsets, epochs.entries(offsets), _prefix_runs(offsets, block_bytes))

    def first(self, n: int, block_bytes: int) -> Slots:
        if n >= self.offsets.size:
            return self
        offsets = self.offsets[:n]
        return Slots(offsets, self.entries[:n], _prefix_runs(offsets, block_bytes))


def _prefix_runs(offsets: np.ndarray, block_bytes: int) -> list[Run]:
    """Copy runs of the slots of blocks 0, 1, 2 ... (a prefix, in chain order)."""
    return slot_runs(SlotTable(np.arange(offsets.size, dtype=np.int64), offsets), block_bytes)


class LastSlots:
    """The slots of the last unpinned answer per request, bounded (oldest out)."""

    def __init__(self, entries: int = LAST_SLOTS_ENTRIES) -> None:
        self._entries = entries
        self._slots: dict[_Key, Slots] = {}

    @staticmethod
    def key(ns_id: str, tokens: np.ndarray, extra: list[bytes], max_blocks: int) -> _Key:
        return (ns_id, xxhash.xxh3_128_digest(tokens), tuple(extra), max_blocks)

    def get(self, key: _Key) -> Slots | None:
        return self._slots.get(key)

    def remember(self, key: _Key, slots: Slots) -> None:
        known = self._slots
        if not slots.offsets.size:
            known.pop(key, None)
            return
        if key not in known and len(known) >= self._entries:
            known.pop(next(iter(known)), None)
        known[key] = slots


class UnpinnedGet:
    """One unpinned get: :meth:`copy_early` while the Acquire is in flight, then
    :meth:`finish` with its answer."""

    def __init__(
        self,
        epochs: SlotEpochs,
        arena: ClientArena,
        last: Slots | None,
        out: np.ndarray | None,
        block_bytes: int,
        max_blocks: int,
    ) -> None:
        self._epochs = epochs
        self._arena = arena
        self._block_bytes = block_bytes
        self._out = out
        if last is not None and max_blocks:
            last = last.first(max_blocks, block_bytes)
        self._last = last
        self._before: np.ndarray | None = None
        self._rows: np.ndarray | None = None  # where the early copy went

    def copy_early(self) -> None:
        """Copy the remembered slots into the output rows (no-op without any)."""
        last = self._last
        if last is None:
            return
        self._before = self._epochs.read(last.entries)
        self._rows = output_array(self._out, last.offsets.size, self._block_bytes)
        # small copies on one thread: the daemon is answering on another core meanwhile
        one = last.offsets.size * self._block_bytes < EARLY_PARALLEL_BYTES
        read_runs(self._arena.mapping, last.runs, self._rows, self._block_bytes, one_thread=one)

    def finish(self, answer: pb.AcquireResponse) -> tuple[np.ndarray, Slots] | None:
        """(blocks ``uint8[n, block_bytes]``, their slots) of a checked unpinned answer;
        None when a slot changed during a copy (the caller acquires, pinned)."""
        offsets = np.array(answer.slot_offsets, dtype=np.int64)
        epochs = np.array(answer.slot_epochs, dtype=np.uint64)
        n = offsets.size
        if epochs.size != n:
            return None
        last, before = self._last, self._before
        if last is not None and np.array_equal(last.offsets, offsets):
            slots = last  # the usual case: nothing moved
        else:
            slots = Slots.of(offsets, self._epochs, self._block_bytes)
        kept = 0
        if last is not None and before is not None:
            m = min(last.offsets.size, n)
            same = (last.offsets[:m] == offsets[:m]) & (before[:m] == epochs[:m])
            kept = m if same.all() else int(np.argmin(same))
        rows = self._out if self._out is not None else self._rows  # out holds max_blocks
        if rows is None or rows.shape[0] < n:
            grown = output_array(None, n, self._block_bytes)
            if kept and rows is not None:
                grown[:kept] = rows[:kept]
            rows = grown
        if kept < n:
            rest = _prefix_runs(offsets[kept:], self._block_bytes)
            read_runs(self._arena.mapping, rest, rows, self._block_bytes, first_row=kept)
        if not np.array_equal(self._epochs.read(slots.entries), epochs):
            return None
        return rows[:n], slots
