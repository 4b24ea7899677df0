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

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvproto.v1.results import Event, NamespaceStats, Stats, TenantStats, TierStats
from kvstore.arena import HostArena, PinHook
from kvstore.disk import DiskTier
from kvstore.errors import (
    InvalidArgument,
    LayoutMismatch,
)
from kvstore.index import Index, NamespaceEntry, Node
from kvstore.keys import BlockKey, NamespaceSpec, chain_keys, tokens_array
from kvstore.policy import GroupedPolicy
from kvstore.results import EventKind, ReadyPrefix, Tier
from kvstore.shared_tier import SharedTier
from kvstore.store_shared import SharedBlocks
from kvstore.store_state import (
    ADMISSION_POLICIES,
    DEFAULT_PRIORITY,
    Counters,
    Lease,
    LeaseIds,
    StoreConfig,
)
from kvstore.tenants import Group

log = logging.getLogger(__name__)


__all__ = ["ADMISSION_POLICIES", "DEFAULT_PRIORITY", "Store", "StoreConfig"]


class Store(SharedBlocks):
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
        self._leases: dict[int, Lease] = {}
        self._owned: dict[str, set[int]] = {}  # owner -> its leases (see own)
        self._lease_ids = LeaseIds()
        self._lease_heap: list[tuple[float, int]] = []
        self._ended: dict[int, str] = {}  # recently ended lease id -> why (for precise errors)
        self._priority_heap: list[tuple[float, int, Node]] = []
        self._priority_until: dict[Node, float] = {}  # blocks whose priority is timed
        self._priority_seq = itertools.count()
        # events as plain tuples in Event's field order (Event._make when read: a block
        # stored makes one, under the lock, and a plain tuple costs half a NamedTuple)
        self._events: deque[tuple[int, EventKind, str, BlockKey, str, float]] = deque(
            maxlen=config.event_buffer
        )
        self._seq = 0
        self._host_blocks = 0
        self._disk_blocks = 0
        self._pending = 0
        self._c = Counters()
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
        self._shared = None if config.shared is None else SharedTier(config.shared, self)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> int:
        """Persist host-only blocks to disk (if configured), flush the writer, free the
        arena. Returns how many block writes to disk were due and never committed (a
        disk fault: see DiskTier.fault); 0 after a clean close."""
        if self._shared is not None:
            self._shared.close()  # its writer reads the arena
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
        """The disk tier's data file, if any."""
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

    # -------------------------------------------------------------- observability
    def stats(self) -> Stats:
        """The store's part of the daemon's Stats (platform, uptime and bound names are
        the daemon's to fill in)."""
        with self._lock:
            self._expire()
            c = self._c
            tiers = [
                TierStats(
                    Tier.HOST.value,
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
                        Tier.DISK.value,
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
            return Stats(
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
                shared=None if self._shared is None else self._shared.stats(),
            )

    def _tenant_usage(self) -> tuple[TenantStats, ...]:
        """Each group's usage (under the lock); none when no namespace has a tenant."""
        if not any(self._groups):
            return ()
        entries: dict[str, list[NamespaceEntry]] = {name: [] for name in self._groups}
        for entry in self._namespaces.values():
            entries[entry.group.name].append(entry)
        return tuple(
            TenantStats(
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

    def wait_ready(self, ns_id: str, keys: Sequence[BlockKey], timeout: float) -> ReadyPrefix:
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
