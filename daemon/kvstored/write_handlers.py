"""The write side of the KVStore servicer: Put (a stream copied into reserved slots
as it arrives), puts into a claim, Reserve, Commit and Abandon."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Sequence

import numpy as np
from google.protobuf.message import DecodeError

from kvproto.v1 import data_frames, result_messages
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1.results import PutResult
from kvstore.errors import InvalidArgument, OutOfSpace, StoreError
from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.results import Reservation, SlotRef
from kvstored import convert
from kvstored.auth import Caller
from kvstored.config import MAX_CHUNK_BYTES
from kvstored.dispatch import Calls, Ctx, NeedsPool
from kvstored.errors import grpc_errors

DRAIN_S = 5.0  # how long a refused Put's remaining data is read before the refusal


def no_room(calls: Calls, reservation: Reservation, n_blocks: int) -> OutOfSpace:
    """The RESOURCE_EXHAUSTED of a put none of whose blocks found room, naming why."""
    if reservation.writer_behind:
        return OutOfSpace(
            f"no room for any of the {n_blocks} blocks: the disk writer is behind (every "
            "block that could make room is due on disk, or on the shared tier with "
            "shared_overflow = wait, and its writer's queue stayed full for "
            f"put_wait_ms={calls.store.config.put_wait_ms}); retry later"
        )
    return OutOfSpace(
        f"no room for any of the {n_blocks} blocks: the store is full of leased or "
        "pending blocks"
    )


@grpc_errors
async def Put(
    calls: Calls,
    request_iterator: AsyncIterable[pb.PutRequest | bytes],
    context: Ctx,
) -> pb.PutResponse:
    messages = aiter(request_iterator)
    try:
        return await _put(calls, messages, context)
    except Exception:
        await _drain(calls, messages)
        raise


async def _drain(calls: Calls, messages: AsyncIterator[pb.PutRequest | bytes]) -> None:
    """Read and drop the rest of a refused Put before the refusal is sent.

    A client still writing when the status arrives may lose its status to the failed
    write: grpc.aio's client then reports INTERNAL ("Internal error from Core",
    grpc/grpc#36066) instead of the refusal. So a refused put is read to its end, at
    most what one put may carry and for at most DRAIN_S; a stream that fails
    meanwhile ends the drain (the refusal is sent all the same)."""
    limit = calls.config.max_transfer_bytes + 2 * MAX_CHUNK_BYTES
    read = 0
    with contextlib.suppress(Exception):
        async with asyncio.timeout(DRAIN_S):
            async for msg in messages:
                read += len(msg) if isinstance(msg, bytes) else msg.ByteSize()
                if read > limit:
                    return


async def _put(
    calls: Calls, messages: AsyncIterator[pb.PutRequest | bytes], context: Ctx
) -> pb.PutResponse:
    caller = calls.access.caller(context)
    first = await anext(messages, None)
    head = _put_header(calls, first)
    if head.lease_id:
        return await _put_into_claim(calls, head, messages, caller)
    prio = convert.optional_priority(head)

    def check_header(quick: bool = False) -> tuple[NamespaceSpec, list[BlockKey]]:
        spec, keys = calls.chain(head.ns_id, head.tokens, head.extra_keys, caller, quick)
        end = convert.block_range(head.start_block, head.n_blocks, len(keys))
        if head.n_blocks == 0:
            raise InvalidArgument("n_blocks must be > 0")
        return spec, keys[:end]

    spec, keys = await calls.run_quick(check_header)
    bb = spec.block_bytes
    expected = head.n_blocks * bb
    if expected > calls.config.max_transfer_bytes:
        raise OutOfSpace(
            f"put of {head.n_blocks} blocks x {bb} bytes = {expected} bytes exceeds "
            f"max_transfer_bytes={calls.config.max_transfer_bytes}; split it"
        )

    windows = _Windows(calls, spec.ns_id, keys, head.start_block, head.n_blocks, prio)
    await windows.open()
    try:
        await _receive(calls, messages, windows, head.n_blocks, bb)
        await windows.finish()
    except BaseException:
        windows.abandon()
        raise
    opened = windows.first
    # Refused outright: a missing parent or another owner computing the first
    # block is an ordinary answer; only lack of room is an error.
    if opened.out_of_space and windows.committed == 0 and opened.existing == 0:
        raise no_room(calls, opened, head.n_blocks)
    return result_messages.put_response(
        PutResult.of_reservation(
            windows.existing,
            windows.last.refused,
            windows.reserved,
            windows.committed,
            windows.durable,
        )
    )


class _Windows:
    """The reservations of one inline Put, and where its bytes go. A chain too long
    for the host tier is reserved one window at a time (kvstore.store_writes): when
    the data reaches the end of a window, that window is committed (the store writes
    it to disk) and the next one reserved. Bytes of blocks that already existed or
    were refused are dropped."""

    def __init__(
        self,
        calls: Calls,
        ns_id: str,
        keys: Sequence[BlockKey],
        start: int,
        n_blocks: int,
        priority: int | None,
    ) -> None:
        self._calls = calls
        self._ns_id, self._keys, self._start, self._n = ns_id, keys, start, n_blocks
        self._priority = priority
        self.reserved = self.committed = self.durable = self.existing = 0
        self._lease = 0  # the current window's, until committed
        self.first = self.last = Reservation(0, 0.0, 0, 0)
        self._sink: _SlotSink | None = None
        self._end = 0  # data offset where the current window's blocks end (more only)

    async def open(self) -> None:
        self.first = await self._reserve(self._start)

    async def _reserve(self, at: int) -> Reservation:
        calls = self._calls

        def reserve(quick: bool = False) -> Reservation:
            if quick:
                calls.check_room(self._ns_id, self._keys, self._start + self._n - at)
            return calls.store.reserve(
                self._ns_id, self._keys, at, calls.config.max_lease_ttl_s, self._priority
            )

        reservation = await calls.run_quick(reserve, may_wait=True)
        self.last, self._lease = reservation, reservation.lease_id
        self.reserved += len(reservation.offsets)
        self.existing += reservation.existing
        bb = calls.store.namespace(self._ns_id).block_bytes
        self._sink = _SlotSink(calls.store.arena.array(), reservation.slots, self._start, bb)
        ended = reservation.first_index + len(reservation.offsets)
        self._end = (ended - self._start) * bb if reservation.more else 0
        return reservation

    async def write(self, position: int, chunk: bytes | memoryview) -> None:
        """Copy ``chunk`` (data bytes from ``position``) into the slots, moving on to
        the next window where it crosses the current one's end."""
        view = memoryview(chunk)
        while self._end and position + len(view) > self._end:
            cut = max(self._end - position, 0)
            assert self._sink is not None
            self._sink.write(position, view[:cut])
            position, view = position + cut, view[cut:]
            await self._commit()
            await self._reserve(self.last.first_index + len(self.last.offsets))
        assert self._sink is not None
        self._sink.write(position, view)

    async def _commit(self) -> None:
        if self._lease:
            lease, self._lease = self._lease, 0
            committed, durable = await _commit(self._calls, lease, None)
            self.committed += committed
            self.durable += durable

    async def finish(self) -> None:
        await self._commit()

    def abandon(self) -> None:
        """Drop the current window's pending blocks (short, and safe while cancelled)."""
        if self._lease:
            with contextlib.suppress(StoreError):
                self._calls.store.abandon(self._lease)


async def _put_into_claim(
    calls: Calls,
    head: pb.PutHeader,
    messages: AsyncIterator[pb.PutRequest | bytes],
    caller: Caller,
) -> pb.PutResponse:
    """Deliver the next ``n_blocks`` blocks of a claim (a write lease) and commit them.

    A malformed delivery (wrong byte count, oversized chunk) is refused and changes
    nothing; a broken transfer (cancelled, failed) abandons the claim: its waiters
    compute for themselves rather than wait for bytes that are not coming.
    """
    lease = calls.access.lease(convert.lease_id(head.lease_id), caller)
    spec = calls.access.spec(head.ns_id, caller)
    if head.n_blocks == 0:
        raise InvalidArgument("n_blocks must be > 0")
    if calls.store.lease_namespace(lease) not in (spec.ns_id, None):  # (None: LeaseError next)
        raise InvalidArgument(f"lease {lease} is not a lease of namespace {head.ns_id}")
    slots = calls.store.claimed_slots(lease, head.n_blocks)
    bb = spec.block_bytes
    sink = _SlotSink(calls.store.arena.array(), slots, slots[0].index, bb)
    try:
        await _receive(calls, messages, sink, head.n_blocks, bb)
        committed, durable = await _commit(calls, lease, head.n_blocks)
    except InvalidArgument:
        raise  # a malformed delivery changes nothing: the claim stays, pending
    except BaseException:
        with contextlib.suppress(StoreError):
            calls.store.abandon(lease)
        raise
    return pb.PutResponse(stored=committed, durable=durable)


async def _receive(
    calls: Calls,
    messages: AsyncIterator[pb.PutRequest | bytes],
    sink: _SlotSink | _Windows,
    n_blocks: int,
    block_bytes: int,
) -> None:
    """Copy a Put's data chunks into ``sink``; exactly n_blocks x block_bytes bytes."""
    expected = n_blocks * block_bytes
    received = 0
    async for msg in messages:
        chunk = _put_data(calls, msg)
        size = len(chunk)
        if size > MAX_CHUNK_BYTES:
            raise InvalidArgument(
                f"data chunk of {size} bytes exceeds max_chunk_bytes={MAX_CHUNK_BYTES}"
            )
        if received + size > expected:
            raise InvalidArgument(
                f"Put data exceeds n_blocks x block_bytes = {n_blocks} x {block_bytes} "
                f"= {expected} bytes (got at least {received + size})"
            )
        if isinstance(sink, _Windows):
            await sink.write(received, chunk)
        else:
            sink.write(received, chunk)
        received += size
    if received != expected:
        raise InvalidArgument(
            f"Put data is {received} bytes, expected n_blocks x block_bytes = "
            f"{n_blocks} x {block_bytes} = {expected}"
        )


def _put_header(calls: Calls, first: pb.PutRequest | bytes | None) -> pb.PutHeader:
    msg = _put_message(first) if isinstance(first, bytes) else first
    if msg is None or msg.WhichOneof("kind") != "header":
        raise InvalidArgument("the first Put message must be a header")
    return msg.header


def _put_data(calls: Calls, msg: pb.PutRequest | bytes) -> bytes | memoryview:
    """The bytes of a Put data message (a view into a framed message: no copy)."""
    if isinstance(msg, bytes):
        span = data_frames.data_span(msg)
        if span is not None:
            offset, size = span
            return memoryview(msg)[offset : offset + size]
        msg = _put_message(msg)
    if msg.WhichOneof("kind") != "data":
        raise InvalidArgument("Put sends one header, then only data chunks")
    return msg.data


def _put_message(raw: bytes) -> pb.PutRequest:
    try:
        return pb.PutRequest.FromString(raw)
    except DecodeError:
        raise InvalidArgument("a Put message is not a valid PutRequest") from None


@grpc_errors
async def Reserve(calls: Calls, request: pb.ReserveRequest, context: Ctx) -> pb.ReserveResponse:
    caller = calls.access.caller(context)
    ttl = convert.seconds(request.ttl_s, "ttl_s")
    prio = convert.optional_priority(request)

    staged = list(request.staged_offsets)
    if request.commit and not staged:
        raise InvalidArgument(
            "commit=true needs staged_offsets: only blocks already written into their "
            "staged slots can be committed on arrival"
        )

    owner = calls.owners.owner_of(context)
    if request.stage_lease_id:
        calls.access.lease(request.stage_lease_id, caller)

    def reserve(quick: bool = False) -> pb.ReserveResponse:
        spec, keys = calls.chain(
            request.ns_id, request.tokens, request.extra_keys, caller, quick
        )
        end = convert.block_range(request.start_block, request.n_blocks, len(keys))
        if quick:  # staged slots are allocated already: only stage_more needs room
            if request.commit and calls.write_through():
                raise NeedsPool  # the commit queues disk writes, which may wait
            fresh = 0 if staged else end - request.start_block
            calls.check_room(spec.ns_id, keys[:end], fresh + request.stage_more)
        res = calls.store.reserve(
            spec.ns_id,
            keys[:end],
            start=request.start_block,
            ttl_s=ttl,
            priority=prio,
            stage_lease_id=request.stage_lease_id,
            staged_offsets=staged,
            stage_more=request.stage_more,
        )
        if res.out_of_space and not res.offsets and not res.existing:
            raise no_room(calls, res, end - request.start_block)
        durable = 0
        if request.commit and res.lease_id:
            durable = calls.store.commit_durably(res.lease_id)[1]
        else:
            calls.owners.own(owner, (res.lease_id,))
        calls.owners.own(owner, (res.stage_lease_id,))
        response = convert.reserve_response(
            res, calls.arena_name(spec), request.compact_slots
        )
        response.durable = durable
        return response

    return await calls.run_quick(reserve, may_wait=True)


@grpc_errors
async def Commit(calls: Calls, request: pb.CommitRequest, context: Ctx) -> pb.CommitResponse:
    caller = calls.access.caller(context)
    lease = calls.access.lease(convert.lease_id(request.lease_id), caller)
    count = request.count if request.HasField("count") else None
    committed, durable = await _commit(calls, lease, count)
    return pb.CommitResponse(committed=committed, durable=durable)


async def _commit(calls: Calls, lease: int, count: int | None) -> tuple[int, int]:
    """(committed, durable): see Store.commit_durably."""
    if calls.write_through() or calls.store.commit_writes_disk(lease):  # waits for the disk
        return await calls.run(calls.store.commit_durably, lease, count)
    return calls.store.commit_durably(lease, count)


@grpc_errors
async def Abandon(calls: Calls, request: pb.AbandonRequest, context: Ctx) -> pb.AbandonResponse:
    caller = calls.access.caller(context)
    lease = calls.access.lease(convert.lease_id(request.lease_id), caller)
    return pb.AbandonResponse(dropped=calls.store.abandon(lease))  # no disk I/O

class _SlotSink:
    """Where the bytes of an inline Put go: data offset -> arena offset of the reserved
    slots. Bytes of blocks that already existed or were refused are dropped."""

    def __init__(
        self, arena: np.ndarray, slots: Sequence[SlotRef], start: int, block_bytes: int
    ) -> None:
        self._arena = arena
        self._starts: list[int] = []  # data offset where each run begins
        self._runs: list[tuple[int, int, int]] = []  # (data offset, arena offset, bytes)
        for slot in slots:
            data = (slot.index - start) * block_bytes
            if self._runs:
                d, a, n = self._runs[-1]
                if d + n == data and a + n == slot.offset:
                    self._runs[-1] = (d, a, n + block_bytes)
                    continue
            self._runs.append((data, slot.offset, block_bytes))
            self._starts.append(data)

    def write(self, position: int, chunk: bytes | memoryview) -> None:
        """Copy the parts of ``chunk`` (data bytes from ``position``) that have slots."""
        end = position + len(chunk)
        i = max(bisect.bisect_right(self._starts, position) - 1, 0)
        while i < len(self._runs):
            data, arena, size = self._runs[i]
            if data >= end:
                break
            lo, hi = max(position, data), min(end, data + size)
            if lo < hi:
                src = np.frombuffer(chunk, np.uint8, hi - lo, lo - position)
                self._arena[arena + lo - data : arena + hi - data] = src
            i += 1
