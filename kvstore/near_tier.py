"""What the node's own tiers share: tiers whose blocks' places are kept in the index.

The node's own tiers, host (the arena every block passes through) and disk (LMDB),
differ from the far tiers behind them (:mod:`kvstore.far_tier`) in one thing: the store
decides what they hold, block by block, so each block's place in them is kept on its
index node (:mod:`kvstore.index`: a few intrusive fields per tier, because millions of
blocks must each cost one object). Each near tier is a part of its own package that
alone writes its fields of a node (:class:`kvstore.host.placement.HostPlacement`,
:class:`kvstore.disk.placement.DiskPlacement`); :class:`kvstore.tiering.Tiers` stacks
them, fastest first, and is their only caller for moves: eviction from tier i is
demotion into a slower tier that holds the block, a miss in tier i is a promotion from
tier i + 1, and leaf-first eviction stays prefix-closed from the top (a block whose
children are held in a faster tier stays where it is).

Protocol: every method runs under the store's lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvproto.v1.results import TierStats
from kvstore.index import Node
from kvstore.policy import GroupedPolicy
from kvstore.results import Tier
from kvstore.tenants import Group


class NearTier(Protocol):
    """One of the node's own tiers (see the module docstring)."""

    kind: Tier  # its name in results, events and losses
    policy: GroupedPolicy  # its eviction order; it lists the ready blocks it holds
    blocks: int  # how many blocks it holds
    # how many of a block's children it holds (0: a leaf here); an attribute getter,
    # not a method: eviction scans call it once per candidate
    held_children: Callable[[Node], int]

    def holds(self, node: Node) -> bool:
        """Whether the block's bytes are in this tier."""
        ...


    def quota(self, group: Group) -> int:
        """A tenant's quota of bytes in this tier (0: none)."""
        ...

    def group_bytes(self, group: Group) -> int:
        """What a tenant's blocks take in this tier."""
        ...

    def drop(self, node: Node) -> None:
        """The block leaves this tier (its bytes freed, its count and lists updated)."""
        ...

    def evicted(self) -> None:
        """Count one eviction from this tier."""
        ...

    def reprioritize(self, node: Node) -> None:
        """The block's priority changed: re-rank it here."""
        ...

    def stats(self) -> TierStats:
        """Occupancy and traffic, as ``kvctl status`` shows them."""
        ...
