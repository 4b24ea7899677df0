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

A claim may be made by one client and filled by another (vLLM's scheduler claims, its
worker computes): ``claim.ticket()`` is a small picklable :class:`ClaimTicket`, and
``Namespace.resume_claim(ticket)`` on the other client is a :class:`Claim` over the same
lease, delivering the blocks not delivered yet. One of them delivers at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from kvclient import wire
from kvclient.arena_path import ClientArena, SlotTable, write_slots
from kvclient.errors import InvalidArgumentError, LeaseError
from kvclient.payloads import as_blocks, as_tokens, check_priority
from kvproto.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvclient.async_client import AsyncNamespace
    from kvclient.sync_client import Namespace


@dataclass(frozen=True, slots=True)
class ClaimTicket:
    """A claim handed to another client: the Reserve's answer and where it started."""

    ns_id: str
    start: int
    response: bytes  # the serialized ReserveResponse
    delivered: int = 0  # blocks delivered before the hand-over


class _ClaimState:
    """What a claim owns and has delivered; builds its requests (no I/O here)."""

    def __init__(
        self,
        ns_id: str,
        block_bytes: int,
        response: pb.ReserveResponse,
        start: int,
        arena: ClientArena | None,
    ) -> None:
        self.ns_id = ns_id
        self.block_bytes = block_bytes
        self.lease_id: int = response.lease_id
        self.existing: int = response.existing
        self.blocks: int = len(response.slots)
        self.first: int = start + response.existing
        self.pending_elsewhere: bool = response.refused > 0 and not response.out_of_space
        self.arena = arena
        self.delivered = 0
        self._slots = wire.slot_table(response)
        self._response = response
        self._start = start

    def ticket(self) -> ClaimTicket:
        """What another client needs to deliver the rest (see the module docstring)."""
        return ClaimTicket(
            self.ns_id, self._start, self._response.SerializeToString(), self.delivered
        )

    @property
    def remaining(self) -> int:
        return self.blocks - self.delivered

    def rows(self, blocks: Any) -> np.ndarray | list[np.ndarray]:
        rows = as_blocks(blocks, self.block_bytes)
        if len(rows) > self.remaining:
            raise ValueError(
                f"{len(rows)} blocks offered, but only {self.remaining} of the claim remain"
            )
        return rows

    def write_arena(self, rows: np.ndarray | list[np.ndarray]) -> pb.CommitRequest:
        """Copy the next blocks into their slots; the Commit that makes them ready."""
        assert self.arena is not None
        n, done = len(rows), self.delivered
        table = SlotTable(
            self._slots.indices[done : done + n], self._slots.offsets[done : done + n]
        )
        write_slots(self.arena.mapping, table, rows, self.block_bytes, self.first + done)
        return pb.CommitRequest(lease_id=self.lease_id, count=n)

    def put_messages(
        self, rows: np.ndarray | list[np.ndarray], chunk_bytes: int
    ) -> Iterator[bytes]:
        """The inline Put that delivers the next blocks into the claim."""
        header = pb.PutHeader(ns_id=self.ns_id, n_blocks=len(rows), lease_id=self.lease_id)
        return wire.put_messages(header, rows, chunk_bytes or wire.DEFAULT_CHUNK_BYTES)

    def describe(self, kind: str) -> str:
        return (
            f"{kind}(blocks {self.first}..{self.first + self.blocks}, "
            f"delivered={self.delivered}, existing={self.existing}, "
            f"pending_elsewhere={self.pending_elsewhere})"
        )


class Claim(_ClaimState):
    """Blocks this session reserved and must compute; see the module docstring."""

    def __init__(
        self, ns: Namespace, response: pb.ReserveResponse, start: int, arena: ClientArena | None
    ) -> None:
        super().__init__(ns.ns_id, ns.block_bytes, response, start, arena)
        self._client = ns.client

    def fill(self, blocks: Any) -> int:
        """Deliver the next ``len(blocks)`` claimed blocks (``uint8[n, block_bytes]`` or
        a list of bytes-likes) and make them ready; returns how many became ready."""
        rows = self.rows(blocks)
        if len(rows) == 0:
            return 0
        client = self._client
        if self.arena is not None:
            done = int(client._call(client._stub.Commit, self.write_arena(rows)).committed)
        else:
            info, _ = client._refresh()
            client._settle()
            try:
                result = client._put_stream(
                    self.put_messages(rows, info.max_chunk_bytes), timeout=client.timeout
                )
            except grpc.RpcError as exc:
                raise client._error(exc) from None
            done = int(result.stored)
        self.delivered += done
        return done

    def abandon(self) -> int:
        """Drop the blocks not delivered yet (waiters compute them); returns how many."""
        if not self.lease_id or self.remaining == 0:
            return 0
        self.delivered = self.blocks
        request = pb.AbandonRequest(lease_id=self.lease_id)
        try:
            return int(self._client._call(self._client._stub.Abandon, request).dropped)
        except LeaseError:  # it ran out or ended already: nothing left to drop
            return 0

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abandon()

    def __repr__(self) -> str:
        return self.describe("Claim")


class AsyncClaim(_ClaimState):
    """:class:`Claim` for :class:`kvclient.AsyncNamespace`: the same, as coroutines."""

    def __init__(
        self,
        ns: AsyncNamespace,
        response: pb.ReserveResponse,
        start: int,
        arena: ClientArena | None,
    ) -> None:
        super().__init__(ns.ns_id, ns.block_bytes, response, start, arena)
        self._client = ns.client

    async def fill(self, blocks: Any) -> int:
        rows = self.rows(blocks)
        if len(rows) == 0:
            return 0
        client = self._client
        if self.arena is not None:
            commit = await asyncio.to_thread(self.write_arena, rows)  # copies off the loop
            done = int((await client._call(client._stub.Commit, commit)).committed)
        else:
            info, _ = await client._refresh()
            await client._settle()
            try:
                result = await client._put_stream(
                    self.put_messages(rows, info.max_chunk_bytes), timeout=client.timeout
                )
            except grpc.RpcError as exc:
                raise client._error(exc) from None
            done = int(result.stored)
        self.delivered += done
        return done

    async def abandon(self) -> int:
        if not self.lease_id or self.remaining == 0:
            return 0
        self.delivered = self.blocks
        request = pb.AbandonRequest(lease_id=self.lease_id)
        try:
            return int((await self._client._call(self._client._stub.Abandon, request)).dropped)
        except LeaseError:
            return 0

    async def __aenter__(self) -> AsyncClaim:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.abandon()

    def __repr__(self) -> str:
        return self.describe("AsyncClaim")


def reserve_request(
    ns_id: str,
    block_tokens: int,
    tokens: Sequence[int] | np.ndarray,
    start: int,
    ttl_s: float | None,
    priority: int | None,
    extra: list[bytes],
) -> pb.ReserveRequest:
    """The Reserve that claims the full blocks of ``tokens`` from ``start`` (validated)."""
    arr = as_tokens(tokens)
    full = len(arr) // block_tokens
    if not 0 <= start <= full:
        raise InvalidArgumentError(f"start={start} is outside the {full} full blocks of tokens")
    check_priority(priority)
    return pb.ReserveRequest(
        ns_id=ns_id,
        tokens=arr[: full * block_tokens].tolist(),
        extra_keys=extra,
        start_block=start,
        ttl_s=ttl_s or 0.0,
        priority=priority,
    )
