"""The host tier's shared-memory arena and its slot allocator.

The host tier is one region of memory created by the daemon at start-up and never
grown: a file in ``/dev/shm`` (or another directory) mapped ``MAP_SHARED``, so that
client processes on the same host can map the same bytes by path with
:func:`map_arena` and copy KV blocks straight into and out of slots. gRPC then only
carries slot offsets. ``shared=False`` gives an anonymous mapping for single-process
use (tests, the inline data path only).

Protocol:

- The daemon owns a :class:`HostArena`: ``alloc(size)`` -> offset (``None`` when no
  free extent can hold the slot: shortage is a value, not an error), ``free(offset)``,
  ``view(offset, size)`` / ``array()`` for its own copies, ``stats()``, ``close()``.
- A client calls ``map_arena(path)`` and reads/writes ``view(offset, size)`` for the
  offsets the daemon handed it. It never allocates; the daemon's index says which
  slots are whose.
- ``pin`` is called once with the slot space right after mapping and returns the
  matching unpin, called on ``close``. The GPU mover plugs ``cudaHostRegister`` in
  here; without it the region is plain pageable memory.
- Pages are faulted in after start-up, not on the hot path: on the VMs we run on a
  fresh page costs about 1 ms per MiB to fault, so the first put into each page of a
  lazily faulted arena runs at a tenth of copy speed. With ``prefault`` a background
  thread asks the kernel for the pages a chunk at a time (``MADV_POPULATE_WRITE``,
  Linux 5.14+; without it the arena stays lazy); start-up does not wait for it and
  close stops it. This commits the arena's memory up front, as pinning it would.

Regions: an arena serving tenants that must not see each other's bytes is cut into
regions, one per such tenant (its host quota's worth) and one common region for the
rest, each with its own slots, allocator and epoch table. Each tenant region is its
own memory file (``memfd_create``: no path, nothing another process can open), which
the daemon hands only to that tenant's clients as a file descriptor; the common
region is the arena file. The daemon maps the files side by side in one range of
addresses (:func:`kvstore.host.mapping.map_fds`), so every offset is an arena offset
whatever region it is in: the store, the mover, pinning and the wire never translate
one. ``alloc(size, tenant=...)`` carves from that tenant's region only, so its slots
never leave its file. An arena without tenant regions is one region, laid out exactly
as before regions: the slots, then the epoch table, in one file.

Each region's allocator is a :class:`kvstore.host.slot_space.SlotSpace` (two-level
segregated fit: O(1) good fit, immediate coalescing, every block size at once).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import operator
import os
import re
import secrets
import tempfile
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from kvproto.v1.arena_handout import FD_PREFIX
from kvstore.host.mapping import ArenaMapping, map_fds
from kvstore.host.slot_epochs import RegionEpochs, SlotEpochs, default_count, table_bytes
from kvstore.host.slot_space import PAGE_SIZE, SlotSpace

log = logging.getLogger(__name__)

PinHook = Callable[[memoryview], Callable[[], None]]
"""Called once with the slot space after mapping; returns the unpin, run on close."""

_PAGE_MASK = PAGE_SIZE - 1
_DEFAULT_DIR = "/dev/shm"
COMMON = ""  # the name of the common region


@dataclass(frozen=True, slots=True)
class Region:
    """One region of an arena: slots ``[base, base + size)``, then its epoch table of
    ``epoch_count`` counters at ``epochs_offset``, all in one file of ``length`` bytes
    mapped at ``base``. ``name``: the tenant whose region it is (COMMON: the rest)."""

    name: str
    base: int
    size: int
    epoch_count: int

    @property
    def epochs_offset(self) -> int:
        return self.base + self.size

    @property
    def length(self) -> int:
        return self.size + table_bytes(self.epoch_count)


@dataclass(frozen=True, slots=True)
class ArenaStats:
    """Occupancy of an arena. ``fragmentation`` is 1 - largest_free/free (0.0 when full)."""

    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    slots: int
    largest_free_bytes: int
    fragmentation: float


def _default_directory() -> str:
    if os.path.isdir(_DEFAULT_DIR) and os.access(_DEFAULT_DIR, os.W_OK | os.X_OK):
        return _DEFAULT_DIR
    return tempfile.gettempdir()


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, someone else's
    return True


_OWN_REGIONS: set[str] = set()  # region files this process created and has not closed


def remove_stale_regions(directory: str, name_prefix: str = "kvstore") -> list[str]:
    """Unlink this user's arena files whose creating process is gone.

    A daemon killed with SIGKILL cannot unlink its arena; the file would hold its
    memory (tmpfs) until reboot. Files of other live processes (or of pids reused by
    live processes: the safe side) are kept. A file named with this process's own pid
    that this process did not create is stale too: in a container the restarted
    daemon is pid 1 again, like the one that was killed. Returns the paths removed.
    """
    pattern = re.compile(rf"^{re.escape(name_prefix)}-{os.getuid()}-(\d+)-[0-9a-f]+$")
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = pattern.match(name)
        path = os.path.join(directory, name)
        if not match or path in _OWN_REGIONS:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or not _pid_alive(pid):
            _unlink_quietly(path)
            removed.append(path)
            log.warning("removed stale arena %s left by a process that is gone", path)
    return removed


def _create_region(directory: str, name_prefix: str, size: int) -> tuple[str, mmap.mmap]:
    """Create an owner-only file of ``size`` bytes and map it, without touching its pages."""
    remove_stale_regions(directory, name_prefix)
    vfs = os.statvfs(directory)
    if vfs.f_bavail * vfs.f_frsize < size:
        # tmpfs accepts ftruncate beyond its size and then SIGBUSes on first touch
        raise OSError(errno.ENOSPC, f"{directory} has less than {size} bytes free")
    name = f"{name_prefix}-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except BaseException:
        _unlink_quietly(path)
        raise
    finally:
        os.close(fd)  # the mapping keeps its own reference to the file
    _OWN_REGIONS.add(path)
    return path, region


def _drop_region_file(path: str) -> None:
    _OWN_REGIONS.discard(path)
    _unlink_quietly(path)


# -- the arena ------------------------------------------------------------------------


def common_bytes(capacity: int, tenant_sizes: Iterable[int]) -> int:
    """The slot bytes of the common region of an arena of ``capacity`` bytes with
    tenant regions of ``tenant_sizes`` (each cut to whole pages, as the arena cuts
    them); the store's and the daemon's config checks ask it before an arena exists."""
    return (capacity & ~_PAGE_MASK) - sum(size & ~_PAGE_MASK for size in tenant_sizes)


def _layout(
    capacity: int, tenant_sizes: Mapping[str, int], epoch_count: int | None
) -> list[Region]:
    """The regions of an arena of ``capacity`` slot bytes: the common one first (what
    the tenants' regions leave), then one per tenant in name order."""
    sizes = {name: operator.index(size) & ~_PAGE_MASK for name, size in tenant_sizes.items()}
    for name, size in sizes.items():
        if not name or size < PAGE_SIZE:
            raise ValueError(f"tenant region {name!r} must be named and at least {PAGE_SIZE} bytes")
    common = common_bytes(capacity, sizes.values())
    if common < PAGE_SIZE:
        raise ValueError(
            f"the tenants' regions ({sum(sizes.values())} bytes) leave less than a page of "
            f"the {capacity}-byte arena for everything else"
        )
    regions, base = [], 0
    for name, size in [(COMMON, common), *sorted(sizes.items())]:
        count = epoch_count if name == COMMON and epoch_count else default_count(size)
        region = Region(name, base, size, count)
        regions.append(region)
        base += region.length
    return regions


def _memfd(name: str, size: int) -> int:
    """A memory file of ``size`` bytes with no path (only fds reach it), close-on-exec,
    sealed against shrinking and growing: the fd is handed to tenants' processes, and
    one that truncated it would make the daemon's next touch of the region a SIGBUS
    (the seals hold for every holder of the fd, the daemon included, and cannot be
    removed)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


# -- the arena ------------------------------------------------------------------------


class HostArena:
    """The daemon's host tier: its regions and the allocator of each."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        regions: Mapping[str, int] | None = None,
        directory: str | None = None,
        shared: bool = True,
        name_prefix: str = "kvstore",
        pin: PinHook | None = None,
        prefault: bool = False,
        epoch_count: int | None = None,
    ) -> None:
        """``regions``: tenant -> bytes of its own region (see the module docstring);
        the common region gets the rest of ``capacity_bytes``."""
        capacity = operator.index(capacity_bytes) & ~_PAGE_MASK
        if capacity < PAGE_SIZE:
            raise ValueError(
                f"arena capacity must be at least {PAGE_SIZE} bytes, got {capacity_bytes}"
            )
        self.capacity_bytes = capacity
        layout = _layout(capacity, regions or {}, epoch_count)
        common, total = layout[0], layout[-1].base + layout[-1].length
        self.regions: dict[str, Region] = {r.name: r for r in layout}
        self._spaces = [SlotSpace(r.base, r.size) for r in layout]
        self._by_name = {r.name: space for r, space in zip(layout, self._spaces, strict=True)}
        self._bases = [r.base for r in layout]
        self._names = [r.name for r in layout]
        self.path: str | None = None
        self.fds: dict[str, int] = {}  # tenant -> the fd of its region's file
        self._instance = secrets.token_hex(8)  # names this arena's regions (name_of)
        self._unlink: Callable[[], object] | None = None
        region: mmap.mmap | ctypes.Array[ctypes.c_ubyte]
        if shared:
            path, region = _create_region(
                directory or _default_directory(), name_prefix, common.length
            )
            self.path = path
            # unlinks the file if the arena is dropped (or the interpreter exits) unclosed
            self._unlink = weakref.finalize(self, _drop_region_file, path)
            if len(layout) > 1:
                region = self._side_by_side(region, layout, total, name_prefix)
        else:
            region = mmap.mmap(-1, total, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self._mapping = ArenaMapping(region, self.path, writable=True)
        whole = self._mapping.array()
        self._slot_array = whole[: layout[-1].base + layout[-1].size]
        self.epochs: SlotEpochs = (
            SlotEpochs.in_region(whole, common.epochs_offset, common.epoch_count)
            if len(layout) == 1
            else RegionEpochs(whole, [(r.base, r.epochs_offset, r.epoch_count) for r in layout])
        )
        self._pin_view: memoryview | None = None
        self._unpin: Callable[[], None] | None = None
        if pin is not None:
            self._pin(pin)
        if prefault:
            self._mapping.map_in_background(write=True)

    def _side_by_side(
        self, common: mmap.mmap, layout: list[Region], total: int, name_prefix: str
    ) -> ctypes.Array[ctypes.c_ubyte]:
        """The common region's file and a memory file per tenant region, mapped in one
        range (the fds are kept: they are what the tenants' clients are handed)."""
        assert self.path is not None
        try:
            for r in layout[1:]:
                self.fds[r.name] = _memfd(f"{name_prefix}-{r.name}", r.length)
            fd = os.open(self.path, os.O_RDWR)
            try:
                parts = [(fd, 0, layout[0].length)]
                parts += [(self.fds[r.name], r.base, r.length) for r in layout[1:]]
                return map_fds(parts, total)
            finally:
                os.close(fd)
        except BaseException:
            _close_fds(list(self.fds.values()))
            self._unlink_now()
            raise
        finally:
            common.close()  # map_fds mapped the file again

    def _unlink_now(self) -> None:
        if self._unlink is not None:
            self._unlink()

    def _pin(self, pin: PinHook) -> None:
        self._pin_view = self._slot_array.data  # the slots (and inner epoch tables)
        try:
            self._unpin = pin(self._pin_view)
        except BaseException:
            self.close()
            raise

    # -- regions

    def name_of(self, region: str) -> str:
        """How answers name ``region`` to a client: the arena file's path for the
        common region ("" when not shared), ``fd:<arena>/<tenant>`` for a tenant's
        (handed out by fd: kvproto.v1.arena_handout; unique to this arena, so a
        client sees a restarted daemon's region as another one)."""
        if region == COMMON or not self.fds:
            return self.path or ""
        return f"{FD_PREFIX}{self._instance}/{region}"

    def region_of(self, tenant: str) -> str:
        """The region a tenant's blocks go in: its own, else the common one."""
        return tenant if tenant in self.regions else COMMON

    def region_at(self, offset: int) -> Region:
        """The region holding the arena offset ``offset``."""
        return self.regions[self._space_at(offset)[1]]

    def _space_at(self, offset: int) -> tuple[SlotSpace, str]:
        i = max(bisect.bisect_right(self._bases, offset) - 1, 0)
        return self._spaces[i], self._names[i]

    # -- public allocator interface

    @property
    def used_bytes(self) -> int:
        """Bytes held by live slots (rounded sizes); never more than capacity_bytes."""
        return sum(space.used_bytes for space in self._spaces)

    def used_bytes_of(self, region: str) -> int:
        return self._by_name[region].used_bytes

    def alloc(self, size: int, tail: bool = False, tenant: str = "") -> int | None:
        """Offset of a new slot of at least ``size`` bytes for a block of ``tenant``
        (in :meth:`region_of` it), or None when nothing fits there. ``tail``: a large
        slot goes at the end of its extent, not the head (kvstore.host.slot_space, 5.)."""
        return self._by_name[self.region_of(tenant)].alloc(size, tail)

    def alloc_run(self, size: int, count: int, tenant: str = "") -> list[int]:
        """Offsets of ``count`` new slots of ``size`` bytes for blocks of ``tenant``,
        carved as one contiguous run (the client copies a put in one piece); [] when no
        free extent of its region holds the whole run (the caller goes slot by slot)."""
        return self._by_name[self.region_of(tenant)].alloc_run(size, count)

    def free(self, offset: int) -> None:
        """Return a slot; merges it with free neighbours. Unknown offsets raise ValueError.
        Bumps the slot's epoch: a reader that copied it unpinned discards its copy."""
        space = self._spaces[0] if len(self._spaces) == 1 else self._space_at(offset)[0]
        space.free(offset)
        self.epochs.bump((offset,))

    def slot_size(self, offset: int) -> int:
        """Bytes reserved for the live slot at ``offset`` (after rounding)."""
        return self._space_at(offset)[0].slot_size(offset)

    def view(self, offset: int, size: int) -> memoryview:
        """Writable zero-copy view of ``arena[offset:offset + size]``."""
        if offset + size > self._slot_array.size:  # the epoch table is not slot space
            raise ValueError(
                f"range [{offset}, {offset + size}) is outside the arena of "
                f"{self.capacity_bytes} bytes"
            )
        return self._mapping.view(offset, size)

    def array(self) -> np.ndarray:
        """The slot space (the file less its epoch table) as a uint8 array (no copy)."""
        return self._slot_array

    def stats(self) -> ArenaStats:
        used = self.used_bytes
        free = self.capacity_bytes - used
        largest = max(space.largest_free() for space in self._spaces)
        return ArenaStats(
            capacity_bytes=self.capacity_bytes,
            used_bytes=used,
            free_bytes=free,
            slots=sum(space.slots for space in self._spaces),
            largest_free_bytes=largest,
            fragmentation=1.0 - largest / free if free else 0.0,
        )

    @property
    def closed(self) -> bool:
        return self._mapping.closed

    def close(self) -> None:
        """Unpin, unlink the file, close the regions' fds and unmap. Idempotent.

        Clients that mapped the file keep their mapping until they close it; the
        memory goes back to the system when the last mapping goes.
        """
        if self._mapping.closed:
            return
        self._mapping.stop_mapping_in()  # before unpinning and unmapping the region
        unpin, self._unpin = self._unpin, None
        try:
            if unpin is not None:
                unpin()
        finally:
            self._release_pin_view()
            self._unlink_now()
            fds, self.fds = list(self.fds.values()), {}
            _close_fds(fds)
            # these viewed the mapping: let it unmap now (later bumps go nowhere)
            self.epochs = SlotEpochs(np.zeros(2, dtype=np.uint64))
            self._slot_array = np.zeros(0, dtype=np.uint8)
            self._mapping.close()

    def _release_pin_view(self) -> None:
        view, self._pin_view = self._pin_view, None
        if view is None:
            return
        try:
            view.release()
        except BufferError:  # the hook kept an export (e.g. an array) of the region
            log.debug("arena %s: pin hook still holds the region", self.path)

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _free_extents(self) -> list[tuple[int, int]]:
        """Sorted (start, size) of every free extent: for tests and debugging, O(n)."""
        return sorted(e for space in self._spaces for e in space.free_extents())
