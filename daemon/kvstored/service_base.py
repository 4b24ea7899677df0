"""What every handler of the KVStore servicer shares: the pools, the quick path, the
chain cache, namespaces, server info and the sessions that own leases (the handlers
themselves: :mod:`kvstored.read_handlers`, :mod:`kvstored.write_handlers`,
:mod:`kvstored.service`; the protocol: :mod:`kvstored.service`'s docstring)."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import InvalidArgument, StoreError, UnknownNamespace
from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.store import Store
from kvstored import convert, hostinfo
from kvstored.auth import Access, Caller
from kvstored.config import MAX_CHUNK_BYTES, DaemonConfig
from kvstored.errors import grpc_errors
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


class NeedsPool(Exception):
    """A call tried on the event loop would wait on the disk or hash a long prompt: it
    stopped before changing anything and runs again on the pool."""


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


class ServiceBase(pb_grpc.KVStoreServicer):
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
        """``fn(quick=True)`` on the event loop; on the pool when it raises NeedsPool."""
        try:
            return fn(True)
        except NeedsPool:
            return await self._run(fn, False)

    def _check_host(self, ns_id: str, keys: Sequence[BlockKey]) -> None:
        """Quick calls only: every ready block of ``keys`` is in the host tier."""
        if self._store.lookup(ns_id, keys).disk_blocks:
            raise NeedsPool

    def _check_room(self, ns_id: str, keys: Sequence[BlockKey], n_blocks: int) -> None:
        """Quick calls only: a reservation of ``n_blocks`` after ``keys``' ready prefix
        fits the arena's free bytes (so it evicts nothing) and needs no promotion."""
        self._check_host(ns_id, keys)
        arena = self._store.arena
        block = -(-self._store.namespace(ns_id).block_bytes // 4096) * 4096
        if arena.capacity_bytes - arena.used_bytes < (n_blocks + 1) * block:
            raise NeedsPool

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
                raise NeedsPool
            keys = self._store.keys_for(spec.ns_id, arr, extras)
            self._chains.put(memo, keys)
        return spec, keys

    def _read_chain(
        self, ns_id: str, tokens: Any, extra: Any, caller: Caller, quick: bool = False
    ) -> tuple[NamespaceSpec, list[BlockKey], int]:
        """:meth:`_chain` for a read, which falls through host, disk and the shared
        tier: the blocks the shared tier has after this node's ready prefix are pulled
        into the host tier first (a network wait: a quick call moves to the pool when
        one could help); the third value counts them."""
        spec, keys = self._chain(ns_id, tokens, extra, caller, quick)
        if self._store.shared is None:
            return spec, keys, 0
        if quick:
            if self._store.shared_gap(spec.ns_id, keys):
                raise NeedsPool
            return spec, keys, 0
        return spec, keys, self._store.pull_shared(spec.ns_id, keys)

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
