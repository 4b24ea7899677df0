"""The disk tier as a part of the store: which blocks have a committed or queued record.

A block is on disk when its node says so (``Node.on_disk``); this part alone writes the
node's disk fields (the flag, children held on disk) and keeps the tier's eviction
order and counts, over the LMDB storage (:class:`kvstore.disk.DiskTier`) that keeps the
bytes. What moves blocks in and out (eviction, write-back, promotion) is the tier
stack's (:mod:`kvstore.tiering`). Under the store's lock, as every near tier
(:mod:`kvstore.near_tier`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from operator import attrgetter

import xxhash

from kvproto.v1.results import TierStats
from kvstore import codecs
from kvstore.codecs import Codec
from kvstore.disk import DiskRecord, DiskTier
from kvstore.events import Counters
from kvstore.index import NamespaceEntry, Node
from kvstore.policy import GroupedPolicy
from kvstore.results import Tier
from kvstore.tenants import Group
from kvstore.tier_events import DISK, TierFeed


class DiskPlacement:
    """The blocks held in the disk tier (see the module docstring). ``coded``: whether
    namespaces with a codec keep their disk blocks encoded (``codec_tiers`` has disk)."""

    kind = Tier.DISK
    held_children: Callable[[Node], int] = attrgetter("disk_children")

    def __init__(
        self,
        storage: DiskTier,
        policy: str,
        coded: bool,
        feed: TierFeed,
        counters: Counters,
        wall: Callable[[], float],
    ) -> None:
        self.storage = storage
        self.policy = GroupedPolicy(policy, "disk")
        self.blocks = 0
        self._coded = coded
        self._feed = feed
        self._counters = counters
        self._wall = wall
        self.queue_full = False  # the last write was refused for queue room

    def holds(self, node: Node) -> bool:
        return node.on_disk

    def quota(self, group: Group) -> int:
        return group.quota.disk_bytes

    def group_bytes(self, group: Group) -> int:
        return group.disk_bytes

    def codec(self, entry: NamespaceEntry) -> Codec | None:
        """The codec a namespace's blocks are kept on disk with (None: as they are)."""
        return entry.codec if self._coded else None

    def size(self, entry: NamespaceEntry) -> int:
        """Bytes one block of ``entry`` takes on disk."""
        codec = self.codec(entry)
        return entry.spec.block_bytes if codec is None else codec.encoded_bytes

    def adopt(self, node: Node, coded: bool) -> None:
        """The block has a disk record (``coded``: kept encoded), written by
        :meth:`write` or found at start-up (kvstore.index_load): it counts as on disk.
        Listing it in the eviction order is the caller's (a load lists its blocks
        later, oldest first)."""
        node.on_disk = True
        self.blocks += 1
        node.ns.group.disk_bytes += node.size
        node.ns.coded_blocks += coded
        if node.parent is not None:
            node.parent.disk_children += 1

    def write(self, node: Node, payload: memoryview, host_coded: bool) -> bool:
        """Hand a host block's bytes (``payload``: its slot; ``host_coded``: encoded
        there already) to the disk writer; the block is on disk from here on. False when
        the storage refuses it (a fault, or its queue is full: never waited for under
        the lock; :attr:`queue_full` tells which)."""
        parent = node.parent.key if node.parent is not None else b""
        record = DiskRecord(
            node.key,
            node.ns.spec.digest,
            parent,
            len(payload),
            xxhash.xxh3_64_intdigest(payload),
            node.priority,
            node.last_access or self._wall(),
            tokens=node.tokens or b"",
        )
        codec = kept = self.codec(node.ns)
        if host_coded:  # encoded in host already: stored as it is (kvstore.host_coding)
            assert codec is not None  # codec_tiers with host has disk
            record = replace(record, codec=codec.code_id, codec_version=codecs.VERSION)
            codec = None
        if not self.storage.write(record, payload, codec=codec):
            self.queue_full = not self.storage.fault
            return False
        self.adopt(node, coded=kept is not None)
        self.policy.insert(node)
        self._feed.stored((node,), DISK)
        self._counters.disk_bytes_in += node.size
        return True

    def drop(self, node: Node) -> None:
        self.storage.delete(node.key)
        if node in self.policy:  # (not yet while the index loads: kvstore.index_load)
            self.policy.remove(node)
        self._feed.removed(node, DISK)
        node.on_disk = False
        self.blocks -= 1
        if node.ns.coded_blocks and self.codec(node.ns) is not None:
            node.ns.coded_blocks -= 1
        node.ns.group.disk_bytes -= node.size
        if node.parent is not None:
            node.parent.disk_children -= 1

    def evicted(self) -> None:
        self._counters.disk_evictions += 1

    def reprioritize(self, node: Node) -> None:
        if node in self.policy:
            self.policy.reprioritize(node)
            self.storage.touch(node.key, node.priority, node.last_access)

    def stats(self) -> TierStats:
        c = self._counters
        return TierStats(
            Tier.DISK.value, self.storage.capacity_bytes, self.storage.used_bytes, self.blocks,
            c.disk_hits, c.disk_misses, c.disk_evictions, c.disk_bytes_in, c.disk_bytes_out,
        )  # fmt: skip
