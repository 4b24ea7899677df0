"""The host tier as a part of the store: which blocks hold arena slots.

A block is in host when its node has a slot (``Node.host_offset >= 0``); this part alone
writes the node's host fields (slot, encoded flag, children held in host, tokens) and
keeps the tier's eviction order and counts.

A block keeps its tokens (packed uint32: 4 bytes a token) while it is in host, for
its KV events and its disk record. Those bytes are memory the arena does not hold: a
namespace of tiny blocks of many tokens (64 bytes of KV, 1 KiB of tokens) would make
the index many times the tier. So the tokens kept are counted (``tokens_bytes``, as
the bytes objects take them) and capped (``tokens_cap``: ``index_tokens_bytes``); a
block that would pass the cap keeps none (``Counters.tokens_not_kept``): its events
carry no token_ids, its disk record none. What moves blocks in and out (eviction,
write-back, promotion) is the tier stack's (:mod:`kvstore.tiering`). Under the store's
lock, as every near tier (:mod:`kvstore.near_tier`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from operator import attrgetter

from kvproto.v1.results import TierStats
from kvstore.events import Counters
from kvstore.host.arena import HostArena
from kvstore.index import PENDING, NamespaceEntry, Node
from kvstore.keys import BlockKey
from kvstore.policy import GroupedPolicy
from kvstore.results import Tier
from kvstore.tenants import Group
from kvstore.tier_events import HOST, TierFeed

BYTES_OBJECT = sys.getsizeof(b"")  # what a bytes object takes besides its bytes


def kept_bytes(tokens: bytes | None) -> int:
    """What a node's ``tokens`` take in memory (0: none kept)."""
    return 0 if tokens is None else BYTES_OBJECT + len(tokens)


class HostPlacement:
    """The blocks held in the host arena (see the module docstring)."""

    kind = Tier.HOST
    held_children: Callable[[Node], int] = attrgetter("host_children")

    def __init__(
        self,
        arena: HostArena,
        policy: str,
        feed: TierFeed,
        counters: Counters,
        tokens_cap: int = 64 << 20,
    ) -> None:
        self.arena = arena
        self.policy = GroupedPolicy(policy, "host")
        self.blocks = 0
        self.tokens_cap = tokens_cap
        self.tokens_bytes = 0  # what the tokens host blocks keep take (see the docstring)
        self._feed = feed
        self._counters = counters

    def holds(self, node: Node) -> bool:
        return node.host_offset >= 0

    def quota(self, group: Group) -> int:
        return group.quota.host_bytes

    def group_bytes(self, group: Group) -> int:
        return group.host_held

    def promoted(self, node: Node, offset: int, tokens: bytes | None) -> None:
        """A ready block came up from a slower tier into slot ``offset`` (with its
        ``tokens``, from the chain of the read that promoted it)."""
        node.host_offset = offset
        self.blocks += 1
        node.ns.group.host_bytes += node.size
        if node.parent is not None:
            node.parent.host_children += 1
        node.tokens = self._keep(tokens)
        self.policy.insert(node)
        self._feed.stored((node,), HOST)

    def new_run(
        self,
        entry: NamespaceEntry,
        keys: Sequence[BlockKey],
        parent: Node | None,
        priority: int,
        offsets: Sequence[int],
        tokens: Sequence[bytes | None],
    ) -> list[Node]:
        """New pending nodes for a run of a chain (``keys[i]`` under ``keys[i - 1]``,
        the first under ``parent``), each in its slot ``offsets[i]`` with its tokens,
        pinned once (by the write lease to come): what :meth:`promoted` counts per block,
        in one pass. The caller indexes them (a pending block always has a host slot)."""
        nodes: list[Node] = []
        for key, offset, toks in zip(keys, offsets, tokens, strict=True):
            toks = self._keep(toks)
            node = Node(key, entry, parent, PENDING, priority, 0.0, 0, 1, offset, tokens=toks)
            nodes.append(node)
            parent = node
        if not nodes:
            return nodes
        self.blocks += len(nodes)
        entry.group.host_bytes += len(nodes) * entry.spec.block_bytes
        for holder in nodes[:-1]:
            holder.host_children = 1
        if nodes[0].parent is not None:
            nodes[0].parent.host_children += 1
        return nodes

    def drop(self, node: Node) -> None:
        if node in self.policy:
            self.policy.remove(node)
        self.arena.free(node.host_offset)
        self._feed.removed(node, HOST)
        node.ns.group.host_bytes -= node.host_bytes
        if node.host_coded:
            node.host_coded = False
            node.ns.host_coded_blocks -= 1
        node.host_offset = -1
        self.tokens_bytes -= kept_bytes(node.tokens)
        node.tokens = None  # kept while in host only (kvstore.index)
        self.blocks -= 1
        if node.parent is not None:
            node.parent.host_children -= 1

    def _keep(self, tokens: bytes | None) -> bytes | None:
        """``tokens`` to keep for a block entering the tier, or None past the cap."""
        size = kept_bytes(tokens)
        if self.tokens_bytes + size > self.tokens_cap:
            self._counters.tokens_not_kept += 1
            return None
        self.tokens_bytes += size
        return tokens

    def recode(self, node: Node, slot: int) -> None:
        """The block moved, encoded, into ``slot`` (kvstore.host_coding); its old slot
        is freed, which bumps that slot's epoch so unpinned copies fail their check."""
        self.arena.free(node.host_offset)
        node.host_offset = slot
        node.host_coded = True
        node.ns.host_coded_blocks += 1
        node.ns.group.host_bytes -= node.size - node.host_bytes

    def evicted(self) -> None:
        self._counters.host_evictions += 1

    def reprioritize(self, node: Node) -> None:
        if node in self.policy:
            self.policy.reprioritize(node)

    def stats(self) -> TierStats:
        c = self._counters
        return TierStats(
            Tier.HOST.value, self.arena.capacity_bytes, self.arena.used_bytes, self.blocks,
            c.host_hits, c.host_misses, c.host_evictions, c.host_bytes_in, c.host_bytes_out,
        )  # fmt: skip
