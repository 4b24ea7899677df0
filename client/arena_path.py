"""The shared-arena data path: copying blocks straight into and out of daemon slots.

On the daemon's own host the client maps the daemon's host arena (a file in
``/dev/shm``) once, with :func:`kvstore.arena.map_arena`, and moves block bytes with
numpy copies while gRPC carries only slot offsets:

- put: ``Reserve`` (the daemon hands out pending slots under a write lease) -> copy
  each block into its slot -> ``Commit``. On any exception in between the client
  calls ``Abandon``, so no half-written block ever becomes visible; if the client
  dies instead, the lease expires and the daemon drops the pending blocks.
- get: ``Acquire`` (the ready prefix is pinned in host slots under a read lease) ->
  copy out of the slots -> ``Release`` in a ``finally``.

Slots that are adjacent in the arena and consecutive in the chain are copied with
one numpy copy per run, not one per block.

Whether the arena can be used is decided per client by :meth:`ClientArena.open`: the
daemon's ``host_id`` must equal this host's, and its arena file must be mappable.
The mapping is checked before each use (:meth:`ClientArena.is_current`) and made
again after the daemon restarted.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.arena import ArenaMapping, map_arena

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Slot:
    """One block's place in the arena: chain position ``index`` at ``[offset, offset+size)``."""

    index: int
    offset: int
    size: int


class ClientArena:
    """This process's mapping of the daemon's arena, and a check that it is still current.

    A daemon that stops unlinks its arena file and a restarted one creates a new file,
    so a mapping whose path no longer names the same inode belongs to a daemon that is
    gone: writing into it would commit garbage to the new one. :meth:`is_current` is a
    ``stat`` (about a microsecond), done before every Reserve / Acquire.
    """

    def __init__(self, mapping: ArenaMapping, path: str, identity: tuple[int, int]) -> None:
        self.mapping = mapping
        self.path = path
        self._identity = identity

    @classmethod
    def open(cls, arena_path: str, daemon_host_id: str, local_host_id: str) -> ClientArena | None:
        """Map the daemon's arena when it is on this host and its file maps; else None."""
        if not arena_path or not daemon_host_id or daemon_host_id != local_host_id:
            return None
        try:
            before = os.stat(arena_path)
            mapping = map_arena(arena_path, writable=True)
        except (OSError, ValueError) as exc:
            log.debug("cannot map arena %s: %s", arena_path, exc)
            return None
        return cls(mapping, arena_path, (before.st_dev, before.st_ino))

    def is_current(self) -> bool:
        """Whether the path still names the file that was mapped."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._identity

    def names_another_arena(self, reported_path: str) -> bool:
        """Whether a Reserve/Acquire answer is about an arena other than this mapping.

        The inode check cannot see a daemon that was SIGKILLed (its file stays) and
        restarted with a new arena: the daemon names its arena in every slot answer.
        """
        return bool(reported_path) and reported_path != self.path

    def close(self) -> None:
        self.mapping.close()


def runs(slots: Sequence[Slot], block_bytes: int) -> Iterator[tuple[int, int, int]]:
    """Group slots into runs -> (first position in ``slots``, count, arena offset).

    A run is consecutive slots whose chain indexes follow each other and whose
    ``block_bytes`` ranges touch in the arena, so one copy covers the whole run.
    """
    i = 0
    while i < len(slots):
        first = slots[i]
        j = i + 1
        while (
            j < len(slots)
            and slots[j].index == slots[j - 1].index + 1
            and slots[j].offset == slots[j - 1].offset + block_bytes
        ):
            j += 1
        yield i, j - i, first.offset
        i = j


def write_slots(
    mapping: ArenaMapping,
    slots: Sequence[Slot],
    blocks: np.ndarray | Sequence[np.ndarray],
    block_bytes: int,
    first_index: int,
) -> None:
    """Copy ``blocks[slot.index - first_index]`` into each slot.

    ``blocks`` is ``uint8[n, block_bytes]`` (one copy per run) or a sequence of
    ``uint8[block_bytes]`` rows (one copy per block).
    """
    arena = mapping.array()
    for pos, count, offset in runs(slots, block_bytes):
        row = slots[pos].index - first_index
        dst = arena[offset : offset + count * block_bytes].reshape(count, block_bytes)
        if isinstance(blocks, np.ndarray):
            np.copyto(dst, blocks[row : row + count])
        else:
            for i in range(count):
                np.copyto(dst[i], blocks[row + i])


def read_slots(
    mapping: ArenaMapping, slots: Sequence[Slot], out: np.ndarray, block_bytes: int
) -> None:
    """Copy each slot into ``out[slot.index]`` (uint8 ``[n, block_bytes]``)."""
    arena = mapping.array()
    for pos, count, offset in runs(slots, block_bytes):
        row = slots[pos].index
        src = arena[offset : offset + count * block_bytes].reshape(count, block_bytes)
        np.copyto(out[row : row + count], src)
