"""What a far tier is: a tier behind the node's host and disk that answers by key.

The node's own tiers keep each block's place in the index (:mod:`kvstore.tiering`).
A far tier does not: it is a store of its own (the shared tier on a Valkey / Redis
Cluster, :mod:`kvstore.shared`; an object store, a shared file system), which evicts
on its own and is asked by key. It is a part with one caller, the store's
:class:`kvstore.tier_stack.TierStack`, and this is all the stack needs of it:

- it is made from a :class:`BlockSource` (``make(source)``): what lends it the blocks to
  write, from its write-behind queue; it writes them on a thread of its own;
- :meth:`FarTier.fetch`: the bytes of the longest prefix of a key chain it holds intact,
  before its own deadline (never under the store's lock: it may wait on a network);
- :meth:`FarTier.usable`: whether a read may find anything now;
- :meth:`FarTier.stats` and :meth:`FarTier.close`.

A block it returns is checked by the tier (its checksum, its key): a bad one is a miss,
and the chain stops before it. :class:`FarTierEntry` is how the store's configuration
names one (:func:`kvstore.store.far_tiers`): adding a far tier is a package with a
:class:`FarTier` and one entry there.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvstore.keys import BlockKey, NamespaceSpec


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A block the store lends a writer: its bytes stay valid until released."""

    spec: NamespaceSpec
    key: BlockKey
    parent: BlockKey | None  # None: the chain's first block
    payload: memoryview
    encoded: bool = False  # the payload is encoded already (kvstore.host_coding)


class Lent(NamedTuple):
    """What the store lends a writer: the next blocks of its write-behind queue."""

    blocks: list[Outgoing]  # unsent ancestors first
    # unpins them; call once they are sent, with the keys the tier took
    release: Callable[[Collection[BlockKey]], None]
    lost: int  # queued blocks no longer in the host tier (or an unsent ancestor)


Known = Callable[[BlockKey], bool]  # whether a block is already on the tier


class BlockSource(Protocol):
    """What a far tier's writer needs of its store."""

    def lend_queued(self, limit: int, known: Known, timeout: float, drop: bool) -> Lent:
        """The next (up to ``limit``) blocks of the tier's write-behind queue that are
        not ``known`` to be on it, each after its unsent ancestors, pinned in the host
        tier until released; waits up to ``timeout`` for one. ``drop``: take them off
        the queue, lend none (the tier is unreachable)."""
        ...


class FarTier(Protocol):
    """A tier behind the node's own (see the module docstring)."""

    def usable(self) -> bool:
        """Whether a read may find anything now (e.g. connected)."""
        ...

    def fetch(self, spec: NamespaceSpec, keys: Sequence[BlockKey]) -> list[memoryview]:
        """The bytes of the longest prefix of ``keys`` found intact before the tier's
        deadline (empty: none)."""
        ...

    def stats(self, queue_bytes: int, queue_dropped: int) -> object:
        """The tier's figures, with its write-behind queue's (bytes held, blocks refused
        while full)."""
        ...

    def close(self) -> None:
        """Stop its writer; later reads find nothing."""
        ...


@dataclass(frozen=True)
class FarTierEntry:
    """One far tier of a store's configuration: its name (its medium in KV events and
    stats), how to make it, and its write-behind queue's rules."""

    name: str
    medium: str  # how KV events name it (kvstore.tier_events)
    make: Callable[[BlockSource], FarTier]
    queue_bytes: int  # the queue's bound
    min_priority: int = 0  # blocks below it are not written to the tier
    wait: bool = False  # past the bound, puts wait for the writer (else: not queued)
