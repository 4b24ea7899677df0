"""The store: index + policy + host arena + disk tier behind one lock.

Protocol (every method is thread-safe; all key chains start at the namespace root):

- ``open_namespace(spec)`` registers a namespace (idempotent; a different layout under
  the same ns_id raises LayoutMismatch). ``keys_for(ns_id, tokens)`` computes the chain.
- ``lookup(ns_id, keys)`` -> longest ready prefix, per-tier counts, pending keys after it.
- Inline data path: ``put(ns_id, keys, payloads, start)`` stores ``payloads[i]`` as the
  block ``keys[start + i]`` (each exactly ``block_bytes``); ``read(ns_id, keys, out)``
  copies the longest ready prefix into one contiguous buffer.
- Shared-arena data path: ``reserve`` -> the caller writes the arena slots -> ``commit``
  (partial commits allowed, in chain order; ``abandon`` drops the rest). ``acquire`` pins
  the ready prefix in host slots under a read lease -> the caller reads -> ``release``.
  Leases expire after their TTL; an expired write lease drops its pending blocks.
- Staged slots (a put with no round trip before its copy): a ``reserve`` may also set
  aside ``stage_more`` empty slots for the caller's next put under a *staging lease*.
  Staged slots are allocated but in no block: invisible, never evicted, freed when the
  lease is released or expires. The next ``reserve`` names them (``staged_offsets``,
  one per offered block, in chain order) and its new blocks take them instead of fresh
  slots, so the caller may copy into them while that reserve is in flight. Each
  reserve that names the lease renews it.
- ``delete``/``clear``/``set_priority``/``stats``/``events_since``/``flush``/``close``.

Copies of block bytes happen outside the lock: the blocks involved are pinned (lease
count) while the lock is released, so eviction cannot free a slot under a reader.
"""

from __future__ import annotations

import array
import heapq
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import overload

import numpy as np
import xxhash

from kvstore.arena import HostArena, PinHook
from kvstore.disk import DiskRecord, DiskSnapshot, DiskTier
from kvstore.errors import (
    InvalidArgument,
    LayoutMismatch,
    LeaseError,
    StoreClosed,
    UnknownNamespace,
)
from kvstore.index import PENDING, READY, Index, NamespaceEntry, Node
from kvstore.keys import BlockKey, NamespaceSpec, chain_keys, tokens_array
from kvstore.policy import MAX_PRIORITY, POLICIES, GroupedPolicy
from kvstore.results import (
    Acquisition,
    Event,
    EventKind,
    Located,
    LookupResult,
    NamespaceStats,
    PutResult,
    Reservation,
    SlotRef,
    StoreStats,
    Tier,
    TierStats,
)
from kvstore.tenants import NAME_RE, Group, Quota, TenantUsage, tenant_of

log = logging.getLogger(__name__)

DEFAULT_PRIORITY = 35
ADMISSION_POLICIES = ("write-back", "write-through", "selective")
# a promotion of at least this many bytes reads its blocks on PROMOTE_THREADS threads
PARALLEL_PROMOTE_BYTES = 4 << 20
PROMOTE_THREADS = max(1, min(4, os.cpu_count() or 1))
DELETE_COMMIT_TIMEOUT_S = 60.0  # clear and delete wait this long for their disk deletions


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Capacities and policies of one store. Sizes are bytes."""

    host_bytes: int
    disk_dir: str | None = None
    disk_bytes: int = 0  # 0: no disk tier
    admission: str = "write-back"  # write-back | write-through | selective
    selective_hits: int = 2  # selective: demote to disk only after this many hits
    disk_min_priority: int = 0  # blocks below this priority are dropped, not demoted
    default_priority: int = DEFAULT_PRIORITY
    lease_ttl_s: float = 30.0
    max_lease_ttl_s: float = 600.0
    max_blocks_per_request: int = 8192
    arena_dir: str | None = None  # where the shared arena file lives (default /dev/shm)
    shared_arena: bool = True  # False: anonymous memory (single-process tests)
    persist_on_close: bool = True  # close() writes host-only blocks to disk first
    event_buffer: int = 65536
    eviction_policy: str = "priority-lru"  # priority-lru | plain-lru (baseline only)
    prefault_arena: bool = False  # fault the arena's pages in on a background thread
    # staged slots one staging lease may hold (bytes); 0: a quarter of host_bytes
    max_staged_bytes: int = 0
    disk_queue_bytes: int = 256 << 20  # block bytes waiting for the disk writer, at most
    # write-through: how long a commit waits for its disk commit before answering
    write_through_wait_s: float = 30.0
    check_disk_in_child: bool = False  # at open, walk the disk tier's B-trees in a child
    # tenant -> its quota (kvstore.tenants); tenants not named here have none
    quotas: Mapping[str, Quota] = field(default_factory=dict)

    @property
    def staged_bytes_limit(self) -> int:
        return self.max_staged_bytes or self.host_bytes // 4

    def validate(self) -> None:
        """Raise InvalidArgument naming the first bad field."""
        if self.host_bytes < 4096:
            raise InvalidArgument(f"host_bytes must be >= 4096, got {self.host_bytes}")
        if self.disk_bytes < 0:
            raise InvalidArgument(f"disk_bytes must be >= 0, got {self.disk_bytes}")
        if self.disk_bytes and not self.disk_dir:
            raise InvalidArgument("disk_dir is required when disk_bytes > 0")
        if self.admission not in ADMISSION_POLICIES:
            raise InvalidArgument(
                f"admission must be one of {list(ADMISSION_POLICIES)}, got {self.admission!r}"
            )
        if self.eviction_policy not in POLICIES:
            raise InvalidArgument(
                f"eviction_policy must be one of {sorted(POLICIES)}, got {self.eviction_policy!r}"
            )
        for name in ("default_priority", "disk_min_priority"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_PRIORITY:
                raise InvalidArgument(f"{name} must be in [0, {MAX_PRIORITY}], got {value}")
        if not 0 < self.lease_ttl_s <= self.max_lease_ttl_s:
            raise InvalidArgument(
                f"lease_ttl_s must be in (0, max_lease_ttl_s={self.max_lease_ttl_s}], "
                f"got {self.lease_ttl_s}"
            )
        if self.max_blocks_per_request < 1:
            raise InvalidArgument("max_blocks_per_request must be >= 1")
        if self.max_staged_bytes < 0:
            raise InvalidArgument(f"max_staged_bytes must be >= 0, got {self.max_staged_bytes}")
        if self.selective_hits < 0:
            raise InvalidArgument(f"selective_hits must be >= 0, got {self.selective_hits}")
        if self.disk_queue_bytes < 1:
            raise InvalidArgument(f"disk_queue_bytes must be >= 1, got {self.disk_queue_bytes}")
        if self.write_through_wait_s < 0:
            raise InvalidArgument(
                f"write_through_wait_s must be >= 0, got {self.write_through_wait_s}"
            )
        for tenant, quota in self.quotas.items():
            if not NAME_RE.match(tenant):
                raise InvalidArgument(f"quotas: {tenant!r} is not a tenant name")
            if quota.host_bytes < 0 or quota.disk_bytes < 0:
                raise InvalidArgument(f"quotas: {tenant}: quotas must be >= 0")


@dataclass(slots=True, eq=False)
class _Lease:
    lease_id: int
    write: bool
    entry: NamespaceEntry
    nodes: list[Node]  # read: pinned ready prefix; write: reserved blocks in chain order
    expires_at: float
    committed: int = 0  # write leases: nodes[:committed] are ready
    first_index: int = 0  # write leases: chain position of nodes[0]
    snapshot: DiskSnapshot | None = None  # read leases with disk extents: keeps them valid
    staged: set[int] | None = None  # staging leases: the empty slots set aside (offsets)
    ttl: float = 0.0  # staging leases: each reserve that uses the lease renews it by this
    owner: str = ""  # the client connection it ends with (see Store.own), "" for none

    @property
    def kind(self) -> str:
        if self.staged is not None:
            return "staging"
        return "write (reserve)" if self.write else "read (acquire)"


@dataclass(slots=True)
class _Counters:
    host_hits: int = 0
    host_misses: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    host_evictions: int = 0
    disk_evictions: int = 0
    host_bytes_in: int = 0
    host_bytes_out: int = 0
    disk_bytes_in: int = 0
    disk_bytes_out: int = 0
    demotions: int = 0
    promotions: int = 0
    dropped: int = 0
    lost_on_disk: int = 0
    known_slot_gets: int = 0  # gets clients served from slots they knew (note_reads)
    disk_file_gets: int = 0  # gets clients served from the disk tier's file (note_reads)
    # gets read again, pinned, after an unpinned copy failed its slot epoch check
    repeated_gets: int = 0


_ENDED_LEASES_KEPT = 4096


class _LeaseIds:
    """Lease ids: 62 random bits plus one (never 0), unguessable by another client.
    Drawn from ``os.urandom`` 512 at a time: one system call per 512 leases, where
    ``secrets.randbits`` makes one per lease (a put makes a lease, often two)."""

    def __init__(self) -> None:
        self._ids: list[int] = []

    def next(self) -> int:
        if not self._ids:
            self._ids = [(word >> 2) + 1 for word in array.array("Q", os.urandom(4096))]
        return self._ids.pop()


class Store:
    """One process's tiered block store. See the module docstring for the protocol."""

    def __init__(
        self,
        config: StoreConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        pin: PinHook | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self._clock = clock
        self._wall = wall
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # events, commits, drops
        self._index = Index()
        self._namespaces: dict[str, NamespaceEntry] = {}
        self._by_digest: dict[bytes, NamespaceEntry] = {}
        self._host_policy = GroupedPolicy(config.eviction_policy, "host")
        self._disk_policy = GroupedPolicy(config.eviction_policy, "disk")
        self._groups: dict[str, Group] = {}  # tenant -> its group (kvstore.tenants)
        self._leases: dict[int, _Lease] = {}
        self._owned: dict[str, set[int]] = {}  # owner -> its leases (see own)
        self._lease_ids = _LeaseIds()
        self._lease_heap: list[tuple[float, int]] = []
        self._ended: dict[int, str] = {}  # recently ended lease id -> why (for precise errors)
        self._priority_heap: list[tuple[float, int, Node]] = []
        self._priority_until: dict[Node, float] = {}  # blocks whose priority is timed
        self._priority_seq = itertools.count()
        # events as plain tuples in Event's field order (Event._make when read: a block
        # stored makes one, under the lock, and a plain tuple costs half a NamedTuple)
        self._events: deque[tuple[int, EventKind, str, BlockKey, Tier | None, float]] = deque(
            maxlen=config.event_buffer
        )
        self._seq = 0
        self._host_blocks = 0
        self._disk_blocks = 0
        self._pending = 0
        self._c = _Counters()
        self._platform = "cpu-only"
        self._closed = False
        self._arena = HostArena(
            config.host_bytes,
            directory=config.arena_dir,
            shared=config.shared_arena,
            pin=pin,
            prefault=config.prefault_arena,
        )
        self._disk: DiskTier | None = None
        try:
            if config.disk_bytes > 0 and config.disk_dir:
                self._disk = DiskTier(
                    config.disk_dir,
                    config.disk_bytes,
                    queue_bytes=config.disk_queue_bytes,
                    # write-through promises durability: the meta page is synced too
                    metasync=config.admission == "write-through",
                    deep_check=config.check_disk_in_child,
                )
                self._rebuild_from_disk()
        except BaseException:
            self._arena.close()
            if self._disk is not None:
                self._disk.close()
            raise
        self._reaper_stop = threading.Event()
        self._promoters: ThreadPoolExecutor | None = None  # made on the first big promotion
        self._reaper = threading.Thread(target=self._reap, name="kvstore-reaper", daemon=True)
        self._reaper.start()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> int:
        """Persist host-only blocks to disk (if configured), flush the writer, free the
        arena. Returns how many block writes to disk were due and never committed (a
        disk fault: see DiskTier.fault); 0 after a clean close."""
        with self._lock:
            if self._closed:
                return 0
            self._closed = True
            for lease in list(self._leases.values()):
                self._end_lease(lease, "the store closed")
            unpersisted = 0
            if self._disk is not None and self.config.persist_on_close:
                if self._disk.fault:  # nothing can be written: count what was due
                    unpersisted = sum(
                        1
                        for node in self._index.nodes.values()
                        if node.in_host and node.ready and not node.on_disk and self._admit(node)
                    )
                else:
                    self._persist_host_blocks()
            self._changed.notify_all()
        self._reaper_stop.set()
        self._reaper.join(timeout=5)
        if self._promoters is not None:
            self._promoters.shutdown(wait=True)
        if self._disk is not None:
            self._disk.close()
            unpersisted += self._disk.stats().lost_writes
        self._arena.close()
        return unpersisted

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued disk write is committed."""
        if self._disk is not None:
            self._disk.flush(timeout)

    @property
    def arena_path(self) -> str | None:
        return self._arena.path

    @property
    def disk_path(self) -> str | None:
        """The disk tier's data file (what ``disk_direct`` extents point into), if any."""
        return self._disk.data_path if self._disk is not None else None

    @property
    def arena_bytes(self) -> int:
        return self._arena.capacity_bytes

    @property
    def arena(self) -> HostArena:
        return self._arena

    @property
    def platform(self) -> str:
        return self._platform

    @property
    def last_event_seq(self) -> int:
        """Sequence number of the newest event (0 before the first)."""
        return self._seq

    def set_platform(self, profile: str) -> None:
        """Called by the GPU layer once it has detected the machine ('pcie', 'c2c')."""
        self._platform = profile

    # ----------------------------------------------------------------- namespaces
    def open_namespace(self, spec: NamespaceSpec) -> NamespaceSpec:
        if spec.block_bytes > self._arena.capacity_bytes:
            raise InvalidArgument(
                f"block_bytes={spec.block_bytes} exceeds the host arena "
                f"({self._arena.capacity_bytes} bytes)"
            )
        with self._lock:
            self._check_open()
            entry = self._namespaces.get(spec.ns_id)
            if entry is not None:
                if entry.spec.digest != spec.digest:
                    raise LayoutMismatch(f"namespace {spec.ns_id} is open with a different layout")
                return entry.spec
            self._register(spec)
            if self._disk is not None:
                self._disk.save_namespace(spec.digest, spec.to_dict())
            return spec

    def namespace(self, ns_id: str) -> NamespaceSpec:
        return self._entry(ns_id).spec

    def namespaces(self) -> list[NamespaceSpec]:
        with self._lock:
            return [entry.spec for entry in self._namespaces.values()]

    def keys_for(
        self,
        ns_id: str,
        tokens: Sequence[int] | np.ndarray,
        extra: Sequence[bytes | str | int] = (),
    ) -> list[BlockKey]:
        spec = self._entry(ns_id).spec
        arr = tokens_array(tokens, spec.vocab_size)
        n_blocks = arr.size // spec.block_tokens
        if n_blocks > self.config.max_blocks_per_request:
            raise InvalidArgument(
                f"{arr.size} tokens make {n_blocks} blocks, more than "
                f"max_blocks_per_request={self.config.max_blocks_per_request}"
            )
        return chain_keys(spec, arr, extra)

    # ------------------------------------------------------------------ read side
    def lookup(self, ns_id: str, keys: Sequence[BlockKey]) -> LookupResult:
        entry = self._entry(ns_id)
        self._check_keys(entry, keys)
        with self._lock:
            self._expire()
            return self._lookup(keys)

    def read(
        self,
        ns_id: str,
        keys: Sequence[BlockKey],
        out: memoryview | None = None,
        start: int = 0,
    ) -> tuple[int, memoryview]:
        """Copy ready blocks ``keys[start:]`` of the longest ready prefix into ``out`` (or
        a new buffer) -> (blocks copied, view of the bytes written). Blocks before
        ``start`` are not copied (the caller has them) but must be ready too. Disk hits
        are verified and promoted into the host tier (parents first) when room can be
        made. Raises InvalidArgument if ``out`` cannot hold len(keys) - start blocks."""
        entry = self._entry(ns_id)
        self._check_keys(entry, keys)
        size = entry.spec.block_bytes
        if not 0 <= start <= len(keys):
            raise InvalidArgument(f"start={start} is outside a chain of {len(keys)} blocks")
        wanted = len(keys) - start
        if out is not None:
            out = memoryview(out).cast("B")
            if out.readonly or out.nbytes < wanted * size:
                raise InvalidArgument(
                    f"out must be a writable buffer of >= {wanted * size} bytes "
                    f"({wanted} blocks x {size}), got {out.nbytes}"
                    + (" (read-only)" if out.readonly else "")
                )
        pinned = self._pin_prefix(entry, keys, promote_all=False)
        assert pinned is not None  # None only for host_only
        nodes, fresh = pinned
        if out is None:
            out = memoryview(bytearray(max(len(nodes) - start, 0) * size))
        ok = len(nodes)
        try:
            ok = self._copy_out(nodes, fresh, out, size, start)
        finally:
            self._finish_pinned(entry, keys, nodes, fresh, ok, keep_pins=False, start=start)
        copied = max(ok - start, 0)
        return copied, out[: copied * size]

    @overload
    def acquire(
        self, ns_id: str, keys: Sequence[BlockKey], ttl_s: float | None = None
    ) -> Acquisition: ...

    @overload
    def acquire(
        self,
        ns_id: str,
        keys: Sequence[BlockKey],
        ttl_s: float | None,
        host_only: bool,
        disk_direct: bool = False,
        count: bool = True,
    ) -> Acquisition | None: ...

    def acquire(
        self,
        ns_id: str,
        keys: Sequence[BlockKey],
        ttl_s: float | None = None,
        host_only: bool = False,
        disk_direct: bool = False,
        count: bool = True,
    ) -> Acquisition | None:
        """Pin the ready prefix of ``keys`` in host slots under a read lease, promoting
        its disk-only blocks. ``host_only``: None, having changed nothing, when one would
        need promoting (for a caller that must not wait on the disk).

        ``disk_direct`` (for a reader that preads the disk file itself): when every
        disk-only block of the prefix is on its first read since it reached the disk
        tier, they are not promoted but answered as extents of the disk file
        (``Acquisition.disk``), kept valid by the lease; reading them waits on no disk
        I/O here, so this answers ``host_only`` callers too. A block read again takes
        the promoting path: a block earns its host slot back by being read twice, and a
        one-off scan of the disk tier does not flush the host tier.

        ``count=False`` for a read counted already (the same get acquiring again): no
        hits or misses are counted, the blocks are touched as by any read."""
        entry = self._entry(ns_id)
        self._check_keys(entry, keys)
        ttl = self._ttl(ttl_s)
        if not count:
            with self._lock:
                self._c.repeated_gets += 1
        if disk_direct and self._disk is not None:
            direct = self._acquire_direct(entry, keys, ttl, self._disk, count)
            if direct is not None:
                return direct
        pinned = self._pin_prefix(entry, keys, promote_all=True, host_only=host_only)
        if pinned is None:
            return None
        nodes, fresh = pinned
        ok = len(nodes)
        try:
            ok = self._fill_promotions(nodes, fresh)
        finally:
            self._finish_pinned(entry, keys, nodes, fresh, ok, keep_pins=True, count=count)
        kept = nodes[:ok]
        with self._lock:
            size = entry.spec.block_bytes
            if not kept:
                return Acquisition(0, 0.0, (), (), size)
            lease = self._new_lease(entry, kept, write=False, ttl=ttl)
            keys = tuple([node.key for node in kept])
            offsets = tuple([node.host_offset for node in kept])
            return Acquisition(lease.lease_id, lease.expires_at, keys, offsets, size)

    def _acquire_direct(
        self,
        entry: NamespaceEntry,
        keys: Sequence[BlockKey],
        ttl: float,
        disk: DiskTier,
        count: bool = True,
    ) -> Acquisition | None:
        """:meth:`acquire` with ``disk_direct``; None, having changed nothing, when the
        prefix has no disk-only block, one of them was read before, or the disk tier
        cannot give an extent for each (queued writes, too many snapshots open ...)."""
        with self._lock:
            self._check_open()
            self._expire()
            nodes = self._ready_prefix(keys)
            on_disk = [i for i, node in enumerate(nodes) if not node.in_host]
            if not on_disk or any(nodes[i].hits for i in on_disk):
                return None
            for node in nodes:
                node.pins += 1
        got = None
        try:  # pinned: the blocks stay indexed; the snapshot keeps their pages in place
            got = disk.extents([nodes[i].key for i in on_disk])
        finally:
            if got is None:
                with self._lock:
                    for node in nodes:
                        node.pins -= 1
        if got is None:
            return None
        snapshot, extents = got
        try:
            self._finish_pinned(entry, keys, nodes, {}, len(nodes), keep_pins=True, count=count)
        except BaseException:
            snapshot.close()
            raise
        with self._lock:
            lease = self._new_lease(entry, nodes, write=False, ttl=ttl)
            lease.snapshot = snapshot
            direct = set(on_disk)
            offsets = tuple(
                [-1 if i in direct else node.host_offset for i, node in enumerate(nodes)]
            )
            return Acquisition(
                lease.lease_id,
                lease.expires_at,
                tuple([node.key for node in nodes]),
                offsets,
                entry.spec.block_bytes,
                tuple(zip(on_disk, extents, strict=True)),
            )

    def locate(self, ns_id: str, keys: Sequence[BlockKey]) -> Located | None:
        """The host slots of the ready prefix of ``keys`` and their epochs, pinning
        nothing (an unpinned read: see :mod:`kvstore.slot_epochs`). Counts the hits and
        touches the prefix as a read does. None, having changed nothing, when a block of
        the prefix is on disk only (the caller acquires instead)."""
        entry = self._entry(ns_id)
        self._check_keys(entry, keys)
        with self._lock:
            self._check_open()
            self._expire()
            nodes, on_disk = self._host_prefix(keys)
            if on_disk:
                return None
            self._count_reads(entry, nodes, len(keys), reads=1, host_hits=len(nodes))
            offsets = [node.host_offset for node in nodes]
            epochs = self._arena.epochs.read(self._arena.epochs.entries(offsets))
            return Located(tuple(offsets), epochs, entry.spec.block_bytes)

    def note_reads(
        self, ns_id: str, keys: Sequence[BlockKey], reads: int, from_disk: bool = False
    ) -> int:
        """Count ``reads`` reads of the prefix ``keys`` that a client served itself, with
        no call of its own: hits, and a touch for eviction, as :meth:`locate` gives each
        read. From slots it knew (checked by their epochs): blocks that left the host
        tier since (and all after them) are not counted. ``from_disk``: read from the
        disk tier's file under the client's own LMDB transaction
        (:mod:`kvclient.disk_index`): the ready prefix is counted wherever it is now,
        its disk-only blocks as disk hits read directly (not promoted). Returns blocks
        counted per read."""
        entry = self._entry(ns_id)
        self._check_keys(entry, keys)
        if reads <= 0:
            return 0
        with self._lock:
            self._check_open()
            if from_disk:
                self._c.disk_file_gets += reads
                nodes = self._ready_prefix(keys)
                host_hits = sum(1 for node in nodes if node.in_host)
            else:
                self._c.known_slot_gets += reads
                nodes, _ = self._host_prefix(keys)
                host_hits = len(nodes)
            if nodes:
                self._count_reads(entry, nodes, len(nodes), reads, host_hits)
            return len(nodes)

    def note_misses(self, ns_id: str, blocks: int) -> None:
        """Count ``blocks`` asked for and not found, for a caller that read only the
        ready prefix it had looked up (the daemon's Get): hit rates stay honest."""
        if blocks <= 0:
            return
        entry = self._entry(ns_id)
        with self._lock:
            entry.misses += blocks
            self._c.host_misses += blocks
            self._c.disk_misses += blocks

    def release(self, lease_id: int) -> None:
        with self._lock:
            self._expire()
            lease = self._lease(lease_id)
            self._end_lease(lease, "released")

    def own(self, owner: str, lease_ids: Sequence[int]) -> None:
        """Tie leases to ``owner`` (a client connection): :meth:`release_owner` ends
        them when it goes away, so a killed client holds nothing for its leases' TTL.
        Ids that are 0 or no longer live are skipped (a lease may end before its
        answer leaves)."""
        with self._lock:
            for lease_id in lease_ids:
                lease = self._leases.get(lease_id)
                if lease is None or lease.owner == owner:
                    continue
                if lease.owner:
                    self._owned[lease.owner].discard(lease_id)
                lease.owner = owner
                self._owned.setdefault(owner, set()).add(lease_id)

    def release_owner(self, owner: str) -> int:
        """End every lease of ``owner`` (its client disconnected): read leases unpin,
        write leases drop their pending blocks, staging leases free their slots, as
        when they expire. The number of leases ended."""
        with self._lock:
            if self._closed:
                return 0
            lease_ids = self._owned.pop(owner, set())
            for lease_id in lease_ids:
                lease = self._leases.get(lease_id)
                if lease is not None:
                    lease.owner = ""
                    self._end_lease(lease, "its client disconnected")
            return len(lease_ids)

    # ----------------------------------------------------------------- write side
    def put(
        self,
        ns_id: str,
        keys: Sequence[BlockKey],
        payloads: Sequence[bytes | bytearray | memoryview],
        start: int = 0,
        priority: int | None = None,
    ) -> PutResult:
        entry = self._entry(ns_id)
        size = entry.spec.block_bytes
        self._check_keys(entry, keys)
        if not 0 <= start <= len(keys) or start + len(payloads) > len(keys):
            raise InvalidArgument(
                f"{len(payloads)} payloads from block {start} do not fit a chain of "
                f"{len(keys)} blocks"
            )
        views = [memoryview(p).cast("B") for p in payloads]
        for i, view in enumerate(views):
            if view.nbytes != size:
                raise InvalidArgument(
                    f"payload {i} is {view.nbytes} bytes; namespace {ns_id} stores "
                    f"blocks of {size} bytes"
                )
        chain = keys[: start + len(views)]
        reservation = self.reserve(ns_id, chain, start, priority=priority)
        reserved = len(reservation.offsets)
        try:
            array = self._arena.array()
            first = reservation.first_index - start
            for i, offset in enumerate(reservation.offsets):
                array[offset : offset + size] = np.frombuffer(views[first + i], dtype=np.uint8)
        except BaseException:
            if reserved:
                self.abandon(reservation.lease_id)
            raise
        if reserved:
            self.commit(reservation.lease_id)
        return PutResult(
            reserved,
            reservation.existing,
            reservation.refused,
            reservation.out_of_space,
        )

    def reserve(
        self,
        ns_id: str,
        keys: Sequence[BlockKey],
        start: int = 0,
        ttl_s: float | None = None,
        priority: int | None = None,
        *,
        stage_lease_id: int = 0,
        staged_offsets: Sequence[int] = (),
        stage_more: int = 0,
    ) -> Reservation:
        """Reserve the blocks ``keys[start:]`` that are not stored yet (pending, each in
        a host slot, under a write lease).

        With ``staged_offsets`` (one per offered block, in chain order; slots of the
        staging lease ``stage_lease_id``) each new block takes its staged slot instead
        of a fresh one; the slots of blocks that turn out to exist stay staged. With
        ``stage_more`` the call also sets aside that many empty slots for the caller's
        next put (fewer when the lease's limit or the room runs out; a new staging
        lease when ``stage_lease_id`` is 0). See the module docstring.
        """
        entry = self._entry(ns_id)
        self._check_keys(entry, keys)
        if not 0 <= start <= len(keys):
            raise InvalidArgument(f"start={start} is outside a chain of {len(keys)} blocks")
        if staged_offsets and len(staged_offsets) != len(keys) - start:
            raise InvalidArgument(
                f"{len(staged_offsets)} staged slots for {len(keys) - start} offered blocks"
            )
        if not 0 <= stage_more <= self.config.max_blocks_per_request:
            raise InvalidArgument(
                f"stage_more={stage_more} is outside [0, {self.config.max_blocks_per_request}]"
            )
        prio = self._priority(priority)
        ttl = self._ttl(ttl_s)
        with self._lock:
            self._check_open()
            self._expire()
            staging = self._staging_lease(entry, stage_lease_id, staged_offsets)
            reservation = self._reserve_locked(
                entry, keys, start, prio, ttl, staging, staged_offsets
            )
            if staging is None and stage_more == 0:
                return reservation
            if staging is None:
                staging = self._new_lease(entry, [], write=False, ttl=ttl)
                staging.staged, staging.ttl = set(), ttl
            granted = self._stage(staging, stage_more)
            staging.expires_at = self._clock() + staging.ttl  # _expire sees the renewal
            return replace(
                reservation,
                stage_lease_id=staging.lease_id,
                staged=tuple(granted),
                stage_ttl_s=staging.ttl,
            )

    def _staging_lease(
        self, entry: NamespaceEntry, lease_id: int, offsets: Sequence[int]
    ) -> _Lease | None:
        """The staging lease a reserve names (None for 0), after checking that it is
        one of this namespace and that ``offsets`` are distinct slots it holds."""
        if not lease_id:
            if offsets:
                raise InvalidArgument("staged slots need the staging lease that holds them")
            return None
        lease = self._lease(lease_id)
        if lease.staged is None:
            raise LeaseError(f"lease {lease_id} is a {lease.kind} lease, not a staging lease")
        if lease.entry is not entry:
            raise LeaseError(
                f"staging lease {lease_id} holds slots of namespace {lease.entry.spec.ns_id}"
            )
        if offsets:
            unknown = [o for o in offsets if o not in lease.staged]
            if unknown:
                raise InvalidArgument(
                    f"{len(unknown)} of the staged slots (first: offset {unknown[0]}) are not "
                    f"held by staging lease {lease_id}"
                )
            if len(set(offsets)) != len(offsets):
                raise InvalidArgument("a staged slot is named twice")
        return lease

    def _stage(self, lease: _Lease, count: int) -> list[int]:
        """Set aside up to ``count`` more empty slots under a staging lease (evicting
        leaves as a put would), within the lease's limit; the offsets granted."""
        assert lease.staged is not None
        size = lease.entry.spec.block_bytes
        room = self.config.staged_bytes_limit // size - len(lease.staged)
        count = max(0, min(count, room))
        group = lease.entry.group
        if count and group.quota.host_bytes:
            count = self._quota_blocks(group, count, size)
        if count == 0:
            return []
        offsets = self._arena.alloc_run(size, count)
        group.staged_bytes += len(offsets) * size
        while len(offsets) < count:
            offset = self._alloc_host(size, group)
            if offset is None:
                break
            offsets.append(offset)
            group.staged_bytes += size
        lease.staged.update(offsets)
        return offsets

    def _reserve_locked(
        self,
        entry: NamespaceEntry,
        keys: Sequence[BlockKey],
        start: int,
        prio: int,
        ttl: float,
        staging: _Lease | None,
        staged_offsets: Sequence[int],
    ) -> Reservation:
        walk = self._index.walk(keys)
        offered = len(keys) - start
        if start > 0 and (len(walk) < start or not walk[start - 1].ready):
            return Reservation(0, 0.0, existing=0, refused=offered)
        existing = 0
        for node in walk[start:]:
            if not node.ready:  # another owner is computing it: wait or recompute
                return Reservation(0, 0.0, existing, offered - existing)
            existing += 1
        for node in walk:
            node.pins += 1
        created: list[Node] = []
        run: list[int] = []
        try:
            parent = walk[-1] if walk else None
            # new blocks go to host, so their prefix must be there too (parents first)
            promoted = all(self._promote_now(node) for node in walk if not node.in_host)
            out_of_space = not promoted
            first_new = max(start, len(walk))
            end = len(keys) if promoted else first_new
            size = entry.spec.block_bytes
            if entry.group.quota.host_bytes and end > first_new and not staged_offsets:
                # (blocks going into staged slots were counted when the slots were staged)
                fits = self._quota_blocks(entry.group, end - first_new, size)
                out_of_space = out_of_space or fits < end - first_new
                end = first_new + fits
            # staged slots, or one carve for the whole batch when a free extent holds
            # it (then one pass makes the run's nodes), else slot by slot (evicting)
            if staged_offsets:
                run = list(staged_offsets[first_new - start : end - start])
            elif end > first_new:
                run = self._arena.alloc_run(size, end - first_new)
            if run:
                created = self._add_pending_run(entry, keys[first_new:end], parent, prio, run)
                if staging is not None and staging.staged is not None:
                    staging.staged.difference_update(run)
                    staging.entry.group.staged_bytes -= len(run) * size
            for i in range(first_new + len(created), end):
                offset = self._alloc_host(size, entry.group)
                if offset is None:
                    out_of_space = True
                    break
                created += self._add_pending_run(entry, keys[i : i + 1], parent, prio, [offset])
                parent = created[-1]
        finally:
            if not staged_offsets:
                for offset in run[len(created) :]:  # only if something above raised
                    self._arena.free(offset)
            for node in walk:
                node.pins -= 1
        self._touch(walk[-1:] if self._host_policy.touch_prefix else walk[start:])
        refused = offered - existing - len(created)
        if not created:
            return Reservation(0, 0.0, existing, refused, out_of_space)
        self._pending += len(created)
        lease = self._new_lease(entry, created, write=True, ttl=ttl)
        first = len(keys) - refused - len(created)
        lease.first_index = first
        return Reservation(
            lease.lease_id,
            lease.expires_at,
            existing,
            refused,
            out_of_space,
            first,
            tuple(keys[first : first + len(created)]),
            tuple([node.host_offset for node in created]),
            size,
        )

    def _add_pending_run(
        self,
        entry: NamespaceEntry,
        keys: Sequence[BlockKey],
        parent: Node | None,
        prio: int,
        offsets: Sequence[int],
    ) -> list[Node]:
        """New pending nodes for a run of a chain (``keys[i]`` under ``keys[i - 1]``,
        the first under ``parent``), each in its host slot ``offsets[i]`` and pinned
        by the write lease to come: what ``Index.add`` and ``_host_add`` do per block,
        in one pass (a put's blocks are one such run; a slot-by-slot reserve makes
        runs of one)."""
        nodes: list[Node] = []
        for key, offset in zip(keys, offsets, strict=True):
            node = Node(key, entry, parent, PENDING, prio, 0.0, 0, 1, offset)
            nodes.append(node)
            parent = node
        self._index.add_chain(nodes)
        self._host_blocks += len(nodes)
        entry.group.host_bytes += len(nodes) * entry.spec.block_bytes
        for holder in nodes[:-1]:
            holder.host_children = 1
        if nodes[0].parent is not None:
            nodes[0].parent.host_children += 1
        return nodes

    def commit(self, lease_id: int, count: int | None = None) -> int:
        """Make the next ``count`` (default: all) reserved blocks of a write lease ready;
        how many. See :meth:`commit_durably` for what write-through adds."""
        return self.commit_durably(lease_id, count)[0]

    def commit_durably(self, lease_id: int, count: int | None = None) -> tuple[int, int]:
        """:meth:`commit`, and how many of the committed blocks are durable when it
        returns: with write-through admission the blocks go to the disk writer and this
        waits (lock released, at most ``write_through_wait_s``, never past a disk fault)
        until they are committed to disk; a block the disk tier refused (a fault, no
        room, below ``disk_min_priority``) is stored but not durable. (ready, durable);
        durable is 0 with the other admission modes, which promise nothing on a crash."""
        with self._lock:
            self._expire()
            lease = self._lease(lease_id, write=True)
            remaining = len(lease.nodes) - lease.committed
            n = remaining if count is None else count
            if not 0 <= n <= remaining:
                raise InvalidArgument(
                    f"count={count} is outside [0, {remaining}] for lease {lease_id}"
                )
            batch = lease.nodes[lease.committed : lease.committed + n]
            self._arena.epochs.bump([node.host_offset for node in batch])  # final bytes now
            for node in batch:
                node.state = READY
                node.pins -= 1
            self._pending -= n
            self._c.host_bytes_in += n * lease.entry.spec.block_bytes
            lease.committed += n
            disk = self._disk
            through = self.config.admission == "write-through" and disk is not None
            if batch:
                self._insert_used(batch)
                self._emit_all(EventKind.STORED, batch, Tier.HOST)
                if through:
                    for node in batch:
                        self._write_to_disk(node)
            if lease.committed == len(lease.nodes):
                self._forget_lease(lease, "committed")
            self._changed.notify_all()
            on_disk = [node.key for node in batch if node.on_disk]
        if not through or not on_disk:
            return n, 0
        assert disk is not None
        return n, disk.wait_committed(on_disk, self.config.write_through_wait_s)

    def claimed_slots(self, lease_id: int, count: int) -> tuple[SlotRef, ...]:
        """The next ``count`` uncommitted blocks of a write lease (chain order), for a
        caller that fills them and then commits ``count``: the arena writer, or the
        daemon delivering an inline Put into a claim."""
        with self._lock:
            self._expire()
            lease = self._lease(lease_id, write=True)
            remaining = len(lease.nodes) - lease.committed
            if not 0 < count <= remaining:
                raise InvalidArgument(
                    f"{count} blocks for lease {lease_id}, which has {remaining} left"
                )
            first = lease.first_index + lease.committed
            nodes = lease.nodes[lease.committed : lease.committed + count]
            return tuple(
                SlotRef(first + i, node.key, node.host_offset, node.size)
                for i, node in enumerate(nodes)
            )

    def fill(self, lease_id: int, payloads: Sequence[bytes | bytearray | memoryview]) -> int:
        """Write ``payloads`` into the next reserved blocks of a write lease and commit
        them: the inline twin of "write the arena slots, then commit" for clients that
        cannot map the arena. Returns how many became ready."""
        slots = self.claimed_slots(lease_id, len(payloads)) if payloads else ()
        views = [memoryview(p).cast("B") for p in payloads]
        for i, (view, slot) in enumerate(zip(views, slots, strict=True)):
            if view.nbytes != slot.size:
                raise InvalidArgument(
                    f"payload {i} is {view.nbytes} bytes; the lease's blocks are {slot.size}"
                )
        # the pending blocks stay pinned by the lease while their bytes are copied
        array = self._arena.array()
        for slot, view in zip(slots, views, strict=True):
            array[slot.offset : slot.offset + slot.size] = np.frombuffer(view, dtype=np.uint8)
        return self.commit(lease_id, len(views))

    def abandon(self, lease_id: int) -> int:
        with self._lock:
            self._expire()
            lease = self._lease(lease_id, write=True)
            dropped = len(lease.nodes) - lease.committed
            self._end_lease(lease, "abandoned")
            return dropped

    def delete(self, ns_id: str, keys: Sequence[BlockKey], start: int = 0) -> int:
        """Drop block ``start`` of the chain and its descendants (busy ones stay); the
        number dropped. Returns once their deletions from disk are committed."""
        entry = self._entry(ns_id)
        self._check_keys(entry, keys)
        if not 0 <= start < max(len(keys), 1):
            raise InvalidArgument(f"start={start} is outside a chain of {len(keys)} blocks")

        def drop() -> int:
            walk = self._index.walk(keys)
            return self._delete_subtree(walk[start]) if len(walk) > start else 0

        return self._drop_and_commit(drop)

    def clear(self, ns_id: str | None = None) -> int:
        """Drop every block of a namespace (of all when None; busy ones stay); the number
        dropped. Returns once their deletions from disk are committed."""
        entries = [self._entry(ns_id)] if ns_id is not None else None

        def drop() -> int:
            removed = 0
            for entry in entries or list(self._namespaces.values()):
                for key in list(entry.roots):
                    root = self._index.get(key)
                    if root is not None:
                        removed += self._delete_subtree(root)
            return removed

        return self._drop_and_commit(drop)

    def _drop_and_commit(self, drop: Callable[[], int]) -> int:
        """Run ``drop`` (it removes blocks; returns how many) under the lock, then, once
        the lock is released, wait until the disk deletions it queued are committed: a
        restart does not bring the blocks back, and a same-host client reading the disk
        file itself (kvclient.disk_index) no longer finds them."""
        with self._lock:
            self._expire()
            on_disk = self._disk_blocks
            removed = drop()
            deleted_on_disk = self._disk_blocks < on_disk
        if not deleted_on_disk:
            return removed
        assert self._disk is not None
        try:
            self._disk.flush(timeout=DELETE_COMMIT_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as exc:  # the blocks are gone from the index
            log.warning("disk deletions not committed yet: %s", exc)
        return removed

    def set_priority(
        self,
        ns_id: str,
        keys: Sequence[BlockKey],
        priority: int,
        duration_s: float | None = None,
        start: int = 0,
    ) -> int:
        entry = self._entry(ns_id)
        self._check_keys(entry, keys)
        prio = self._priority(priority)
        if duration_s is not None and not duration_s > 0:
            raise InvalidArgument(f"duration_s must be > 0 when given, got {duration_s}")
        if not 0 <= start <= len(keys):
            raise InvalidArgument(f"start={start} is outside a chain of {len(keys)} blocks")
        with self._lock:
            self._expire()
            until = self._clock() + duration_s if duration_s else 0.0
            changed = self._index.walk(keys)[start:]
            for node in changed:
                self._set_node_priority(node, prio)
                if until:
                    self._priority_until[node] = until
                    heapq.heappush(self._priority_heap, (until, next(self._priority_seq), node))
                else:
                    self._priority_until.pop(node, None)
            return len(changed)

    # -------------------------------------------------------------- observability
    def stats(self) -> StoreStats:
        with self._lock:
            self._expire()
            c = self._c
            tiers = [
                TierStats(
                    Tier.HOST,
                    self._arena.capacity_bytes,
                    self._arena.used_bytes,
                    self._host_blocks,
                    c.host_hits,
                    c.host_misses,
                    c.host_evictions,
                    c.host_bytes_in,
                    c.host_bytes_out,
                )
            ]
            disk_queue = 0
            corrupt = 0
            disk_counters: dict[str, int] = {}
            fault = ""
            if self._disk is not None:
                dstats = self._disk.stats()
                disk_queue = dstats.queue_bytes
                corrupt = dstats.corrupt_reads
                fault = dstats.fault
                disk_counters = {
                    "disk_refused_writes": dstats.refused_writes,
                    "disk_dropped_writes": dstats.dropped_writes,
                }
                tiers.append(
                    TierStats(
                        Tier.DISK,
                        self._disk.capacity_bytes,
                        self._disk.used_bytes,
                        self._disk_blocks,
                        c.disk_hits,
                        c.disk_misses,
                        c.disk_evictions,
                        c.disk_bytes_in,
                        c.disk_bytes_out,
                    )
                )
            namespaces = tuple(
                NamespaceStats(
                    ns_id,
                    e.spec.model,
                    e.spec.block_tokens,
                    e.spec.block_bytes,
                    e.blocks,
                    e.bytes,
                    e.hits,
                    e.misses,
                )
                for ns_id, e in self._namespaces.items()
            )
            return StoreStats(
                tiers=tuple(tiers),
                namespaces=namespaces,
                demotions=c.demotions,
                promotions=c.promotions,
                pending_blocks=self._pending,
                leases=sum(lease.staged is None for lease in self._leases.values()),
                corrupt_reads=corrupt,
                disk_queue_bytes=disk_queue,
                counters={
                    "dropped": c.dropped,
                    "lost_on_disk": c.lost_on_disk,
                    "known_slot_gets": c.known_slot_gets,
                    "disk_file_gets": c.disk_file_gets,
                    "repeated_gets": c.repeated_gets,
                    "event_seq": self._seq,  # the newest event's seq (kvctl events --count)
                    **disk_counters,
                },
                staged_bytes=sum(
                    len(lease.staged) * self._arena.slot_size(next(iter(lease.staged)))
                    for lease in self._leases.values()
                    if lease.staged
                ),
                disk_fault=fault,
                tenants=self._tenant_usage(),
            )

    def _tenant_usage(self) -> tuple[TenantUsage, ...]:
        """Each group's usage (under the lock); none when no namespace has a tenant."""
        if not any(self._groups):
            return ()
        entries: dict[str, list[NamespaceEntry]] = {name: [] for name in self._groups}
        for entry in self._namespaces.values():
            entries[entry.group.name].append(entry)
        return tuple(
            TenantUsage(
                name,
                group.host_held,
                group.disk_bytes,
                group.quota.host_bytes,
                group.quota.disk_bytes,
                len(entries[name]),
                sum(e.blocks for e in entries[name]),
                sum(e.hits for e in entries[name]),
                sum(e.misses for e in entries[name]),
                group.quota_evictions,
            )
            for name, group in sorted(self._groups.items())
        )

    def events_since(self, seq: int, timeout: float = 0.0, limit: int = 1024) -> list[Event]:
        deadline = self._clock() + max(timeout, 0.0)
        with self._changed:
            while self._seq <= seq and not self._closed:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return []
                self._changed.wait(remaining)
            if not self._events:
                return []
            first = self._events[0][0]
            begin = max(seq + 1 - first, 0)
            return [Event._make(e) for e in itertools.islice(self._events, begin, begin + limit)]

    def wait_ready(self, ns_id: str, keys: Sequence[BlockKey], timeout: float) -> LookupResult:
        entry = self._entry(ns_id)
        self._check_keys(entry, keys)
        deadline = self._clock() + max(timeout, 0.0)
        with self._changed:
            while True:
                self._expire()
                result = self._lookup(keys)
                remaining = deadline - self._clock()
                if not result.pending_keys or remaining <= 0 or self._closed:
                    return result
                # short slices: a lapsed owner lease is noticed by _expire() promptly
                self._changed.wait(min(remaining, 0.05))

    def expire(self) -> None:
        """Reclaim expired leases and priorities now (also done on every call)."""
        with self._lock:
            self._expire()

    def verify_invariants(self) -> None:
        """Walk the whole index and raise AssertionError on any broken invariant.

        O(blocks): for tests and debugging, not for the serving path.
        """
        with self._lock:
            self._expire()  # applies a disk capacity the writer lowered meanwhile
            host = disk = pending = 0
            held: set[int] = set()  # host slots of blocks
            group_bytes = {name: [0, 0] for name in self._groups}  # host, disk
            for node in self._index.nodes.values():
                parent = node.parent
                assert node.pins >= 0, f"{node}: negative pins"
                assert node.in_host or node.on_disk, f"{node}: indexed but in no tier"
                if not node.ready:
                    pending += 1
                    assert node.in_host and node.pins >= 1, f"{node}: pending without slot/lease"
                if parent is not None:
                    assert self._index.get(parent.key) is parent, f"{node}: parent not indexed"
                    assert node.ready <= parent.ready, f"{node}: ready under a pending parent"
                    if node.in_host:
                        assert parent.in_host, f"{node}: in host, parent is not"
                    if node.on_disk:
                        assert parent.on_disk, f"{node}: on disk, parent is not"
                children = list(node.children())
                assert node.host_children == sum(c.in_host for c in children), f"{node}: host count"
                assert node.disk_children == sum(c.on_disk for c in children), f"{node}: disk count"
                listed = node in self._host_policy
                assert listed == (node.in_host and node.ready), f"{node}: host list membership"
                assert (node in self._disk_policy) == node.on_disk, f"{node}: disk list membership"
                host += node.in_host
                disk += node.on_disk
                group_bytes[node.ns.group.name][0] += node.size * node.in_host
                group_bytes[node.ns.group.name][1] += node.size * node.on_disk
                if node.in_host:
                    held.add(node.host_offset)
            assert host == self._host_blocks and disk == self._disk_blocks, "tier block counts"
            staged_of = {name: 0 for name in self._groups}
            for lease in self._leases.values():
                slots = len(lease.staged or ())
                staged_of[lease.entry.group.name] += slots * lease.entry.spec.block_bytes
            for name, group in self._groups.items():
                held_bytes = [group.host_bytes, group.disk_bytes]
                assert group_bytes[name] == held_bytes, f"tenant {name!r}: bytes counted"
                assert staged_of[name] == group.staged_bytes, f"tenant {name!r}: staged bytes"
            staged = [o for lease in self._leases.values() for o in lease.staged or ()]
            assert len(set(staged)) == len(staged), "a slot staged twice"
            assert held.isdisjoint(staged), "a staged slot holds a block"
            for offset in staged:
                self._arena.slot_size(offset)  # raises unless a live slot
            assert pending == self._pending, "pending count"
            assert self._arena.used_bytes <= self._arena.capacity_bytes, "host over capacity"
            if self._disk is not None:
                assert self._disk.used_bytes <= self._disk.capacity_bytes, "disk over capacity"

    # =============================================================== internals
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the store is closed")

    def _entry(self, ns_id: str | None) -> NamespaceEntry:
        entry = self._namespaces.get(ns_id or "")
        if entry is None:
            raise UnknownNamespace(f"unknown namespace {ns_id!r}; open it first")
        return entry

    def _register(self, spec: NamespaceSpec) -> NamespaceEntry:
        tenant = tenant_of(spec.tenant_salt)
        group = self._groups.get(tenant)
        if group is None:
            quota = self.config.quotas.get(tenant, Quota())
            group = self._groups[tenant] = Group(tenant, quota)
        entry = NamespaceEntry(spec, group)
        self._namespaces[spec.ns_id] = entry
        self._by_digest[spec.digest] = entry
        return entry

    def _check_keys(self, entry: NamespaceEntry, keys: Sequence[BlockKey]) -> None:
        limit = self.config.max_blocks_per_request
        if len(keys) > limit:
            raise InvalidArgument(
                f"{len(keys)} blocks in one request, more than max_blocks_per_request={limit}"
            )
        width = entry.spec.key_bytes
        # set(map(...)) runs in C: this is on every lookup of up to thousands of keys
        if keys and (set(map(type, keys)) != {bytes} or set(map(len, keys)) != {width}):
            raise InvalidArgument(f"block keys of namespace {entry.spec.ns_id} are {width} bytes")

    def _priority(self, priority: int | None) -> int:
        if priority is None:
            return self.config.default_priority
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidArgument(f"priority must be an integer, got {priority!r}")
        if not 0 <= priority <= MAX_PRIORITY:
            raise InvalidArgument(f"priority must be in [0, {MAX_PRIORITY}], got {priority}")
        return priority

    def _ttl(self, ttl_s: float | None) -> float:
        if ttl_s is None:
            return self.config.lease_ttl_s
        if not 0 < ttl_s <= self.config.max_lease_ttl_s:
            raise InvalidArgument(
                f"ttl_s must be in (0, {self.config.max_lease_ttl_s}], got {ttl_s}"
            )
        return ttl_s

    def _lookup(self, keys: Sequence[BlockKey]) -> LookupResult:
        walk = self._index.walk(keys)
        ready = host = 0
        for node in walk:  # attributes, not the properties: this runs per block per call
            if node.state != READY:
                break
            ready += 1
            if node.host_offset >= 0:
                host += 1
        pending = tuple(
            node.key for node in itertools.takewhile(lambda n: not n.ready, walk[ready:])
        )
        return LookupResult(ready, host, ready - host, pending)

    # --- pinned reads -----------------------------------------------------------
    def _pin_prefix(
        self,
        entry: NamespaceEntry,
        keys: Sequence[BlockKey],
        promote_all: bool,
        host_only: bool = False,
    ) -> tuple[list[Node], dict[int, int]] | None:
        """Pin the ready prefix and reserve host slots for its disk-only blocks.

        Returns the pinned nodes and {position: fresh host offset} for blocks to promote.
        With ``promote_all`` the prefix is cut at the first block that gets no slot
        (acquire needs every block in host); otherwise that block is read from disk.
        With ``host_only``, None (nothing pinned) when a block is not in the host tier.
        """
        with self._lock:
            self._check_open()
            self._expire()
            nodes = self._ready_prefix(keys)
            all_host = all(node.host_offset >= 0 for node in nodes)
            if host_only and not all_host:
                return None
            for node in nodes:
                node.pins += 1
            if all_host:
                return nodes, {}
            fresh: dict[int, int] = {}
            for i, node in enumerate(nodes):
                if node.in_host:
                    continue
                offset = self._alloc_host(node.size, node.ns.group)
                if offset is None:
                    if promote_all:
                        for late in nodes[i:]:
                            late.pins -= 1
                        del nodes[i:]
                    break
                fresh[i] = offset
            return nodes, fresh

    def _copy_out(
        self, nodes: list[Node], fresh: dict[int, int], out: memoryview, size: int, start: int
    ) -> int:
        """Copy pinned blocks ``nodes[start:]`` into ``out`` and fill the promotion slots
        of all of them (no lock held); returns how many of ``nodes`` are good."""
        array = self._arena.array()
        dst = np.frombuffer(out, dtype=np.uint8)
        for i, node in enumerate(nodes):
            target = dst[(i - start) * size : (i - start + 1) * size] if i >= start else None
            if node.in_host:
                if target is not None:
                    target[:] = array[node.host_offset : node.host_offset + size]
                continue
            assert self._disk is not None
            if i in fresh:
                slot = self._arena.view(fresh[i], size)
                if self._disk.read(node.key, out=slot) is None:
                    return i
                if target is not None:
                    target[:] = array[fresh[i] : fresh[i] + size]
            elif target is not None:
                window = out[(i - start) * size : (i - start + 1) * size]
                if self._disk.read(node.key, out=window) is None:
                    return i
        return len(nodes)

    def _fill_promotions(self, nodes: list[Node], fresh: dict[int, int]) -> int:
        """Read disk-only blocks into their fresh host slots (no lock held); the number
        of leading ``nodes`` that are good.

        A disk read is a pread and a checksum pass, both without the GIL: promotions
        of ``PARALLEL_PROMOTE_BYTES`` or more run on PROMOTE_THREADS threads at once."""
        disk = self._disk
        todo = sorted(fresh)

        def fill(i: int) -> bool:
            assert disk is not None
            slot = self._arena.view(fresh[i], nodes[i].size)
            return disk.read(nodes[i].key, out=slot) is not None

        def fill_all(part: list[int]) -> int | None:
            """The first block of ``part`` that failed, or None."""
            for i in part:
                if not fill(i):
                    return i
            return None

        if len(todo) > 1 and sum(nodes[i].size for i in todo) >= PARALLEL_PROMOTE_BYTES:
            # one share per thread (a hand-off per block would cost more than it saves)
            share = -(-len(todo) // PROMOTE_THREADS)
            parts = [todo[k : k + share] for k in range(0, len(todo), share)]
            pool = self._promote_pool()
            futures = [pool.submit(fill_all, part) for part in parts[1:]]
            failed = [fill_all(parts[0])] + [f.result() for f in futures]
            bad = [i for i in failed if i is not None]
            return min(bad) if bad else len(nodes)
        first_bad = fill_all(todo)
        return len(nodes) if first_bad is None else first_bad

    def _promote_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._promoters is None:
                self._promoters = ThreadPoolExecutor(
                    PROMOTE_THREADS, thread_name_prefix="kvstore-promote"
                )
            return self._promoters

    def _finish_pinned(
        self,
        entry: NamespaceEntry,
        keys: Sequence[BlockKey],
        nodes: list[Node],
        fresh: dict[int, int],
        ok: int,
        keep_pins: bool,
        start: int = 0,
        count: bool = True,
    ) -> None:
        """Publish promotions of nodes[:ok], fix blocks lost on disk, count hits of the
        blocks the caller asked for (``start`` on; not with ``count=False``), unpin."""
        with self._lock:
            host_hits = sum(1 for node in nodes[start:ok] if node.host_offset >= 0)
            promoted = 0  # served blocks read into a fresh slot (the rest came from host)
            for i, offset in fresh.items():
                node = nodes[i]
                if start <= i < ok and not node.in_host:
                    promoted += 1
                if i < ok and not node.in_host and not self._closed:
                    self._publish_promotion(node, offset)
                else:
                    self._arena.free(offset)
            for node in nodes[ok:] if keep_pins else nodes:
                node.pins -= 1
            if ok < len(nodes) and nodes[ok].on_disk:
                self._lost_on_disk(nodes[ok])
            if count:
                self._count_served(
                    entry, len(keys) - start, max(ok - start, 0), host_hits, promoted
                )
                for node in nodes[:ok]:
                    node.hits += 1
            # blocks deleted while pinned are not touched: their subtrees went with them,
            # so the still indexed ones are a prefix of the chain
            end = ok
            while end and self._index.get(nodes[end - 1].key) is not nodes[end - 1]:
                end -= 1
            self._touch(nodes[:end])

    def _count_served(
        self, entry: NamespaceEntry, wanted: int, served: int, host_hits: int, promoted: int = 0
    ) -> None:
        """Hit and miss counters of a read that asked for ``wanted`` blocks and served
        ``served`` (``host_hits`` of them from host, ``promoted`` read into a fresh host
        slot, the rest straight from disk). Under the lock."""
        c = self._c
        c.host_hits += host_hits
        c.host_misses += wanted - host_hits
        c.disk_hits += served - host_hits
        c.disk_misses += wanted - served
        c.host_bytes_out += host_hits * entry.spec.block_bytes
        direct = served - host_hits - promoted  # read from disk without promoting
        c.disk_bytes_out += direct * entry.spec.block_bytes  # promotions counted above
        entry.hits += served
        entry.misses += wanted - served

    def _ready_prefix(self, keys: Sequence[BlockKey]) -> list[Node]:
        """The ready blocks of ``keys``' prefix, in any tier. Under the lock."""
        nodes: list[Node] = []
        for node in self._index.walk(keys):
            if node.state != READY:
                break
            nodes.append(node)
        return nodes

    def _host_prefix(self, keys: Sequence[BlockKey]) -> tuple[list[Node], bool]:
        """(the ready blocks of ``keys``' prefix up to the first one not in the host
        tier, whether that one is ready on disk only). Under the lock."""
        nodes: list[Node] = []
        for node in self._index.walk(keys):
            if node.state != READY:
                break
            if node.host_offset < 0:
                return nodes, True
            nodes.append(node)
        return nodes, False

    def _count_reads(
        self, entry: NamespaceEntry, nodes: list[Node], wanted: int, reads: int, host_hits: int
    ) -> None:
        """Count ``reads`` reads that asked for ``wanted`` blocks each and were served
        ``nodes`` (``host_hits`` of them from host slots, the rest straight from disk),
        and touch them as used. Under the lock."""
        n = len(nodes)
        self._count_served(entry, wanted * reads, n * reads, host_hits * reads)
        for node in nodes:
            node.hits += reads
        self._touch(nodes)

    def _promote_now(self, node: Node) -> bool:
        """Copy a disk-only block into a host slot while holding the lock.

        Only for the prefix of a reserve (a few blocks, usually after a restart); reads
        promote outside the lock. The caller pins ``node`` and its ancestors.
        """
        assert self._disk is not None and node.on_disk and not node.in_host
        offset = self._alloc_host(node.size, node.ns.group)
        if offset is None:
            return False
        if self._disk.read(node.key, out=self._arena.view(offset, node.size)) is None:
            self._arena.free(offset)
            self._lost_on_disk(node)
            return False
        self._publish_promotion(node, offset)
        return True

    def _publish_promotion(self, node: Node, offset: int) -> None:
        """A disk block's bytes are verified in host slot ``offset``: it is in host now."""
        self._arena.epochs.bump((offset,))  # the slot's bytes are final from here on
        self._host_add(node, offset)
        self._host_policy.insert(node)
        self._c.promotions += 1
        self._c.host_bytes_in += node.size
        self._c.disk_bytes_out += node.size
        self._emit(EventKind.PROMOTED, node, Tier.HOST)

    def _lost_on_disk(self, node: Node) -> None:
        """A block the index had on disk could not be read back (checksum or gone).

        Its disk descendants lose their parent there: blocks also in host just leave the
        disk tier, disk-only ones are dropped. If a concurrent reader still pins a
        disk-only block of that subtree, cleanup waits for the next failed read.
        """
        subtree = [n for n in self._index.subtree_postorder(node) if n.on_disk]
        if any(n.pins and not n.in_host for n in subtree):
            return
        self._c.lost_on_disk += 1
        self._emit(EventKind.CORRUPT, node, Tier.DISK)
        for late in subtree:
            if late.in_host:
                self._disk_drop(late)
            else:
                self._drop_node(late)

    # --- leases -------------------------------------------------------------------
    def _new_lease(
        self, entry: NamespaceEntry, nodes: list[Node], write: bool, ttl: float
    ) -> _Lease:
        lease_id = self._lease_ids.next()
        while lease_id in self._leases or lease_id in self._ended:
            lease_id = self._lease_ids.next()
        lease = _Lease(lease_id, write, entry, nodes, self._clock() + ttl)
        self._leases[lease_id] = lease
        heapq.heappush(self._lease_heap, (lease.expires_at, lease_id))
        return lease

    def _lease(self, lease_id: int, write: bool | None = None) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            why = self._ended.get(lease_id)
            if why is None:
                raise LeaseError(f"unknown lease {lease_id}")
            raise LeaseError(f"lease {lease_id} has ended ({why})")
        if write is not None and (lease.write != write or lease.staged is not None):
            raise LeaseError(f"lease {lease_id} is a {lease.kind} lease")
        return lease

    def _end_lease(self, lease: _Lease, why: str) -> None:
        if lease.write:
            dropped = lease.nodes[lease.committed :]
            for node in reversed(dropped):
                node.pins -= 1
                self._emit(EventKind.PENDING_DROPPED, node, Tier.HOST)
                self._host_drop(node)
                self._index.remove(node)
            self._pending -= len(dropped)
        else:
            for node in lease.nodes:
                node.pins -= 1
        for offset in lease.staged or ():
            self._arena.free(offset)
        if lease.staged:
            lease.entry.group.staged_bytes -= len(lease.staged) * lease.entry.spec.block_bytes
        self._forget_lease(lease, why)
        self._changed.notify_all()

    def _forget_lease(self, lease: _Lease, why: str) -> None:
        if lease.snapshot is not None:
            lease.snapshot.close()
        if lease.owner:
            owned = self._owned.get(lease.owner)
            if owned is not None:
                owned.discard(lease.lease_id)
                if not owned:
                    del self._owned[lease.owner]
        del self._leases[lease.lease_id]
        self._ended[lease.lease_id] = why
        if len(self._ended) > _ENDED_LEASES_KEPT:
            del self._ended[next(iter(self._ended))]

    def _expire(self) -> None:
        """Reclaim expired leases and timed priorities; apply a lowered disk capacity."""
        if self._disk is not None and self._disk.drain_shrunk():
            self._shrink_disk(self._disk)
        now = self._clock()
        heap = self._lease_heap
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is None:
                continue
            if lease.expires_at <= now:
                self._end_lease(lease, "expired")
            else:  # renewed (a staging lease): its one entry goes back with the new time
                heapq.heappush(heap, (lease.expires_at, lease_id))
        pheap = self._priority_heap
        while pheap and pheap[0][0] <= now:
            until, _, node = heapq.heappop(pheap)
            if self._priority_until.get(node) == until:
                del self._priority_until[node]
                self._set_node_priority(node, self.config.default_priority)

    def _reap(self) -> None:
        while not self._reaper_stop.wait(0.25):
            with self._lock:
                if self._closed:
                    return
                self._expire()

    # --- tiers ----------------------------------------------------------------------
    def _host_add(self, node: Node, offset: int) -> None:
        node.host_offset = offset
        self._host_blocks += 1
        node.ns.group.host_bytes += node.size
        if node.parent is not None:
            node.parent.host_children += 1

    def _host_drop(self, node: Node) -> None:
        if node in self._host_policy:
            self._host_policy.remove(node)
        self._arena.free(node.host_offset)
        node.host_offset = -1
        self._host_blocks -= 1
        node.ns.group.host_bytes -= node.size
        if node.parent is not None:
            node.parent.host_children -= 1

    def _disk_add(self, node: Node) -> None:
        node.on_disk = True
        self._disk_blocks += 1
        node.ns.group.disk_bytes += node.size
        self._disk_policy.insert(node)
        if node.parent is not None:
            node.parent.disk_children += 1

    def _disk_drop(self, node: Node) -> None:
        assert self._disk is not None
        self._disk.delete(node.key)
        self._disk_policy.remove(node)
        node.on_disk = False
        self._disk_blocks -= 1
        node.ns.group.disk_bytes -= node.size
        if node.parent is not None:
            node.parent.disk_children -= 1

    def _drop_node(self, node: Node) -> None:
        """Remove a childless, unpinned block from every tier and the index."""
        if node.in_host:
            self._host_drop(node)
        if node.on_disk:
            self._disk_drop(node)
        self._index.remove(node)
        self._priority_until.pop(node, None)
        self._c.dropped += 1
        self._emit(EventKind.REMOVED, node, None)

    def _delete_subtree(self, root: Node) -> int:
        """Drop ``root`` and its descendants, keeping busy blocks and their ancestors."""
        removed = 0
        for node in self._index.subtree_postorder(root):
            if node.pins or not node.ready or node.first_child is not None:
                continue
            self._drop_node(node)
            removed += 1
        return removed

    def _set_node_priority(self, node: Node, priority: int) -> None:
        node.priority = priority
        if node in self._host_policy:
            self._host_policy.reprioritize(node)
        if node in self._disk_policy:
            self._disk_policy.reprioritize(node)
            assert self._disk is not None
            self._disk.touch(node.key, priority, node.last_access)

    def _touch(self, named: Sequence[Node]) -> None:
        """Mark a use of the blocks a request named (root-to-leaf order).

        Prefix-aware policies count a use of a block as a use of its whole prefix:
        one timestamp, walked leaf to root so every parent ends up after (newer than)
        its children in the eviction lists. Plain LRU touches only ``named``.
        """
        if not named:
            return
        now = self._wall()
        last = named[-1]
        if not self._host_policy.touch_prefix:
            used = [node for node in named if node.ready]
        elif named[0].parent is None and last.state == READY:
            used = named[::-1]  # the whole prefix, leaf first (a ready block's parents are)
        else:
            used = [node for node in itertools.chain((last,), last.ancestors()) if node.ready]
        for node in used:
            node.last_access = now
        self._host_policy.touch_all(used)
        if self._disk is not None:
            self._disk_policy.touch_all(used)

    def _insert_used(self, batch: Sequence[Node]) -> None:
        """List blocks that just became ready (one run of a chain, parents first) in the
        host tier as just used, then touch their prefix: the order that inserting them
        and then ``_touch(batch)`` gives, with one list operation per block, not three."""
        policy = self._host_policy
        now = self._wall()
        for node in batch:
            node.last_access = now
        policy.insert_all(batch[::-1] if policy.touch_prefix else batch)
        parent = batch[0].parent
        if policy.touch_prefix and parent is not None:
            self._touch((parent,))  # a prefix-aware touch of a block is one of its prefix

    # --- eviction -------------------------------------------------------------------
    def _alloc_host(self, size: int, group: Group) -> int | None:
        """A host slot of ``size`` bytes for a block of ``group``, evicting host leaves
        until one fits (the group's own first, while it is at its quota)."""
        if not self._quota_room(group, size, host=True):
            return None
        while True:
            offset = self._arena.alloc(size)
            if offset is not None:
                return offset
            victim = self._victim(self._host_policy, host=True)
            if victim is None:
                return None
            self._evict_from_host(victim)

    def _quota_room(self, group: Group, nbytes: int, host: bool) -> bool:
        """Make ``nbytes`` more fit ``group``'s quota in one tier by evicting its own
        least valuable blocks; False when they cannot (its blocks there are pinned,
        pending or parents of such). Other groups' blocks are never touched."""
        limit = group.quota.host_bytes if host else group.quota.disk_bytes
        if not limit:
            return True
        policy = self._host_policy if host else self._disk_policy
        while (group.host_held if host else group.disk_bytes) + nbytes > limit:
            victim = self._victim(policy, host, group.name)
            if victim is None:
                return False
            group.quota_evictions += 1
            if host:
                self._evict_from_host(victim)
            else:
                self._evict_from_disk(victim)
        return True

    def _quota_blocks(self, group: Group, n: int, size: int) -> int:
        """How many of ``n`` new host blocks of ``size`` bytes ``group``'s quota takes
        (evicting its own blocks to make room for as many as it can)."""
        if self._quota_room(group, n * size, host=True):
            return n
        # every block of the group that could go went: what is left is what fits now
        return max(0, (group.quota.host_bytes - group.host_held) // size)

    def _victim(self, policy: GroupedPolicy, host: bool, group: str | None = None) -> Node | None:
        """The tier's next block to evict (of one group when ``group`` is given)."""
        for node in policy.candidates(group):
            if node.pins or not node.ready:
                continue
            if policy.leaf_first:
                if (node.host_children if host else node.disk_children) == 0:
                    return node
            elif not self._subtree_busy(node):
                return node
        return None

    def _subtree_busy(self, node: Node) -> bool:
        return any(n.pins or not n.ready for n in self._index.subtree_postorder(node))

    def _evict_from_host(self, node: Node) -> None:
        self._c.host_evictions += 1
        if not self._host_policy.leaf_first:  # plain LRU: descendants become unusable
            for late in self._index.subtree_postorder(node)[:-1]:
                self._drop_node(late)
        if node.on_disk or self._write_to_disk(node):
            self._host_drop(node)
            self._c.demotions += 1
            self._emit(EventKind.DEMOTED, node, Tier.DISK)
            return
        self._drop_node(node)  # a host leaf that is not on disk has no disk children

    def _admit(self, node: Node) -> bool:
        if node.priority < self.config.disk_min_priority:
            return False
        if self.config.admission == "selective":
            return node.hits >= self.config.selective_hits
        return True

    def _write_to_disk(self, node: Node, evict: bool = True) -> bool:
        """Queue a host block's bytes for the disk tier; False if not admitted or no room.

        The disk tier is prefix-closed on its own: ancestors missing from disk are
        written first (they stay in host too), so what is on disk is always a usable
        forest by itself and survives a restart whole. ``evict=False`` writes only into
        free room (used at close, so persisting the host tier never pushes out blocks
        that were already committed to disk).
        """
        disk = self._disk
        if disk is None or node.on_disk or not self._admit(node):
            return False
        if disk.fault:  # refused now, before making room for it
            disk.refuse()
            return False
        chain = [node]
        # the nearest ancestor already on disk is pinned too: it is a disk leaf until
        # the chain lands under it, and making room must not evict it first
        held = [node]
        for ancestor in node.ancestors():
            held.append(ancestor)
            if ancestor.on_disk:
                break
            chain.append(ancestor)
        for pinned in held:
            pinned.pins += 1
        try:
            group = node.ns.group
            for block in reversed(chain):  # parents first
                footprint = disk.footprint(block.size)
                if evict:
                    if not self._quota_room(group, block.size, host=False):
                        return False
                    if not self._make_disk_room(footprint):
                        return False
                elif disk.used_bytes + footprint > disk.capacity_bytes or (
                    group.quota.disk_bytes
                    and group.disk_bytes + block.size > group.quota.disk_bytes
                ):
                    return False
                if not self._queue_disk_write(disk, block):
                    return False
            return True
        finally:
            for pinned in held:
                pinned.pins -= 1

    def _queue_disk_write(self, disk: DiskTier, node: Node) -> bool:
        """Hand a host block to the disk writer; False when the tier refuses it (a disk
        fault, or its queue is full: never waited for under the lock)."""
        payload = self._arena.view(node.host_offset, node.size)
        parent = node.parent.key if node.parent is not None else b""
        record = DiskRecord(
            node.key,
            node.ns.spec.digest,
            parent,
            node.size,
            xxhash.xxh3_64_intdigest(payload),
            node.priority,
            node.last_access or self._wall(),
        )
        if not disk.write(record, payload):
            return False
        self._disk_add(node)
        self._c.disk_bytes_in += node.size
        return True

    def _make_disk_room(self, nbytes: int) -> bool:
        disk = self._disk
        assert disk is not None
        if disk.drain_shrunk():
            self._shrink_disk(disk)
        capacity = disk.capacity_bytes
        if nbytes > capacity:
            return False
        while disk.used_bytes + nbytes > capacity:
            victim = self._victim(self._disk_policy, host=False)
            if victim is None:
                return False
            self._evict_from_disk(victim)
        return True

    def _shrink_disk(self, disk: DiskTier) -> None:
        """LMDB ran out of map space and lowered the tier's effective capacity: evict
        disk leaves until the blocks fit it again."""
        while disk.used_bytes > disk.capacity_bytes:
            victim = self._victim(self._disk_policy, host=False)
            if victim is None:
                return
            self._evict_from_disk(victim)

    def _evict_from_disk(self, node: Node) -> None:
        self._c.disk_evictions += 1
        if not self._disk_policy.leaf_first:
            for late in self._index.subtree_postorder(node)[:-1]:
                self._drop_node(late)
        if node.in_host:
            self._disk_drop(node)
        else:
            self._drop_node(node)

    def _persist_host_blocks(self) -> None:
        """At close: write host-only ready blocks to disk, parents first, while room lasts."""
        for entry in self._namespaces.values():
            queue = [self._index.nodes[key] for key in entry.roots]
            while queue:
                node = queue.pop()
                if not node.in_host or not node.ready:
                    continue
                if not node.on_disk and not self._write_to_disk(node, evict=False):
                    continue  # not admitted: its descendants would be orphans on disk
                queue.extend(node.children())

    def _rebuild_from_disk(self) -> None:
        """Rebuild the index of disk blocks from LMDB; drop records that lost their parent."""
        disk = self._disk
        assert disk is not None
        for digest, spec_dict in disk.namespaces().items():
            spec = NamespaceSpec.from_dict(spec_dict)
            if spec.digest == digest:
                self._register(spec)
        records = {record.key: record for record in disk.records()}
        depth: dict[bytes, int] = {}
        orphans: list[bytes] = []
        for key in records:
            chain: list[DiskRecord] = []
            cursor: bytes | None = key
            while cursor is not None and cursor not in depth:
                record = records.get(cursor)
                if record is None or record.ns_digest not in self._by_digest:
                    orphans.extend(r.key for r in chain)
                    chain = []
                    break
                chain.append(record)
                cursor = record.parent or None
            for record in reversed(chain):
                parent = self._index.get(BlockKey(record.parent)) if record.parent else None
                entry = self._by_digest[record.ns_digest]
                if record.size != entry.spec.block_bytes:
                    orphans.append(record.key)
                    continue
                node = Node(
                    BlockKey(record.key),
                    entry,
                    parent,
                    state=READY,
                    priority=record.priority,
                    last_access=record.last_access,
                )
                self._index.add(node)
                node.on_disk = True
                self._disk_blocks += 1
                entry.group.disk_bytes += record.size
                if parent is not None:
                    parent.disk_children += 1
                depth[record.key] = depth.get(record.parent, -1) + 1
        for key in orphans:
            disk.delete(key)
        order = sorted(depth, key=lambda k: (records[k].last_access, -depth[k]))
        for key in order:
            self._disk_policy.insert(self._index.nodes[BlockKey(key)])
        if orphans:
            log.warning("dropped %d disk blocks whose parent was missing", len(orphans))
        log.info("rebuilt %d disk blocks in %d namespaces", len(depth), len(self._namespaces))

    # --- events ---------------------------------------------------------------------
    def _emit(self, kind: EventKind, node: Node, tier: Tier | None) -> None:
        self._emit_all(kind, (node,), tier)

    def _emit_all(self, kind: EventKind, nodes: Sequence[Node], tier: Tier | None) -> None:
        """One event per node, in order; waiters are woken once."""
        now = self._wall()
        seq = self._seq
        self._events.extend(
            [
                (seq + i, kind, node.ns.spec.ns_id, node.key, tier, now)
                for i, node in enumerate(nodes, 1)
            ]
        )
        self._seq = seq + len(nodes)
        self._changed.notify_all()
