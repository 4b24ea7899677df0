"""The kvstore.v1.KVStore servicer: thin asyncio handlers over one :class:`Store`.

Why grpc.aio and not a sync server with a thread pool: Put, Get and WatchEvents are
streams whose duration depends on the peer's network and patience (a WatchEvents
lasts as long as a ``kvctl events`` runs); under grpc.aio they cost a coroutine while
they wait, not a pool thread, so slow or idle peers cannot starve the other calls.
Store calls lock, hash and copy block bytes, so each one runs on a bounded thread pool
(``workers``) via ``run_in_executor``; calls that may wait a long time (Lookup with
``wait_pending_s``, event polling) use a second pool so they cannot fill the first.

Each handler does three things: convert and validate the request (``convert``), run
one synchronous function against the store on a pool, convert the result. Short calls
skip the pool (a hand-off to a pool thread and back costs about a millisecond on a
busy two-core machine, more than the call itself): Release, Abandon, Commit (unless
write-through admission makes it write to disk), and Lookup, Acquire, Get, Reserve
and Put when the chain is at most ``QUICK_BLOCKS`` blocks and already in the host
tier (and, for writes, the arena has room without evicting). Those run on the event
loop; a quick attempt that finds it would have to touch the disk raises
``_NeedsPool`` before it changed anything and runs again on the pool. Errors are
mapped to status codes in one place (``errors.grpc_errors``); a request that fails
validation changed nothing in the store.

Data paths (see proto/kvproto/v1/kvstore.proto):
- Put: header {ns_id, tokens, start_block, n_blocks, priority}, then chunks that
  concatenate to exactly n_blocks * block_bytes. After the header the blocks are
  reserved (pending, under a write lease) and each chunk is copied straight into its
  arena slots as it arrives; the blocks are committed once all bytes are in, and
  abandoned on a short or long stream or any error, so such a stream stores nothing.
  A put of which nothing could be admitted for lack of room answers RESOURCE_EXHAUSTED.
- Get: header {ready_blocks, start_block, n_blocks, block_bytes, truncated}, then
  chunks of blocks [start_block, start_block + n_blocks). The blocks are pinned under
  a read lease and every chunk is cut straight out of the arena slots (one copy); a
  prefix that cannot be pinned in host (no room to promote a disk block) is read into
  a buffer instead. One call moves at most ``max_transfer_bytes``; ``truncated`` says
  to call again.

Both data streams build and read the data messages' framing themselves when the
service is registered with :func:`add_to_server` (identity (de)serializers for Get and
Put: one copy per chunk instead of three on the daemon's side). The bytes on the wire
are ordinary ``GetResponse`` / ``PutRequest`` messages either way.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from kvproto.v1 import data_frames, result_messages
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import kvstore_pb2_grpc as pb_grpc
from kvproto.v1.limits import MAX_READS_PER_PREFIX, MAX_REPORTED_PREFIXES
from kvproto.v1.results import Event, PutResult
from kvstore.errors import InvalidArgument, LeaseError, OutOfSpace, StoreError, UnknownNamespace
from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.results import Reservation, SlotRef
from kvstore.store import Store
from kvstored import convert, hostinfo
from kvstored.auth import Access, Caller
from kvstored.config import GET_CHUNK_BYTES, MAX_CHUNK_BYTES, DaemonConfig
from kvstored.errors import grpc_errors, tolerant
from kvstored.names import NamespaceNames

log = logging.getLogger("kvstored.service")

T = TypeVar("T")

EVENT_POLL_S = 0.25  # how long one event poll waits in the store before re-checking shutdown
EVENT_BATCH = 1024
MAX_WAIT_PENDING_S = 300.0
SESSION_METADATA = "kvstore-session"  # the call metadata naming a client's Session
SESSION_OWNER = "session:"  # owner names of gRPC sessions (local calls: "local:<pid>")
SESSION_ID_MIN, SESSION_ID_MAX = 16, 64
CHAIN_CACHE_KEYS = 1 << 16  # block keys kept by the chain cache (about 6 MiB)
QUICK_BLOCKS = 1024  # larger requests (hashing ~1 ms per 400 blocks) always use the pool


class _NeedsPool(Exception):
    """A call tried on the event loop would wait on the disk or hash a long prompt: it
    stopped before changing anything and runs again on the pool."""


class KVStoreService(pb_grpc.KVStoreServicer):
    """Servicer for ``kvstore.v1.KVStore``; owns its thread pools, not the store."""

    def __init__(
        self,
        store: Store,
        config: DaemonConfig,
        names: NamespaceNames,
        version: str,
        access: Access,
    ) -> None:
        self._store = store
        self._config = config
        self._names = names
        self.access = access
        self._version = version
        self._started = time.monotonic()
        self._host_id = hostinfo.host_id()
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="kv-store")
        self._wait_pool = ThreadPoolExecutor(64, thread_name_prefix="kv-wait")
        self._stopping = asyncio.Event()
        self._chains = ChainCache(CHAIN_CACHE_KEYS)
        # True once add_to_server registered Get and Put with identity (de)serializers:
        # Get then yields framed bytes and Put receives them (see kvproto.v1.data_frames).
        self.framed = False
        # the local-call socket once kvstored.local_calls serves it (ServerInfo names it)
        self.local_socket = ""
        self._live: dict[str, int] = {}  # open connections and sessions per owner

    def begin_shutdown(self) -> None:
        """End the open WatchEvents streams so a graceful stop does not wait for them."""
        self._stopping.set()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._wait_pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[..., T], *args: Any, wait: bool = False) -> T:
        loop = asyncio.get_running_loop()
        pool = self._wait_pool if wait else self._pool
        return await loop.run_in_executor(pool, functools.partial(fn, *args))

    async def _run_quick(self, fn: Callable[[bool], T]) -> T:
        """``fn(quick=True)`` on the event loop; on the pool when it raises _NeedsPool."""
        try:
            return fn(True)
        except _NeedsPool:
            return await self._run(fn, False)

    def _check_host(self, ns_id: str, keys: Sequence[BlockKey]) -> None:
        """Quick calls only: every ready block of ``keys`` is in the host tier."""
        if self._store.lookup(ns_id, keys).disk_blocks:
            raise _NeedsPool

    def _check_room(self, ns_id: str, keys: Sequence[BlockKey], n_blocks: int) -> None:
        """Quick calls only: a reservation of ``n_blocks`` after ``keys``' ready prefix
        fits the arena's free bytes (so it evicts nothing) and needs no promotion."""
        self._check_host(ns_id, keys)
        arena = self._store.arena
        block = -(-self._store.namespace(ns_id).block_bytes // 4096) * 4096
        if arena.capacity_bytes - arena.used_bytes < (n_blocks + 1) * block:
            raise _NeedsPool

    def _write_through(self) -> bool:
        return self._store.config.admission == "write-through"

    # --- shared helpers (run on a pool thread) --------------------------------------

    def _chain(
        self, ns_id: str, tokens: Any, extra: Any, caller: Caller, quick: bool = False
    ) -> tuple[NamespaceSpec, list[BlockKey]]:
        """The namespace (one the caller owns) and the key chain of a request's tokens;
        a Lookup and the Acquire or Get that follows it for the same prompt hash it once
        (ChainCache)."""
        spec = self.access.spec(ns_id, caller)
        arr = convert.tokens(tokens)
        extras = convert.extra_keys(extra)
        memo = (spec.ns_id, arr.tobytes(), tuple(extras))
        keys = self._chains.get(memo)
        if keys is None:
            if quick and arr.size > QUICK_BLOCKS * spec.block_tokens:
                raise _NeedsPool
            keys = self._store.keys_for(spec.ns_id, arr, extras)
            self._chains.put(memo, keys)
        return spec, keys

    # --- namespaces -------------------------------------------------------------------

    @grpc_errors
    async def OpenNamespace(
        self, request: pb.OpenNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> pb.NamespaceInfo:
        caller = self.access.caller(context)
        spec = self.access.scoped(caller, convert.spec_from_proto(request.spec))
        if spec.block_bytes > self._config.max_transfer_bytes:
            raise InvalidArgument(
                f"block_bytes={spec.block_bytes} exceeds max_transfer_bytes="
                f"{self._config.max_transfer_bytes}: such a block could not be moved inline"
            )
        if request.name:
            opened = await self._run(
                self._names.bind, request.name, spec, self._store.open_namespace, caller.tenant
            )
        else:
            opened = await self._run(self._store.open_namespace, spec)
        return convert.namespace_info(opened, request.name or self._name_of(opened.ns_id))

    @grpc_errors
    async def DescribeNamespace(
        self, request: pb.DescribeNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> pb.NamespaceInfo:
        caller = self.access.caller(context)
        if not request.ns_id:
            raise InvalidArgument("ns_id is required")

        def describe() -> pb.NamespaceInfo:
            spec = self.access.spec(request.ns_id, caller)
            stats = {n.ns_id: n for n in self._store.stats().namespaces}.get(spec.ns_id)
            return convert.namespace_info(spec, self._name_of(spec.ns_id), stats)

        return await self._run(describe)

    @grpc_errors
    async def ListNamespaces(
        self, request: pb.ListNamespacesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListNamespacesResponse:
        caller = self.access.caller(context)

        def list_all() -> pb.ListNamespacesResponse:
            names = self._names.names_by_ns_id()
            infos = []
            for ns in self._store.stats().namespaces:
                try:
                    spec = self._store.namespace(ns.ns_id)
                except UnknownNamespace:  # removed between the two calls
                    continue
                if not caller.owns(spec):
                    continue
                infos.append(convert.namespace_info(spec, names.get(ns.ns_id, ""), ns))
            return pb.ListNamespacesResponse(namespaces=infos)

        return await self._run(list_all)

    def _name_of(self, ns_id: str) -> str:
        return self._names.names_by_ns_id().get(ns_id, "")

    @grpc_errors
    async def ServerInfo(
        self, request: pb.ServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfoResponse:
        caller = self.access.caller(context)
        cfg = self._config
        arena = self._store.arena
        return pb.ServerInfoResponse(
            version=self._version,
            platform=self._store.platform,
            arena_path=self._store.arena_path or "",
            arena_bytes=self._store.arena_bytes,
            host_id=self._host_id,
            max_message_bytes=cfg.max_message_bytes,
            max_blocks_per_request=cfg.max_blocks_per_request,
            default_lease_ttl_s=cfg.lease_ttl_s,
            max_lease_ttl_s=cfg.max_lease_ttl_s,
            max_chunk_bytes=MAX_CHUNK_BYTES,
            max_transfer_bytes=cfg.max_transfer_bytes,
            pid=os.getpid(),
            uptime_s=time.monotonic() - self._started,
            local_socket=self.local_socket,
            slot_epochs_offset=arena.epochs_offset if arena.path else 0,
            slot_epochs_count=arena.epochs.count if arena.path else 0,
            arena_prefaulted=self._store.config.prefault_arena,
            disk_path=self._store.disk_path or "",
            admission=self._store.config.admission,
            uid=os.getuid(),
            tenant=caller.tenant,
        )

    @grpc_errors
    async def Session(
        self, request: pb.SessionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionResponse]:
        """Hold a client's session open; end its leases when the stream ends (see the
        proto). One message says the session is registered; then nothing until the
        client goes or the daemon stops."""
        self.access.caller(context)
        if not SESSION_ID_MIN <= len(request.session_id) <= SESSION_ID_MAX:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"session_id must be {SESSION_ID_MIN} to {SESSION_ID_MAX} characters, "
                f"got {len(request.session_id)}",
            )
        owner = SESSION_OWNER + request.session_id
        self.owner_opened(owner)
        try:
            yield pb.SessionResponse()
            await self._stopping.wait()
        finally:
            self.owner_closed(owner)

    # Owners: a client's process (local calls) or its Session (gRPC) is "live" while it
    # has a connection or stream open; its leases end when the last one closes. A call
    # still running then makes its leases after that: _own ends them at once.

    def owner_opened(self, owner: str) -> None:
        self._live[owner] = self._live.get(owner, 0) + 1

    def owner_closed(self, owner: str) -> None:
        left = self._live.get(owner, 1) - 1
        if left:
            self._live[owner] = left
            return
        self._live.pop(owner, None)
        self.release_owner(owner)

    def owner_of(self, context: Any) -> str:
        """Whose leases a call makes: the local-call connection's process, or the open
        Session named in the call's metadata; "" for none (the leases' TTL applies)."""
        owner = getattr(context, "owner", None)
        if owner is not None:
            return str(owner)
        for key, value in context.invocation_metadata() or ():
            if key == SESSION_METADATA:
                named = SESSION_OWNER + str(value)
                return named if named in self._live else ""
        return ""

    def _own(self, owner: str, lease_ids: Sequence[int]) -> None:
        """Tie leases a call made to its owner (any thread); if the owner went away
        while the call ran, end them now."""
        ids = [lease_id for lease_id in lease_ids if lease_id]
        if not owner or not ids:
            return
        self._store.own(owner, ids)
        if owner not in self._live:
            self.release_owner(owner)

    def release_owner(self, owner: str) -> None:
        """End the leases of a client that went away (its connection or session)."""
        try:
            ended = self._store.release_owner(owner)
        except StoreError:  # closed: its leases ended with it
            return
        if ended:
            log.info(
                "released %d leases of a client that went away (%s)",
                ended,
                owner,
                extra={"event": "client_gone"},
            )

    # --- read side --------------------------------------------------------------------

    @grpc_errors
    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupResponse:
        caller = self.access.caller(context)
        wait = convert.seconds(request.wait_pending_s, "wait_pending_s")
        if wait is not None and wait > MAX_WAIT_PENDING_S:
            raise InvalidArgument(
                f"wait_pending_s must be <= {MAX_WAIT_PENDING_S}, got {request.wait_pending_s}"
            )

        def lookup(quick: bool = False) -> pb.LookupResponse:
            spec, keys = self._chain(
                request.ns_id, request.tokens, request.extra_keys, caller, quick
            )
            if wait:
                result = self._store.wait_ready(spec.ns_id, keys, wait)
            else:
                result = self._store.lookup(spec.ns_id, keys)
            return convert.lookup_response(result, spec.block_tokens, len(keys))

        if wait is not None:
            return await self._run(lookup, wait=True)
        return await self._run_quick(lookup)

    @grpc_errors
    async def Get(
        self, request: pb.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GetResponse | bytes]:
        caller = self.access.caller(context)
        plan = await self._run_quick(functools.partial(self._open_read, request, caller))
        finished = False
        try:
            yield self._message(pb.GetResponse(header=plan.header))
            for pieces, size in plan.chunks(GET_CHUNK_BYTES):
                if self.framed:
                    yield data_frames.framed(pieces, size)  # one copy, out of the arena
                else:
                    yield pb.GetResponse(data=b"".join(pieces))
            finished = True
        finally:
            if plan.lease_id:
                released = self._release_quietly(plan.lease_id)
                if finished and not released:
                    # the slots may have been reused while we read them: the client must
                    # not keep what it got, so the call ends with an error status
                    raise LeaseError(
                        f"the read lease of this Get ran out after {self._config.max_lease_ttl_s}"
                        " s while the bytes were being sent; call again"
                    )

    def _open_read(self, request: pb.GetRequest, caller: Caller, quick: bool = False) -> _ReadPlan:
        """Find what a Get sends and pin it: the header and the bytes."""
        spec, keys = self._chain(request.ns_id, request.tokens, request.extra_keys, caller, quick)
        start, bb = request.start_block, spec.block_bytes
        if start > len(keys):
            raise InvalidArgument(
                f"start_block={start} is beyond the {len(keys)} full blocks the tokens make"
            )
        found = self._store.lookup(spec.ns_id, keys)
        if quick and (found.disk_blocks or start):
            raise _NeedsPool
        ready = found.ready_blocks
        asked = min(len(keys), start + request.max_blocks) if request.max_blocks else len(keys)
        self._store.note_misses(spec.ns_id, asked - max(ready, start))
        # one call moves at most max_transfer_bytes, but always at least one block
        end = ready
        if request.max_blocks:
            end = min(end, start + request.max_blocks)
        end = min(end, start + max(1, self._config.max_transfer_bytes // bb))
        if end <= start:
            header = pb.GetHeader(
                ready_blocks=ready,
                ready_tokens=ready * spec.block_tokens,
                start_block=start,
                block_bytes=bb,
            )
            return _ReadPlan(header, [])
        plan = self._pin_for_read(spec, keys[:end], start) if start == 0 else None
        if plan is None:
            n, view = self._store.read(spec.ns_id, keys[:end], start=start)
            plan = _ReadPlan(pb.GetHeader(), [view] if n else [], n_blocks=n)
        n = plan.n_blocks
        if start + n < end:  # evicted between lookup and read: the prefix is shorter
            ready = start + n
        plan.header = pb.GetHeader(
            ready_blocks=ready,
            ready_tokens=ready * spec.block_tokens,
            start_block=start,
            n_blocks=n,
            block_bytes=bb,
            truncated=ready > end,
        )
        return plan

    def _pin_for_read(
        self, spec: NamespaceSpec, keys: list[BlockKey], start: int
    ) -> _ReadPlan | None:
        """Pin ``keys`` in host slots under a read lease; None (nothing pinned) when part
        of the prefix cannot be (a disk block with no room to promote it: read() copies
        it from disk instead)."""
        got = self._store.acquire(spec.ns_id, keys, self._config.max_lease_ttl_s)
        if len(got.offsets) < len(keys):
            if got.lease_id:
                self._store.release(got.lease_id)
            return None
        arena = self._store.arena
        runs = _slot_runs(got.offsets[start:], got.block_bytes)
        segments = [arena.view(offset, size) for offset, size in runs]
        return _ReadPlan(pb.GetHeader(), segments, got.lease_id, len(keys) - start)

    def _release_quietly(self, lease_id: int) -> bool:
        """Release a lease the service took itself; False if it had already ended."""
        try:
            self._store.release(lease_id)
        except LeaseError:
            return False
        except StoreError:  # the store closed: its leases are gone with it
            return False
        return True

    def _message(self, msg: Any) -> Any:
        """A non-data message of Get, serialized here when Get is registered framed."""
        return msg.SerializeToString() if self.framed else msg

    @grpc_errors
    async def Acquire(
        self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> pb.AcquireResponse:
        caller = self.access.caller(context)
        if request.unpinned and not request.compact_slots:
            raise InvalidArgument(
                "unpinned needs compact_slots: slot_epochs are given per slot_offsets entry"
            )
        if request.disk_direct and not request.compact_slots:
            raise InvalidArgument(
                "disk_direct needs compact_slots: disk_blocks index the slot_offsets entries"
            )
        ttl = convert.seconds(request.ttl_s, "ttl_s")  # checked first: a refusal changes nothing
        self._release_done(request.release_lease_ids)
        owner = self.owner_of(context)

        def acquire(quick: bool = False) -> pb.AcquireResponse:
            spec, keys = self._chain(
                request.ns_id, request.tokens, request.extra_keys, caller, quick
            )
            if request.max_blocks:
                keys = keys[: request.max_blocks]
            if request.unpinned:
                located = self._store.locate(spec.ns_id, keys)
                if located is not None:
                    return convert.located_response(
                        located, spec.block_tokens, self._store.arena_path or ""
                    )
                if quick and not request.disk_direct:  # a block is on disk only
                    raise _NeedsPool
            got = self._store.acquire(
                spec.ns_id,
                keys,
                ttl,
                host_only=quick,
                disk_direct=request.disk_direct,
                count=not request.counted,
            )
            if got is None:  # a block is on disk only: promoting it waits on the disk
                raise _NeedsPool
            self._own(owner, (got.lease_id,))
            return convert.acquire_response(
                got, spec.block_tokens, self._store.arena_path or "", request.compact_slots
            )

        return await self._run_quick(acquire)

    @grpc_errors
    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        self.access.caller(context)
        lease = convert.lease_id(request.lease_id)
        self._release_done(request.more_lease_ids)
        self._store.release(lease)  # no disk I/O: on the loop
        return pb.ReleaseResponse()

    @grpc_errors
    async def ReportReads(
        self, request: pb.ReportReadsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportReadsResponse:
        caller = self.access.caller(context)
        prefixes = request.prefixes
        if len(prefixes) > MAX_REPORTED_PREFIXES:
            raise InvalidArgument(
                f"{len(prefixes)} prefixes in one ReportReads, more than {MAX_REPORTED_PREFIXES}"
            )
        limit = self._store.config.max_blocks_per_request

        def report(quick: bool = False) -> pb.ReportReadsResponse:
            # every prefix is checked before any is counted: a bad one changes nothing
            checked: list[tuple[str, list[BlockKey], int]] = []
            for i, prefix in enumerate(prefixes):
                spec, keys = self._chain(
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
                checked.append(
                    (spec.ns_id, keys[: prefix.n_blocks], prefix.reads, prefix.from_disk)
                )
            self._release_done(request.release_lease_ids)
            counted = 0
            for ns_id, keys, reads, from_disk in checked:
                counted += self._store.note_reads(ns_id, keys, reads, from_disk) * reads
            return pb.ReportReadsResponse(blocks_counted=counted)

        return await self._run_quick(report)

    def _release_done(self, lease_ids: Sequence[int]) -> None:
        """Release leases a client is done with, skipping those that already ended."""
        for lease in lease_ids:
            with contextlib.suppress(LeaseError):
                self._store.release(lease)

    # --- write side -------------------------------------------------------------------

    @grpc_errors
    async def Put(
        self,
        request_iterator: AsyncIterable[pb.PutRequest | bytes],
        context: grpc.aio.ServicerContext,
    ) -> pb.PutResponse:
        caller = self.access.caller(context)
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        head = self._put_header(first)
        if head.lease_id:
            return await self._put_into_claim(head, messages, caller)
        prio = convert.optional_priority(head)

        def check_header(quick: bool = False) -> tuple[NamespaceSpec, list[BlockKey]]:
            spec, keys = self._chain(head.ns_id, head.tokens, head.extra_keys, caller, quick)
            end = convert.block_range(head.start_block, head.n_blocks, len(keys))
            if head.n_blocks == 0:
                raise InvalidArgument("n_blocks must be > 0")
            return spec, keys[:end]

        spec, keys = await self._run_quick(check_header)
        bb = spec.block_bytes
        expected = head.n_blocks * bb
        if expected > self._config.max_transfer_bytes:
            raise OutOfSpace(
                f"put of {head.n_blocks} blocks x {bb} bytes = {expected} bytes exceeds "
                f"max_transfer_bytes={self._config.max_transfer_bytes}; split it"
            )

        def reserve(quick: bool = False) -> Reservation:
            if quick:
                self._check_room(spec.ns_id, keys, head.n_blocks)
            return self._store.reserve(
                spec.ns_id, keys, head.start_block, self._config.max_lease_ttl_s, prio
            )

        reservation = await self._run_quick(reserve)
        lease = reservation.lease_id
        sink = _SlotSink(self._store.arena.array(), reservation.slots, head.start_block, bb)
        committed = durable = 0
        try:
            await self._receive(messages, sink, head.n_blocks, bb)
            if lease:
                committed, durable = await self._commit(lease, None)
        except BaseException:
            if lease and not committed:
                with contextlib.suppress(StoreError):
                    self._store.abandon(lease)  # short, and safe while being cancelled
            raise
        # Refused outright: a missing parent or another owner computing the first
        # block is an ordinary answer; only lack of room is an error.
        if reservation.out_of_space and committed == 0 and reservation.existing == 0:
            raise OutOfSpace(
                f"no room for any of the {head.n_blocks} blocks: the store is full "
                "of leased or pending blocks"
            )
        return result_messages.put_response(
            PutResult.of_reservation(
                reservation.existing,
                reservation.refused,
                len(reservation.offsets),
                committed,
                durable,
            )
        )

    async def _put_into_claim(
        self,
        head: pb.PutHeader,
        messages: AsyncIterator[pb.PutRequest | bytes],
        caller: Caller,
    ) -> pb.PutResponse:
        """Deliver the next ``n_blocks`` blocks of a claim (a write lease) and commit them.

        A malformed delivery (wrong byte count, oversized chunk) is refused and changes
        nothing; a broken transfer (cancelled, failed) abandons the claim: its waiters
        compute for themselves rather than wait for bytes that are not coming.
        """
        lease = convert.lease_id(head.lease_id)
        spec = self.access.spec(head.ns_id, caller)
        if head.n_blocks == 0:
            raise InvalidArgument("n_blocks must be > 0")
        slots = self._store.claimed_slots(lease, head.n_blocks)
        if any(slot.size != spec.block_bytes for slot in slots):
            raise InvalidArgument(f"lease {lease} is not a lease of namespace {head.ns_id}")
        bb = spec.block_bytes
        sink = _SlotSink(self._store.arena.array(), slots, slots[0].index, bb)
        try:
            await self._receive(messages, sink, head.n_blocks, bb)
            committed, durable = await self._commit(lease, head.n_blocks)
        except InvalidArgument:
            raise  # a malformed delivery changes nothing: the claim stays, pending
        except BaseException:
            with contextlib.suppress(StoreError):
                self._store.abandon(lease)
            raise
        return pb.PutResponse(stored=committed, durable=durable)

    async def _receive(
        self,
        messages: AsyncIterator[pb.PutRequest | bytes],
        sink: _SlotSink,
        n_blocks: int,
        block_bytes: int,
    ) -> None:
        """Copy a Put's data chunks into ``sink``; exactly n_blocks x block_bytes bytes."""
        expected = n_blocks * block_bytes
        received = 0
        async for msg in messages:
            chunk = self._put_data(msg)
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
            sink.write(received, chunk)
            received += size
        if received != expected:
            raise InvalidArgument(
                f"Put data is {received} bytes, expected n_blocks x block_bytes = "
                f"{n_blocks} x {block_bytes} = {expected}"
            )

    def _put_header(self, first: pb.PutRequest | bytes | None) -> pb.PutHeader:
        msg = self._put_message(first) if isinstance(first, bytes) else first
        if msg is None or msg.WhichOneof("kind") != "header":
            raise InvalidArgument("the first Put message must be a header")
        return msg.header

    def _put_data(self, msg: pb.PutRequest | bytes) -> bytes | memoryview:
        """The bytes of a Put data message (a view into a framed message: no copy)."""
        if isinstance(msg, bytes):
            span = data_frames.data_span(msg)
            if span is not None:
                offset, size = span
                return memoryview(msg)[offset : offset + size]
            msg = self._put_message(msg)
        if msg.WhichOneof("kind") != "data":
            raise InvalidArgument("Put sends one header, then only data chunks")
        return msg.data

    @staticmethod
    def _put_message(raw: bytes) -> pb.PutRequest:
        try:
            return pb.PutRequest.FromString(raw)
        except DecodeError:
            raise InvalidArgument("a Put message is not a valid PutRequest") from None

    @grpc_errors
    async def Reserve(
        self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReserveResponse:
        caller = self.access.caller(context)
        ttl = convert.seconds(request.ttl_s, "ttl_s")
        prio = convert.optional_priority(request)

        staged = list(request.staged_offsets)
        if request.commit and not staged:
            raise InvalidArgument(
                "commit=true needs staged_offsets: only blocks already written into their "
                "staged slots can be committed on arrival"
            )

        owner = self.owner_of(context)

        def reserve(quick: bool = False) -> pb.ReserveResponse:
            spec, keys = self._chain(
                request.ns_id, request.tokens, request.extra_keys, caller, quick
            )
            end = convert.block_range(request.start_block, request.n_blocks, len(keys))
            if quick:  # staged slots are allocated already: only stage_more needs room
                if request.commit and self._write_through():
                    raise _NeedsPool  # the commit queues disk writes, which may wait
                fresh = 0 if staged else end - request.start_block
                self._check_room(spec.ns_id, keys[:end], fresh + request.stage_more)
            res = self._store.reserve(
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
                raise OutOfSpace(
                    f"no room to reserve any of the {end - request.start_block} blocks: the "
                    "store is full of leased or pending blocks"
                )
            durable = 0
            if request.commit and res.lease_id:
                durable = self._store.commit_durably(res.lease_id)[1]
            else:
                self._own(owner, (res.lease_id,))
            self._own(owner, (res.stage_lease_id,))
            response = convert.reserve_response(
                res, self._store.arena_path or "", request.compact_slots
            )
            response.durable = durable
            return response

        return await self._run_quick(reserve)

    @grpc_errors
    async def Commit(
        self, request: pb.CommitRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitResponse:
        self.access.caller(context)
        lease = convert.lease_id(request.lease_id)
        count = request.count if request.HasField("count") else None
        committed, durable = await self._commit(lease, count)
        return pb.CommitResponse(committed=committed, durable=durable)

    async def _commit(self, lease: int, count: int | None) -> tuple[int, int]:
        """(committed, durable): see Store.commit_durably."""
        if self._write_through():  # commit waits for the disk
            return await self._run(self._store.commit_durably, lease, count)
        return self._store.commit_durably(lease, count)

    @grpc_errors
    async def Abandon(
        self, request: pb.AbandonRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbandonResponse:
        self.access.caller(context)
        lease = convert.lease_id(request.lease_id)
        return pb.AbandonResponse(dropped=self._store.abandon(lease))  # no disk I/O

    # --- management -------------------------------------------------------------------

    @grpc_errors
    async def Delete(
        self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteResponse:
        caller = self.access.caller(context)

        def delete() -> int:
            spec, keys = self._chain(request.ns_id, request.tokens, request.extra_keys, caller)
            if request.start_block >= len(keys):
                raise InvalidArgument(
                    f"start_block={request.start_block} is not one of the {len(keys)} full "
                    "blocks the tokens make"
                )
            return self._store.delete(spec.ns_id, keys, start=request.start_block)

        return pb.DeleteResponse(removed=await self._run(delete))

    @grpc_errors
    async def Clear(
        self, request: pb.ClearRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClearResponse:
        caller = self.access.caller(context)

        def clear() -> int:
            if request.ns_id:
                return self._store.clear(self.access.spec(request.ns_id, caller).ns_id)
            if caller.admin:
                return self._store.clear(None)
            # a tenant's Clear with no namespace clears its own namespaces, no other
            owned = [spec.ns_id for spec in self._store.namespaces() if caller.owns(spec)]
            return sum(self._store.clear(ns_id) for ns_id in owned)

        return pb.ClearResponse(removed=await self._run(clear))

    @grpc_errors
    async def SetPriority(
        self, request: pb.SetPriorityRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetPriorityResponse:
        caller = self.access.caller(context)
        prio = convert.priority(request.priority)
        duration = convert.seconds(request.duration_s, "duration_s")

        def set_priority() -> int:
            spec, keys = self._chain(request.ns_id, request.tokens, request.extra_keys, caller)
            if request.start_block > len(keys):
                raise InvalidArgument(
                    f"start_block={request.start_block} is beyond the {len(keys)} full "
                    "blocks the tokens make"
                )
            return self._store.set_priority(
                spec.ns_id, keys, prio, duration_s=duration, start=request.start_block
            )

        return pb.SetPriorityResponse(changed=await self._run(set_priority))

    # --- observability ----------------------------------------------------------------

    @grpc_errors
    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        caller = self.access.caller(context)
        stats = await self._run(self._store.stats)
        if not caller.admin:  # a tenant sees its own namespaces, and no tenant's usage
            own = tuple(n for n in stats.namespaces if self.access.visible(caller, n.ns_id))
            stats = dataclasses.replace(stats, namespaces=own, tenants=())
        names = self._names.names_by_ns_id()
        named = tuple(dataclasses.replace(n, name=names.get(n.ns_id, "")) for n in stats.namespaces)
        return result_messages.stats_response(
            dataclasses.replace(
                stats,
                namespaces=named,
                platform=self._store.platform,
                uptime_s=time.monotonic() - self._started,
            )
        )

    @grpc_errors
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        caller = self.access.caller(context)
        ns_filter = self.access.spec(request.ns_id, caller).ns_id if request.ns_id else ""
        kinds = set(request.kinds)
        for kind in kinds:
            if kind not in result_messages.EVENT_KINDS.values():
                raise InvalidArgument(f"kinds: unknown event kind {kind}")
        seq = await self._run(self._latest_seq) if request.from_now else request.from_seq
        while not self._stopping.is_set():
            events: list[Event] = await self._run(
                self._store.events_since, seq, EVENT_POLL_S, EVENT_BATCH, wait=True
            )
            if not events:
                continue
            missed = max(0, events[0].seq - seq - 1)
            seq = events[-1].seq
            out = [
                result_messages.event_message(e)
                for e in events
                if (not ns_filter or e.ns_id == ns_filter)
                and (not kinds or result_messages.EVENT_KINDS[e.kind] in kinds)
                and self.access.visible(caller, e.ns_id)
            ]
            if out or missed:
                yield pb.WatchEventsResponse(events=out, missed=missed)

    def _latest_seq(self) -> int:
        return self._store.last_event_seq


# --- registration ---------------------------------------------------------------------


class _Registry:
    """Stands in for a grpc server to collect the generated method handlers."""

    def __init__(self) -> None:
        self.methods: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.methods.update(handlers)


SERVICE_NAME = "kvstore.v1.KVStore"


def add_to_server(service: KVStoreService, server: Any) -> None:
    """Register ``service`` like ``add_KVStoreServicer_to_server``, with Get and Put on
    framed bytes: Get's data messages are built by :func:`data_frames.framed` (one copy
    out of the arena) and Put's are read in place (one copy into the arena), where the
    generated (de)serializers would copy each chunk twice more. Same messages on the
    wire, so every client works unchanged."""
    registry = _Registry()
    pb_grpc.add_KVStoreServicer_to_server(service, registry)
    methods = {
        name: handler._replace(
            request_deserializer=tolerant(handler.request_deserializer, f"{name} request")
        )
        for name, handler in registry.methods.items()
    }
    methods["Get"] = grpc.unary_stream_rpc_method_handler(
        service.Get,
        request_deserializer=tolerant(pb.GetRequest.FromString, "Get request"),
        response_serializer=None,
    )
    methods["Put"] = grpc.stream_unary_rpc_method_handler(
        service.Put, request_deserializer=None, response_serializer=pb.PutResponse.SerializeToString
    )
    service.framed = True
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, methods),))
    server.add_registered_method_handlers(SERVICE_NAME, methods)


# --- data-path helpers -----------------------------------------------------------------


class ChainCache:
    """Key chains computed recently, by (ns_id, token bytes, extra keys); LRU, bounded by
    the number of keys held. Keys are a pure function of those, so a hit is exact."""

    def __init__(self, max_keys: int) -> None:
        self._max_keys = max_keys
        self._entries: OrderedDict[tuple[str, bytes, tuple[bytes, ...]], list[BlockKey]] = (
            OrderedDict()
        )
        self._held = 0
        self._lock = threading.Lock()

    def get(self, memo: tuple[str, bytes, tuple[bytes, ...]]) -> list[BlockKey] | None:
        with self._lock:
            keys = self._entries.get(memo)
            if keys is not None:
                self._entries.move_to_end(memo)
            return keys

    def put(self, memo: tuple[str, bytes, tuple[bytes, ...]], keys: list[BlockKey]) -> None:
        if not keys or len(keys) > self._max_keys:
            return
        with self._lock:
            if memo in self._entries:
                return
            self._entries[memo] = keys
            self._held += len(keys)
            while self._held > self._max_keys:
                _, old = self._entries.popitem(last=False)
                self._held -= len(old)


@dataclass(slots=True)
class _ReadPlan:
    """What one Get sends: its header and the bytes, as segments (arena views under
    ``lease_id``, or one buffer read by Store.read)."""

    header: pb.GetHeader
    segments: list[memoryview]
    lease_id: int = 0
    n_blocks: int = 0

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


def _slot_runs(offsets: Sequence[int], size: int) -> Iterator[tuple[int, int]]:
    """(offset, bytes) of runs of ``size``-byte slots that follow each other in the arena."""
    i = 0
    while i < len(offsets):
        start = offsets[i]
        j = i + 1
        while j < len(offsets) and offsets[j] == start + (j - i) * size:
            j += 1
        yield start, (j - i) * size
        i = j


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
