"""The shared-arena data path: copying blocks straight into and out of daemon slots.

On the daemon's own host the client maps the daemon's host arena (a file in
``/dev/shm``) once, with :func:`kvstore.host.mapping.map_arena`, or, for a tenant with its
own region, the region the daemon hands it as a file descriptor
(:mod:`kvproto.v1.arena_handout`), at its arena offset. It moves block bytes with numpy
copies while gRPC carries only slot offsets:

- put: ``Reserve`` (the daemon hands out pending slots under a write lease) -> copy
  each block into its slot -> ``Commit``. On any exception in between the client
  calls ``Abandon``, so no half-written block ever becomes visible; if the client
  dies instead, the lease expires and the daemon drops the pending blocks.
- get: ``Acquire`` (the ready prefix is pinned in host slots under a read lease) ->
  copy out of the slots -> ``Release``.
- zero-copy reads: ``Acquire`` -> :func:`slot_views` hands out read-only numpy views
  of the slots themselves -> ``Release`` when the caller is done with them.

Copies never loop over blocks in Python. The slots of a request are grouped into
*runs* (:func:`kvstore.host.slot_runs.slot_runs`, strided): consecutive chain positions
whose arena offsets step by one constant stride. Large blocks are allocated at rising,
adjacent offsets (one run, stride ``block_bytes``); small ones are carved from the
top of a free extent down (one run with a negative stride). A run is one strided
numpy view, so a whole batch is usually one ``np.copyto``. numpy releases the GIL for
these copies, and a large batch is split between threads (:func:`parallel_copy`):
on a machine with a free core that copies close to twice as fast as one thread.

Whether the arena can be used is decided per client by :meth:`ClientArena.open`: the
daemon's ``host_id`` must equal this host's, and its arena file (or region) must be
mappable.
The mapping is checked before each use (:meth:`ClientArena.is_current`) and made
again after the daemon restarted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvproto.v1.arena_handout import FD_PREFIX, fetch_region
from kvproto.v1.host import host_id
from kvproto.v1.results import ServerInfo
from kvstore.host.mapping import ArenaMapping, map_arena, map_fds
from kvstore.host.slot_runs import Run, slot_runs
from kvstore.stream_copy import copy_into

log = logging.getLogger(__name__)

# A copy of at least this many bytes is split between COPY_THREADS threads (the caller
# and helpers). Below it a thread hand-off costs more than it saves, and the daemon
# wants the other core. Copies out of the arena, one thread vs two, medians (2-core
# VMs): 4 MiB 0.146 vs 0.18-0.20 ms, 8 MiB 0.285 vs 0.31, 16 MiB 0.58 vs 0.51 (AMD EPYC,
# 2026-11-23); an earlier host's early copies: 4 MiB 0.59-0.74 vs 0.64-0.77, 16 MiB
# 2.6-3.1 vs 1.3-1.9.
PARALLEL_COPY_BYTES = 8 << 20
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True, slots=True)
class Slot:
    """One block's place in the arena: chain position ``index`` at ``[offset, offset+size)``."""

    index: int
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class SlotTable:
    """The slots of one Reserve / Acquire answer as two int64 arrays (chain order)."""

    indices: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return int(self.indices.size)

    @classmethod
    def of(cls, slots: Sequence[Slot]) -> SlotTable:
        n = len(slots)
        return cls(
            np.fromiter((s.index for s in slots), np.int64, n),
            np.fromiter((s.offset for s in slots), np.int64, n),
        )


class ClientArena:
    """This process's mapping of the daemon's arena, and a check that it is still current.

    A daemon that stops unlinks its arena file and a restarted one creates a new file,
    so a mapping whose path no longer names the same inode belongs to a daemon that is
    gone: writing into it would commit garbage to the new one. :meth:`is_current` is a
    ``stat`` (about a microsecond), done before every Reserve / Acquire.
    """

    def __init__(
        self, mapping: ArenaMapping, path: str, identity: tuple[int, int] | None
    ) -> None:
        self.mapping = mapping
        self.path = path  # the arena_path answers name it by
        self._identity = identity  # the file's (st_dev, st_ino); None: handed out by fd

    @classmethod
    def open(cls, info: ServerInfo, token: str = "", timeout: float = 10.0) -> ClientArena | None:
        """Map the daemon's arena when it is on this host and maps here (its file by
        path; a tenant's own region by fd, asked for with ``token``); else None."""
        arena_path = info.arena_path
        if not arena_path or not info.host_id or info.host_id != host_id():
            return None
        if arena_path.startswith(FD_PREFIX):
            return cls._handed_out(info, token, timeout)
        try:
            before = os.stat(arena_path)
            mapping = map_arena(arena_path, writable=True)
        except (OSError, ValueError) as exc:
            log.debug("cannot map arena %s: %s", arena_path, exc)
            return None
        return cls(mapping, arena_path, (before.st_dev, before.st_ino))

    @classmethod
    def _handed_out(cls, info: ServerInfo, token: str, timeout: float) -> ClientArena | None:
        """This tenant's region (:func:`map_handed_out`); None, logged, when it cannot be."""
        try:
            mapping, name = map_handed_out(info.arena_socket, token, timeout, info.uid)
        except (OSError, ValueError) as exc:
            log.debug("no arena region from %s: %s", info.arena_socket or "(none)", exc)
            return None
        return cls(mapping, name, None)

    def is_current(self) -> bool:
        """Whether the path still names the file that was mapped (a region handed out
        by fd has no path: answers that name another arena tell a restart)."""
        if self._identity is None:
            return True
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

    def close_behind(self) -> None:
        """:meth:`close` on a thread of its own, at the lowest CPU priority. The mapping
        of a daemon that is gone can hold the last reference to its arena, and unmapping
        it then frees every page the arena had: a cost in proportion to the arena, which
        the request that found the new daemon must not pay, nor the engine's next steps
        (on a busy machine the thread waits for idle CPU)."""
        threading.Thread(target=self._close_last, name="kvclient-unmap", daemon=True).start()

    def _close_last(self) -> None:
        if sys.platform == "linux":  # a thread's own priority (its id names it there)
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        self.close()


def map_handed_out(
    socket_path: str, token: str, timeout: float, daemon_uid: int | None,
    *, writable: bool = True,
) -> tuple[ArenaMapping, str]:  # fmt: skip
    """Map the region the daemon on ``socket_path`` hands ``token``'s tenant
    (kvproto.v1.arena_handout) at its arena offset, so the offsets in answers need no
    translating; -> the mapping and the region's name (the arena_path answers give).
    OSError or ValueError saying why not."""
    fd, reply = fetch_region(socket_path, token, timeout, daemon_uid)
    try:
        offset, length = int(reply["offset"]), int(reply["length"])  # type: ignore[call-overload]
        region = map_fds([(fd, offset, length)], offset + length, writable=writable)
    except TypeError as exc:
        raise ValueError(f"not a region: {reply}") from exc
    finally:
        os.close(fd)
    return ArenaMapping(region, None, writable=writable, start=offset), str(reply["arena"])


# -- runs -----------------------------------------------------------------------------


def run_view(arena: np.ndarray, run: Run, block_bytes: int, *, writable: bool) -> np.ndarray:
    """``uint8[run.count, block_bytes]`` view of the run's slots, in chain order.

    Raises ValueError if any byte of the run lies outside the mapping (offsets come
    from another process: never make a strided view past the end of the arena).
    """
    count, stride, offset = run.count, run.stride, run.offset
    last = offset + (count - 1) * stride
    low, high = min(offset, last), max(offset, last) + block_bytes
    if low < 0 or high > arena.size or block_bytes <= 0:
        raise ValueError(f"slots [{low}, {high}) are outside the arena of {arena.size} bytes")
    if abs(stride) == block_bytes:
        view = arena[low:high].reshape(count, block_bytes)
        return view if stride > 0 else view[::-1]
    base = arena[low:high]
    view = as_strided(base, (count, block_bytes), (abs(stride), 1), writeable=writable)
    return view if stride > 0 else view[::-1]


# -- copies ---------------------------------------------------------------------------

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _new_pool_in_child() -> None:
    """After a fork: the pool's threads are the parent's, and the child has none of
    them, so a split copy handed to it would wait forever; the child makes its own
    pool when it first needs one (see :mod:`kvclient.fork_safety`)."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_pool_in_child)


def copy_pool() -> ThreadPoolExecutor:
    """The helper threads of copies split between COPY_THREADS threads (made once)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="kvclient-copy")
        return _pool


def start_copy_threads() -> None:
    """Start the copy helper threads now (at connect) rather than in a first copy."""
    if COPY_THREADS >= 2:
        copy_pool().submit(int).result()


def parallel_copy(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]],
    copy: Callable[[np.ndarray, np.ndarray], None] = np.copyto,
) -> None:
    """``copy(dst, src)`` for each pair; pairs that together hold at least
    ``PARALLEL_COPY_BYTES`` are cut into row ranges copied by COPY_THREADS threads."""
    total = sum(dst.nbytes for dst, _ in pairs)
    if COPY_THREADS < 2 or total < PARALLEL_COPY_BYTES:
        for dst, src in pairs:
            copy(dst, src)
        return
    # cut every pair into pieces of about total / COPY_THREADS bytes, whole rows each
    share = -(-total // COPY_THREADS)
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    for dst, src in pairs:
        rows = dst.shape[0]
        row_bytes = max(dst.nbytes // max(rows, 1), 1)
        per = max(1, share // row_bytes)
        if dst.ndim == 1 or rows == 1:  # one big row: cut along the bytes instead
            flat_dst, flat_src = dst.reshape(-1), src.reshape(-1)
            step = max(share, 1 << 20)
            for lo in range(0, flat_dst.size, step):
                pieces.append((flat_dst[lo : lo + step], flat_src[lo : lo + step]))
            continue
        for lo in range(0, rows, per):
            pieces.append((dst[lo : lo + per], src[lo : lo + per]))
    pool = copy_pool()
    futures: list[Future[None]] = []
    mine = pieces[: -(-len(pieces) // COPY_THREADS)]  # the caller's own share
    for dst, src in pieces[len(mine) :]:
        futures.append(pool.submit(copy, dst, src))
    try:
        for dst, src in mine:
            copy(dst, src)
    finally:
        for future in futures:
            future.result()


MAP_IN_MIN_BYTES = 64 << 10  # smaller slots: one call each would cost more than it saves


def map_in_run(mapping: ArenaMapping, run: Run, block_bytes: int) -> None:
    """Map a run's slots into this process's page table before writing them: one call
    per contiguous range (or per slot of 64 KiB and more) instead of a page fault per
    page (see ArenaMapping.map_in)."""
    if run.count == 1 or abs(run.stride) == block_bytes:
        low = min(run.offset, run.offset + (run.count - 1) * run.stride)
        mapping.map_in(low, run.count * block_bytes, write=False)
    elif block_bytes >= MAP_IN_MIN_BYTES:
        for k in range(run.count):
            mapping.map_in(run.offset + k * run.stride, block_bytes, write=False)


def write_slots(
    mapping: ArenaMapping,
    slots: SlotTable | Sequence[Slot],
    blocks: np.ndarray | Sequence[np.ndarray],
    block_bytes: int,
    first_index: int,
) -> None:
    """Copy ``blocks[index - first_index]`` into the slot of each chain ``index``.

    ``blocks`` is ``uint8[n, block_bytes]`` (one copy per run) or a sequence of
    ``uint8[block_bytes]`` rows (one copy per block: they are separate buffers).
    Rows of 64 KiB and more are written with streaming stores
    (:func:`kvstore.stream_copy.copy_into`): a put's slots are cold and nothing reads
    them soon, so their lines are not read into the cache before being overwritten.
    """
    table = slots if isinstance(slots, SlotTable) else SlotTable.of(slots)
    arena = mapping.array()
    pairs: list[tuple[np.ndarray, np.ndarray]] = []
    for run in slot_runs(table.offsets, block_bytes, table.indices, strided=True):
        row = int(table.indices[run.pos]) - first_index
        dst = run_view(arena, run, block_bytes, writable=True)
        map_in_run(mapping, run, block_bytes)
        if isinstance(blocks, np.ndarray):
            pairs.append((dst, blocks[row : row + run.count]))
        else:
            pairs.extend((dst[i], blocks[row + i]) for i in range(run.count))
    parallel_copy(pairs, copy_into)


def read_slots(
    mapping: ArenaMapping,
    slots: SlotTable | Sequence[Slot],
    out: np.ndarray,
    block_bytes: int,
    first_index: int = 0,
) -> None:
    """Copy the slot of each chain ``index`` into ``out[index - first_index]``
    (uint8 ``[n, block_bytes]``): one copy per run, no intermediate buffer."""
    table = slots if isinstance(slots, SlotTable) else SlotTable.of(slots)
    arena = mapping.array()
    pairs = []
    for run in slot_runs(table.offsets, block_bytes, table.indices, strided=True):
        row = int(table.indices[run.pos]) - first_index
        src = run_view(arena, run, block_bytes, writable=False)
        pairs.append((out[row : row + run.count], src))
    parallel_copy(pairs)


def read_runs(
    mapping: ArenaMapping,
    runs: Sequence[Run],
    out: np.ndarray,
    block_bytes: int,
    first_row: int = 0,
) -> None:
    """Copy the runs of a table whose chain positions are 0, 1, 2 ... (an Acquire
    answer's) into ``out[first_row + run.pos ...]``: :func:`read_slots` with the runs
    already known."""
    arena = mapping.array()
    pairs = []
    for run in runs:
        row = first_row + run.pos
        src = run_view(arena, run, block_bytes, writable=False)
        pairs.append((out[row : row + run.count], src))
    parallel_copy(pairs)


def slot_views(
    mapping: ArenaMapping, slots: SlotTable, block_bytes: int
) -> tuple[list[np.ndarray], np.ndarray | None]:
    """Read-only zero-copy views of the slots -> (one ``uint8[block_bytes]`` per block,
    ``uint8[n, block_bytes]`` of all of them when they form one run, else None)."""
    arena = mapping.array()
    rows: list[np.ndarray] = []
    whole: np.ndarray | None = None
    runs = slot_runs(slots.offsets, block_bytes, slots.indices, strided=True)
    for run in runs:
        view = run_view(arena, run, block_bytes, writable=False)
        view.flags.writeable = False
        if len(runs) == 1:
            whole = view
        rows.extend(view)
    return rows, whole


# -- zero-copy reads ------------------------------------------------------------------


class BlockViews:
    """Blocks pinned by a read lease, seen in place: read-only numpy views of the arena.

    ``views`` (one ``uint8[block_bytes]`` per block, chain order) and ``blocks`` (all
    of them as one ``uint8[n_blocks, block_bytes]`` view when their slots form one run,
    else None) cost no copy; ``copy_to(out)`` copies them with one call per run. Valid
    only while the lease is held: once released the daemon may reuse the slots, so
    the views must not be read any more (keep a copy instead).
    """

    def __init__(
        self,
        mapping: ArenaMapping,
        table: SlotTable,
        block_bytes: int,
        block_tokens: int,
        lease_id: int,
    ) -> None:
        self._mapping = mapping
        self._table = table
        self.block_bytes = block_bytes
        self.n_blocks = len(table)
        self.tokens = self.n_blocks * block_tokens
        self.lease_id = lease_id
        self.released = lease_id == 0
        self._views: tuple[list[np.ndarray], np.ndarray | None] | None = None

    def _check(self) -> None:
        if self.released and self.n_blocks:
            raise RuntimeError("the lease was released: its views may hold other blocks now")

    @property
    def slots(self) -> SlotTable:
        """The leased slots (chain positions and arena offsets)."""
        self._check()
        return self._table

    @property
    def views(self) -> list[np.ndarray]:
        self._check()
        if self._views is None:
            self._views = slot_views(self._mapping, self._table, self.block_bytes)
        return self._views[0]

    @property
    def blocks(self) -> np.ndarray | None:
        self._check()
        if self._views is None:
            self._views = slot_views(self._mapping, self._table, self.block_bytes)
        return self._views[1]

    def copy_to(self, out: np.ndarray, first: int = 0, count: int | None = None) -> np.ndarray:
        """Copy blocks ``first .. first + count`` (default: to the last) into ``out``
        (``uint8[>= count, block_bytes]``) -> the rows written."""
        self._check()
        if count is None:
            count = self.n_blocks - first
        if first < 0 or count < 0 or first + count > self.n_blocks:
            raise ValueError(
                f"blocks {first}..{first + count} are outside the lease's {self.n_blocks}"
            )
        if out.dtype != np.uint8 or out.ndim != 2 or out.shape[1] != self.block_bytes:
            raise ValueError(f"out must be uint8 [k, {self.block_bytes}]")
        if out.shape[0] < count:
            raise ValueError(f"out holds {out.shape[0]} blocks, {count} are copied")
        table = self._table
        if first or count != self.n_blocks:
            end = first + count
            table = SlotTable(table.indices[first:end], table.offsets[first:end])
        read_slots(self._mapping, table, out, self.block_bytes, first_index=first)
        return out[:count]

    def _forget(self) -> None:
        self.released = True
        self._views = None

    def __len__(self) -> int:
        return self.n_blocks

    def __repr__(self) -> str:
        state = "released" if self.released else f"lease {self.lease_id}"
        return f"{type(self).__name__}({self.n_blocks} blocks, {self.tokens} tokens, {state})"
