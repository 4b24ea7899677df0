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

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import kvstore_pb2_grpc as pb_grpc
from kvproto.v1 import result_messages
from kvproto.v1.results import Event
from kvstore.errors import InvalidArgument
from kvstored import convert
from kvstored.errors import grpc_errors, tolerant
from kvstored.service_base import (
    EVENT_BATCH,
    EVENT_POLL_S,
)
from kvstored.write_handlers import WriteHandlers


class KVStoreService(WriteHandlers):
    """Servicer for ``kvstore.v1.KVStore``; owns its thread pools, not the store. The
    handlers are in layers, each using only those below: :class:`ServiceBase` (shared
    helpers, namespaces, sessions), :class:`ReadHandlers`, :class:`WriteHandlers`, and
    here management and observability."""

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
