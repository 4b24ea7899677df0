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

Why that is safe is in :mod:`kvstore.host.slot_epochs`. The answer, not the remembered
slots, says which blocks the prefix has, so a prefix that grew or shrank is seen at
once; the remembered slots only decide what can be copied early.

A get whose last answer was **complete** (every block the request asks for, so the
prefix cannot have grown) needs no Acquire at all (:meth:`UnpinnedGet.read_known`):
when the counters of its slots still equal the epochs of that answer before and after
the copy, no slot was freed or refilled since the daemon named them, so they hold the
same blocks' final bytes, which is what the daemon would answer now (a block leaves
the index only with its slot freed). The daemon learns of such reads afterwards, in
batches (:mod:`kvclient.accounting`), and counts them as hits and touches
their blocks for eviction as it does for the reads it serves.

Rows of ``out`` past the blocks returned may be overwritten by the early copy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import xxhash

from kvclient.accounting import ReadKey
from kvclient.arena_path import ClientArena, read_runs
from kvclient.payloads import output_array
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1.results import ServerInfo
from kvstore.host.slot_epochs import READS_IN_ORDER, SlotEpochs
from kvstore.host.slot_runs import Run, slot_runs

READS_ENV = "KVCLIENT_READS"
LAST_SLOTS_ENTRIES = 4096  # prefixes remembered per client (a few KiB each at most)


def wanted_blocks(n_tokens: int, block_tokens: int, max_blocks: int) -> int:
    """The blocks a get of ``n_tokens`` tokens asks for (its full blocks, at most
    ``max_blocks`` when that is set): an answer with that many is complete."""
    full = n_tokens // block_tokens
    return min(full, max_blocks) if max_blocks else full


def epoch_table(arena: ClientArena, info: ServerInfo) -> SlotEpochs | None:
    """The daemon's slot epoch table in this mapping; None when unpinned reads are not
    possible (no table, or a CPU that may reorder loads: every get then pins, as on
    GH200) or are switched off (``KVCLIENT_READS=pinned``: the route of such hosts, on
    any host, which is how CI runs it)."""
    count, offset = info.slot_epochs_count, info.slot_epochs_offset
    pinned = os.environ.get(READS_ENV, "") == "pinned"
    if pinned or not READS_IN_ORDER or count <= 0 or offset % 8:
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
    runs: list[Run]  # their copy runs (kvstore.host.slot_runs)
    epochs: np.ndarray  # uint64: the answer's epoch of each slot
    complete: bool  # the answer had every block its request asked for

    @classmethod
    def of(
        cls,
        offsets: np.ndarray,
        epochs: SlotEpochs,
        block_bytes: int,
        answered: np.ndarray,
        complete: bool = False,
    ) -> Slots:
        entries = epochs.entries(offsets)
        return cls(offsets, entries, _prefix_runs(offsets, block_bytes), answered, complete)

    def first(self, n: int, block_bytes: int) -> Slots:
        if n >= self.offsets.size:
            return self
        offsets = self.offsets[:n]
        runs = _prefix_runs(offsets, block_bytes)
        return Slots(offsets, self.entries[:n], runs, self.epochs[:n], self.complete)


def _prefix_runs(offsets: np.ndarray, block_bytes: int) -> list[Run]:
    """Copy runs of the slots of blocks 0, 1, 2 ... (a prefix, in chain order)."""
    return slot_runs(offsets, block_bytes, strided=True)


class LastSlots:
    """The slots of the last unpinned answer per request, bounded (oldest out)."""

    def __init__(self, entries: int = LAST_SLOTS_ENTRIES) -> None:
        self._entries = entries
        self._slots: dict[ReadKey, Slots] = {}

    @staticmethod
    def key(ns_id: str, tokens: np.ndarray, extra: list[bytes], max_blocks: int) -> ReadKey:
        return (ns_id, xxhash.xxh3_128_digest(tokens.data), tuple(extra), max_blocks)

    def get(self, key: ReadKey) -> Slots | None:
        return self._slots.get(key)

    def remember(self, key: ReadKey, slots: Slots) -> None:
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
        wanted: int,
    ) -> None:
        """``wanted``: the blocks the request asks for (its tokens' full blocks, at most
        max_blocks when that is set)."""
        self._epochs = epochs
        self._arena = arena
        self._block_bytes = block_bytes
        self._out = out
        self._wanted = wanted
        if last is not None and max_blocks:
            last = last.first(max_blocks, block_bytes)
        self._last = last
        self._before: np.ndarray | None = None
        self._rows: np.ndarray | None = None  # where the early copy went

    @property
    def knows_all(self) -> bool:
        """Whether :meth:`read_known` may serve the get (the last answer was complete)."""
        return self._last is not None and self._last.complete

    def read_known(self) -> np.ndarray | None:
        """The blocks of the last answer, when it was complete and none of its slots
        changed since (checked before and after the copy); None otherwise (the caller
        asks the daemon). Nothing is sent: the caller reports the read later."""
        last = self._last
        if last is None or not last.complete:
            return None
        read = self._epochs.read
        if not np.array_equal(read(last.entries), last.epochs):
            return None
        rows = output_array(self._out, last.offsets.size, self._block_bytes)
        read_runs(self._arena.mapping, last.runs, rows, self._block_bytes)
        if not np.array_equal(read(last.entries), last.epochs):
            return None
        return rows[: last.offsets.size]

    def copy_early(self) -> None:
        """Copy the remembered slots into the output rows (no-op without any)."""
        last = self._last
        if last is None:
            return
        self._before = self._epochs.read(last.entries)
        self._rows = output_array(self._out, last.offsets.size, self._block_bytes)
        read_runs(self._arena.mapping, last.runs, self._rows, self._block_bytes)

    def finish(self, answer: pb.AcquireResponse) -> tuple[np.ndarray, Slots] | None:
        """(blocks ``uint8[n, block_bytes]``, their slots) of a checked unpinned answer;
        None when a slot changed during a copy (the caller acquires, pinned)."""
        offsets = np.array(answer.slot_offsets, dtype=np.int64)
        epochs = np.array(answer.slot_epochs, dtype=np.uint64)
        n = offsets.size
        if epochs.size != n:
            return None
        last, before = self._last, self._before
        complete = n >= self._wanted
        if last is not None and np.array_equal(last.offsets, offsets):
            # the usual case: nothing moved (the epochs may have, and the prefix grown)
            slots = Slots(last.offsets, last.entries, last.runs, epochs, complete)
        else:
            slots = Slots.of(offsets, self._epochs, self._block_bytes, epochs, complete)
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
