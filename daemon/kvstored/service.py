"""The kvstore.v1.KVStore servicer: thin asyncio handlers over one :class:`Store`.

Why grpc.aio and not a sync server with a thread pool: Put, Get and WatchEvents are
streams whose duration depends on the peer's network and patience (a WatchEvents
lasts as long as a ``kvctl events`` runs); under grpc.aio they cost a coroutine while
they wait, not a pool thread, so slow or idle peers cannot starve the other calls.
The servicer is one thin class: it makes its parts and names, for each RPC, the handler
that serves it. The parts: :class:`kvstored.dispatch.Calls` (the store, the settings,
where a call runs: the quick path on the event loop or a thread pool, and the key
chains of requests), :class:`kvstored.owners.Owners` (whose leases a call makes), and
the handlers: :mod:`kvstored.read_handlers` (Lookup, LookupBatch, Get, Acquire, Release,
ReportReads), :mod:`kvstored.write_handlers` (Put, Reserve, Commit, Abandon) and
:mod:`kvstored.admin_handlers` (namespaces, server info, sessions, management, stats
and events).

Each handler is a module-level function of ``(calls, request, context)``; the servicer
binds it to its :class:`~kvstored.dispatch.Calls`. It does three things: convert and
validate the request (``convert``), run one synchronous function against the store
(on the event loop when it is short: Release, Abandon, Commit unless write-through
makes it write to disk, and Lookup, Acquire, Get, Reserve and Put when the chain is
short and already in the host tier; else on a pool), convert the result. Errors are
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

from functools import partial
from typing import Any

import grpc

from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import kvstore_pb2_grpc as pb_grpc
from kvstored import admin_handlers, read_handlers, write_handlers
from kvstored.dispatch import Calls
from kvstored.errors import tolerant


class KVStoreService:
    """Servicer for ``kvstore.v1.KVStore`` (see the module docstring): each RPC is an
    attribute naming its handler, as ``add_KVStoreServicer_to_server`` looks them up;
    owns its thread pools, not the store."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls  # also where the server sets ``framed`` and ``local_socket``
        self.access = calls.access
        # each RPC and the handler that serves it, bound to the calls' parts
        self.Lookup = partial(read_handlers.Lookup, calls)
        self.LookupBatch = partial(read_handlers.LookupBatch, calls)
        self.Get = partial(read_handlers.Get, calls)
        self.Acquire = partial(read_handlers.Acquire, calls)
        self.Release = partial(read_handlers.Release, calls)
        self.ReportReads = partial(read_handlers.ReportReads, calls)
        self.Put = partial(write_handlers.Put, calls)
        self.Reserve = partial(write_handlers.Reserve, calls)
        self.Commit = partial(write_handlers.Commit, calls)
        self.Abandon = partial(write_handlers.Abandon, calls)
        self.OpenNamespace = partial(admin_handlers.OpenNamespace, calls)
        self.DescribeNamespace = partial(admin_handlers.DescribeNamespace, calls)
        self.ListNamespaces = partial(admin_handlers.ListNamespaces, calls)
        self.ServerInfo = partial(admin_handlers.ServerInfo, calls)
        self.Session = partial(admin_handlers.Session, calls)
        self.Delete = partial(admin_handlers.Delete, calls)
        self.Clear = partial(admin_handlers.Clear, calls)
        self.SetPriority = partial(admin_handlers.SetPriority, calls)
        self.Stats = partial(admin_handlers.Stats, calls)
        self.WatchEvents = partial(admin_handlers.WatchEvents, calls)

    def begin_shutdown(self) -> None:
        """End the open WatchEvents and Session streams so a graceful stop does not
        wait for them."""
        self.calls.stopping.set()

    def close(self) -> None:
        self.calls.close()

    def owner_opened(self, owner: str) -> None:
        """A connection or stream of ``owner`` opened (see kvstored.owners)."""
        self.calls.owners.opened(owner)

    def owner_closed(self, owner: str) -> None:
        """One of ``owner``'s connections closed: its leases end with the last one."""
        self.calls.owners.closed(owner)


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
    service.calls.framed = True
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, methods),))
    server.add_registered_method_handlers(SERVICE_NAME, methods)
