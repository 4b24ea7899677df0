"""The kvstore.v1.KVStore servicer: thin asyncio handlers over one :class:`Store`.

Why grpc.aio and not a sync server with a thread pool: Put, Get and WatchEvents are
streams whose duration depends on the peer's network and patience (a WatchEvents
lasts as long as a ``kvctl events`` runs); under grpc.aio they cost a coroutine while
they wait, not a pool thread, so slow or idle peers cannot starve the other calls.
Store calls lock, hash and copy block bytes, so each one runs on a bounded thread pool
(``workers``) via ``run_in_executor``; calls that may wait a long time (Lookup with
``wait_pending_s``, event polling) use a second pool so they cannot fill the first.

Each handler does three things: convert and validate the request (``convert``), run
one synchronous function against the store on a pool, convert the result. Errors are
mapped to status codes in one place (``errors.grpc_errors``); a request that fails
validation changed nothing in the store.

Data paths (see proto/kvproto/v1/kvstore.proto):
- Put: header {ns_id, tokens, start_block, n_blocks, priority}, then chunks that
  concatenate to exactly n_blocks * block_bytes; the blocks are stored in one
  ``Store.put`` once all bytes have arrived, so a short or long stream stores nothing.
  A put of which nothing could be admitted for lack of room answers RESOURCE_EXHAUSTED.
- Get: header {ready_blocks, start_block, n_blocks, block_bytes, truncated}, then
  chunks of blocks [start_block, start_block + n_blocks). One call moves at most
  ``max_transfer_bytes`` (bounds daemon memory); ``truncated`` says to call again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import InvalidArgument, OutOfSpace, UnknownNamespace
from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.results import Event
from kvstore.store import Store
from kvstored import convert, hostinfo
from kvstored.config import GET_CHUNK_BYTES, MAX_CHUNK_BYTES, DaemonConfig
from kvstored.errors import grpc_errors
from kvstored.names import NamespaceNames

log = logging.getLogger("kvstored.service")

T = TypeVar("T")

EVENT_POLL_S = 0.25  # how long one event poll waits in the store before re-checking shutdown
EVENT_BATCH = 1024
MAX_WAIT_PENDING_S = 300.0


class KVStoreService(pb_grpc.KVStoreServicer):
    """Servicer for ``kvstore.v1.KVStore``; owns its thread pools, not the store."""

    def __init__(
        self, store: Store, config: DaemonConfig, names: NamespaceNames, version: str
    ) -> None:
        self._store = store
        self._config = config
        self._names = names
        self._version = version
        self._started = time.monotonic()
        self._host_id = hostinfo.host_id()
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="kv-store")
        self._wait_pool = ThreadPoolExecutor(64, thread_name_prefix="kv-wait")
        self._stopping = asyncio.Event()

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

    # --- shared helpers (run on a pool thread) --------------------------------------

    def _spec(self, ns_id: str) -> NamespaceSpec:
        if not ns_id:
            raise InvalidArgument("ns_id is required")
        return self._store.namespace(self._names.resolve(ns_id))

    def _chain(self, ns_id: str, tokens: Any, extra: Any) -> tuple[NamespaceSpec, list[BlockKey]]:
        spec = self._spec(ns_id)
        keys = self._store.keys_for(spec.ns_id, convert.tokens(tokens), convert.extra_keys(extra))
        return spec, keys

    # --- namespaces -------------------------------------------------------------------

    @grpc_errors
    async def OpenNamespace(
        self, request: pb.OpenNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> pb.NamespaceInfo:
        spec = convert.spec_from_proto(request.spec)
        if spec.block_bytes > self._config.max_transfer_bytes:
            raise InvalidArgument(
                f"block_bytes={spec.block_bytes} exceeds max_transfer_bytes="
                f"{self._config.max_transfer_bytes}: such a block could not be moved inline"
            )
        if request.name:
            opened = await self._run(
                self._names.bind, request.name, spec, self._store.open_namespace
            )
        else:
            opened = await self._run(self._store.open_namespace, spec)
        return convert.namespace_info(opened, request.name or self._name_of(opened.ns_id))

    @grpc_errors
    async def DescribeNamespace(
        self, request: pb.DescribeNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> pb.NamespaceInfo:
        if not request.ns_id:
            raise InvalidArgument("ns_id is required")

        def describe() -> pb.NamespaceInfo:
            spec = self._spec(request.ns_id)
            stats = {n.ns_id: n for n in self._store.stats().namespaces}.get(spec.ns_id)
            return convert.namespace_info(spec, self._name_of(spec.ns_id), stats)

        return await self._run(describe)

    @grpc_errors
    async def ListNamespaces(
        self, request: pb.ListNamespacesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListNamespacesResponse:
        def list_all() -> pb.ListNamespacesResponse:
            names = self._names.names_by_ns_id()
            infos = []
            for ns in self._store.stats().namespaces:
                try:
                    spec = self._store.namespace(ns.ns_id)
                except UnknownNamespace:  # removed between the two calls
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
        cfg = self._config
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
        )

    # --- read side --------------------------------------------------------------------

    @grpc_errors
    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupResponse:
        wait = convert.seconds(request.wait_pending_s, "wait_pending_s")
        if wait is not None and wait > MAX_WAIT_PENDING_S:
            raise InvalidArgument(
                f"wait_pending_s must be <= {MAX_WAIT_PENDING_S}, got {request.wait_pending_s}"
            )

        def lookup() -> pb.LookupResponse:
            spec, keys = self._chain(request.ns_id, request.tokens, request.extra_keys)
            if wait:
                result = self._store.wait_ready(spec.ns_id, keys, wait)
            else:
                result = self._store.lookup(spec.ns_id, keys)
            return convert.lookup_response(result, spec.block_tokens, len(keys))

        return await self._run(lookup, wait=wait is not None)

    @grpc_errors
    async def Get(
        self, request: pb.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GetResponse]:
        def read() -> tuple[pb.GetHeader, memoryview]:
            spec, keys = self._chain(request.ns_id, request.tokens, request.extra_keys)
            start, bb = request.start_block, spec.block_bytes
            if start > len(keys):
                raise InvalidArgument(
                    f"start_block={start} is beyond the {len(keys)} full blocks the tokens make"
                )
            ready = self._store.lookup(spec.ns_id, keys).ready_blocks
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
                return header, memoryview(b"")
            n, view = self._store.read(spec.ns_id, keys[:end], start=start)
            if start + n < end:  # evicted between lookup and read: the prefix is shorter
                ready = start + n
            header = pb.GetHeader(
                ready_blocks=ready,
                ready_tokens=ready * spec.block_tokens,
                start_block=start,
                n_blocks=n,
                block_bytes=bb,
                truncated=ready > end,
            )
            return header, view

        header, data = await self._run(read)
        yield pb.GetResponse(header=header)
        for offset in range(0, len(data), GET_CHUNK_BYTES):
            yield pb.GetResponse(data=bytes(data[offset : offset + GET_CHUNK_BYTES]))

    @grpc_errors
    async def Acquire(
        self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> pb.AcquireResponse:
        ttl = convert.seconds(request.ttl_s, "ttl_s")

        def acquire() -> pb.AcquireResponse:
            spec, keys = self._chain(request.ns_id, request.tokens, request.extra_keys)
            if request.max_blocks:
                keys = keys[: request.max_blocks]
            got = self._store.acquire(spec.ns_id, keys, ttl)
            return convert.acquire_response(got, spec.block_tokens, self._store.arena_path or "")

        return await self._run(acquire)

    @grpc_errors
    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        await self._run(self._store.release, convert.lease_id(request.lease_id))
        return pb.ReleaseResponse()

    # --- write side -------------------------------------------------------------------

    @grpc_errors
    async def Put(
        self, request_iterator: AsyncIterable[pb.PutRequest], context: grpc.aio.ServicerContext
    ) -> pb.PutResponse:
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        if first is None or first.WhichOneof("kind") != "header":
            raise InvalidArgument("the first Put message must be a header")
        head = first.header
        prio = convert.optional_priority(head)

        def check_header() -> tuple[NamespaceSpec, list[BlockKey]]:
            spec, keys = self._chain(head.ns_id, head.tokens, head.extra_keys)
            end = convert.block_range(head.start_block, head.n_blocks, len(keys))
            if head.n_blocks == 0:
                raise InvalidArgument("n_blocks must be > 0")
            return spec, keys[:end]

        spec, keys = await self._run(check_header)
        bb = spec.block_bytes
        expected = head.n_blocks * bb
        if expected > self._config.max_transfer_bytes:
            raise OutOfSpace(
                f"put of {head.n_blocks} blocks x {bb} bytes = {expected} bytes exceeds "
                f"max_transfer_bytes={self._config.max_transfer_bytes}; split it"
            )
        buf = bytearray(expected)
        view = memoryview(buf)
        received = 0
        async for msg in messages:
            if msg.WhichOneof("kind") != "data":
                raise InvalidArgument("Put sends one header, then only data chunks")
            chunk = msg.data
            if len(chunk) > MAX_CHUNK_BYTES:
                raise InvalidArgument(
                    f"data chunk of {len(chunk)} bytes exceeds max_chunk_bytes={MAX_CHUNK_BYTES}"
                )
            if received + len(chunk) > expected:
                raise InvalidArgument(
                    f"Put data exceeds n_blocks x block_bytes = {head.n_blocks} x {bb} "
                    f"= {expected} bytes (got at least {received + len(chunk)})"
                )
            view[received : received + len(chunk)] = chunk
            received += len(chunk)
        if received != expected:
            raise InvalidArgument(
                f"Put data is {received} bytes, expected n_blocks x block_bytes = "
                f"{head.n_blocks} x {bb} = {expected}"
            )

        def put() -> pb.PutResponse:
            start = head.start_block
            payloads = [view[i * bb : (i + 1) * bb] for i in range(head.n_blocks)]
            result = self._store.put(spec.ns_id, keys, payloads, start=start, priority=prio)
            # Refused outright: a missing parent or another owner computing the first
            # block is an ordinary answer; only lack of room is an error.
            if result.out_of_space and result.stored == 0 and result.existing == 0:
                raise OutOfSpace(
                    f"no room for any of the {head.n_blocks} blocks: the store is full "
                    "of leased or pending blocks"
                )
            return convert.put_response(result)

        return await self._run(put)

    @grpc_errors
    async def Reserve(
        self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReserveResponse:
        ttl = convert.seconds(request.ttl_s, "ttl_s")
        prio = convert.optional_priority(request)

        def reserve() -> pb.ReserveResponse:
            spec, keys = self._chain(request.ns_id, request.tokens, request.extra_keys)
            end = convert.block_range(request.start_block, request.n_blocks, len(keys))
            res = self._store.reserve(
                spec.ns_id, keys[:end], start=request.start_block, ttl_s=ttl, priority=prio
            )
            if res.out_of_space and not res.slots and not res.existing:
                raise OutOfSpace(
                    f"no room to reserve any of the {end - request.start_block} blocks: the "
                    "store is full of leased or pending blocks"
                )
            return convert.reserve_response(res, self._store.arena_path or "")

        return await self._run(reserve)

    @grpc_errors
    async def Commit(
        self, request: pb.CommitRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitResponse:
        lease = convert.lease_id(request.lease_id)
        count = request.count if request.HasField("count") else None
        return pb.CommitResponse(committed=await self._run(self._store.commit, lease, count))

    @grpc_errors
    async def Abandon(
        self, request: pb.AbandonRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbandonResponse:
        lease = convert.lease_id(request.lease_id)
        return pb.AbandonResponse(dropped=await self._run(self._store.abandon, lease))

    # --- management -------------------------------------------------------------------

    @grpc_errors
    async def Delete(
        self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteResponse:
        def delete() -> int:
            spec, keys = self._chain(request.ns_id, request.tokens, request.extra_keys)
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
        def clear() -> int:
            ns_id = self._spec(request.ns_id).ns_id if request.ns_id else None
            return self._store.clear(ns_id)

        return pb.ClearResponse(removed=await self._run(clear))

    @grpc_errors
    async def SetPriority(
        self, request: pb.SetPriorityRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetPriorityResponse:
        prio = convert.priority(request.priority)
        duration = convert.seconds(request.duration_s, "duration_s")

        def set_priority() -> int:
            spec, keys = self._chain(request.ns_id, request.tokens, request.extra_keys)
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
        stats = await self._run(self._store.stats)
        return convert.stats_response(
            stats,
            self._store.platform,
            time.monotonic() - self._started,
            self._names.names_by_ns_id(),
        )

    @grpc_errors
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        ns_filter = self._names.resolve(request.ns_id) if request.ns_id else ""
        kinds = set(request.kinds)
        for kind in kinds:
            if kind not in convert.EVENT_KINDS.values():
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
                convert.event(e)
                for e in events
                if (not ns_filter or e.ns_id == ns_filter)
                and (not kinds or convert.EVENT_KINDS[e.kind] in kinds)
            ]
            if out or missed:
                yield pb.WatchEventsResponse(events=out, missed=missed)

    def _latest_seq(self) -> int:
        return self._store.last_event_seq
