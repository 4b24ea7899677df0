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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvclient import wire
from kvclient.arena_path import ClientArena, SlotTable, write_slots
from kvclient.connection import Connection
from kvclient.effects import Io, Op, Work
from kvclient.errors import InvalidArgumentError, LeaseError
from kvclient.payloads import as_blocks, as_tokens, check_priority
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1.results import NamespaceInfo


@dataclass(frozen=True, slots=True)
class ClaimTicket:
    """A claim handed to another client: the Reserve's answer and where it started."""

    ns_id: str
    start: int
    response: bytes  # the serialized ReserveResponse
    delivered: int = 0  # blocks delivered before the hand-over


class Claim:
    """Blocks this session reserved and must compute; see the module docstring.

    ``fill`` and ``abandon`` return their counts with :class:`kvclient.KVClient`, and
    awaitables of them with :class:`kvclient.AsyncKVClient`; leave it with ``with`` or
    ``async with`` likewise."""

    def __init__(
        self,
        conn: Connection,
        ns: NamespaceInfo,
        response: pb.ReserveResponse,
        start: int,
        arena: ClientArena | None,
    ) -> None:
        self._conn = conn
        self.ns_id = ns.ns_id
        self.block_bytes = ns.block_bytes
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

    def fill(self, blocks: Any) -> Any:
        """Deliver the next ``len(blocks)`` claimed blocks (``uint8[n, block_bytes]`` or
        a list of bytes-likes) and make them ready; returns how many became ready."""
        return self._conn.drive(self._fill(blocks))

    def abandon(self) -> Any:
        """Drop the blocks not delivered yet (waiters compute them); returns how many."""
        return self._conn.drive(self._abandon())

    def _fill(self, blocks: Any) -> Op[int]:
        rows = as_blocks(blocks, self.block_bytes)
        if len(rows) > self.remaining:
            raise ValueError(
                f"{len(rows)} blocks offered, but only {self.remaining} of the claim remain"
            )
        if len(rows) == 0:
            return 0
        conn = self._conn
        if self.arena is not None:
            commit = yield Work(self._write_arena, (rows,))
            done = int((yield from conn.call("Commit", commit)).committed)
        else:
            info, _ = yield from conn.refresh()
            yield from conn.settle()
            header = pb.PutHeader(ns_id=self.ns_id, n_blocks=len(rows), lease_id=self.lease_id)
            chunk = info.max_chunk_bytes or wire.DEFAULT_CHUNK_BYTES
            messages = wire.put_messages(header, rows, chunk)
            done = int((yield from conn.over_grpc(Io(conn.grpc.put, (messages,)))).stored)
        self.delivered += done
        return done

    def _write_arena(self, rows: np.ndarray | list[np.ndarray]) -> pb.CommitRequest:
        """Copy the next blocks into their slots; the Commit that makes them ready."""
        assert self.arena is not None
        n, done = len(rows), self.delivered
        table = SlotTable(
            self._slots.indices[done : done + n], self._slots.offsets[done : done + n]
        )
        write_slots(self.arena.mapping, table, rows, self.block_bytes, self.first + done)
        return pb.CommitRequest(lease_id=self.lease_id, count=n)

    def _abandon(self) -> Op[int]:
        if not self.lease_id or self.remaining == 0:
            return 0
        self.delivered = self.blocks
        request = pb.AbandonRequest(lease_id=self.lease_id)
        try:
            return int((yield from self._conn.call("Abandon", request)).dropped)
        except LeaseError:  # it ran out or ended already: nothing left to drop
            return 0

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abandon()

    async def __aenter__(self) -> Claim:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.abandon()

    def __repr__(self) -> str:
        return (
            f"Claim(blocks {self.first}..{self.first + self.blocks}, "
            f"delivered={self.delivered}, existing={self.existing}, "
            f"pending_elsewhere={self.pending_elsewhere})"
        )


def claim(conn: Connection, ns: NamespaceInfo, request: pb.ReserveRequest, start: int) -> Op[Claim]:
    """Reserve the blocks of ``request`` (from :func:`reserve_request`)."""
    _, arena = yield from conn.arena_for_data()
    response = yield from conn.call("Reserve", request)
    if arena is not None and arena.names_another_arena(response.arena_path):
        conn.forget_arena()  # the daemon restarted: deliver inline this time
        arena = None
    return Claim(conn, ns, response, start, arena)


def resume(conn: Connection, ns: NamespaceInfo, ticket: ClaimTicket) -> Op[Claim]:
    """The claim of ``ticket`` on this client; no call is made."""
    if ticket.ns_id != ns.ns_id:
        raise InvalidArgumentError(f"the claim is of namespace {ticket.ns_id}, not of {ns.ns_id}")
    response = pb.ReserveResponse.FromString(ticket.response)
    _, arena = yield from conn.arena_for_data()
    if arena is not None and arena.names_another_arena(response.arena_path):
        arena = None  # made before the daemon restarted: its lease is gone anyway
    resumed = Claim(conn, ns, response, ticket.start, arena)
    resumed.delivered = ticket.delivered
    return resumed


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
