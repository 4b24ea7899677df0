"""Claims: early reuse from the engine's side.

A burst of requests that share a system prompt should pay for one prefill. The first
request *claims* the blocks nobody has (a Reserve: they become pending, visible to every
lookup), computes them, and delivers them chunk by chunk as its prefill advances; each
delivered block is ready at once. The other requests see the blocks pending and wait
(``Namespace.lookup(tokens, wait_pending_s=...)``) instead of recomputing.

Protocol of a :class:`Claim` (from :meth:`kvclient.Namespace.claim`):

1. ``claim.first`` .. ``claim.first + claim.blocks`` are this session's to compute;
   ``claim.existing`` blocks before them were ready already; ``claim.pending_elsewhere``
   says whether a block after them is being computed by another session (wait for it or
   compute it without storing).
2. ``claim.fill(blocks)`` delivers the next ``len(blocks)`` claimed blocks and makes
   them ready: through the shared arena (write the slots, then Commit) on the daemon's
   host, else inline (a Put carrying the claim's lease id).
3. Leaving the ``with`` block (or ``claim.abandon()``) drops what was not delivered, so
   waiters compute for themselves. A claim that is never finished also ends by itself
   when its lease runs out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from kvclient import wire
from kvclient.arena_path import ClientArena, SlotTable, write_slots
from kvclient.errors import LeaseError
from kvclient.payloads import as_blocks
from kvproto.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvclient.sync_client import Namespace


class Claim:
    """Blocks this session reserved and must compute; see the module docstring."""

    def __init__(
        self, ns: Namespace, response: pb.ReserveResponse, start: int, arena: ClientArena | None
    ) -> None:
        self._ns = ns
        self.lease_id: int = response.lease_id
        self.existing: int = response.existing
        self.blocks: int = len(response.slots)
        self.first: int = start + response.existing
        self.pending_elsewhere: bool = response.refused > 0 and not response.out_of_space
        self._slots = wire.slot_table(response.slots)
        self._arena = arena
        self.delivered = 0

    @property
    def remaining(self) -> int:
        return self.blocks - self.delivered

    def fill(self, blocks: Any) -> int:
        """Deliver the next ``len(blocks)`` claimed blocks (``uint8[n, block_bytes]`` or
        a list of bytes-likes) and make them ready; returns how many became ready."""
        rows = as_blocks(blocks, self._ns.block_bytes)
        n = len(rows)
        if n == 0:
            return 0
        if n > self.remaining:
            raise ValueError(f"{n} blocks offered, but only {self.remaining} of the claim remain")
        client = self._ns.client
        first = self.first + self.delivered
        if self._arena is not None:
            table = SlotTable(
                self._slots.indices[self.delivered : self.delivered + n],
                self._slots.offsets[self.delivered : self.delivered + n],
            )
            write_slots(self._arena.mapping, table, rows, self._ns.block_bytes, first)
            request = pb.CommitRequest(lease_id=self.lease_id, count=n)
            done = int(client._call(client._stub.Commit, request).committed)
        else:
            header = pb.PutHeader(ns_id=self._ns.ns_id, n_blocks=n, lease_id=self.lease_id)
            info, _ = client._refresh()
            chunk = info.max_chunk_bytes or (4 << 20)
            client._settle()
            try:
                done = int(
                    client._put_stream(
                        wire.put_messages(header, rows, chunk), timeout=client.timeout
                    ).stored
                )
            except grpc.RpcError as exc:
                raise client._error(exc) from None
        self.delivered += done
        return done

    def abandon(self) -> int:
        """Drop the blocks not delivered yet (waiters compute them); returns how many."""
        if not self.lease_id or self.remaining == 0:
            return 0
        client = self._ns.client
        try:
            response = client._call(client._stub.Abandon, pb.AbandonRequest(lease_id=self.lease_id))
        except LeaseError:  # it ran out or ended already: nothing left to drop
            return 0
        dropped = int(response.dropped)
        self.delivered = self.blocks
        return dropped

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abandon()

    def __repr__(self) -> str:
        return (
            f"Claim(blocks {self.first}..{self.first + self.blocks}, delivered={self.delivered}, "
            f"existing={self.existing}, pending_elsewhere={self.pending_elsewhere})"
        )


def claim_tokens(arr: np.ndarray, block_tokens: int) -> list[int]:
    """The tokens of the full blocks of ``arr`` (what a Reserve needs)."""
    return arr[: len(arr) // block_tokens * block_tokens].tolist()
