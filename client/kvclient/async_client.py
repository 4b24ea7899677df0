"""The asyncio twin of :mod:`kvclient.sync_client`: ``AsyncKVClient`` / ``AsyncNamespace``.

Same methods, same protocol, same results and exceptions, as coroutines over
``grpc.aio``:

- put, shared arena: Reserve -> copy into the slots (in a worker thread, so a large
  copy does not stall the event loop) -> Commit; Abandon on any exception, including
  cancellation. With staged slots (:mod:`kvclient.staged_slots`) the copy runs while
  the Reserve is in flight and the Commit is sent without waiting for its answer.
- put, inline: client-streaming Put per batch (header, then chunks).
- get, shared arena: Acquire -> copy out (worker thread) -> Release, carried by the
  next Acquire or sent within RELEASE_DELAY_S (one round trip per get).
- acquire: Acquire -> zero-copy read-only views of the slots (:class:`AsyncBlockLease`)
  -> Release when the ``async with`` block ends.
- get, inline: server-streaming Get, called again while the header says truncated.

Create the client inside the running event loop (``async with AsyncKVClient() as c``).
The arena mapping is checked before each use and made again after the daemon was
unreachable or restarted, as in the sync client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio
import numpy as np

from kvclient import wire
from kvclient.address import CHANNEL_OPTIONS, resolve_address
from kvclient.arena_path import BlockViews, ClientArena, SlotTable, start_copy_threads, write_slots
from kvclient.claims import AsyncClaim, reserve_request
from kvclient.disk_index import DiskFirstReads
from kvclient.disk_reads import DiskFile, read_answer, read_first_from_file
from kvclient.errors import (
    ArenaUnavailableError,
    DaemonUnavailableError,
    InvalidArgumentError,
    KVStoreError,
    error_from_rpc,
)
from kvclient.local_calls import (
    AsyncLocalCalls,
    LocalCallFailed,
    LocalCallStatus,
    OnAnswer,
    raise_local_failure,
)
from kvclient.payloads import (
    as_blocks,
    as_tokens,
    blocks_per_call,
    check_cover,
    check_out,
    check_priority,
    check_start,
    output_array,
)
from kvclient.puts_ahead import AsyncPendingPut, answer_handler
from kvclient.results import (
    Event,
    GetResult,
    LookupResult,
    NamespaceInfo,
    PutResult,
    ServerInfo,
    Stats,
    write_through,
)
from kvclient.security import TLS, Credentials
from kvclient.session import GrpcSession
from kvclient.staged_slots import SlotStash, put_reserve
from kvclient.sync_client import DEFAULT_TIMEOUT_S, RELEASE_DELAY_S
from kvclient.unpinned_reads import (
    LastSlots,
    ReadKey,
    ReadReports,
    UnpinnedGet,
    epoch_table,
    wanted_blocks,
)
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import kvstore_pb2_grpc as pb_grpc
from kvproto.v1.host import host_id
from kvproto.v1.local_calls import UNARY_METHODS
from kvstore.slot_epochs import SlotEpochs

log = logging.getLogger(__name__)

_Response = TypeVar("_Response")


class AsyncKVClient:
    """asyncio client of one kvstored; ``await client.close()`` (or ``async with``)."""

    def __init__(
        self,
        addr: str | None = None,
        *,
        use_arena: bool | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        token: str | None = None,
        tls: TLS | None = None,
        socket_owner: int | str | None = None,
    ) -> None:
        self.addr = resolve_address(addr)
        self.use_arena = use_arena
        self.timeout = timeout
        # token, TLS and whose socket to trust: arguments, else the environment
        self._credentials = Credentials.resolve(token, tls, socket_owner)
        self._channel = self._credentials.aio_channel(self.addr, CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        # Get and Put with identity (de)serializers: the data chunks are framed here
        self._get_stream = self._channel.unary_stream(
            wire.GET_METHOD,
            request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=None,
        )
        self._put_stream = self._channel.stream_unary(
            wire.PUT_METHOD,
            request_serializer=None,
            response_deserializer=pb.PutResponse.FromString,
        )
        self._lock = asyncio.Lock()
        self._info: ServerInfo | None = None  # None: ask the daemon again
        self._arena: ClientArena | None = None
        self._closed = False
        # read leases done with, not released yet (see _release_later), and gets served
        # from known slots, not reported yet (see _report_read)
        self._done: list[int] = []
        self._reads = ReadReports()
        self._settling = asyncio.Lock()  # held while pending work is sent (_settle)
        self._flush_handle: asyncio.TimerHandle | None = None
        self._flushes: set[asyncio.Task[None]] = set()
        # calls whose answer neither a block still pinned by this client nor a read it
        # has not reported can change
        self._unordered = (self._stub.Acquire, self._stub.Lookup, self._stub.ServerInfo)
        # calls over gRPC whose leases end with this client's session (kvclient.session)
        self._session = GrpcSession(self.addr, CHANNEL_OPTIONS, self._credentials)
        self._leasing = (self._stub.Acquire, self._stub.Reserve)
        # unary calls go over the daemon's local socket while the arena is mapped
        self._local: AsyncLocalCalls | None = None
        self._local_names = {getattr(self._stub, name): name for name in UNARY_METHODS}
        # unpinned gets (kvclient.unpinned_reads): the arena's epoch table, last slots
        self._epochs: SlotEpochs | None = None
        self._last_slots = LastSlots()
        # disk_direct gets (kvclient.disk_reads): the daemon's disk file, when readable
        self._disk: DiskFile | None = None
        self._disk_first = DiskFirstReads()  # prefixes read from it with no call
        # arena puts: the staged slots of each namespace (kvclient.staged_slots)
        self._stashes: dict[str, SlotStash] = {}

    # -- lifecycle ------------------------------------------------------------------

    async def close(self) -> None:
        """Close the channel and unmap the arena. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        # staging leases go with the read leases: their slots come back at once
        staging = (stash.detach() for stash in self._stashes.values())
        self._done.extend(lease_id for lease_id in staging if lease_id)
        await self._settle()
        if self._local is not None:  # the answers of puts sent ahead resolve their results
            await self._local.read_owed(self.timeout)
        self._session.close()
        await self._channel.close()
        arena, self._arena = self._arena, None
        if arena is not None:
            arena.close()
        if self._local is not None:
            self._local.close()
        if self._disk is not None:
            self._disk.close()

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncKVClient({self.addr!r}, use_arena={self.use_arena})"

    # -- plumbing -------------------------------------------------------------------

    async def _call(
        self,
        method: Callable[..., Awaitable[_Response]],
        request: Any,
        during: Callable[[], None] | None = None,
        settle: bool = True,
    ) -> _Response:
        """One unary call; every gRPC error becomes a KVStoreError. ``during`` runs on a
        worker thread while the call is in flight (local calls), else before it."""
        pending = self._done or self._reads or self._settling.locked()
        if settle and pending and method not in self._unordered:
            await self._settle()  # ``settle`` False: the calls of _settle itself
        local = self._local
        if local is not None:
            name = self._local_names.get(method)
            if name is not None:
                try:
                    return await local.call(name, request, self.timeout, during)
                except LocalCallStatus as exc:
                    raise self._checked(exc.error(self.addr)) from None
                except LocalCallFailed as exc:
                    self._local_failed(local, exc)  # raises unless gRPC may take the call
        if during is not None:
            await asyncio.to_thread(during)
        return await self._call_grpc(method, request)

    async def _send(
        self,
        method: Callable[..., Awaitable[Any]],
        request: Any,
        on_answer: OnAnswer | None = None,
    ) -> None:
        """Like KVClient._send: over the local socket without waiting for the answer."""
        local = self._local
        name = self._local_names.get(method)
        try:
            if local is not None and name is not None:
                try:
                    await local.send(name, request, self.timeout, on_answer)
                    return
                except LocalCallFailed as exc:
                    self._local_failed(local, exc)  # raises unless gRPC may take the call
            reply = await self._call(method, request)
        except KVStoreError as error:
            if on_answer is not None:
                on_answer(None, error)
            raise
        if on_answer is not None:
            on_answer(reply, None)

    def _stash(self, ns_id: str) -> SlotStash:
        return self._stashes.setdefault(ns_id, SlotStash())

    async def _call_grpc(
        self, method: Callable[..., Awaitable[_Response]], request: Any
    ) -> _Response:
        try:
            if method in self._leasing:
                metadata = self._session.metadata(wait=False)
                return await method(request, timeout=self.timeout, metadata=metadata)
            return await method(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def _local_failed(self, local: AsyncLocalCalls, exc: LocalCallFailed) -> None:
        """Stop using a local socket that failed; raise unless the call never left."""
        if self._local is local:
            self._local, self._info = None, None  # asked again at the next data call
        local.close()
        raise_local_failure(exc, self.addr, self.timeout)

    def _release_later(self, lease_id: int) -> None:
        """Release a read lease with the next Acquire, or within RELEASE_DELAY_S (see
        :meth:`kvclient.KVClient._release_later`)."""
        self._done.append(lease_id)
        self._flush_later()

    def _report_read(
        self, key: ReadKey, tokens: list[int], n_blocks: int, from_disk: bool = False
    ) -> None:
        """Report a get served from known slots or the disk file later (see
        :meth:`kvclient.KVClient._report_read`)."""
        if self._reads.add(key, tokens, n_blocks, from_disk):
            self._flush_soon()  # many prefixes pending: now
        else:
            self._flush_later()

    def _flush_later(self) -> None:
        if self._flush_handle is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._flush_handle = loop.call_later(RELEASE_DELAY_S, self._flush_soon)

    def _flush_soon(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self._flush_handle = None
        if self._done or self._reads:
            task = asyncio.ensure_future(self._settle())
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)

    def _take_done(self) -> list[int]:
        done, self._done = self._done, []
        return done

    async def _settle(self) -> None:
        """Release the pending leases (one Release call for all of them) and report the
        pending reads (one ReportReads) now. A settle in flight (the flusher's) is waited
        for: any call made after this returns comes after every release and report."""
        async with self._settling:
            done = self._take_done()
            reads = self._reads.take()
            if done:
                request = pb.ReleaseRequest(lease_id=done[0], more_lease_ids=done[1:])
                try:
                    await self._call(self._stub.Release, request, settle=False)
                except KVStoreError as exc:
                    log.debug("release of %d leases: %s", len(done), exc)
            if reads is not None:
                try:
                    await self._call(self._stub.ReportReads, reads, settle=False)
                except KVStoreError as exc:
                    log.debug("report of reads of %d prefixes: %s", len(reads.prefixes), exc)

    def _error(self, exc: grpc.RpcError) -> KVStoreError:
        return self._checked(error_from_rpc(exc, self.addr))

    def _checked(self, error: KVStoreError) -> KVStoreError:
        if isinstance(error, DaemonUnavailableError):
            self._info = None  # it may come back as a new process with a new arena
        return error

    async def _refresh(self) -> tuple[ServerInfo, ClientArena | None]:
        """Server info and the arena mapping; asked again after the daemon was unreachable
        or when the mapped arena file is no longer the daemon's."""
        async with self._lock:
            info, arena = self._info, self._arena
            if info is not None and (arena is None or arena.is_current()):
                return info, arena
            # over gRPC: it names the local socket, and a dead one must not hide it
            response = await self._call_grpc(self._stub.ServerInfo, pb.ServerInfoRequest())
            info = wire.server_info(response)
            old, arena = self._arena, None
            if self.use_arena is not False:
                arena = ClientArena.open(info.arena_path, info.host_id, host_id())
            old_local, local = self._local, None
            if arena is not None and info.local_socket:
                local = AsyncLocalCalls(info.local_socket, self._credentials.token, info.uid)
            self._info, self._arena, self._local = info, arena, local
            self._epochs = epoch_table(arena, info) if arena is not None else None
            self._last_slots = LastSlots()
            old_disk = self._disk
            self._disk = DiskFile.open(info.disk_path) if arena is not None else None
            if arena is not None:  # what a first get would pay, paid at connect
                start_copy_threads()
            if self._disk is not None:
                self._disk.open_index_now()
        if old is not None:
            old.close()
        if old_disk is not None:
            old_disk.close()
        if old_local is not None:
            old_local.close()
        return info, arena

    async def _arena_for_data(self) -> tuple[ServerInfo, ClientArena | None]:
        info, arena = await self._refresh()
        if arena is None and self.use_arena:
            raise ArenaUnavailableError(
                f"the shared arena of kvstored at {self.addr} cannot be mapped here "
                f"(arena {info.arena_path or 'not shared'}, same host: "
                f"{info.host_id == host_id()})",
                addr=self.addr,
            )
        return info, arena

    async def arena_in_use(self) -> bool:
        """Whether data calls go through the shared arena (asks the daemon once)."""
        return (await self._arena_for_data())[1] is not None

    # -- daemon-wide calls ----------------------------------------------------------

    async def server_info(self) -> ServerInfo:
        return wire.server_info(await self._call(self._stub.ServerInfo, pb.ServerInfoRequest()))

    async def stats(self) -> Stats:
        return wire.stats(await self._call(self._stub.Stats, pb.StatsRequest()))

    async def namespaces(self) -> list[NamespaceInfo]:
        response = await self._call(self._stub.ListNamespaces, pb.ListNamespacesRequest())
        return [wire.namespace_info(ns) for ns in response.namespaces]

    async def clear(self, ns: str | None = None) -> int:
        """Remove every block (of namespace ``ns``, or of all); returns blocks removed."""
        response = await self._call(self._stub.Clear, pb.ClearRequest(ns_id=ns or ""))
        return int(response.removed)

    async def events(
        self,
        from_seq: int = 0,
        *,
        ns_id: str = "",
        kinds: Sequence[str] = (),
        from_now: bool = False,
        duration_s: float | None = None,
    ) -> AsyncIterator[Event]:
        """Events with seq > ``from_seq``, following the stream until the caller stops
        (or ``duration_s`` passes). Leaving the ``async for`` cancels the call."""
        try:
            request = pb.WatchEventsRequest(
                from_seq=from_seq,
                from_now=from_now,
                ns_id=ns_id,
                kinds=wire.event_kind_values(kinds),
            )
        except KeyError as exc:
            raise InvalidArgumentError(f"unknown event kind {exc}") from None
        call = self._stub.WatchEvents(request, timeout=duration_s)
        try:
            async for msg in call:
                if msg.missed:
                    log.warning("kvstored dropped %d events before they were sent", msg.missed)
                for event in wire.events(msg):
                    yield event
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            if code is grpc.StatusCode.CANCELLED:
                return
            if code is grpc.StatusCode.DEADLINE_EXCEEDED and duration_s is not None:
                return
            raise self._error(exc) from None
        finally:
            call.cancel()

    # -- namespaces -----------------------------------------------------------------

    async def namespace(
        self,
        model: str,
        block_tokens: int = 16,
        block_bytes: int = 0,
        *,
        name: str = "",
        **layout: Any,
    ) -> AsyncNamespace:
        """Open (or re-open) a namespace; ``layout`` as in :meth:`KVClient.namespace`."""
        request = wire.namespace_request(model, block_tokens, block_bytes, name, layout)
        info = await self._call(self._stub.OpenNamespace, request)
        await self._refresh()  # map the arena now: opening is a connect step
        return AsyncNamespace(self, wire.namespace_info(info))

    async def open_namespace(self, ns_id: str) -> AsyncNamespace:
        """A handle on an existing namespace, by ns_id or bound name (NOT_FOUND if none)."""
        request = pb.DescribeNamespaceRequest(ns_id=ns_id)
        info = await self._call(self._stub.DescribeNamespace, request)
        await self._refresh()
        return AsyncNamespace(self, wire.namespace_info(info))


class AsyncNamespace:
    """Data calls of one namespace, as coroutines (see :class:`kvclient.Namespace`)."""

    def __init__(self, client: AsyncKVClient, info: NamespaceInfo) -> None:
        self.client = client
        self.info = info
        self.ns_id = info.ns_id
        self.block_tokens = info.block_tokens
        self.block_bytes = info.block_bytes

    def __repr__(self) -> str:
        return (
            f"AsyncNamespace({self.ns_id!r}, block_tokens={self.block_tokens}, "
            f"block_bytes={self.block_bytes})"
        )

    # -- read side ------------------------------------------------------------------

    async def lookup(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        extra_keys: wire.ExtraKeys = (),
        wait_pending_s: float = 0.0,
    ) -> LookupResult:
        request = pb.LookupRequest(
            ns_id=self.ns_id,
            tokens=as_tokens(tokens).tolist(),
            extra_keys=wire.extra_bytes(extra_keys),
            wait_pending_s=wait_pending_s,
        )
        return wire.lookup_result(await self.client._call(self.client._stub.Lookup, request))

    async def get(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        extra_keys: wire.ExtraKeys = (),
        out: np.ndarray | None = None,
    ) -> GetResult:
        token_array = as_tokens(tokens)
        token_list = token_array.tolist()
        max_blocks = check_out(out, self.block_bytes)
        _, arena = await self.client._arena_for_data()
        extra = wire.extra_bytes(extra_keys)
        if arena is None:
            return await self._get_inline(token_list, extra, out, max_blocks)
        epochs = self.client._epochs
        counted = False
        if epochs is not None:
            got = await self._get_unpinned(
                arena, epochs, token_array, token_list, extra, out, max_blocks
            )
            if got is not None:
                return got
            counted = True  # its Acquire counted this get: the copy did not check out
        return await self._get_arena(arena, token_list, extra, out, max_blocks, counted=counted)

    async def _get_unpinned(
        self,
        arena: ClientArena,
        epochs: SlotEpochs,
        token_array: np.ndarray,
        tokens: list[int],
        extra: list[bytes],
        out: np.ndarray | None,
        max_blocks: int,
    ) -> GetResult | None:
        """See :meth:`kvclient.Namespace._get_unpinned`."""
        client = self.client
        last_slots = client._last_slots
        key = last_slots.key(self.ns_id, token_array, extra, max_blocks)
        wanted = wanted_blocks(len(tokens), self.block_tokens, max_blocks)
        last = last_slots.get(key)
        reader = UnpinnedGet(epochs, arena, last, out, self.block_bytes, max_blocks, wanted)
        known = await asyncio.to_thread(reader.read_known) if reader.knows_all else None
        if known is not None:  # no call: the slots still hold the last answer's blocks
            client._report_read(key, tokens, len(known))
            return GetResult(tokens=len(known) * self.block_tokens, blocks=known)
        disk = client._disk
        if last is None and disk is not None and disk.index is not None:  # a first read
            blocks = await asyncio.to_thread(
                read_first_from_file, disk, client._disk_first, self.ns_id, key, token_array,
                extra, out, self.block_bytes, wanted,
            )  # fmt: skip
            if blocks is not None:
                client._report_read(key, tokens, wanted, from_disk=True)
                return GetResult(tokens=wanted * self.block_tokens, blocks=blocks)
        done, direct = client._take_done(), client._disk is not None
        request = wire.get_request(
            self.ns_id, tokens, extra, max_blocks, done, unpinned=True, disk_direct=direct
        )
        answer = await client._call(client._stub.Acquire, request, during=reader.copy_early)
        if answer.lease_id or arena.names_another_arena(answer.arena_path):
            # pinned after all (a block was on disk), or from a restarted daemon
            return await self._read_acquired(arena, answer, tokens, extra, out, max_blocks)
        done = await asyncio.to_thread(reader.finish, answer)
        if done is None:
            return None
        blocks, slots = done
        last_slots.remember(key, slots)
        return GetResult(tokens=len(blocks) * self.block_tokens, blocks=blocks)

    async def _get_arena(
        self,
        arena: ClientArena,
        tokens: list[int],
        extra: list[bytes],
        out: np.ndarray | None,
        max_blocks: int,
        disk_direct: bool = True,
        counted: bool = False,
    ) -> GetResult:
        """``counted``: an Acquire of this get was answered and counted already."""
        client = self.client
        direct = disk_direct and client._disk is not None
        done = client._take_done()
        request = wire.get_request(
            self.ns_id, tokens, extra, max_blocks, done, disk_direct=direct, counted=counted
        )
        acquired = await client._call(client._stub.Acquire, request)
        return await self._read_acquired(arena, acquired, tokens, extra, out, max_blocks)

    async def _read_acquired(
        self,
        arena: ClientArena,
        acquired: pb.AcquireResponse,
        tokens: list[int],
        extra: list[bytes],
        out: np.ndarray | None,
        max_blocks: int,
    ) -> GetResult:
        """Copy the blocks of a pinned Acquire answer out, then release its lease."""
        client = self.client
        if arena.names_another_arena(acquired.arena_path):  # the daemon restarted
            if acquired.lease_id:
                await client._call(
                    client._stub.Release, pb.ReleaseRequest(lease_id=acquired.lease_id)
                )
            client._info = None  # the next call maps the new arena
            return await self._get_inline(tokens, extra, out, max_blocks)
        try:
            slots = wire.slot_table(acquired)
            blocks = output_array(out, len(slots), self.block_bytes)
            host, extents = wire.split_disk_blocks(acquired, slots)
            whole = await asyncio.to_thread(
                read_answer, arena.mapping, host, extents, client._disk, blocks, self.block_bytes
            )
        finally:
            if acquired.lease_id:
                client._release_later(acquired.lease_id)
        if not whole:  # a block from the disk file failed its check: the daemon reads it
            return await self._get_arena(arena, tokens, extra, out, max_blocks, disk_direct=False)
        return GetResult(tokens=len(slots) * self.block_tokens, blocks=blocks)

    def acquire(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        extra_keys: wire.ExtraKeys = (),
        max_blocks: int = 0,
        ttl_s: float | None = None,
    ) -> AsyncAcquire:
        """Pin the cached prefix of ``tokens`` and see its blocks in place, no copy::

            async with ns.acquire(tokens) as lease:   # or: lease = await ns.acquire(...)
                for block in lease.views:             # read-only uint8[block_bytes] each
                    ...
            # released here (or by `await lease.release()`)

        Shared arena only (:class:`ArenaUnavailableError` otherwise); see
        :meth:`kvclient.Namespace.acquire`.
        """
        token_list = as_tokens(tokens).tolist()
        if max_blocks < 0:
            raise InvalidArgumentError(f"max_blocks must be >= 0, got {max_blocks}")
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidArgumentError(f"ttl_s must be > 0, got {ttl_s}")
        request = pb.AcquireRequest(
            ns_id=self.ns_id,
            tokens=token_list,
            extra_keys=wire.extra_bytes(extra_keys),
            max_blocks=max_blocks,
            ttl_s=ttl_s or 0.0,
            compact_slots=True,
        )
        return AsyncAcquire(self, request)

    async def _acquire(self, request: pb.AcquireRequest) -> AsyncBlockLease:
        client = self.client
        for _ in range(2):
            info, arena = await client._arena_for_data()
            if arena is None:
                raise ArenaUnavailableError(
                    f"zero-copy views need the shared arena of kvstored at {client.addr}, "
                    f"which cannot be mapped here (arena {info.arena_path or 'not shared'})",
                    addr=client.addr,
                )
            request.release_lease_ids[:] = client._take_done()
            acquired = await client._call(client._stub.Acquire, request)
            if not arena.names_another_arena(acquired.arena_path):
                table = wire.slot_table(acquired)
                return AsyncBlockLease(
                    client, arena, table, self.block_bytes, self.block_tokens, acquired.lease_id
                )
            if acquired.lease_id:  # the daemon restarted: map its new arena and ask again
                release = pb.ReleaseRequest(lease_id=acquired.lease_id)
                await client._call(client._stub.Release, release)
            client._info = None
        raise ArenaUnavailableError("kvstored keeps naming another arena", addr=client.addr)

    async def _get_inline(
        self, tokens: list[int], extra: list[bytes], out: np.ndarray | None, max_blocks: int
    ) -> GetResult:
        client = self.client
        blocks: np.ndarray | None = None
        received = 0
        while True:
            remaining = (max_blocks - received) if max_blocks else 0
            request = pb.GetRequest(
                ns_id=self.ns_id,
                tokens=tokens,
                extra_keys=extra,
                start_block=received,
                max_blocks=remaining,
            )
            header: pb.GetHeader | None = None
            n = filled = 0
            flat = np.empty(0, dtype=np.uint8)
            try:
                async for raw in client._get_stream(request, timeout=client.timeout):
                    if header is None:
                        header = wire.get_header(raw)
                        if header is None:
                            raise KVStoreError("kvstored sent data before the Get header")
                        if blocks is None:
                            total = header.ready_blocks
                            if max_blocks:
                                total = min(total, max_blocks)
                            blocks = output_array(out, total, self.block_bytes)
                        n = min(header.n_blocks, blocks.shape[0] - received)
                        flat = blocks[received : received + n].reshape(-1)
                        continue
                    data = wire.data_of(raw)
                    take = min(len(data), flat.size - filled)
                    if take > 0:
                        flat[filled : filled + take] = np.frombuffer(data, np.uint8, take)
                    filled += len(data)
            except grpc.RpcError as exc:
                raise client._error(exc) from None
            if header is None or blocks is None:
                raise KVStoreError("kvstored closed the Get stream before its header")
            if filled < n * self.block_bytes:
                raise KVStoreError(
                    f"Get stream ended after {filled} of {n * self.block_bytes} bytes",
                    addr=client.addr,
                )
            received += n
            if not header.truncated or n == 0 or received >= blocks.shape[0]:
                break
        return GetResult(tokens=received * self.block_tokens, blocks=blocks[:received])

    # -- write side -----------------------------------------------------------------

    async def put(
        self,
        tokens: Sequence[int] | np.ndarray,
        blocks: Any,
        start: int = 0,
        priority: int | None = None,
        *,
        extra_keys: wire.ExtraKeys = (),
    ) -> PutResult:
        result = await self._put(tokens, blocks, start, priority, extra_keys, ahead=False)
        assert isinstance(result, PutResult)
        return result

    async def put_nowait(
        self,
        tokens: Sequence[int] | np.ndarray,
        blocks: Any,
        start: int = 0,
        priority: int | None = None,
        *,
        extra_keys: wire.ExtraKeys = (),
    ) -> AsyncPendingPut:
        """Like the sync client's ``put_nowait`` (:mod:`kvclient.puts_ahead`): returns
        once the bytes are in the arena; ``await pending.result()`` for the counts."""
        result = await self._put(tokens, blocks, start, priority, extra_keys, ahead=True)
        if isinstance(result, AsyncPendingPut):
            return result
        return AsyncPendingPut.of(result, self.client.addr)

    async def _put(
        self,
        tokens: Sequence[int] | np.ndarray,
        blocks: Any,
        start: int,
        priority: int | None,
        extra_keys: wire.ExtraKeys,
        ahead: bool,
    ) -> PutResult | AsyncPendingPut:
        arr = as_tokens(tokens)
        rows = as_blocks(blocks, self.block_bytes)
        n = len(rows)
        check_cover(arr, self.block_tokens, start, n)
        check_priority(priority)
        if n == 0:
            return PutResult(stored=0, existing=0, refused=0)
        token_list = arr[: (start + n) * self.block_tokens].tolist()
        extra = wire.extra_bytes(extra_keys)
        info, arena = await self.client._arena_for_data()
        if arena is not None:
            return await self._put_arena(arena, token_list, extra, rows, start, priority, ahead)
        return await self._put_inline(info, token_list, extra, rows, start, priority)

    async def _put_arena(
        self,
        arena: ClientArena,
        tokens: list[int],
        extra: list[bytes],
        rows: np.ndarray | list[np.ndarray],
        start: int,
        priority: int | None,
        ahead: bool = False,
    ) -> PutResult | AsyncPendingPut:
        client = self.client
        stash = client._stash(self.ns_id)
        local = client._local if ahead else None
        if local is not None and len(stash) < len(rows):
            await local.read_owed(client.timeout)  # answers of puts sent ahead: more slots
        request, staged = put_reserve(
            stash, arena, self.ns_id, tokens, extra, start, len(rows), priority, ahead
        )
        sent_at = time.monotonic()
        if staged is not None and request.commit:
            return await self._send_ahead(arena, stash, request, staged, rows, start, sent_at)
        if staged is not None:  # every block into its staged slot while the Reserve flies
            bb = self.block_bytes
            try:
                reserved = await client._call(
                    client._stub.Reserve,
                    request,
                    during=lambda: write_slots(arena.mapping, staged, rows, bb, start),
                )
            except BaseException:
                stash.drop(request, client._release_later)
                raise
        else:
            reserved = await client._call(client._stub.Reserve, request)
            if arena.names_another_arena(reserved.arena_path):  # the daemon restarted
                if reserved.lease_id:
                    await _abandon_quietly(client, reserved.lease_id)
                client._info = None  # the next call maps the new arena
                info, _ = await client._refresh()
                return await self._put_inline(info, tokens, extra, rows, start, priority)
        stash.answered(sent_at, request, reserved)
        slots = wire.slot_table(reserved)
        if reserved.lease_id:
            try:
                if staged is None:
                    bb = self.block_bytes
                    await _copy_to_the_end(write_slots, arena.mapping, slots, rows, bb, start)
            except BaseException:
                await _abandon_quietly(client, reserved.lease_id)
                raise
            commit = pb.CommitRequest(lease_id=reserved.lease_id)
            if write_through(client._info):  # wait: the answer says what is durable
                answer = await client._call(client._stub.Commit, commit)
                return wire.committed_put(reserved, len(slots), answer)
            # nothing on the put's path needs the answer (see the sync client)
            await client._send(client._stub.Commit, commit)
        return PutResult(stored=len(slots), existing=reserved.existing, refused=reserved.refused)

    async def _send_ahead(
        self,
        arena: ClientArena,
        stash: SlotStash,
        request: pb.ReserveRequest,
        staged: SlotTable,
        rows: np.ndarray | list[np.ndarray],
        start: int,
        sent_at: float,
    ) -> AsyncPendingPut:
        """Like the sync client's: the copy, then the Reserve that commits, unanswered."""
        client = self.client
        try:
            bb = self.block_bytes
            await _copy_to_the_end(write_slots, arena.mapping, staged, rows, bb, start)
        except BaseException:
            stash.drop(request, client._release_later)
            raise
        local = client._local
        pending = AsyncPendingPut(
            client.addr, None if local is None else lambda: local.read_owed(client.timeout)
        )
        on_answer = answer_handler(
            pending, stash, request, sent_at, client._checked, client._release_later
        )
        await client._send(client._stub.Reserve, request, on_answer)
        return pending

    async def _put_inline(
        self,
        info: ServerInfo,
        tokens: list[int],
        extra: list[bytes],
        rows: np.ndarray | list[np.ndarray],
        start: int,
        priority: int | None,
    ) -> PutResult:
        client = self.client
        chunk = info.max_chunk_bytes or wire.DEFAULT_CHUNK_BYTES
        per_call = blocks_per_call(
            info.max_transfer_bytes, info.max_blocks_per_request, self.block_bytes
        )
        stored = existing = refused = durable = 0
        done = 0
        while done < len(rows):
            n = min(per_call, len(rows) - done)
            header = pb.PutHeader(
                ns_id=self.ns_id,
                tokens=tokens[: (start + done + n) * self.block_tokens],
                extra_keys=extra,
                start_block=start + done,
                n_blocks=n,
                priority=priority,
            )
            messages = wire.put_messages(header, rows[done : done + n], chunk)
            await client._settle()
            try:
                result = await client._put_stream(messages, timeout=client.timeout)
            except grpc.RpcError as exc:
                raise client._error(exc) from None
            stored += result.stored
            existing += result.existing
            refused += result.refused
            durable += result.durable
            done += n
            if result.refused:  # the chain is broken: later blocks have no parent
                refused += len(rows) - done
                break
        return PutResult(stored=stored, existing=existing, refused=refused, durable=durable)

    # -- early reuse ----------------------------------------------------------------

    async def claim(
        self,
        tokens: Sequence[int] | np.ndarray,
        start: int = 0,
        *,
        ttl_s: float | None = None,
        priority: int | None = None,
        extra_keys: wire.ExtraKeys = (),
    ) -> AsyncClaim:
        """See :meth:`kvclient.Namespace.claim`."""
        request = reserve_request(
            self.ns_id,
            self.block_tokens,
            tokens,
            start,
            ttl_s,
            priority,
            wire.extra_bytes(extra_keys),
        )
        _, arena = await self.client._arena_for_data()
        response = await self.client._call(self.client._stub.Reserve, request)
        if arena is not None and arena.names_another_arena(response.arena_path):
            self.client._info = None  # the daemon restarted: deliver inline this time
            arena = None
        return AsyncClaim(self, response, start, arena)

    # -- management -----------------------------------------------------------------

    async def delete(
        self, tokens: Sequence[int] | np.ndarray, start: int = 0, *, extra_keys: wire.ExtraKeys = ()
    ) -> int:
        request = pb.DeleteRequest(
            ns_id=self.ns_id,
            tokens=as_tokens(tokens).tolist(),
            extra_keys=wire.extra_bytes(extra_keys),
            start_block=check_start(start),
        )
        return int((await self.client._call(self.client._stub.Delete, request)).removed)

    async def set_priority(
        self,
        tokens: Sequence[int] | np.ndarray,
        priority: int,
        duration_s: float | None = None,
        *,
        start: int = 0,
        extra_keys: wire.ExtraKeys = (),
    ) -> int:
        check_priority(priority)
        request = pb.SetPriorityRequest(
            ns_id=self.ns_id,
            tokens=as_tokens(tokens).tolist(),
            extra_keys=wire.extra_bytes(extra_keys),
            start_block=check_start(start),
            priority=priority,
            duration_s=duration_s or 0.0,
        )
        return int((await self.client._call(self.client._stub.SetPriority, request)).changed)


class AsyncBlockLease(BlockViews):
    """A read lease on cached blocks with zero-copy views of them (from
    :meth:`AsyncNamespace.acquire`); released by ``async with`` or :meth:`release`."""

    def __init__(
        self,
        client: AsyncKVClient,
        arena: ClientArena,
        table: SlotTable,
        block_bytes: int,
        block_tokens: int,
        lease_id: int,
    ) -> None:
        super().__init__(arena.mapping, table, block_bytes, block_tokens, lease_id)
        self._client = client

    async def release(self) -> None:
        """Give the blocks back (idempotent); the views must not be used after it."""
        if self.released:
            return
        self._forget()
        self._client._release_later(self.lease_id)

    async def __aenter__(self) -> AsyncBlockLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


class AsyncAcquire:
    """What :meth:`AsyncNamespace.acquire` returns: await it for the lease, or use it
    in ``async with`` to have the lease released at the end of the block."""

    def __init__(self, ns: AsyncNamespace, request: pb.AcquireRequest) -> None:
        self._ns = ns
        self._request = request
        self._lease: AsyncBlockLease | None = None

    def __await__(self) -> Generator[Any, None, AsyncBlockLease]:
        return self._ns._acquire(self._request).__await__()

    async def __aenter__(self) -> AsyncBlockLease:
        self._lease = await self._ns._acquire(self._request)
        return self._lease

    async def __aexit__(self, *exc: object) -> None:
        if self._lease is not None:
            await self._lease.release()


async def _copy_to_the_end(copy: Callable[..., None], *args: Any) -> None:
    """``copy(*args)`` on a worker thread. Cancelled meanwhile, it waits for the copy to
    end before raising: the caller then frees the slots, which a copy still running
    would go on writing after another block got them."""
    running = asyncio.ensure_future(asyncio.to_thread(copy, *args))
    try:
        await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.wait([running])
        raise


async def _abandon_quietly(client: AsyncKVClient, lease_id: int) -> None:
    """Drop a write lease after a failed copy; the lease expiring does it otherwise."""
    try:
        await client._call(client._stub.Abandon, pb.AbandonRequest(lease_id=lease_id))
    except KVStoreError as exc:
        log.warning("abandon of lease %d failed (%s); it expires on its own", lease_id, exc)
