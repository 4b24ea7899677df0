"""Why a prompt missed: the store's memory of blocks it lost, and the answer it gives.

:class:`RecentLosses` remembers the newest ``LOSS_MEMORY`` blocks that left the store
entirely: when, from which tier, and by which rule (see ``RULES``). It is bounded (an
ordered dict, oldest forgotten first: about 200 bytes per block, 13 MiB in all), so
"never stored" means "not stored, or lost longer ago than the memory reaches".

:func:`explain` walks a chain to its first block that is not served and names the
reason the store knows: pending on another writer, lost (with the remembered rule),
or never stored. A block stored under another namespace (another model, layout or
salt) is the daemon's part to find, since only it knows which namespaces the caller
may see (:mod:`kvstored.why`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.index import Index
from kvstore.keys import BlockKey

LOSS_MEMORY = 65536  # blocks remembered

# how a block left its last tier
PRIORITY = "priority"  # leaf-first eviction: lowest priority, then least recently used
QUOTA = "quota"  # its tenant was at its quota in that tier
TTL = "ttl"  # reserved, and its writer's lease ran out before the commit
CORRUPT = "corrupt"  # its disk record failed the checksum
DELETED = "deleted"  # a Delete or Clear
RULES = (PRIORITY, QUOTA, TTL, CORRUPT, DELETED)

# the reasons explain gives (kvctl why prints them)
SERVED = "served"  # every block is served
PENDING = "pending"
LOST = "lost"
NEVER_STORED = "never_stored"
OTHER_NAMESPACE = "other_namespace"  # (found by the daemon)


@dataclass(frozen=True, slots=True)
class Loss:
    when: float  # wall clock
    tier: str  # the tier it left last ("host", "disk")
    rule: str  # one of RULES


@dataclass(frozen=True, slots=True)
class MissReason:
    """The first block of a chain that is not served, and why."""

    block: int  # its index in the chain (== len(chain) when every block is served)
    reason: str  # SERVED, PENDING, LOST, NEVER_STORED or OTHER_NAMESPACE
    loss: Loss | None = None  # for LOST
    detail: str = ""  # for OTHER_NAMESPACE: which namespace and what differs


class RecentLosses:
    """The newest blocks that left the store (see the module docstring). Under the
    store's lock."""

    def __init__(self, capacity: int = LOSS_MEMORY) -> None:
        self.capacity = capacity
        self._losses: OrderedDict[bytes, Loss] = OrderedDict()

    def __len__(self) -> int:
        return len(self._losses)

    def note(self, key: bytes, loss: Loss) -> None:
        losses = self._losses
        losses[key] = loss
        losses.move_to_end(key)
        if len(losses) > self.capacity:
            losses.popitem(last=False)

    def get(self, key: bytes) -> Loss | None:
        return self._losses.get(key)


def explain(index: Index, losses: RecentLosses, keys: Sequence[BlockKey]) -> MissReason:
    """Why the chain ``keys`` is not served whole: its first block that is missing or
    not ready, and the reason the store knows (under the store's lock)."""
    for i, key in enumerate(keys):
        node = index.get(key)
        if node is None:
            loss = losses.get(key)
            if loss is not None:
                return MissReason(i, LOST, loss)
            return MissReason(i, NEVER_STORED)
        if not node.ready:
            return MissReason(i, PENDING)
    return MissReason(len(keys), SERVED)
