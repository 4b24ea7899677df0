"""The prefix index: one node per block, linked to its parent and children.

Blocks form a forest per namespace: a node's parent is the block before it in every
prompt that contains it. The index answers "how much of this key chain is usable" and
keeps the bookkeeping that eviction needs; it knows nothing about bytes, tiers' storage
or policy order (see store.py and policy.py).

Memory matters (millions of blocks): a node is one slotted object with intrusive links
(first child / siblings for the tree, prev / next for the per-tier eviction lists), so
indexing a block costs one object, its key bytes and one dict entry, nothing else.
What every block of a namespace shares (its size) lives on the namespace; what few
blocks have (a timed priority) lives in the store's side tables; the payload checksum
lives in the disk record, which is the only place it is checked.

Notes:
1. A node is *in host* when ``host_offset >= 0`` and *on disk* when ``on_disk``; a
   pending node always has a host slot. Each tier's fields are written by that tier's
   part alone (kvstore.near_tier: kvstore.host.placement, kvstore.disk.placement).
2. ``host_children`` / ``disk_children`` count the children held in that tier, so
   "leaf in tier T" is one integer test (eviction is leaf-first per tier).
3. ``pins`` counts leases and in-flight copies; a pinned node never leaves a tier,
   and its host slot is never re-encoded (kvstore.host_coding).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.codecs import Codec
from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.tenants import Group

PENDING = 0
READY = 1


@dataclass(slots=True)
class NamespaceEntry:
    """A registered namespace, its tenant's group, its codec and its counters."""

    spec: NamespaceSpec
    group: Group = field(default_factory=lambda: Group(""))
    codec: Codec | None = None  # how a coded tier keeps its blocks (None: exact)
    coded_blocks: int = 0  # of its blocks on disk, those kept encoded there
    host_coded_blocks: int = 0  # of its blocks in host, those kept encoded there
    blocks: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    roots: set[BlockKey] = field(default_factory=set)  # keys of first blocks of chains


@dataclass(slots=True, eq=False)
class Node:
    key: BlockKey
    ns: NamespaceEntry
    parent: Node | None
    state: int = PENDING
    priority: int = 35
    last_access: float = 0.0  # wall clock, persisted with disk records
    hits: int = 0
    pins: int = 0
    host_offset: int = -1
    host_coded: bool = False  # its host slot holds it encoded (kvstore.host_coding)
    on_disk: bool = False
    held_behind: int = 0  # write-behind queues that keep it in host (kvstore.tier_stack)
    # the block's tokens (packed uint32), kept while it is in the host tier: what KV
    # events and its disk record carry (kvstore.keys.KeyChain; None: not known)
    tokens: bytes | None = None
    host_children: int = 0
    disk_children: int = 0
    # tree links
    first_child: Node | None = None
    next_sibling: Node | None = None
    prev_sibling: Node | None = None
    # eviction-list links, one pair per tier (owned by policy.TierPolicy)
    host_prev: Node | None = None
    host_next: Node | None = None
    host_list: Any = None
    disk_prev: Node | None = None
    disk_next: Node | None = None
    disk_list: Any = None

    @property
    def size(self) -> int:
        return self.ns.spec.block_bytes

    @property
    def in_host(self) -> bool:
        return self.host_offset >= 0

    @property
    def host_bytes(self) -> int:
        """Bytes its host slot holds: its size, or its encoded size."""
        codec = self.ns.codec
        return codec.encoded_bytes if self.host_coded and codec is not None else self.size

    @property
    def ready(self) -> bool:
        return self.state == READY

    def children(self) -> Iterator[Node]:
        child = self.first_child
        while child is not None:
            nxt = child.next_sibling
            yield child
            child = nxt

    def ancestors(self) -> Iterator[Node]:
        """This node's parent, grandparent, ... up to the root."""
        node = self.parent
        while node is not None:
            yield node
            node = node.parent

    def __repr__(self) -> str:  # keep reprs short: nodes link to whole trees
        where = ("H" if self.in_host else "") + ("D" if self.on_disk else "")
        state = "ready" if self.ready else "pending"
        return f"Node({self.key.hex()[:12]}, {state}, {where or '-'}, pins={self.pins})"


class Index:
    """Key -> node map plus the tree links; every mutation keeps parents consistent."""

    def __init__(self) -> None:
        self.nodes: dict[BlockKey, Node] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def get(self, key: BlockKey) -> Node | None:
        return self.nodes.get(key)

    def walk(self, keys: Sequence[BlockKey]) -> list[Node]:
        """Nodes of the longest prefix of ``keys`` present in the index (any state)."""
        nodes = self.nodes
        found: list[Node] = []
        parent: Node | None = None
        for key in keys:
            node = nodes.get(key)
            if node is None or node.parent is not parent:
                break
            found.append(node)
            parent = node
        return found

    def add(self, node: Node) -> None:
        """Insert a new childless node under its parent (which must be indexed)."""
        assert node.key not in self.nodes, "block indexed twice"
        self.nodes[node.key] = node
        self._attach(node)
        node.ns.blocks += 1
        node.ns.bytes += node.ns.spec.block_bytes

    def add_chain(self, nodes: Sequence[Node]) -> None:
        """Insert new childless nodes that form a chain (each the parent of the next;
        the first under its own parent, which must be indexed), with the namespace's
        counts updated once: a put's blocks in one pass."""
        if not nodes:
            return
        index = self.nodes
        for node in nodes:
            assert node.key not in index, "block indexed twice"
            index[node.key] = node
        for holder, child in zip(nodes, nodes[1:], strict=False):
            holder.first_child = child  # new: no other children, no siblings
        first = nodes[0]
        self._attach(first)
        first.ns.blocks += len(nodes)
        first.ns.bytes += len(nodes) * first.ns.spec.block_bytes

    @staticmethod
    def _attach(node: Node) -> None:
        """Link a new node as its parent's first child, or as a root of its namespace."""
        parent = node.parent
        if parent is None:
            node.ns.roots.add(node.key)
            return
        head = parent.first_child
        node.next_sibling = head
        if head is not None:
            head.prev_sibling = node
        parent.first_child = node

    def remove(self, node: Node) -> None:
        """Unlink a childless node that has left every tier."""
        assert node.first_child is None, "removing a block that still has children"
        assert not node.in_host and not node.on_disk, "removing a block still held in a tier"
        parent = node.parent
        if parent is None:
            node.ns.roots.discard(node.key)
        else:
            if node.prev_sibling is not None:
                node.prev_sibling.next_sibling = node.next_sibling
            else:
                parent.first_child = node.next_sibling
            if node.next_sibling is not None:
                node.next_sibling.prev_sibling = node.prev_sibling
            node.prev_sibling = node.next_sibling = None
        del self.nodes[node.key]
        node.ns.blocks -= 1
        node.ns.bytes -= node.size

    def subtree_postorder(self, root: Node) -> list[Node]:
        """``root`` and all its descendants, children before parents (iterative)."""
        order: list[Node] = []
        stack = [root]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children())
        order.reverse()
        return order
