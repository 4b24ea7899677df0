"""The parts of one store, and the upkeep that spans them.

A :class:`kvstore.store.Store` is a façade over these parts, behind one lock:

- ``namespaces`` (:mod:`kvstore.namespaces`): namespace entries and tenant groups;
- ``index`` (:mod:`kvstore.index`): the block tree;
- ``counters`` and ``events`` (:mod:`kvstore.events`): what the store tells about itself;
- ``leases`` (:mod:`kvstore.leases`): who holds which blocks and slots, until when;
- ``arena`` (:mod:`kvstore.host.arena`) and ``disk`` (:mod:`kvstore.disk`): the tiers' bytes;
- ``tiers`` (:mod:`kvstore.tiering`): the near tiers' stack, host then disk, each a part
  that keeps its blocks' places (:mod:`kvstore.near_tier`), and moving blocks between them;
- ``queues`` (:mod:`kvstore.tier_stack`): the blocks due on each far tier.

The store's operations (:mod:`kvstore.store_reads`, :mod:`kvstore.store_writes`,
:mod:`kvstore.tier_stack`) are classes that take these parts and call them. What no
single part owns is here: whether the store is open, and ending leases (their blocks'
side in :meth:`Tiers.let_go`, the table's in :meth:`LeaseTable.forget`), on demand or
when they run out (:meth:`StoreParts.expire`, run by every call and by the store's
reaper thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.disk import DiskTier
from kvstore.errors import StoreClosed
from kvstore.events import Counters, EventLog
from kvstore.host.arena import HostArena
from kvstore.index import Index
from kvstore.leases import Lease, LeaseTable
from kvstore.namespaces import Namespaces
from kvstore.store_config import StoreConfig
from kvstore.tenants import Group
from kvstore.tiering import Tiers

if TYPE_CHECKING:
    from kvstore.tier_stack import WriteBehind


@dataclass(eq=False)
class StoreParts:
    """A store's parts (see the module docstring); ``lock`` guards all of them."""

    config: StoreConfig
    clock: Callable[[], float]
    wall: Callable[[], float]
    lock: threading.RLock
    changed: threading.Condition  # on ``lock``: events, commits, drops
    namespaces: Namespaces
    index: Index
    counters: Counters
    events: EventLog
    leases: LeaseTable
    arena: HostArena
    disk: DiskTier | None
    tiers: Tiers
    queues: list[WriteBehind] = field(default_factory=list)  # one per far tier
    closed: bool = False

    def host_room(self, group: Group) -> int:
        """The host bytes a tenant's blocks may take at most: its quota, else its
        arena region (its own, or the common one)."""
        region = self.arena.regions[self.arena.region_of(group.name)]
        return group.quota.host_bytes or region.size

    def check_open(self) -> None:
        if self.closed:
            raise StoreClosed("the store is closed")

    def end_lease(self, lease: Lease, why: str) -> None:
        """End a live lease now (``why`` names it in later errors). Under the lock."""
        self.tiers.let_go(lease, expired=why == "expired")
        self.leases.forget(lease, why)
        self.changed.notify_all()

    @property
    def behind_full(self) -> bool:
        """Whether a far tier's write-behind queue holds puts back (kvstore.tier_stack)."""
        return any(queue.full for queue in self.queues)

    def wait_for_writer(self, nbytes: int, deadline: float, behind: bool) -> None:
        """Wait, not holding the lock, until ``deadline`` at most, for the writer that
        makes host room (back-pressure: :mod:`kvstore.tiering`): a far tier's
        (``behind``; it notifies ``changed`` as it takes blocks, and so does every
        commit, hence a short wait before the caller looks again) or the disk's (until
        its queue takes ``nbytes`` more)."""
        remaining = max(0.0, deadline - time.monotonic())
        if behind:
            with self.lock:
                self.changed.wait(min(0.05, remaining))
            return
        assert self.disk is not None
        self.disk.wait_room(nbytes, remaining)

    def expire(self) -> None:
        """End the leases and timed priorities that ran out; apply a disk capacity the
        disk tier lowered. Under the lock."""
        self.tiers.apply_shrunk_disk()
        for lease in self.leases.due():
            self.end_lease(lease, "expired")
        self.tiers.expire_priorities(self.clock())
