"""The daemon-wide calls of the KVStore servicer: namespaces, server info, sessions,
management (Delete, Clear, SetPriority) and observability (Stats, WatchEvents)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator

import grpc

from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import result_messages
from kvproto.v1.results import Event
from kvstore.errors import InvalidArgument, UnknownNamespace
from kvstore.host.arena import COMMON
from kvstored import convert
from kvstored.config import MAX_CHUNK_BYTES
from kvstored.dispatch import Calls, Ctx
from kvstored.errors import grpc_errors
from kvstored.owners import SESSION_OWNER

EVENT_POLL_S = 0.25  # how long one event poll waits in the store before re-checking shutdown
EVENT_BATCH = 1024
SESSION_ID_MIN, SESSION_ID_MAX = 16, 64


# --- namespaces -------------------------------------------------------------------


@grpc_errors
async def OpenNamespace(
    calls: Calls, request: pb.OpenNamespaceRequest, context: Ctx
) -> pb.NamespaceInfo:
    caller = calls.access.caller(context)
    spec = calls.access.scoped(caller, convert.spec_from_proto(request.spec))
    if spec.block_bytes > calls.config.max_transfer_bytes:
        raise InvalidArgument(
            f"block_bytes={spec.block_bytes} exceeds max_transfer_bytes="
            f"{calls.config.max_transfer_bytes}: such a block could not be moved inline"
        )
    if request.name:
        bind = calls.names.bind
        opened = await calls.run(
            bind, request.name, spec, calls.store.open_namespace, caller.tenant
        )
    else:
        opened = await calls.run(calls.store.open_namespace, spec)
    return convert.namespace_info(opened, request.name or _name_of(calls, opened.ns_id))


@grpc_errors
async def DescribeNamespace(
    calls: Calls, request: pb.DescribeNamespaceRequest, context: Ctx
) -> pb.NamespaceInfo:
    caller = calls.access.caller(context)
    if not request.ns_id:
        raise InvalidArgument("ns_id is required")

    def describe() -> pb.NamespaceInfo:
        spec = calls.access.spec(request.ns_id, caller)
        stats = {n.ns_id: n for n in calls.store.stats().namespaces}.get(spec.ns_id)
        return convert.namespace_info(spec, _name_of(calls, spec.ns_id), stats)

    return await calls.run(describe)


@grpc_errors
async def ListNamespaces(
    calls: Calls, request: pb.ListNamespacesRequest, context: Ctx
) -> pb.ListNamespacesResponse:
    caller = calls.access.caller(context)

    def list_all() -> pb.ListNamespacesResponse:
        names = calls.names.names_by_ns_id()
        infos = []
        for ns in calls.store.stats().namespaces:
            try:
                spec = calls.store.namespace(ns.ns_id)
            except UnknownNamespace:  # removed between the two calls
                continue
            if not caller.owns(spec):
                continue
            infos.append(convert.namespace_info(spec, names.get(ns.ns_id, ""), ns))
        return pb.ListNamespacesResponse(namespaces=infos)

    return await calls.run(list_all)


def _name_of(calls: Calls, ns_id: str) -> str:
    return calls.names.names_by_ns_id().get(ns_id, "")


@grpc_errors
async def ServerInfo(
    calls: Calls, request: pb.ServerInfoRequest, context: Ctx
) -> pb.ServerInfoResponse:
    tenant = calls.access.caller(context).tenant
    cfg, arena = calls.config, calls.store.arena
    # the caller's region: a tenant's own (handed out by fd), else the common one
    region = arena.regions[arena.region_of(tenant) if calls.arena_socket else COMMON]
    shared = bool(arena.path)
    return pb.ServerInfoResponse(
        version=calls.version,
        platform=calls.store.platform,
        arena_path=arena.name_of(region.name),
        arena_socket=calls.arena_socket if region.name else "",
        arena_bytes=region.size,
        host_id=calls.host_id,
        max_message_bytes=cfg.max_message_bytes,
        max_blocks_per_request=cfg.max_blocks_per_request,
        default_lease_ttl_s=cfg.lease_ttl_s,
        max_lease_ttl_s=cfg.max_lease_ttl_s,
        max_chunk_bytes=MAX_CHUNK_BYTES,
        max_transfer_bytes=cfg.max_transfer_bytes,
        pid=os.getpid(),
        uptime_s=time.monotonic() - calls.started,
        local_socket=calls.local_socket,
        slot_epochs_offset=region.epochs_offset if shared else 0,
        slot_epochs_count=region.epoch_count if shared else 0,
        arena_prefaulted=calls.store.config.prefault_arena,
        admission=calls.store.config.admission,
        uid=os.getuid(),
        tenant=tenant,
    )


@grpc_errors
async def Session(
    calls: Calls, request: pb.SessionRequest, context: Ctx
) -> AsyncIterator[pb.SessionResponse]:
    """Hold a client's session open; end its leases when the stream ends (see the
    proto). One message says the session is registered; then nothing until the
    client goes or the daemon stops."""
    calls.access.caller(context)
    if not SESSION_ID_MIN <= len(request.session_id) <= SESSION_ID_MAX:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"session_id must be {SESSION_ID_MIN} to {SESSION_ID_MAX} characters, "
            f"got {len(request.session_id)}",
        )
    owner = SESSION_OWNER + request.session_id
    calls.owners.opened(owner)
    try:
        yield pb.SessionResponse()
        await calls.stopping.wait()
    finally:
        calls.owners.closed(owner)

# --- management -------------------------------------------------------------------


@grpc_errors
async def Delete(calls: Calls, request: pb.DeleteRequest, context: Ctx) -> pb.DeleteResponse:
    caller = calls.access.caller(context)

    def delete() -> int:
        spec, keys = calls.chain(
            request.ns_id, request.tokens, request.extra_keys, caller
        )
        if request.start_block >= len(keys):
            raise InvalidArgument(
                f"start_block={request.start_block} is not one of the {len(keys)} full "
                "blocks the tokens make"
            )
        return calls.store.delete(spec.ns_id, keys, start=request.start_block)

    return pb.DeleteResponse(removed=await calls.run(delete))


@grpc_errors
async def Clear(calls: Calls, request: pb.ClearRequest, context: Ctx) -> pb.ClearResponse:
    caller = calls.access.caller(context)

    def clear() -> int:
        if request.ns_id:
            return calls.store.clear(calls.access.spec(request.ns_id, caller).ns_id)
        if caller.admin:
            return calls.store.clear(None)
        # a tenant's Clear with no namespace clears its own namespaces, no other
        owned = [spec.ns_id for spec in calls.store.namespaces() if caller.owns(spec)]
        return sum(calls.store.clear(ns_id) for ns_id in owned)

    return pb.ClearResponse(removed=await calls.run(clear))


@grpc_errors
async def SetPriority(
    calls: Calls, request: pb.SetPriorityRequest, context: Ctx
) -> pb.SetPriorityResponse:
    caller = calls.access.caller(context)
    prio = convert.priority(request.priority)
    duration = convert.seconds(request.duration_s, "duration_s")

    def set_priority() -> int:
        spec, keys = calls.chain(
            request.ns_id, request.tokens, request.extra_keys, caller
        )
        if request.start_block > len(keys):
            raise InvalidArgument(
                f"start_block={request.start_block} is beyond the {len(keys)} full "
                "blocks the tokens make"
            )
        return calls.store.set_priority(
            spec.ns_id, keys, prio, duration_s=duration, start=request.start_block
        )

    return pb.SetPriorityResponse(changed=await calls.run(set_priority))

# --- observability ----------------------------------------------------------------


@grpc_errors
async def Stats(calls: Calls, request: pb.StatsRequest, context: Ctx) -> pb.StatsResponse:
    caller = calls.access.caller(context)
    stats = await calls.run(calls.store.stats)
    if not caller.admin:  # a tenant sees its own namespaces and events, no tenant's usage
        own = tuple(n for n in stats.namespaces if calls.access.visible(caller, n.ns_id))
        seq = await calls.run(calls.store.last_event_seq, caller.tenant)
        counters = {**stats.counters, "event_seq": seq}
        stats = dataclasses.replace(stats, namespaces=own, tenants=(), counters=counters)
    # the bytes Get streams hold copied (kvstored.get_buffers): all, or the tenant's
    copied = calls.get_buffers.held if caller.admin else calls.get_buffers.held_by(caller)
    stats = dataclasses.replace(stats, counters={**stats.counters, "get_buffer_bytes": copied})
    names = calls.names.names_by_ns_id()
    named = tuple(dataclasses.replace(n, name=names.get(n.ns_id, "")) for n in stats.namespaces)
    return result_messages.stats_response(
        dataclasses.replace(
            stats,
            namespaces=named,
            platform=calls.store.platform,
            uptime_s=time.monotonic() - calls.started,
        )
    )


@grpc_errors
async def WatchEvents(
    calls: Calls, request: pb.WatchEventsRequest, context: Ctx
) -> AsyncIterator[pb.WatchEventsResponse]:
    caller = calls.access.caller(context)
    ns_filter = calls.access.spec(request.ns_id, caller).ns_id if request.ns_id else ""
    kinds = set(request.kinds)
    for kind in kinds:
        if kind not in result_messages.EVENT_KINDS.values():
            raise InvalidArgument(f"kinds: unknown event kind {kind}")
    tenant = None if caller.admin else caller.tenant  # a tenant's events: its own numbers
    seq = request.from_seq
    if request.from_now:
        seq = await calls.run(calls.store.last_event_seq, tenant)
    while not calls.stopping.is_set():
        parked, got = await calls.run_parked(
            calls.event_shares, caller, calls.store.events_since, seq, EVENT_POLL_S, EVENT_BATCH,
            tenant,
        )  # fmt: skip
        if parked:
            events: list[Event] = got or []
        else:  # past the caller's share of threads: poll here, and pause
            events = calls.store.events_since(seq, 0.0, EVENT_BATCH, tenant)
            if not events:
                await asyncio.sleep(EVENT_POLL_S / 5)
        if not events:
            continue
        missed = max(0, events[0].seq - seq - 1)
        seq = events[-1].seq
        out = [
            result_messages.event_message(e)
            for e in events
            if (not ns_filter or e.ns_id == ns_filter)
            and (not kinds or result_messages.EVENT_KINDS[e.kind] in kinds)
            and calls.access.visible(caller, e.ns_id)
        ]
        if out or missed:
            yield pb.WatchEventsResponse(events=out, missed=missed)

