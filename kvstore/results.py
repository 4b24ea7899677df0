"""The store's own result types: leases, slots and prefixes, which carry keys and
arena offsets that only the daemon sees.

They carry no references into the store (no nodes, no locks). What crosses the wire
as it is (put counts, stats, events) is in :mod:`kvproto.v1.results`, one set for the
store, the daemon and the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

from kvstore.keys import BlockKey


class Tier(str, Enum):
    HOST = "host"
    DISK = "disk"


class EventKind(str, Enum):
    STORED = "stored"  # a block became ready (committed) in the store
    REMOVED = "removed"  # a block left the store entirely
    DEMOTED = "demoted"  # host -> disk
    PROMOTED = "promoted"  # disk -> host
    PENDING_DROPPED = "pending_dropped"  # a reserved block was abandoned or its lease ran out
    CORRUPT = "corrupt"  # a disk record failed its checksum and was dropped


@dataclass(frozen=True, slots=True)
class ReadyPrefix:
    """Longest usable prefix of a key chain (the daemon answers a Lookup with its counts).

    ``ready_blocks`` counts blocks from the root that are ready and stored with all
    their ancestors; ``host_blocks + disk_blocks == ready_blocks`` (a block held in
    both tiers counts as host). ``pending_keys`` are the reserved-but-uncommitted
    blocks that directly follow the ready prefix (an owner is computing them).
    """

    ready_blocks: int
    host_blocks: int
    disk_blocks: int
    pending_keys: tuple[BlockKey, ...] = ()
    shared_blocks: int = 0  # of host_blocks, pulled from the shared tier by this call


@dataclass(frozen=True, slots=True)
class SlotRef:
    """One block's bytes in the shared host arena: ``arena[offset : offset + size]``."""

    index: int  # position of the block in the request's key chain
    key: BlockKey
    offset: int
    size: int


def slot_refs(
    first: int, keys: Sequence[BlockKey], offsets: Sequence[int], size: int
) -> tuple[SlotRef, ...]:
    """SlotRefs of the blocks at chain positions ``first``, ``first + 1``, ... (what a
    result keeps as keys and offsets, for callers that want one object per block)."""
    return tuple(
        SlotRef(first + i, key, offset, size)
        for i, (key, offset) in enumerate(zip(keys, offsets, strict=True))
    )


@dataclass(frozen=True, slots=True)
class Reservation:
    """Write lease from :meth:`Store.reserve`: fill each slot, then commit.

    The newly reserved (pending) blocks are chain positions ``first_index`` on, in
    chain order: ``keys`` and their host arena ``offsets`` (``slots`` gives them as
    SlotRefs). Blocks of the request that were already ready are counted in
    ``existing``; blocks that could not be reserved (no room, or pending under another
    owner) end the reservation, and so do the blocks after one window of a chain too
    long for the host tier (:attr:`more`).
    """

    lease_id: int
    expires_at: float  # monotonic clock
    existing: int
    refused: int
    out_of_space: bool = False  # a block was refused because no room could be made
    # ... because only the disk writer could make it, and put_wait_ms ran out
    writer_behind: bool = False
    first_index: int = 0
    keys: tuple[BlockKey, ...] = ()
    offsets: tuple[int, ...] = ()
    block_bytes: int = 0
    # staged slots (see Store.reserve): the staging lease the call used or made (0:
    # none), the slots it set aside now, and by how long each use renews the lease
    stage_lease_id: int = 0
    staged: tuple[int, ...] = ()
    stage_ttl_s: float = 0.0

    @property
    def slots(self) -> tuple[SlotRef, ...]:
        """The reserved blocks as SlotRefs (built on demand: the hot path uses
        ``offsets``)."""
        return slot_refs(self.first_index, self.keys, self.offsets, self.block_bytes)

    @property
    def more(self) -> bool:
        """Whether this is one window of a chain too long for the host tier: the
        blocks after it were not refused for want of room, they are for the next
        reserve, from ``first_index + len(offsets)`` (kvstore.store_writes)."""
        return bool(self.offsets) and self.refused > 0 and not self.out_of_space


@dataclass(frozen=True, slots=True)
class Acquisition:
    """Read lease from :meth:`Store.acquire`: the ready prefix, pinned in host slots."""

    lease_id: int  # 0 when no block was pinned (nothing to release)
    expires_at: float
    keys: tuple[BlockKey, ...]  # of blocks first_index .. first_index + n-1 of the chain
    offsets: tuple[int, ...]  # their host arena offsets
    block_bytes: int
    first_index: int = 0  # the chain position of the first pinned block (see acquire)
    # the ready prefix's length, in any tier, when it goes on past the pinned blocks
    # (the host room capped them, or held no more); else 0
    ready_blocks: int = 0

    @property
    def slots(self) -> tuple[SlotRef, ...]:
        """The same as SlotRefs (built on demand: the hot path uses ``offsets``)."""
        return slot_refs(self.first_index, self.keys, self.offsets, self.block_bytes)


@dataclass(frozen=True, slots=True)
class Located:
    """From :meth:`Store.locate`: the ready prefix's host slots, not pinned, with the
    epoch of each slot when they were read (see :mod:`kvstore.host.slot_epochs`)."""

    offsets: tuple[int, ...]  # host arena offsets of blocks 0 .. n-1 of the chain
    epochs: np.ndarray  # uint64, one per offset
    block_bytes: int
