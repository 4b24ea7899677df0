"""The store: index + policy + host arena + disk tier behind one lock.

Protocol (every method is thread-safe; all key chains start at the namespace root):

- ``open_namespace(spec)`` registers a namespace (idempotent; a different layout under
  the same ns_id raises LayoutMismatch). ``keys_for(ns_id, tokens)`` computes the chain.
- ``lookup(ns_id, keys)`` -> longest ready prefix, per-tier counts, pending keys after it;
  ``lookup_many(ns_id, chains)``: a lookup of each chain, under one hold of the lock.
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

The store is a façade: it makes its parts (:mod:`kvstore.store_parts`) and hands each
call to the one that serves it: :class:`kvstore.store_reads.Reads`,
:class:`kvstore.store_writes.Writes`, :class:`kvstore.tier_stack.TierStack` (the far
tiers behind host and disk, made from :func:`far_tiers`); what spans them all
(lifecycle, namespaces, leases' ends, stats, events) is here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvproto.v1.results import Event, NamespaceStats, SharedStats, Stats, TenantStats
from kvstore.disk import DiskTier
from kvstore.disk.placement import DiskPlacement
from kvstore.errors import InvalidArgument, LayoutMismatch, OutOfSpace
from kvstore.events import Counters, EventLog
from kvstore.far_tier import FarTierEntry
from kvstore.host.arena import HostArena, PinHook
from kvstore.host.placement import HostPlacement
from kvstore.host_coding import HostCoding
from kvstore.index import Index, NamespaceEntry
from kvstore.index_load import IndexLoad
from kvstore.keys import (
    BlockKey,
    KeyChain,
    NamespaceSpec,
    chain_keys,
    relabel,
    tokens_array,
)
from kvstore.leases import LeaseTable
from kvstore.namespaces import Namespaces
from kvstore.results import ReadyPrefix
from kvstore.shared.tier import SharedTier
from kvstore.store_config import ADMISSION_POLICIES, DEFAULT_PRIORITY, StoreConfig
from kvstore.store_parts import StoreParts
from kvstore.store_reads import Reads, ready_prefix
from kvstore.store_writes import Writes
from kvstore.tenants import tenant_of
from kvstore.tier_events import SHARED, TierFeed
from kvstore.tier_stack import TierStack, WriteBehind
from kvstore.tiering import Tiers

log = logging.getLogger(__name__)

REAP_EVERY_S = 0.25  # the reaper thread ends leases that ran out this often

__all__ = ["ADMISSION_POLICIES", "DEFAULT_PRIORITY", "Store", "StoreConfig", "far_tiers"]


def far_tiers(config: StoreConfig) -> list[FarTierEntry]:
    """The far tiers a configuration names, in the order reads fall through them
    (kvstore.tier_stack): one entry per kind of tier."""
    entries: list[FarTierEntry] = []
    if (shared := config.shared) is not None:
        coded = "shared" in config.codec_tiers
        entries.append(FarTierEntry(
            "shared", SHARED, lambda source: SharedTier(shared, source, coded),
            shared.queue_bytes, shared.min_priority, shared.overflow == "wait",
        ))  # fmt: skip
    return entries


class Store:
    """One process's tiered block store. See the module docstring for the protocol."""

    def __init__(
        self,
        config: StoreConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        pin: PinHook | None = None,
        feed: TierFeed | None = None,
        more_tiers: Sequence[FarTierEntry] = (),
    ) -> None:
        """``feed``: where the store tells each block that enters or leaves a tier
        (for a KV event publisher: :mod:`kvstore.tier_events`); none by default.
        ``more_tiers``: far tiers behind those the configuration names."""
        config.validate()
        self.config = config
        self._lock = threading.RLock()
        changed = threading.Condition(self._lock)  # events, commits, drops
        self._platform = "cpu-only"
        self._arena = HostArena(
            config.host_bytes,
            regions={t: q.host_bytes for t, q in config.quotas.items() if q.host_bytes},
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
                    lazy=True,  # its records are indexed by an IndexLoad, after the start
                )
            namespaces = Namespaces(config.quotas, config.max_blocks_per_request)
            index = Index()
            counters = Counters()
            events = EventLog(config.event_buffer, changed, wall)
            told = feed if feed is not None else TierFeed(0)
            host = HostPlacement(
                self._arena, config.eviction_policy, told, counters, config.index_tokens_bytes
            )
            disk = None
            if self._disk is not None:
                coded = "disk" in config.codec_tiers
                disk = DiskPlacement(
                    self._disk, config.eviction_policy, coded, told, counters, wall
                )
            tiers = Tiers(config, index, namespaces, host, disk, counters, events, wall, told)
            far = [*far_tiers(config), *more_tiers]
            self._parts = StoreParts(
                config, clock, wall, self._lock, changed, namespaces, index, counters, events,
                LeaseTable(clock), self._arena, self._disk, tiers,
                [WriteBehind(entry) for entry in far],
            )  # fmt: skip
            self._load: IndexLoad | None = None
            if self._disk is not None:
                self._load = IndexLoad(self._parts)
                self._load.start()
        except BaseException:
            self._arena.close()
            if self._disk is not None:
                self._disk.close()
            raise
        self._reads = Reads(self._parts)
        self._writes = Writes(self._parts)
        self._stack = TierStack(self._parts, self._writes)
        # each call of the protocol is served by the part that owns it
        self.lookup = self._reads.lookup
        self.lookup_many = self._reads.lookup_many
        self.read = self._reads.read
        self.acquire = self._reads.acquire
        self.read_ahead = self._reads.read_ahead
        self.locate = self._reads.locate
        self.why = self._reads.why
        self.note_reads = self._reads.note_reads
        self.note_misses = self._reads.note_misses
        self.put = self._writes.put
        self.reserve = self._writes.reserve
        self.commit = self._writes.commit
        self.commit_durably = self._writes.commit_durably
        self.commit_writes_disk = self._writes.commit_writes_disk
        self.claimed_slots = self._writes.claimed_slots
        self.fill = self._writes.fill
        self.abandon = self._writes.abandon
        self.delete = self._writes.delete
        self.clear = self._writes.clear
        self.set_priority = self._writes.set_priority
        self.far_gap = self._stack.gap
        self.pull = self._stack.pull
        self._reaper_stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="kvstore-reaper", daemon=True)
        self._reaper.start()
        if "host" in config.codec_tiers:
            self._parts.tiers.coder = HostCoding(self._parts)
        self._stack.start(far)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> int:
        """Persist the host blocks due on disk (if configured; waiting for the writer
        for up to ``persist_timeout_s``), flush the writer, free the arena. Returns how
        many blocks due on disk were never committed (the time ran out, or a disk fault:
        see DiskTier.fault); 0 after a clean close."""
        self._stack.close()  # the far tiers' writers read the arena
        if self._load is not None:
            self._load.stop()
        parts = self._parts
        if parts.tiers.coder is not None:
            parts.tiers.coder.close()  # it writes host slots
        with self._lock:
            if parts.closed:
                return 0
            parts.closed = True
            for lease in parts.leases:
                parts.end_lease(lease, "the store closed")
            unpersisted = 0
            if self._disk is not None and self.config.persist_on_close:
                deadline = time.monotonic() + self.config.persist_timeout_s
                unpersisted = parts.tiers.persist_host_blocks(deadline)
            parts.changed.notify_all()
        self._reaper_stop.set()
        self._reaper.join(timeout=5)
        self._reads.close()
        if self._disk is not None:
            self._disk.close()
            unpersisted += self._disk.stats().lost_writes
        self._arena.close()
        return unpersisted

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_host_coded(self, timeout: float) -> bool:
        """Wait until the host tier's encoder has encoded every block offered to it
        (``codec_tiers`` with host; at once without); False at the deadline."""
        coder = self._parts.tiers.coder
        if coder is None:
            return True
        with self._lock:
            return self._parts.changed.wait_for(lambda: coder.idle, timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued disk write is committed."""
        if self._disk is not None:
            self._disk.flush(timeout)

    @property
    def writer_behind(self) -> bool:
        """A hint that puts which must evict may wait for a writer now: the disk's
        queue is nearly full, or a far tier's is over its bound with ``overflow = wait``
        (see :mod:`kvstore.store_writes`)."""
        disk_behind = self._disk is not None and self._disk.nearly_full
        return disk_behind or self._parts.behind_full

    @property
    def arena_path(self) -> str | None:
        return self._arena.path

    def arena_name(self, tenant: str) -> str:
        """How answers name the arena region of ``tenant``'s blocks (HostArena.name_of)."""
        return self._arena.name_of(self._arena.region_of(tenant))

    @property
    def arena_bytes(self) -> int:
        return self._arena.capacity_bytes

    @property
    def arena(self) -> HostArena:
        return self._arena

    @property
    def platform(self) -> str:
        return self._platform

    def last_event_seq(self, tenant: str | None = None) -> int:
        """Sequence number of the newest event (0 before the first): of every event,
        or of ``tenant``'s (kvstore.events: each tenant's are numbered on their own)."""
        with self._lock:
            return self._parts.events.seq(tenant)

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
            self._parts.check_open()
            entry = self._parts.namespaces.get(spec.ns_id)
            if entry is not None:
                if entry.spec.digest != spec.digest:
                    raise LayoutMismatch(f"namespace {spec.ns_id} is open with a different layout")
                relabelled = relabel(entry.spec, spec)
                if relabelled is not entry.spec:
                    entry.spec = relabelled
                    if self._disk is not None:
                        self._disk.save_namespace(relabelled.digest, relabelled.to_dict())
                return entry.spec
            limit = self.config.tenant_max_namespaces
            group = self._parts.namespaces.groups.get(tenant_of(spec.tenant_salt))
            if limit and group is not None and group.namespaces >= limit:
                raise OutOfSpace(
                    f"{group.namespaces} namespaces are open already, the most one tenant "
                    "may open (tenant_max_namespaces)"
                )
            self._parts.namespaces.register(spec)
            if self._disk is not None:
                self._disk.save_namespace(spec.digest, spec.to_dict())
            return spec

    def namespace(self, ns_id: str) -> NamespaceSpec:
        return self._parts.namespaces.entry(ns_id).spec

    def find_namespace(self, ns_id: str) -> NamespaceSpec | None:
        """The open namespace ``ns_id``, or None (no exception: a caller that answers
        a missing one as it answers another tenant's takes the same path for both)."""
        entry = self._parts.namespaces.get(ns_id)
        return None if entry is None else entry.spec

    def namespaces(self, tenant: str | None = None) -> list[NamespaceSpec]:
        """Every namespace, or ``tenant``'s only."""
        with self._lock:
            parts = self._parts.namespaces
            entries = list(parts) if tenant is None else parts.of_tenant(tenant)
            return [entry.spec for entry in entries]

    def keys_for(
        self,
        ns_id: str,
        tokens: Sequence[int] | np.ndarray,
        extra: Sequence[bytes | str | int] = (),
    ) -> list[BlockKey]:
        spec = self._parts.namespaces.entry(ns_id).spec
        arr = tokens_array(tokens, spec.vocab_size)
        n_blocks = arr.size // spec.block_tokens
        if n_blocks > self.config.max_blocks_per_request:
            raise InvalidArgument(
                f"{arr.size} tokens make {n_blocks} blocks, more than "
                f"max_blocks_per_request={self.config.max_blocks_per_request}"
            )
        return KeyChain(chain_keys(spec, arr, extra), arr, spec.block_tokens)

    # -------------------------------------------------------------- observability
    def stats(self) -> Stats:
        """The store's part of the daemon's Stats (platform, uptime and bound names are
        the daemon's to fill in)."""
        parts = self._parts
        shared = self._stack.stats("shared")
        assert shared is None or isinstance(shared, SharedStats)
        with self._lock:
            parts.expire()
            c = parts.counters
            tiers = [tier.stats() for tier in parts.tiers.near]
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
                    "disk_codec_mismatches": dstats.codec_mismatches,
                }
            namespaces = tuple(
                NamespaceStats(
                    e.spec.ns_id,
                    e.spec.model,
                    e.spec.block_tokens,
                    e.spec.block_bytes,
                    e.blocks,
                    e.bytes,
                    e.hits,
                    e.misses,
                    codec=e.spec.codec,
                    served_model=e.spec.served_model,
                    tokenizer=e.spec.tokenizer,
                    saved_bytes=(e.coded_blocks + e.host_coded_blocks) * (
                        e.spec.block_bytes - e.codec.encoded_bytes if e.codec else 0
                    ),
                )
                for e in parts.namespaces
            )
            return Stats(
                tiers=tuple(tiers),
                namespaces=namespaces,
                demotions=c.demotions,
                promotions=c.promotions,
                pending_blocks=parts.tiers.pending,
                leases=sum(lease.staged is None for lease in parts.leases),
                corrupt_reads=corrupt,
                disk_queue_bytes=disk_queue,
                counters={
                    "dropped": c.dropped,
                    "lost_on_disk": c.lost_on_disk,
                    "known_slot_gets": c.known_slot_gets,
                    "repeated_gets": c.repeated_gets,
                    "put_waits": c.put_waits,
                    "writer_refused": c.writer_refused,
                    "dirty_dropped": c.dirty_dropped,
                    "room_refused": c.room_refused,
                    "tokens_not_kept": c.tokens_not_kept,
                    "index_tokens_bytes": parts.tiers.host.tokens_bytes,
                    "event_seq": parts.events.seq(),  # the newest event's (kvctl events --count)
                    **self._feed_figures(),
                    **self._load_progress(),
                    **disk_counters,
                },
                staged_bytes=sum(
                    len(lease.staged) * self._arena.slot_size(next(iter(lease.staged)))
                    for lease in parts.leases
                    if lease.staged
                ),
                disk_fault=fault,
                tenants=self._tenant_usage(),
                shared=shared,
            )

    def _feed_figures(self) -> dict[str, int]:
        """The KV event feed's figures, when a publisher takes it (kvstore.tier_events)."""
        feed = self._parts.tiers.feed
        if not feed.on:
            return {}
        return {
            "kv_events_dropped": feed.dropped,
            "kv_events_queued": len(feed),
            "kv_events_queued_bytes": feed.queued_bytes,
        }

    def _load_progress(self) -> dict[str, int]:
        """The disk index load's records, loaded of the total (none without a disk)."""
        if self._load is None:
            return {}
        loaded = self._load.total if self._load.done.is_set() else self._load.loaded
        return {"index_records_loaded": loaded, "index_records_total": self._load.total}

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Wait until the disk tier's index is loaded (see :mod:`kvstore.index_load`);
        whether it is."""
        return self._load is None or self._load.done.wait(timeout)

    def _tenant_usage(self) -> tuple[TenantStats, ...]:
        """Each group's usage (under the lock); none when no namespace has a tenant."""
        groups = self._parts.namespaces.groups
        if not any(groups):
            return ()
        entries: dict[str, list[NamespaceEntry]] = {name: [] for name in groups}
        for entry in self._parts.namespaces:
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
            for name, group in sorted(groups.items())
        )

    def events_since(
        self, seq: int, timeout: float = 0.0, limit: int = 1024, tenant: str | None = None
    ) -> list[Event]:
        """The events after number ``seq`` (of every event, or of ``tenant``'s), waiting
        up to ``timeout`` for one."""
        parts = self._parts
        deadline = parts.clock() + max(timeout, 0.0)
        with parts.changed:
            while parts.events.seq(tenant) <= seq and not parts.closed:
                remaining = deadline - parts.clock()
                if remaining <= 0:
                    return []
                parts.changed.wait(remaining)
            return parts.events.since(seq, limit, tenant)

    def wait_ready(self, ns_id: str, keys: Sequence[BlockKey], timeout: float) -> ReadyPrefix:
        parts = self._parts
        parts.namespaces.check_keys(parts.namespaces.entry(ns_id), keys)
        deadline = parts.clock() + max(timeout, 0.0)
        with parts.changed:
            while True:
                parts.expire()
                result = ready_prefix(parts.index, keys)
                remaining = deadline - parts.clock()
                if not result.pending_keys or remaining <= 0 or parts.closed:
                    return result
                # short slices: a lapsed owner lease is noticed by expire() promptly
                parts.changed.wait(min(remaining, 0.05))

    def verify_invariants(self) -> None:
        """Walk the whole index and raise AssertionError on any broken invariant.

        O(blocks): for tests and debugging, not for the serving path.
        """
        parts = self._parts
        tiers, groups = parts.tiers, parts.namespaces.groups
        with self._lock:
            parts.expire()  # applies a disk capacity the writer lowered meanwhile
            host = disk = pending = 0
            held: set[int] = set()  # host slots of blocks
            group_bytes = {name: [0, 0] for name in groups}  # host, disk
            coded_of = {e.spec.ns_id: 0 for e in parts.namespaces}  # encoded in host
            for node in parts.index.nodes.values():
                parent = node.parent
                assert node.pins >= 0, f"{node}: negative pins"
                assert node.in_host or node.on_disk, f"{node}: indexed but in no tier"
                if not node.ready:
                    pending += 1
                    assert node.in_host and node.pins >= 1, f"{node}: pending without slot/lease"
                if parent is not None:
                    assert parts.index.get(parent.key) is parent, f"{node}: parent not indexed"
                    assert node.ready <= parent.ready, f"{node}: ready under a pending parent"
                    if node.in_host:  # (a chain too long for the host tier: on disk)
                        assert parent.in_host or parent.on_disk, f"{node}: parent in no tier"
                    if node.on_disk:
                        assert parent.on_disk, f"{node}: on disk, parent is not"
                children = list(node.children())
                assert node.host_children == sum(c.in_host for c in children), f"{node}: host count"
                assert node.disk_children == sum(c.on_disk for c in children), f"{node}: disk count"
                listed = node in tiers.host.policy
                assert listed == (node.in_host and node.ready), f"{node}: host list membership"
                if tiers.disk is not None:
                    listed = node in tiers.disk.policy
                    assert listed == node.on_disk, f"{node}: disk list membership"
                host += node.in_host
                disk += node.on_disk
                group_bytes[node.ns.group.name][0] += node.host_bytes * node.in_host
                group_bytes[node.ns.group.name][1] += node.size * node.on_disk
                if node.in_host:
                    held.add(node.host_offset)
                    assert self._arena.slot_size(node.host_offset) >= node.host_bytes
                coded_of[node.ns.spec.ns_id] += node.host_coded
                assert node.in_host or not node.host_coded, f"{node}: encoded in no slot"
            counted = [tier.blocks for tier in tiers.near] + [0] * (2 - len(tiers.near))
            assert [host, disk] == counted, "tier block counts"
            staged_of = {name: 0 for name in groups}
            for lease in parts.leases:
                slots = len(lease.staged or ())
                staged_of[lease.entry.group.name] += slots * lease.entry.spec.block_bytes
            for name, group in groups.items():
                held_bytes = [group.host_bytes, group.disk_bytes]
                assert group_bytes[name] == held_bytes, f"tenant {name!r}: bytes counted"
                assert staged_of[name] == group.staged_bytes, f"tenant {name!r}: staged bytes"
            staged = [o for lease in parts.leases for o in lease.staged or ()]
            assert len(set(staged)) == len(staged), "a slot staged twice"
            assert held.isdisjoint(staged), "a staged slot holds a block"
            for offset in staged:
                self._arena.slot_size(offset)  # raises unless a live slot
            decoded = [o for lease in parts.leases for o in lease.decoded or ()]
            assert held.isdisjoint(decoded) and len(set(decoded)) == len(decoded), "decoded"
            for e in parts.namespaces:
                assert coded_of[e.spec.ns_id] == e.host_coded_blocks, f"{e}: encoded count"
            assert pending == tiers.pending, "pending count"
            assert self._arena.used_bytes <= self._arena.capacity_bytes, "host over capacity"
            if self._disk is not None:
                assert self._disk.used_bytes <= self._disk.capacity_bytes, "disk over capacity"

    # ------------------------------------------------------------------ leases
    @property
    def shared(self) -> SharedTier | None:
        """The shared tier, when the configuration names one."""
        tier = self._stack.tier("shared")
        assert tier is None or isinstance(tier, SharedTier)
        return tier

    def lease_namespace(self, lease_id: int) -> str | None:
        """The namespace lease ``lease_id`` is (or was, lately) held for; None if
        unknown: who may name it (kvstored.auth)."""
        with self._lock:
            return self._parts.leases.namespace_of(lease_id)

    def release(self, lease_id: int) -> None:
        with self._lock:
            self._parts.expire()
            self._parts.end_lease(self._parts.leases.get(lease_id), "released")

    def own(self, owner: str, lease_ids: Sequence[int]) -> None:
        """Tie leases to ``owner`` (a client connection): :meth:`release_owner` ends
        them when it goes away, so a killed client holds nothing for its leases' TTL.
        Ids that are 0 or no longer live are skipped (a lease may end before its
        answer leaves)."""
        with self._lock:
            self._parts.leases.own(owner, lease_ids)

    def release_owner(self, owner: str) -> int:
        """End every lease of ``owner`` (its client disconnected): read leases unpin,
        write leases drop their pending blocks, staging leases free their slots, as
        when they expire. The number of leases ended."""
        with self._lock:
            if self._parts.closed:
                return 0
            leases = self._parts.leases.take_owned(owner)
            for lease in leases:
                self._parts.end_lease(lease, "its client disconnected")
            return len(leases)

    def expire(self) -> None:
        """Reclaim expired leases and priorities now (also done on every call)."""
        with self._lock:
            self._parts.expire()

    def _reap(self) -> None:
        while not self._reaper_stop.wait(REAP_EVERY_S):
            with self._lock:
                if self._parts.closed:
                    return
                self._parts.expire()
