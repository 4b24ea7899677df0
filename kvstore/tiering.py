"""The near tiers' stack: where each block's bytes are on this node, and moving them.

:class:`Tiers` stacks the node's own tiers, fastest first (:mod:`kvstore.near_tier`:
host, then disk when there is one; each a part that alone keeps its blocks' places,
eviction order and counts), keeps the blocks' timed priorities, and is the only caller
that moves blocks between them: a block enters and leaves a tier here and nowhere else.
The far tiers behind them are the other stack's (:mod:`kvstore.tier_stack`).

- Eviction from tier i is demotion into a slower tier that holds the block; a block no
  other tier holds is gone (remembered by rule, :mod:`kvstore.misses`).
- Only leaves leave a tier, lowest priority then least recently used first, and a block
  whose children are held in a faster tier stays (prefix-closed from the top); a host
  leaf is written back to disk when admitted, else dropped; a tenant at its quota
  evicts its own blocks first. When no host leaf can go, a block already on disk leaves
  the host tier, its children there keep it on disk (a long prefix has one, pinned, leaf).
- A host block due on disk (admitted, not written yet: "dirty") never leaves the host
  tier unwritten: when the disk writer's queue is full, eviction passes over dirty
  blocks to clean ones (on disk, or not due there), and when none is left it reports
  :attr:`Tiers.writer_blocked`, so that the put that needed the room waits for the
  writer outside the lock (:mod:`kvstore.store_writes`). Only a put past that wait
  under ``overflow = drop`` sets :attr:`Tiers.drop_dirty`, and each block dropped so
  is counted (``dirty_dropped``).
- A disk hit is promoted into a host slot; a disk block that cannot be read back goes,
  with every block under it that has no path through host.
- At close the host blocks due on disk are written there (waiting for the writer until
  a deadline); at start :mod:`kvstore.index_load` indexes the disk tier's records.
- Ending a lease (:meth:`Tiers.let_go`) unpins its blocks, drops its pending ones and
  frees its staged slots.

No lock of its own: every method runs under the store's lock (:mod:`kvstore.store`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.disk import DiskTier
from kvstore.disk.placement import DiskPlacement
from kvstore.events import Counters, EventLog
from kvstore.host.placement import HostPlacement
from kvstore.index import READY, Index, NamespaceEntry, Node
from kvstore.keys import BlockKey
from kvstore.leases import Lease
from kvstore.misses import CORRUPT, DELETED, PRIORITY, QUOTA, TTL, Loss, RecentLosses
from kvstore.namespaces import Namespaces
from kvstore.near_tier import NearTier
from kvstore.results import EventKind, Tier
from kvstore.store_config import StoreConfig
from kvstore.tenants import Group
from kvstore.tier_events import TierFeed

if TYPE_CHECKING:
    from kvstore.host_coding import HostCoding

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 2.0  # a stop that persists the host tier logs its progress this often
HOST, DISK = 0, 1  # levels of the near tiers in :attr:`Tiers.near`


@dataclass(eq=False)
class Tiers:
    """Block placement over the near tiers, fastest first (see the module docstring);
    the parts it works on are its fields."""

    config: StoreConfig
    index: Index
    namespaces: Namespaces
    host: HostPlacement
    disk: DiskPlacement | None
    counters: Counters
    events: EventLog
    wall: Callable[[], float]
    feed: TierFeed  # what routers hear (the same feed the tiers tell)
    losses: RecentLosses = field(default_factory=RecentLosses)  # what `why` answers

    def __post_init__(self) -> None:
        near: list[NearTier] = [self.host] if self.disk is None else [self.host, self.disk]
        self.near = tuple(near)  # fastest first: HOST, DISK
        # per level, the tiers before and after it (eviction asks them for every victim)
        self._faster = [self.near[:level] for level in range(len(near))]
        self._slower = [self.near[level + 1 :] for level in range(len(near))]
        self.arena = self.host.arena
        self.pending = 0  # blocks reserved and not committed yet
        self._priority_heap: list[tuple[float, int, Node]] = []
        self._priority_until: dict[Node, float] = {}  # blocks whose priority is timed
        self._priority_seq = itertools.count()
        # set when a host eviction passed over dirty blocks for want of queue room and
        # found nothing else (reset by whoever asks); see the module docstring
        self.writer_blocked = False
        self.drop_dirty = False  # evict dirty blocks unwritten (overflow = drop)
        # a far tier's write-behind queue holds its blocks in host (overflow = wait):
        # eviction passes over them and says so here (kvstore.tier_stack)
        self.behind_blocked = False
        self._queue_full = False  # the last write_to_disk was refused for queue room
        # encodes coded namespaces' host blocks (codec_tiers has host; set by the store)
        self.coder: HostCoding | None = None
        # tenants with their own arena region: the common region's eviction skips them
        self._own_regions = frozenset(name for name in self.arena.regions if name)

    def drop_node(self, node: Node, rule: str = DELETED) -> None:
        """Remove a childless, unpinned block from every tier and the index; the
        store remembers by which rule (kvstore.misses)."""
        slowest = Tier.HOST
        for tier in self.near:
            if tier.holds(node):
                tier.drop(node)
                slowest = tier.kind
        if node.ready:  # remembered by the slowest tier it was in
            self.losses.note(node.key, Loss(self.wall(), slowest.value, rule))
        self.index.remove(node)
        self._priority_until.pop(node, None)
        self.counters.dropped += 1
        self.events.emit(EventKind.REMOVED, node, "")

    def delete_subtree(self, root: Node) -> int:
        """Drop ``root`` and its descendants, keeping busy blocks and their ancestors."""
        removed = 0
        for node in self.index.subtree_postorder(root):
            if node.pins or not node.ready or node.first_child is not None:
                continue
            self.drop_node(node)
            removed += 1
        return removed

    def reprioritize(self, node: Node, priority: int) -> None:
        node.priority = priority
        for tier in self.near:
            tier.reprioritize(node)

    def touch(self, named: Sequence[Node]) -> None:
        """Mark a use of the blocks a request named (root-to-leaf order).

        Prefix-aware policies count a use of a block as a use of its whole prefix:
        one timestamp, walked leaf to root so every parent ends up after (newer than)
        its children in the eviction lists. Plain LRU touches only ``named``.
        """
        if not named:
            return
        now = self.wall()
        last = named[-1]
        used: Sequence[Node]
        if not self.host.policy.touch_prefix:
            used = [node for node in named if node.ready]
        elif named[0].parent is None and last.state == READY:
            used = named[::-1]  # the whole prefix, leaf first (a ready block's parents are)
        else:
            used = [node for node in itertools.chain((last,), last.ancestors()) if node.ready]
        for node in used:
            node.last_access = now
        for tier in self.near:
            tier.policy.touch_all(used)

    def insert_used(self, batch: Sequence[Node]) -> None:
        """List blocks that just became ready (one run of a chain, parents first) in the
        host tier as just used, then touch their prefix: the order that inserting them
        and then ``touch(batch)`` gives, with one list operation per block, not three."""
        policy = self.host.policy
        now = self.wall()
        for node in batch:
            node.last_access = now
        policy.insert_all(batch[::-1] if policy.touch_prefix else batch)
        parent = batch[0].parent
        if policy.touch_prefix and parent is not None:
            self.touch((parent,))  # a prefix-aware touch of a block is one of its prefix

    def add_pending_run(
        self,
        entry: NamespaceEntry,
        keys: Sequence[BlockKey],
        parent: Node | None,
        prio: int,
        offsets: Sequence[int],
        tokens: Sequence[bytes | None],
    ) -> list[Node]:
        """New pending nodes for a run of a chain, made by the host tier in their slots
        ``offsets`` (:meth:`HostPlacement.new_run`), then indexed: a put's blocks are one
        such run; a slot-by-slot reserve makes runs of one."""
        nodes = self.host.new_run(entry, keys, parent, prio, offsets, tokens)
        self.index.add_chain(nodes)
        return nodes

    # --- priorities -------------------------------------------------------------------
    def set_priority(self, node: Node, priority: int, until: float) -> None:
        """Give ``node`` a priority, until the clock reads ``until`` (0: for good)."""
        self.reprioritize(node, priority)
        if until:
            self._priority_until[node] = until
            heapq.heappush(self._priority_heap, (until, next(self._priority_seq), node))
        else:
            self._priority_until.pop(node, None)

    def expire_priorities(self, now: float) -> None:
        """Timed priorities that ran out fall back to the default."""
        heap = self._priority_heap
        while heap and heap[0][0] <= now:
            until, _, node = heapq.heappop(heap)
            if self._priority_until.get(node) == until:
                del self._priority_until[node]
                self.reprioritize(node, self.config.default_priority)

    def apply_shrunk_disk(self) -> None:
        """Evict disk leaves if the disk tier lowered its effective capacity."""
        if self.disk is not None and self.disk.storage.drain_shrunk():
            self._shrink_disk(self.disk.storage)

    # --- leases -----------------------------------------------------------------------
    def let_go(self, lease: Lease, expired: bool = False) -> None:
        """What ending a lease does to blocks and slots: a read lease unpins its blocks,
        a write lease drops its uncommitted ones (remembered as lost to ``expired``:
        its TTL ran out), a staging lease frees its slots, a read lease its decoded
        copies."""
        if lease.write:
            dropped = lease.nodes[lease.committed :]
            for node in reversed(dropped):
                node.pins -= 1
                self.events.emit(EventKind.PENDING_DROPPED, node, Tier.HOST)
                if expired:
                    self.losses.note(node.key, Loss(self.wall(), Tier.HOST.value, TTL))
                self.host.drop(node)
                self.index.remove(node)
            self.pending -= len(dropped)
        else:
            for node in lease.nodes:
                node.pins -= 1
        for offset in lease.decoded or ():
            self.arena.free(offset)
        for offset in lease.staged or ():
            self.arena.free(offset)
        if lease.staged:
            lease.entry.group.staged_bytes -= len(lease.staged) * lease.entry.spec.block_bytes

    # --- eviction -------------------------------------------------------------------
    def alloc_host(self, size: int, group: Group, tail: bool = False) -> int | None:
        """A host slot of ``size`` bytes for a block of ``group``, evicting host leaves
        until one fits (the group's own first, while it is at its quota); ``tail``: see
        HostArena.alloc."""
        if not self._quota_room(group, size, HOST):
            return None
        own_region = bool(self.arena.region_of(group.name))
        while True:
            offset = self.arena.alloc(size, tail, group.name)
            if offset is not None:
                return offset
            # a tenant's own region makes room from its own blocks; the common region
            # from those of every group without one
            victim = self._host_victim(group.name if own_region else None, self._own_regions)
            if victim is None:
                return None
            self._evict(HOST, victim)

    def _quota_room(self, group: Group, nbytes: int, level: int) -> bool:
        """Make ``nbytes`` more fit ``group``'s quota in tier ``level`` by evicting its
        own least valuable blocks; False when they cannot (its blocks there are pinned,
        pending or parents of such). Other groups' blocks are never touched."""
        tier = self.near[level]
        limit = tier.quota(group)
        while limit and tier.group_bytes(group) + nbytes > limit:
            victim = self._victim(level, group.name)
            if victim is None:
                return False
            group.quota_evictions += 1
            self._evict(level, victim, QUOTA)
        return True

    def quota_blocks(self, group: Group, n: int, size: int) -> int:
        """How many of ``n`` new host blocks of ``size`` bytes ``group``'s quota takes
        (evicting its own blocks to make room for as many as it can)."""
        if self._quota_room(group, n * size, HOST):
            return n
        # every block of the group that could go went: what is left is what fits now
        return max(0, (group.quota.host_bytes - group.host_held) // size)

    def _leaves(
        self, level: int, group: str | None = None, skip: Collection[str] = ()
    ) -> Iterator[Node]:
        """Tier ``level``'s blocks that may leave it, in its eviction order (of
        ``group``, or of any group not in ``skip``): ready and unpinned; under a
        leaf-first policy, leaves of that tier that hold up no child in a faster tier
        (a block whose children are in host stays on disk: the tiers stay prefix-closed
        from the top); under plain LRU, those whose subtree is idle."""
        tier = self.near[level]
        faster = self._faster[level]
        leaf_first = tier.policy.leaf_first
        held_children = tier.held_children
        for node in tier.policy.candidates(group, skip):
            if node.pins or not node.ready:
                continue
            if leaf_first:
                if held_children(node):
                    continue
                if faster and any(up.held_children(node) and not up.holds(node) for up in faster):
                    continue
            elif self._subtree_busy(node):
                continue
            yield node

    def _victim(
        self, level: int, group: str | None = None, skip: Collection[str] = ()
    ) -> Node | None:
        """Tier ``level``'s next block to evict (see :meth:`_leaves`; the host tier's
        passes over blocks not written where they are due: :meth:`_host_victim`)."""
        if level == HOST:
            return self._host_victim(group, skip)
        return next(self._leaves(level, group, skip), None)

    def _host_victim(self, group: str | None, skip: Collection[str]) -> Node | None:
        """The host tier's next block to evict (see the module docstring): the first
        evictable candidate that is clean, or dirty and now queued for the disk; a dirty
        one the writer has no queue room for is passed over (and dropped only under
        :attr:`drop_dirty`). Once the queue refused one, the scan tries no more writes."""
        queue_full = False
        for node in self._leaves(HOST, group, skip):
            if node.held_behind:
                self.writer_blocked = self.behind_blocked = True
                continue
            if node.on_disk or not self.due_on_disk(node):
                return node
            if not queue_full:
                if self.write_to_disk(node) or not self._queue_full:
                    return node  # queued now, or refused for good (no disk room, quota, fault)
                queue_full = True
            if self.drop_dirty:
                self.counters.dirty_dropped += 1
                return node
            self.writer_blocked = True
        return self._clean_inner_victim(group, skip) if self.host.policy.leaf_first else None

    def _clean_inner_victim(self, group: str | None, skip: Collection[str]) -> Node | None:
        """When no host leaf can go: the first evictable block already on disk with
        children in host (a long prefix read window by window is one chain in host whose
        only leaf is pinned). It leaves the host tier; its children keep it on disk."""
        for node in self.host.policy.candidates(group, skip):
            movable = node.on_disk and node.ready and not node.pins and node.host_children
            if movable and not node.held_behind:
                return node
        return None

    @property
    def queue_full(self) -> bool:
        """Whether the last :meth:`write_to_disk` was refused for want of queue room."""
        return self._queue_full

    def due_on_disk(self, node: Node) -> bool:
        """Whether a host block is dirty: admitted to the disk tier and not written."""
        return self.disk is not None and not node.on_disk and self.admit(node)

    def _subtree_busy(self, node: Node) -> bool:
        return any(n.pins or not n.ready for n in self.index.subtree_postorder(node))

    def _evict(self, level: int, node: Node, rule: str = PRIORITY) -> None:
        """``node`` leaves tier ``level``: demoted where a slower tier holds it (the
        host victim was written there first when due), kept where a faster one does,
        else gone (remembered by ``rule``)."""
        tier = self.near[level]
        tier.evicted()
        if not tier.policy.leaf_first:  # plain LRU: descendants become unusable
            for late in self.index.subtree_postorder(node)[:-1]:
                self.drop_node(late, rule)
        for slower in self._slower[level]:
            if slower.holds(node):
                self._demote(tier, node, slower)
                return
        for faster in self._faster[level]:
            if faster.holds(node):
                tier.drop(node)
                return
        self.drop_node(node, rule)

    def _demote(self, tier: NearTier, node: Node, into: NearTier) -> None:
        """``node`` leaves ``tier`` for the slower tier ``into``, which holds it."""
        tier.drop(node)
        self.counters.demotions += 1
        self.events.emit(EventKind.DEMOTED, node, into.kind)

    def admit(self, node: Node) -> bool:
        if node.priority < self.config.disk_min_priority:
            return False
        if self.config.admission == "selective":
            return node.hits >= self.config.selective_hits
        return True

    def write_to_disk(self, node: Node, evict: bool = True, admitted: bool = False) -> bool:
        """Queue a host block's bytes for the disk tier; False if not admitted or no room.
        ``admitted``: the caller admits it (a chain too long for the host tier, whose
        blocks have nowhere else to go: selective admission does not wait for hits).

        The disk tier is prefix-closed on its own: ancestors missing from disk are
        written first (they stay in host too), so what is on disk is always a usable
        forest by itself and survives a restart whole. ``evict=False`` writes only into
        free room (used at close, so persisting the host tier never pushes out blocks
        that were already committed to disk).
        """
        self._queue_full = False
        if self.disk is None or node.on_disk or not (admitted or self.admit(node)):
            return False
        disk = self.disk.storage
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
                footprint = disk.footprint(self.disk.size(block.ns))
                if evict:
                    if not self._quota_room(group, block.size, DISK):
                        return False
                    if not self._make_disk_room(footprint):
                        return False
                elif disk.used_bytes + footprint > disk.capacity_bytes or (
                    group.quota.disk_bytes
                    and group.disk_bytes + block.size > group.quota.disk_bytes
                ):
                    return False
                payload = self.arena.view(block.host_offset, block.host_bytes)
                if not self.disk.write(block, payload, block.host_coded):
                    self._queue_full = self.disk.queue_full
                    return False
            return True
        finally:
            for pinned in held:
                pinned.pins -= 1

    def spill(self, nodes: Sequence[Node]) -> int:
        """Let the blocks of a window of a chain too long for the host tier leave it
        (kvstore.store_writes): those on disk, unpinned, without children in host, leaf
        first. How many left."""
        disk = self.disk
        if disk is None:
            return 0
        left = 0
        for node in reversed(nodes):
            movable = node.in_host and node.on_disk and node.ready and not node.pins
            if movable and node.host_children == 0 and self.index.get(node.key) is node:
                self._demote(self.host, node, disk)
                left += 1
        return left

    def _make_disk_room(self, nbytes: int) -> bool:
        assert self.disk is not None
        disk = self.disk.storage
        if disk.drain_shrunk():
            self._shrink_disk(disk)
        capacity = disk.capacity_bytes
        if nbytes > capacity:
            return False
        while disk.used_bytes + nbytes > capacity:
            victim = self._victim(DISK)
            if victim is None:
                return False
            self._evict(DISK, victim)
        return True

    def _shrink_disk(self, disk: DiskTier) -> None:
        """LMDB ran out of map space and lowered the tier's effective capacity: evict
        disk leaves until the blocks fit it again."""
        while disk.used_bytes > disk.capacity_bytes:
            victim = self._victim(DISK)
            if victim is None:
                return
            self._evict(DISK, victim)

    def persist_host_blocks(self, deadline: float) -> int:
        """At close: write the host blocks due on disk, parents first, into the disk
        tier's free room (never evicting blocks committed there), waiting for the
        writer's queue until ``deadline`` (monotonic) and logging progress. Returns how
        many due blocks were not queued for want of time or because the disk failed;
        blocks that do not fit its capacity are logged, as an eviction would be."""
        assert self.disk is not None
        disk = self.disk.storage
        due = self._due_blocks()
        total, total_bytes = len(due), sum(node.size for node in due)
        if not due:
            return 0
        log.info(
            "persisting the host tier: %d blocks (%.1f MiB) due on disk",
            total, total_bytes / 2**20, extra={"event": "persisting"},
        )  # fmt: skip
        started = shown = time.monotonic()
        lost: set[Node] = set()
        no_room = written = written_bytes = 0
        for node in due:
            parent = node.parent
            if parent is not None and not parent.on_disk:  # not written: this would be
                missed = parent in lost  # an orphan on disk; it shares its parent's fate
            elif self._persist_one(disk, node, deadline):
                written += 1
                written_bytes += node.size
                if time.monotonic() - shown >= PROGRESS_EVERY_S:
                    shown = time.monotonic()
                    log.info(
                        "persisting the host tier: %d of %d blocks (%.1f MiB) left",
                        total - written, total, (total_bytes - written_bytes) / 2**20,
                        extra={"event": "persisting"},
                    )  # fmt: skip
                continue
            else:
                missed = bool(disk.fault) or self._queue_full
            if missed:
                lost.add(node)
            else:
                no_room += 1
        if no_room:
            log.info(
                "%d host blocks did not fit the disk tier's capacity at close; not persisted",
                no_room,
            )
        log.info(
            "persisted %d of %d host blocks (%.1f MiB) in %.1f s",
            written, total, written_bytes / 2**20, time.monotonic() - started,
            extra={"event": "persisted"},
        )  # fmt: skip
        return len(lost)

    def _due_blocks(self) -> list[Node]:
        """The host blocks due on disk, parents first (a block not admitted there
        keeps its descendants off it: they would be orphans on disk). A host block's
        parent is in host or on disk, so the walk goes on through blocks on disk only
        (a chain too long for the host tier: its last window in host, the rest on disk)
        and stops at the first block of a chain in neither."""
        due: list[Node] = []
        for entry in self.namespaces:
            queue = [self.index.nodes[key] for key in entry.roots]
            while queue:
                node = queue.pop()
                if not node.ready:
                    continue
                if not node.in_host:
                    if node.on_disk and node.host_children + node.disk_children:
                        queue.extend(node.children())
                    continue
                if not node.on_disk:
                    if not self.due_on_disk(node):
                        continue
                    due.append(node)
                queue.extend(node.children())
        return due

    def _persist_one(self, disk: DiskTier, node: Node, deadline: float) -> bool:
        """Queue one block for the disk at close, waiting for queue room until
        ``deadline``; False when it was not queued (see :meth:`persist_host_blocks`)."""
        while not self.write_to_disk(node, evict=False):
            if not self._queue_full:
                return False
            if not disk.wait_room(node.size, deadline - time.monotonic()):
                return False
        return True

    def publish_promotion(self, node: Node, offset: int, tokens: bytes | None = None) -> None:
        """A disk block's bytes are verified in host slot ``offset``: it is in host now
        (with its ``tokens``, from the chain of the read that promoted it)."""
        self.arena.epochs.bump((offset,))  # the slot's bytes are final from here on
        self.host.promoted(node, offset, tokens)
        if self.coder is not None:
            self.coder.offer((node,))
        self.counters.promotions += 1
        self.counters.host_bytes_in += node.size
        self.counters.disk_bytes_out += node.size
        self.events.emit(EventKind.PROMOTED, node, Tier.HOST)

    def lost_on_disk(self, node: Node) -> None:
        """A block the index had on disk could not be read back (checksum or gone).

        Its disk descendants lose their parent there and leave the disk tier. A block
        stays only in host, and only where every block from ``node`` down to it is in
        host (a block under a block that is lost whole is unusable). If a concurrent
        reader still pins a block that goes whole, cleanup waits for the next failed
        read.
        """
        subtree = self.index.subtree_postorder(node)  # children before their parents
        kept: set[Node] = set()  # usable in host after the loss
        for late in reversed(subtree):  # parents first
            if late.in_host and (late is node or late.parent in kept):
                kept.add(late)
        gone = [n for n in subtree if n not in kept]
        if any(n.pins for n in gone):
            return
        self.counters.lost_on_disk += 1
        self.events.emit(EventKind.CORRUPT, node, Tier.DISK)
        for late in subtree:
            if late in kept:
                if late.on_disk:
                    assert self.disk is not None
                    self.disk.drop(late)
            else:
                self.drop_node(late, CORRUPT)
