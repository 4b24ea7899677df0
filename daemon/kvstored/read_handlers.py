"""The read side of the KVStore servicer: Lookup, LookupBatch (many Lookups of one
namespace in one call), Get (a stream cut out of the arena slots, or of one window
copied: kvstored.get_buffers), Acquire, Release and the batched read reports."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvproto.v1 import data_frames
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1.limits import MAX_READS_PER_PREFIX, MAX_REPORTED_PREFIXES
from kvstore.errors import InvalidArgument, LeaseError, NoRoom, StoreError
from kvstore.host.slot_runs import slot_runs
from kvstore.keys import BlockKey, NamespaceSpec
from kvstored import convert, why
from kvstored.auth import Caller
from kvstored.config import GET_CHUNK_BYTES
from kvstored.dispatch import QUICK_BLOCKS, Calls, Ctx, NeedsPool
from kvstored.errors import grpc_errors
from kvstored.get_buffers import COPIES

MAX_WAIT_PENDING_S = 300.0
# a LookupBatch of more chains goes to the pool: each costs ~20 us of Python (its
# message, its chain, its lookup) beside its hashing, so 64 hold the loop about as long
# as a Lookup of QUICK_BLOCKS blocks does
QUICK_CHAINS = 64


@grpc_errors
async def Lookup(calls: Calls, request: pb.LookupRequest, context: Ctx) -> pb.LookupResponse:
    caller = calls.access.caller(context)
    wait = convert.seconds(request.wait_pending_s, "wait_pending_s")
    if wait is not None and wait > MAX_WAIT_PENDING_S:
        raise InvalidArgument(
            f"wait_pending_s must be <= {MAX_WAIT_PENDING_S}, got {request.wait_pending_s}"
        )

    def lookup(quick: bool = False, parked: bool = True) -> pb.LookupResponse:
        pacer = why.Pacer()  # (an explain's: the chain and its lookup are its first step)
        spec, keys, pulled = calls.read_chain(
            request.ns_id, request.tokens, request.extra_keys, caller, quick
        )
        if request.explain:
            pacer.pace()
        if wait and parked:
            result = calls.store.wait_ready(spec.ns_id, keys, wait)
        else:
            result = calls.store.lookup(spec.ns_id, keys)
        result = replace(result, shared_blocks=min(pulled, result.host_blocks))
        response = convert.lookup_response(result, spec.block_tokens, len(keys))
        if request.explain:
            tokens, extra = convert.tokens(request.tokens), convert.extra_keys(request.extra_keys)
            miss = why.explain(calls.store, spec, keys, tokens, extra, caller, pacer)
            response.miss.CopyFrom(miss)
        return response

    if wait is not None:  # parked within the caller's share, else answered at once
        parked, answer = await calls.run_parked(calls.wait_shares, caller, lookup)
        if parked:
            assert answer is not None
            return answer
        return await calls.run_quick(lambda quick: lookup(quick, parked=False))
    if request.explain:  # (explain looks in every namespace: its own paced thread)
        return await calls.run_explain(caller, lookup)
    return await calls.run_quick(lookup)


@grpc_errors
async def LookupBatch(
    calls: Calls, request: pb.LookupBatchRequest, context: Ctx
) -> pb.LookupBatchResponse:
    """A Lookup of each chain (no waiting, no explain): every chain is checked and
    hashed before any is pulled from a far tier or looked up, so a bad one changes
    nothing; the lookups themselves hold the store's lock once (Store.lookup_many)."""
    caller = calls.access.caller(context)
    chains = request.chains
    limit = calls.store.config.max_blocks_per_request
    if len(chains) > limit:
        raise InvalidArgument(
            f"{len(chains)} chains in one LookupBatch, more than max_blocks_per_request={limit}"
        )

    def lookup_batch(quick: bool = False) -> pb.LookupBatchResponse:
        spec = calls.access.spec(request.ns_id, caller)
        n_blocks = sum(len(chain.tokens) // spec.block_tokens for chain in chains)
        if n_blocks > limit:
            raise InvalidArgument(
                f"{n_blocks} blocks in one LookupBatch, more than max_blocks_per_request={limit}"
            )
        if quick and (n_blocks > QUICK_BLOCKS or len(chains) > QUICK_CHAINS):
            raise NeedsPool  # that much hashing would hold the event loop up
        keyed: list[list[BlockKey]] = []
        for i, chain in enumerate(chains):
            try:
                _, keys = calls.chain(spec.ns_id, chain.tokens, chain.extra_keys, caller, quick)
            except InvalidArgument as exc:
                raise InvalidArgument(f"chains[{i}]: {exc}") from None
            keyed.append(keys)
        pulled = [calls.pull(spec.ns_id, keys, quick) for keys in keyed]
        found = calls.store.lookup_many(spec.ns_id, keyed)
        return pb.LookupBatchResponse(answers=[
            convert.lookup_response(
                replace(result, shared_blocks=min(n, result.host_blocks)), spec.block_tokens,
                len(keys),
            )
            for result, n, keys in zip(found, pulled, keyed, strict=True)
        ])  # fmt: skip

    return await calls.run_quick(lookup_batch)


@grpc_errors
async def Get(
    calls: Calls, request: pb.GetRequest, context: Ctx
) -> AsyncIterator[pb.GetResponse | bytes]:
    caller = calls.access.caller(context)
    plan = await calls.run_quick(functools.partial(_open_read, calls, request, caller))
    if plan.copy is not None:  # one window, copied: its bytes held until the call is done
        held = COPIES * plan.copy.n_bytes  # the copy, and its messages in gRPC's queue
        await calls.get_buffers.take(caller, held, calls.config.put_wait_ms / 1000)
        context.add_done_callback(_giver(calls, caller, held))
        plan = await calls.run(_copy_window, calls, plan.copy)
    finished = False
    try:
        yield _message(calls, pb.GetResponse(header=plan.header))
        for pieces, size in plan.chunks(GET_CHUNK_BYTES):
            if calls.framed:
                yield data_frames.framed(pieces, size)  # one copy, out of the arena
            else:
                yield pb.GetResponse(data=b"".join(pieces))
        finished = True
    finally:
        if plan.lease_id:
            released = _release_quietly(calls, plan.lease_id)
            if finished and not released:
                # the slots may have been reused while we read them: the client
                # must not keep what it got, so the call ends with an error status
                ttl = calls.config.max_lease_ttl_s
                raise LeaseError(
                    f"the read lease of this Get ran out after {ttl} s while the "
                    "bytes were being sent; call again"
                )


def _giver(calls: Calls, caller: Caller, nbytes: int) -> Callable[[Any], None]:
    """A Get call's done callback that gives back the ``nbytes`` it held, on the loop."""
    loop = asyncio.get_running_loop()

    def give(_: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nothing waits
            loop.call_soon_threadsafe(calls.get_buffers.give, caller, nbytes)

    return give


def _open_read(
    calls: Calls, request: pb.GetRequest, caller: Caller, quick: bool = False
) -> _ReadPlan:
    """Find what a Get sends: the header and the bytes pinned in the arena, or the
    window to copy when they cannot all be pinned (``copy``: not copied yet, its bytes
    are held first: kvstored.get_buffers)."""
    spec, keys, _ = calls.read_chain(
        request.ns_id, request.tokens, request.extra_keys, caller, quick
    )
    start, bb = request.start_block, spec.block_bytes
    if start > len(keys):
        raise InvalidArgument(
            f"start_block={start} is beyond the {len(keys)} full blocks the tokens make"
        )
    found = calls.store.lookup(spec.ns_id, keys)
    if quick and (found.disk_blocks or start):
        raise NeedsPool
    ready = found.ready_blocks
    asked = min(len(keys), start + request.max_blocks) if request.max_blocks else len(keys)
    calls.store.note_misses(spec.ns_id, asked - max(ready, start))
    # one call moves at most max_transfer_bytes, but always at least one block
    end = ready
    if request.max_blocks:
        end = min(end, start + request.max_blocks)
    end = min(end, start + max(1, calls.config.max_transfer_bytes // bb))
    if end <= start:
        header = pb.GetHeader(
            ready_blocks=ready,
            ready_tokens=ready * spec.block_tokens,
            start_block=start,
            block_bytes=bb,
        )
        return _ReadPlan(header, [])
    plan = _pin_for_read(calls, spec, keys[:end], start) if start == 0 else None
    if plan is None:  # copied: one window per call (the client calls again)
        window = max(1, calls.get_buffers.window_bytes(calls.config.window_bytes) // bb)
        end = min(end, start + window)
        return _ReadPlan(pb.GetHeader(), [], copy=_Copy(spec, keys[:end], start, ready))
    return _with_header(plan, spec, start, ready, end)


def _copy_window(calls: Calls, copy: _Copy) -> _ReadPlan:
    """Copy the window a Get could not pin (on the pool, its bytes held already)."""
    n, view = calls.store.read(copy.spec.ns_id, copy.keys, start=copy.start)
    plan = _ReadPlan(pb.GetHeader(), [view] if n else [], n_blocks=n)
    return _with_header(plan, copy.spec, copy.start, copy.ready, len(copy.keys))


def _with_header(
    plan: _ReadPlan, spec: NamespaceSpec, start: int, ready: int, end: int
) -> _ReadPlan:
    """``plan`` with its header: the blocks it sends (from ``start``, meant to ``end``)
    and the ready prefix (``ready``, or shorter when a block went meanwhile)."""
    n = plan.n_blocks
    if start + n < end:  # evicted between lookup and read: the prefix is shorter
        ready = start + n
    plan.header = pb.GetHeader(
        ready_blocks=ready,
        ready_tokens=ready * spec.block_tokens,
        start_block=start,
        n_blocks=n,
        block_bytes=spec.block_bytes,
        truncated=ready > end,
    )
    return plan


def _pin_for_read(
    calls: Calls, spec: NamespaceSpec, keys: list[BlockKey], start: int
) -> _ReadPlan | None:
    """Pin ``keys`` in host slots under a read lease; None (nothing pinned) when part
    of the prefix cannot be (a disk block with no room to promote it: read() copies
    it from disk instead)."""
    got = calls.store.acquire(spec.ns_id, keys, calls.config.max_lease_ttl_s)
    if len(got.offsets) < len(keys):
        if got.lease_id:
            calls.store.release(got.lease_id)
        return None
    arena = calls.store.arena
    bb = got.block_bytes
    runs = slot_runs(got.offsets[start:], bb)  # adjacent slots: one view each
    segments = [arena.view(run.offset, run.count * bb) for run in runs]
    return _ReadPlan(pb.GetHeader(), segments, got.lease_id, len(keys) - start)


def _release_quietly(calls: Calls, lease_id: int) -> bool:
    """Release a lease the service took itself; False if it had already ended."""
    try:
        calls.store.release(lease_id)
    except LeaseError:
        return False
    except StoreError:  # the store closed: its leases are gone with it
        return False
    return True


def _message(calls: Calls, msg: Any) -> Any:
    """A non-data message of Get, serialized here when Get is registered framed."""
    return msg.SerializeToString() if calls.framed else msg


@grpc_errors
async def Acquire(calls: Calls, request: pb.AcquireRequest, context: Ctx) -> pb.AcquireResponse:
    caller = calls.access.caller(context)
    if request.unpinned and not request.compact_slots:
        raise InvalidArgument(
            "unpinned needs compact_slots: slot_epochs are given per slot_offsets entry"
        )
    ttl = convert.seconds(request.ttl_s, "ttl_s")  # checked first: a refusal changes nothing
    _release_done(calls, request.release_lease_ids, caller)
    owner = calls.owners.owner_of(context)

    def acquire(quick: bool = False, room_wait_s: float = 0.0) -> pb.AcquireResponse:
        spec, keys, _ = calls.read_chain(
            request.ns_id, request.tokens, request.extra_keys, caller, quick
        )
        start = request.start_block
        if start > len(keys):
            raise InvalidArgument(
                f"start_block={start} is beyond the {len(keys)} full blocks the tokens make"
            )
        chain = keys
        if request.max_blocks:
            keys = keys[: start + request.max_blocks]
        if request.unpinned and not start:
            located = calls.store.locate(spec.ns_id, keys)
            if located is not None:
                return convert.located_response(
                    located, spec.block_tokens, calls.arena_name(spec)
                )
            # a block is on disk only: acquire promotes it (from the page cache, when quick)
        # wait_room: an empty answer would read as the prefix's end (Namespace.windows)
        got = calls.store.acquire(
            spec.ns_id, keys, ttl, host_only=quick, count=not request.counted, start=start,
            wait_room=room_wait_s,
        )  # fmt: skip
        if got is None:  # a block is on disk only: promoting it waits on the disk
            raise NeedsPool
        calls.owners.own(owner, (got.lease_id,))
        response = convert.acquire_response(
            got, spec.block_tokens, calls.arena_name(spec), request.compact_slots
        )
        response.ready_blocks = got.ready_blocks  # (the host tier did not hold it all)
        ended = start + len(got.offsets)
        if request.read_ahead and got.offsets and ended < len(chain):
            window = request.max_blocks or len(got.offsets)
            calls.store.read_ahead(spec.ns_id, chain[: ended + window], ended)
        return response

    try:
        return await calls.run_quick(acquire)
    except NoRoom as refused:
        # not one host slot for the window now: wait for room on the waiting pool,
        # within the caller's share of it, never on a store worker that other calls need
        wait_s = calls.config.put_wait_ms / 1000
        parked, answer = await calls.run_parked(calls.wait_shares, caller, acquire, False, wait_s)
        if not parked:
            raise NoRoom(
                f"{refused}; this caller waits for room in its share of calls already"
            ) from None
        assert answer is not None
        return answer


@grpc_errors
async def Release(calls: Calls, request: pb.ReleaseRequest, context: Ctx) -> pb.ReleaseResponse:
    caller = calls.access.caller(context)
    lease = calls.access.lease(convert.lease_id(request.lease_id), caller)
    _release_done(calls, request.more_lease_ids, caller)
    calls.store.release(lease)  # no disk I/O: on the loop
    return pb.ReleaseResponse()


@grpc_errors
async def ReportReads(
    calls: Calls, request: pb.ReportReadsRequest, context: Ctx
) -> pb.ReportReadsResponse:
    caller = calls.access.caller(context)
    prefixes = request.prefixes
    if len(prefixes) > MAX_REPORTED_PREFIXES:
        raise InvalidArgument(
            f"{len(prefixes)} prefixes in one ReportReads, more than {MAX_REPORTED_PREFIXES}"
        )
    limit = calls.store.config.max_blocks_per_request

    def report(quick: bool = False) -> pb.ReportReadsResponse:
        # every prefix is checked before any is counted: a bad one changes nothing
        checked: list[tuple[str, list[BlockKey], int]] = []
        for i, prefix in enumerate(prefixes):
            spec, keys = calls.chain(
                prefix.ns_id, prefix.tokens, prefix.extra_keys, caller, quick
            )
            if prefix.n_blocks > min(len(keys), limit):
                raise InvalidArgument(
                    f"prefixes[{i}]: n_blocks={prefix.n_blocks}, but its tokens make "
                    f"{len(keys)} full blocks (max_blocks_per_request={limit})"
                )
            if prefix.reads > MAX_READS_PER_PREFIX:
                raise InvalidArgument(
                    f"prefixes[{i}]: reads={prefix.reads}, more than one report may "
                    f"claim ({MAX_READS_PER_PREFIX}); report more often"
                )
            checked.append((spec.ns_id, keys[: prefix.n_blocks], prefix.reads))
        _release_done(calls, request.release_lease_ids, caller)
        counted = 0
        for ns_id, keys, reads in checked:
            counted += calls.store.note_reads(ns_id, keys, reads) * reads
        return pb.ReportReadsResponse(blocks_counted=counted)

    return await calls.run_quick(report)


def _release_done(calls: Calls, lease_ids: Sequence[int], caller: Caller) -> None:
    """Release leases a client is done with, skipping those that already ended (and
    any another tenant holds)."""
    for lease in lease_ids:
        with contextlib.suppress(LeaseError):
            calls.store.release(calls.access.lease(lease, caller))

@dataclass(frozen=True, slots=True)
class _Copy:
    """A window of a Get to copy (Store.read): ``keys[start:]``, of a ``ready`` prefix."""

    spec: NamespaceSpec
    keys: list[BlockKey]
    start: int
    ready: int

    @property
    def n_bytes(self) -> int:
        return (len(self.keys) - self.start) * self.spec.block_bytes


@dataclass(slots=True)
class _ReadPlan:
    """What one Get sends: its header and the bytes, as segments (arena views under
    ``lease_id``, or one buffer read by Store.read); or, before that, the window to
    copy (``copy``)."""

    header: pb.GetHeader
    segments: list[memoryview]
    lease_id: int = 0
    n_blocks: int = 0
    copy: _Copy | None = None

    def chunks(self, limit: int) -> Iterator[tuple[list[memoryview], int]]:
        """The segments cut into messages of at most ``limit`` bytes -> (pieces, bytes)."""
        pieces: list[memoryview] = []
        size = 0
        for segment in self.segments:
            offset = 0
            while offset < len(segment):
                take = min(limit - size, len(segment) - offset)
                pieces.append(segment[offset : offset + take])
                size += take
                offset += take
                if size == limit:
                    yield pieces, size
                    pieces, size = [], 0
        if pieces:
            yield pieces, size
