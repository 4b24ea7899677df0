"""The store's state and the bookkeeping every part of it uses.

:class:`StoreState` names every field of a :class:`kvstore.store.Store` (made in
``Store.__init__``) and holds the small helpers the other parts share: namespace
entries and checks, the per-tier counts of a node, touches, events. The parts stack
on it in one line, each using only those below: :class:`kvstore.tiering.Tiering`,
:class:`kvstore.leases.Leases`, :class:`kvstore.store_reads.Reads`,
:class:`kvstore.store_writes.Writes`, and :class:`kvstore.store.Store` on top. All
of it runs under the store's one lock (``_lock``) unless a docstring says otherwise.
"""

from __future__ import annotations

import array
import itertools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvstore.arena import HostArena
from kvstore.disk import DiskTier
from kvstore.errors import (
    InvalidArgument,
    StoreClosed,
    UnknownNamespace,
)
from kvstore.index import READY, Index, NamespaceEntry, Node
from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.policy import MAX_PRIORITY, POLICIES, GroupedPolicy
from kvstore.results import (
    EventKind,
    ReadyPrefix,
)
from kvstore.shared_tier import SharedConfig
from kvstore.tenants import NAME_RE, Group, Quota, tenant_of

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
    shared: SharedConfig | None = None  # a shared tier on a Valkey / Redis Cluster

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
        if self.shared is not None:
            self.shared.validate()
        for tenant, quota in self.quotas.items():
            if not NAME_RE.match(tenant):
                raise InvalidArgument(f"quotas: {tenant!r} is not a tenant name")
            if quota.host_bytes < 0 or quota.disk_bytes < 0:
                raise InvalidArgument(f"quotas: {tenant}: quotas must be >= 0")


@dataclass(slots=True, eq=False)
class Lease:
    lease_id: int
    write: bool
    entry: NamespaceEntry
    nodes: list[Node]  # read: pinned ready prefix; write: reserved blocks in chain order
    expires_at: float
    committed: int = 0  # write leases: nodes[:committed] are ready
    first_index: int = 0  # write leases: chain position of nodes[0]
    staged: set[int] | None = None  # staging leases: the empty slots set aside (offsets)
    ttl: float = 0.0  # staging leases: each reserve that uses the lease renews it by this
    owner: str = ""  # the client connection it ends with (see Store.own), "" for none

    @property
    def kind(self) -> str:
        if self.staged is not None:
            return "staging"
        return "write (reserve)" if self.write else "read (acquire)"


@dataclass(slots=True)
class Counters:
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
    # gets read again, pinned, after an unpinned copy failed its slot epoch check
    repeated_gets: int = 0


ENDED_LEASES_KEPT = 4096


class LeaseIds:
    """Lease ids: 62 random bits plus one (never 0), unguessable by another client.
    Drawn from ``os.urandom`` 512 at a time: one system call per 512 leases, where
    ``secrets.randbits`` makes one per lease (a put makes a lease, often two)."""

    def __init__(self) -> None:
        self._ids: list[int] = []

    def next(self) -> int:
        if not self._ids:
            self._ids = [(word >> 2) + 1 for word in array.array("Q", os.urandom(4096))]
        return self._ids.pop()


class StoreState:
    """The fields of a Store, and helpers on them (see the module docstring)."""

    config: StoreConfig
    _clock: Callable[[], float]
    _wall: Callable[[], float]
    _lock: threading.RLock
    _changed: threading.Condition  # events, commits, drops (on _lock)
    _index: Index
    _namespaces: dict[str, NamespaceEntry]
    _by_digest: dict[bytes, NamespaceEntry]
    _host_policy: GroupedPolicy
    _disk_policy: GroupedPolicy
    _groups: dict[str, Group]  # tenant -> its group (kvstore.tenants)
    _leases: dict[int, Lease]
    _owned: dict[str, set[int]]  # owner -> its leases (see Store.own)
    _lease_ids: LeaseIds
    _lease_heap: list[tuple[float, int]]
    _ended: dict[int, str]  # recently ended lease id -> why (for precise errors)
    _priority_heap: list[tuple[float, int, Node]]
    _priority_until: dict[Node, float]  # blocks whose priority is timed
    _priority_seq: Iterator[int]
    # events as plain tuples in Event's field order (Event._make when read)
    _events: deque[tuple[int, EventKind, str, BlockKey, str, float]]
    _seq: int
    _host_blocks: int
    _disk_blocks: int
    _pending: int
    _c: Counters
    _platform: str
    _closed: bool
    _arena: HostArena
    _disk: DiskTier | None
    _reaper_stop: threading.Event
    _promoters: ThreadPoolExecutor | None  # made on the first big promotion
    _reaper: threading.Thread

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

    def _lookup(self, keys: Sequence[BlockKey]) -> ReadyPrefix:
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
        return ReadyPrefix(ready, host, ready - host, pending)

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
        self._emit(EventKind.REMOVED, node, "")

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

    # --- events ---------------------------------------------------------------------
    def _emit(self, kind: EventKind, node: Node, tier: str) -> None:
        self._emit_all(kind, (node,), tier)

    def _emit_all(self, kind: EventKind, nodes: Sequence[Node], tier: str) -> None:
        """One event per node, in order, in ``tier`` (a Tier, or "" when it left the
        store); waiters are woken once."""
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
