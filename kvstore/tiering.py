"""Moving blocks between tiers: eviction, write-back, promotion, rebuild at start.

Only leaves leave a tier, lowest priority then least recently used first
(:mod:`kvstore.policy`); a host leaf is written back to disk when admitted, else
dropped; a disk hit is promoted into a host slot, parents first; at start the disk
tier's records rebuild the index (see the module docstring of :mod:`kvstore.store`).
"""

from __future__ import annotations

import logging

import xxhash

from kvstore.disk import DiskRecord, DiskTier
from kvstore.index import READY, Node
from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.policy import GroupedPolicy
from kvstore.results import (
    EventKind,
    Tier,
)
from kvstore.store_state import (
    StoreState,
)
from kvstore.tenants import Group

log = logging.getLogger(__name__)


class Tiering(StoreState):
    """Eviction, write-back, promotion and rebuild (see the module docstring)."""

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
