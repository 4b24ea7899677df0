"""The blocking client of kvstored: ``KVClient`` and its per-namespace ``Namespace`` handle.

Protocol, per call:

- ``client.namespace(model, block_tokens, block_bytes, **layout)`` -> OpenNamespace
  (idempotent on the daemon) -> a :class:`Namespace` bound to the returned ns_id.
- put, shared arena (same host): Reserve -> copy each block into its slot -> Commit;
  Abandon if anything in between raises. Only slot offsets cross the socket. Once
  the client holds staged slots (:mod:`kvclient.staged_slots`) the copy runs while
  the Reserve is in flight and the Commit is sent without waiting for its answer.
- put, inline: one client-streaming Put per batch (header, then the bytes in chunks of
  ``max_chunk_bytes``); batches of at most ``max_transfer_bytes`` of blocks, each
  starting where the previous one ended (``start_block``).
- get, shared arena: Acquire (pins the ready prefix under a read lease) -> copy out of
  the slots -> Release in a ``finally``.
- get, inline: server-streaming Get (header, then chunks); when the header says
  ``truncated``, call again from the next block.
- lookup / delete / set_priority / clear / stats / server_info: one unary call each;
  events: the WatchEvents stream, as an iterator.

The arena is used when ``use_arena`` is None (auto) or True and the daemon's
``ServerInfo.host_id`` equals this host's and its arena file maps; ``use_arena=True``
raises :class:`ArenaUnavailableError` otherwise, ``False`` always goes inline. The
mapping is made once, checked before each use (its file must still be the daemon's
arena) and made again after the daemon was unreachable or restarted.

Every grpc.RpcError becomes a :class:`kvclient.errors.KVStoreError` subclass here;
results are the frozen dataclasses of :mod:`kvclient.results`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from kvclient import wire
from kvclient.address import CHANNEL_OPTIONS, resolve_address
from kvclient.arena_path import BlockViews, ClientArena, SlotTable, start_copy_threads, write_slots
from kvclient.claims import Claim, ClaimTicket, reserve_request
from kvclient.disk_index import DiskFirstReads
from kvclient.disk_reads import DiskFile, read_answer, read_first_from_file
from kvclient.errors import (
    ArenaUnavailableError,
    DaemonUnavailableError,
    InvalidArgumentError,
    KVStoreError,
    error_from_rpc,
)
from kvclient.fork_safety import renew_in_child
from kvclient.local_calls import (
    LocalCallFailed,
    LocalCalls,
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
from kvclient.puts_ahead import PendingPut, answer_handler
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

DEFAULT_TIMEOUT_S = 30.0
RELEASE_DELAY_S = 0.05  # longest a get's read lease outlives the get (see _release_later)

_Response = TypeVar("_Response")


class KVClient:
    """Blocking client of one kvstored. Thread-safe; close it (or use ``with``)."""

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
        self._channel = self._credentials.channel(self.addr, CHANNEL_OPTIONS)
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
        self._info: ServerInfo | None = None  # None: ask the daemon again
        self._arena: ClientArena | None = None
        self._closed = False
        self._pending_since = 0.0  # when the oldest pending lease or read was queued
        self._new_thread_state()
        # calls whose answer neither a block still pinned by this client nor a read it
        # has not reported can change
        self._unordered = (self._stub.Acquire, self._stub.Lookup, self._stub.ServerInfo)
        # calls over gRPC whose leases end with this client's session (kvclient.session)
        self._session = GrpcSession(self.addr, CHANNEL_OPTIONS, self._credentials)
        self._leasing = (self._stub.Acquire, self._stub.Reserve)
        # unary calls go over the daemon's local socket while the arena is mapped
        self._local: LocalCalls | None = None
        self._local_names = {getattr(self._stub, name): name for name in UNARY_METHODS}
        # unpinned gets (kvclient.unpinned_reads): the arena's epoch table, last slots
        self._epochs: SlotEpochs | None = None
        self._last_slots = LastSlots()
        # disk_direct gets (kvclient.disk_reads): the daemon's disk file, when readable,
        # and the prefixes this client has read from it with no call (kvclient.disk_index)
        self._disk: DiskFile | None = None
        self._disk_first = DiskFirstReads()
        # arena puts: the staged slots of each namespace (kvclient.staged_slots)
        self._stashes: dict[str, SlotStash] = {}
        renew_in_child(self)

    def _after_fork_in_child(self) -> None:
        self._new_thread_state()

    def _new_thread_state(self) -> None:
        """The client's locks, flusher and the flusher's work, all new: at creation,
        and again in a forked child (a thread of the parent, its flusher say, may have
        held a lock at the fork and would never release it there; the parent's pending
        releases and reads are the parent's to send)."""
        self._lock = threading.Lock()
        # read leases done with, not released yet (see _release_later), and gets served
        # from known slots, not reported yet (see _report_read): the flusher's work
        self._done: list[int] = []
        self._reads = ReadReports()
        self._settling = threading.Lock()  # held while pending work is sent (_settle)
        self._done_cond = threading.Condition()
        self._flusher: threading.Thread | None = None
        self._flusher_parked = False  # waiting for work (else: for a pending lease's due time)

    # -- lifecycle ------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel and unmap the arena. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            arena, self._arena = self._arena, None
        with self._done_cond:
            self._done_cond.notify_all()  # the flusher exits
            # staging leases go with the read leases: their slots come back at once
            staging = (stash.detach() for stash in self._stashes.values())
            self._done.extend(lease_id for lease_id in staging if lease_id)
        self._settle()
        self._session.close()
        self._channel.close()
        if arena is not None:
            arena.close()
        if self._local is not None:
            self._local.close()
        if self._disk is not None:
            self._disk.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVClient({self.addr!r}, use_arena={self.use_arena})"

    # -- plumbing -------------------------------------------------------------------

    def _call(
        self,
        method: Callable[..., _Response],
        request: Any,
        during: Callable[[], None] | None = None,
        settle: bool = True,
    ) -> _Response:
        """One unary call; every gRPC error becomes a KVStoreError. ``during`` runs
        while the call is in flight (local calls), else before it."""
        pending = self._done or self._reads or self._settling.locked()
        if settle and pending and method not in self._unordered:
            self._settle()  # ``settle`` False: the calls of _settle itself
        local = self._local
        if local is not None:
            name = self._local_names.get(method)
            if name is not None:
                try:
                    return local.call(name, request, self.timeout, during)
                except LocalCallStatus as exc:
                    raise self._checked(exc.error(self.addr)) from None
                except LocalCallFailed as exc:
                    self._local_failed(local, exc)  # raises unless gRPC may take the call
        if during is not None:
            during()
        return self._call_grpc(method, request)

    def _send(
        self, method: Callable[..., Any], request: Any, on_answer: OnAnswer | None = None
    ) -> None:
        """Send a call whose answer nothing waits for (an arena put's Commit, a put sent
        ahead): over the local socket without waiting (LocalCalls.send), else as a plain
        call. ``on_answer`` gets the answer when it is read (an error raised here is
        handed to it too)."""
        local = self._local
        name = self._local_names.get(method)
        try:
            if local is not None and name is not None:
                try:
                    local.send(name, request, self.timeout, on_answer)
                    return
                except LocalCallFailed as exc:
                    self._local_failed(local, exc)  # raises unless gRPC may take the call
            reply = self._call(method, request)
        except KVStoreError as error:
            if on_answer is not None:
                on_answer(None, error)
            raise
        if on_answer is not None:
            on_answer(reply, None)

    def _stash(self, ns_id: str) -> SlotStash:
        with self._lock:
            return self._stashes.setdefault(ns_id, SlotStash())

    def _call_grpc(self, method: Callable[..., _Response], request: Any) -> _Response:
        try:
            if method in self._leasing:
                metadata = self._session.metadata(wait=True)
                return method(request, timeout=self.timeout, metadata=metadata)
            return method(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def _local_failed(self, local: LocalCalls, exc: LocalCallFailed) -> None:
        """Stop using a local socket that failed; raise unless the call never left."""
        with self._lock:
            if self._local is local:
                self._local, self._info = None, None  # asked again at the next data call
        local.close()
        raise_local_failure(exc, self.addr, self.timeout)

    def _release_later(self, lease_id: int) -> None:
        """Release a read lease without a round trip of its own.

        The lease id rides on this client's next Acquire (``release_lease_ids``), so a
        loop of gets costs one call per get instead of two. Until then the blocks stay
        pinned, never longer than RELEASE_DELAY_S: a flusher thread sends a Release for
        whatever is still pending then. Every call whose answer a pin could change
        (put, delete, clear, stats ...: all but Acquire, Lookup, ServerInfo) first
        releases what is pending, so this client never sees its own stale pins.
        """
        with self._done_cond:
            self._mark_pending()
            self._done.append(lease_id)
            self._wake_flusher(now=False)

    def _report_read(
        self, key: ReadKey, tokens: list[int], n_blocks: int, from_disk: bool = False
    ) -> None:
        """Tell the daemon, later, of a get served from known slots (no call of its
        own: see :mod:`kvclient.unpinned_reads`) or ``from_disk`` (the disk file:
        :mod:`kvclient.disk_index`), so that it counts the hits and touches the blocks.
        Reads ride with the pending releases: sent within RELEASE_DELAY_S
        (at once when many prefixes are pending), and before any call whose answer
        they could change (Stats ...), so this client sees its own reads counted."""
        with self._done_cond:
            self._mark_pending()
            full = self._reads.add(key, tokens, n_blocks, from_disk)
            self._wake_flusher(now=full)

    def _mark_pending(self) -> None:
        """Under _done_cond, before queueing work: start the delay if none was queued."""
        if not self._done and not self._reads:
            self._pending_since = time.monotonic()

    def _wake_flusher(self, now: bool) -> None:
        """Under _done_cond: start the flusher, or wake it when idle (not per get: a
        thread hop), or when the work is due ``now``."""
        if now:
            self._pending_since = 0.0
        # not alive: never started, or started in the parent before a fork
        if (self._flusher is None or not self._flusher.is_alive()) and not self._closed:
            self._flusher = threading.Thread(
                target=self._flush_loop, name="kvclient-release", daemon=True
            )
            self._flusher.start()
        elif self._flusher_parked or now:
            self._done_cond.notify()

    def _take_done(self) -> list[int]:
        """The pending lease ids, for a request that releases them."""
        if not self._done:
            return []
        with self._done_cond:
            done, self._done = self._done, []
        return done

    def _settle(self) -> None:
        """Release the pending leases (one Release call for all of them) and report the
        pending reads (one ReportReads) now. A settle in flight (the flusher's) is waited
        for: any call made after this returns comes after every release and report."""
        with self._settling:
            done = self._take_done()
            reads = self._reads.take()
            if done:
                request = pb.ReleaseRequest(lease_id=done[0], more_lease_ids=done[1:])
                try:
                    self._call(self._stub.Release, request, settle=False)
                except KVStoreError as exc:
                    # the first lease ran out (the others are released all the same), or the
                    # daemon is gone (and its leases with it)
                    log.debug("release of %d leases: %s", len(done), exc)
            if reads is not None:
                try:
                    self._call(self._stub.ReportReads, reads, settle=False)
                except KVStoreError as exc:  # the daemon restarted, a namespace is gone ...
                    log.debug("report of reads of %d prefixes: %s", len(reads.prefixes), exc)

    def _flush_loop(self) -> None:
        """Release leases pending for RELEASE_DELAY_S. Wakes once per delay while gets
        go on (their own Acquires carry the releases), parks when there is nothing."""
        cond = self._done_cond
        while True:
            with cond:
                if self._closed:
                    return
                if not self._done and not self._reads:
                    self._flusher_parked = True
                    cond.wait()
                    self._flusher_parked = False
                    continue
                wait = self._pending_since + RELEASE_DELAY_S - time.monotonic()
                if wait > 0:
                    cond.wait(wait)
                    continue
            self._settle()

    def _error(self, exc: grpc.RpcError) -> KVStoreError:
        return self._checked(error_from_rpc(exc, self.addr))

    def _checked(self, error: KVStoreError) -> KVStoreError:
        if isinstance(error, DaemonUnavailableError):
            self._info = None  # it may come back as a new process with a new arena
        return error

    def _refresh(self) -> tuple[ServerInfo, ClientArena | None]:
        """Server info and the arena mapping; asked again after the daemon was unreachable
        or when the mapped arena file is no longer the daemon's."""
        with self._lock:
            info, arena = self._info, self._arena
            if info is not None and (arena is None or arena.is_current()):
                return info, arena
            # over gRPC: it names the local socket, and a dead one must not hide it
            request = pb.ServerInfoRequest()
            info = wire.server_info(self._call_grpc(self._stub.ServerInfo, request))
            old, arena = self._arena, None
            if self.use_arena is not False:
                arena = ClientArena.open(info.arena_path, info.host_id, host_id())
            old_local, local = self._local, None
            if arena is not None and info.local_socket:
                local = LocalCalls(info.local_socket, self._credentials.token, info.uid)
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

    def _arena_for_data(self) -> tuple[ServerInfo, ClientArena | None]:
        info, arena = self._refresh()
        if arena is None and self.use_arena:
            raise ArenaUnavailableError(
                f"the shared arena of kvstored at {self.addr} cannot be mapped here "
                f"(arena {info.arena_path or 'not shared'}, same host: "
                f"{info.host_id == host_id()})",
                addr=self.addr,
            )
        return info, arena

    @property
    def arena_in_use(self) -> bool:
        """Whether data calls go through the shared arena (asks the daemon once)."""
        return self._arena_for_data()[1] is not None

    # -- daemon-wide calls ----------------------------------------------------------

    def server_info(self) -> ServerInfo:
        return wire.server_info(self._call(self._stub.ServerInfo, pb.ServerInfoRequest()))

    def stats(self) -> Stats:
        return wire.stats(self._call(self._stub.Stats, pb.StatsRequest()))

    def namespaces(self) -> list[NamespaceInfo]:
        response = self._call(self._stub.ListNamespaces, pb.ListNamespacesRequest())
        return [wire.namespace_info(ns) for ns in response.namespaces]

    def clear(self, ns: str | None = None) -> int:
        """Remove every block (of namespace ``ns``, or of all); returns blocks removed."""
        return int(self._call(self._stub.Clear, pb.ClearRequest(ns_id=ns or "")).removed)

    def events(
        self,
        from_seq: int = 0,
        *,
        ns_id: str = "",
        kinds: Sequence[str] = (),
        from_now: bool = False,
        duration_s: float | None = None,
    ) -> Iterator[Event]:
        """Events with seq > ``from_seq``, following the stream until the caller stops
        iterating (or ``duration_s`` passes). Breaking out of the loop cancels the call."""
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
            for msg in call:
                if msg.missed:
                    log.warning("kvstored dropped %d events before they were sent", msg.missed)
                yield from wire.events(msg)
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

    def namespace(
        self,
        model: str,
        block_tokens: int = 16,
        block_bytes: int = 0,
        *,
        name: str = "",
        **layout: Any,
    ) -> Namespace:
        """Open (or re-open) a namespace; ``layout``: num_layers, num_kv_heads, head_dim,
        dtype, rank, world_size, tenant_salt, hash_algorithm, vocab_size."""
        request = wire.namespace_request(model, block_tokens, block_bytes, name, layout)
        info = wire.namespace_info(self._call(self._stub.OpenNamespace, request))
        self._refresh()  # map the arena now: opening is a connect step, not a first get
        return Namespace(self, info)

    def open_namespace(self, ns_id: str) -> Namespace:
        """A handle on an existing namespace, by ns_id or bound name (NOT_FOUND if none)."""
        request = pb.DescribeNamespaceRequest(ns_id=ns_id)
        info = wire.namespace_info(self._call(self._stub.DescribeNamespace, request))
        self._refresh()
        return Namespace(self, info)


class Namespace:
    """Data calls of one namespace. Tokens: list or ndarray of ints (the whole prompt
    from its first token); blocks: ``[n_blocks, block_bytes]`` array or bytes-likes."""

    def __init__(self, client: KVClient, info: NamespaceInfo) -> None:
        self.client = client
        self.info = info
        self.ns_id = info.ns_id
        self.block_tokens = info.block_tokens
        self.block_bytes = info.block_bytes

    def __repr__(self) -> str:
        return (
            f"Namespace({self.ns_id!r}, block_tokens={self.block_tokens}, "
            f"block_bytes={self.block_bytes})"
        )

    # -- read side ------------------------------------------------------------------

    def lookup(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        extra_keys: wire.ExtraKeys = (),
        wait_pending_s: float = 0.0,
    ) -> LookupResult:
        """Longest cached prefix of ``tokens`` (and what other sessions are computing)."""
        request = pb.LookupRequest(
            ns_id=self.ns_id,
            tokens=as_tokens(tokens).tolist(),
            extra_keys=wire.extra_bytes(extra_keys),
            wait_pending_s=wait_pending_s,
        )
        return wire.lookup_result(self.client._call(self.client._stub.Lookup, request))

    def get(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        extra_keys: wire.ExtraKeys = (),
        out: np.ndarray | None = None,
    ) -> GetResult:
        """Bytes of the longest cached prefix: ``uint8[n_blocks, block_bytes]``.

        ``out`` (``uint8[k, block_bytes]``, C-contiguous) is filled instead of a new
        array, and caps the blocks returned at k: reuse it across calls.
        """
        token_array = as_tokens(tokens)
        token_list = token_array.tolist()
        max_blocks = check_out(out, self.block_bytes)
        _, arena = self.client._arena_for_data()
        extra = wire.extra_bytes(extra_keys)
        if arena is None:
            return self._get_inline(token_list, extra, out, max_blocks)
        epochs = self.client._epochs
        counted = False
        if epochs is not None:
            got = self._get_unpinned(arena, epochs, token_array, token_list, extra, out, max_blocks)
            if got is not None:
                return got
            counted = True  # its Acquire counted this get: the copy did not check out
        return self._get_arena(arena, token_list, extra, out, max_blocks, counted=counted)

    def _get_unpinned(
        self,
        arena: ClientArena,
        epochs: SlotEpochs,
        token_array: np.ndarray,
        tokens: list[int],
        extra: list[bytes],
        out: np.ndarray | None,
        max_blocks: int,
    ) -> GetResult | None:
        """A get that pins nothing and copies while its Acquire is in flight (see
        kvclient.unpinned_reads); None when a slot changed under a copy (the only
        None: the daemon has counted this get by then)."""
        client = self.client
        last_slots = client._last_slots
        key = last_slots.key(self.ns_id, token_array, extra, max_blocks)
        wanted = wanted_blocks(len(tokens), self.block_tokens, max_blocks)
        last = last_slots.get(key)
        reader = UnpinnedGet(epochs, arena, last, out, self.block_bytes, max_blocks, wanted)
        known = reader.read_known()
        if known is not None:  # no call: the slots still hold the last answer's blocks
            client._report_read(key, tokens, len(known))
            return GetResult(tokens=len(known) * self.block_tokens, blocks=known)
        if last is None:  # a first read: the prefix may be on disk (kvclient.disk_index)
            blocks = read_first_from_file(
                client._disk, client._disk_first, self.ns_id, key, token_array, extra, out,
                self.block_bytes, wanted,
            )  # fmt: skip
            if blocks is not None:
                client._report_read(key, tokens, wanted, from_disk=True)
                return GetResult(tokens=wanted * self.block_tokens, blocks=blocks)
        done, direct = client._take_done(), client._disk is not None
        request = wire.get_request(
            self.ns_id, tokens, extra, max_blocks, done, unpinned=True, disk_direct=direct
        )
        answer = client._call(client._stub.Acquire, request, during=reader.copy_early)
        if answer.lease_id or arena.names_another_arena(answer.arena_path):
            # pinned after all (a block was on disk), or from a restarted daemon
            return self._read_acquired(arena, answer, tokens, extra, out, max_blocks)
        done = reader.finish(answer)
        if done is None:
            return None
        blocks, slots = done
        last_slots.remember(key, slots)
        return GetResult(tokens=len(blocks) * self.block_tokens, blocks=blocks)

    def _get_arena(
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
        acquired = client._call(client._stub.Acquire, request)
        return self._read_acquired(arena, acquired, tokens, extra, out, max_blocks)

    def _read_acquired(
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
                client._call(client._stub.Release, pb.ReleaseRequest(lease_id=acquired.lease_id))
            client._info = None  # the next call maps the new arena
            return self._get_inline(tokens, extra, out, max_blocks)
        try:
            slots = wire.slot_table(acquired)
            blocks = output_array(out, len(slots), self.block_bytes)
            host, extents = wire.split_disk_blocks(acquired, slots)
            whole = read_answer(
                arena.mapping, host, extents, client._disk, blocks, self.block_bytes
            )
        finally:
            if acquired.lease_id:
                client._release_later(acquired.lease_id)
        if not whole:  # a block from the disk file failed its check: the daemon reads it
            return self._get_arena(arena, tokens, extra, out, max_blocks, disk_direct=False)
        return GetResult(tokens=len(slots) * self.block_tokens, blocks=blocks)

    def acquire(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        extra_keys: wire.ExtraKeys = (),
        max_blocks: int = 0,
        ttl_s: float | None = None,
    ) -> BlockLease:
        """Pin the cached prefix of ``tokens`` and see its blocks in place, no copy::

            with ns.acquire(tokens) as lease:      # lease.tokens cached tokens
                for block in lease.views:          # read-only uint8[block_bytes] each
                    ...                            # e.g. copy to the GPU
            # released here: the views must not be used any more

        Shared arena only (:class:`ArenaUnavailableError` otherwise). The lease lasts
        ``ttl_s`` (the daemon's default when None) unless released first.
        """
        token_list = as_tokens(tokens).tolist()
        if max_blocks < 0:
            raise InvalidArgumentError(f"max_blocks must be >= 0, got {max_blocks}")
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidArgumentError(f"ttl_s must be > 0, got {ttl_s}")
        client = self.client
        request = pb.AcquireRequest(
            ns_id=self.ns_id,
            tokens=token_list,
            extra_keys=wire.extra_bytes(extra_keys),
            max_blocks=max_blocks,
            ttl_s=ttl_s or 0.0,
            compact_slots=True,
        )
        for _ in range(2):
            info, arena = client._arena_for_data()
            if arena is None:
                raise ArenaUnavailableError(
                    f"zero-copy views need the shared arena of kvstored at {client.addr}, "
                    f"which cannot be mapped here (arena {info.arena_path or 'not shared'})",
                    addr=client.addr,
                )
            request.release_lease_ids[:] = client._take_done()
            acquired = client._call(client._stub.Acquire, request)
            if not arena.names_another_arena(acquired.arena_path):
                table = wire.slot_table(acquired)
                return BlockLease(
                    client, arena, table, self.block_bytes, self.block_tokens, acquired.lease_id
                )
            if acquired.lease_id:  # the daemon restarted: map its new arena and ask again
                client._call(client._stub.Release, pb.ReleaseRequest(lease_id=acquired.lease_id))
            client._info = None
        raise ArenaUnavailableError("kvstored keeps naming another arena", addr=client.addr)

    def _get_inline(
        self, tokens: list[int], extra: list[bytes], out: np.ndarray | None, max_blocks: int
    ) -> GetResult:
        client = self.client
        blocks: np.ndarray | None = None
        received = 0  # blocks written into `blocks`
        while True:
            remaining = (max_blocks - received) if max_blocks else 0
            request = pb.GetRequest(
                ns_id=self.ns_id,
                tokens=tokens,
                extra_keys=extra,
                start_block=received,
                max_blocks=remaining,
            )
            try:
                stream = client._get_stream(request, timeout=client.timeout)
                header = wire.get_header(next(stream))
                if header is None:
                    raise KVStoreError("kvstored sent data before the Get header")
                if blocks is None:
                    total = header.ready_blocks
                    if max_blocks:
                        total = min(total, max_blocks)
                    blocks = output_array(out, total, self.block_bytes)
                # another client may have evicted part of the prefix between calls
                n = min(header.n_blocks, blocks.shape[0] - received)
                flat = blocks[received : received + n].reshape(-1)
                filled = 0
                for raw in stream:
                    data = wire.data_of(raw)
                    take = min(len(data), flat.size - filled)
                    if take > 0:
                        flat[filled : filled + take] = np.frombuffer(data, np.uint8, take)
                    filled += len(data)
            except grpc.RpcError as exc:
                raise client._error(exc) from None
            except StopIteration:
                raise KVStoreError("kvstored closed the Get stream before its header") from None
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

    def put(
        self,
        tokens: Sequence[int] | np.ndarray,
        blocks: Any,
        start: int = 0,
        priority: int | None = None,
        *,
        extra_keys: wire.ExtraKeys = (),
    ) -> PutResult:
        """Store ``blocks[i]`` as the block ``start + i`` of ``tokens``' chain.

        Blocks before ``start`` must already be stored (else the offer is refused).
        """
        result = self._put(tokens, blocks, start, priority, extra_keys, ahead=False)
        assert isinstance(result, PutResult)
        return result

    def put_nowait(
        self,
        tokens: Sequence[int] | np.ndarray,
        blocks: Any,
        start: int = 0,
        priority: int | None = None,
        *,
        extra_keys: wire.ExtraKeys = (),
    ) -> PendingPut:
        """Like :meth:`put`, but return once the bytes are in the daemon's arena,
        without waiting for its answer (:mod:`kvclient.puts_ahead`): the counts, or the
        daemon's error, come from the returned PendingPut's ``result()``. The blocks are
        ``blocks``' bytes at the time of the call. Without the arena it is a plain put."""
        result = self._put(tokens, blocks, start, priority, extra_keys, ahead=True)
        if isinstance(result, PendingPut):
            return result
        return PendingPut.of(result, self.client.addr)

    def _put(
        self,
        tokens: Sequence[int] | np.ndarray,
        blocks: Any,
        start: int,
        priority: int | None,
        extra_keys: wire.ExtraKeys,
        ahead: bool,
    ) -> PutResult | PendingPut:
        arr = as_tokens(tokens)
        rows = as_blocks(blocks, self.block_bytes)
        n = len(rows)
        check_cover(arr, self.block_tokens, start, n)
        check_priority(priority)
        if n == 0:
            return PutResult(stored=0, existing=0, refused=0)
        token_list = arr[: (start + n) * self.block_tokens].tolist()
        extra = wire.extra_bytes(extra_keys)
        info, arena = self.client._arena_for_data()
        if arena is not None:
            return self._put_arena(arena, token_list, extra, rows, start, priority, ahead)
        return self._put_inline(info, token_list, extra, rows, start, priority)

    def _put_arena(
        self,
        arena: ClientArena,
        tokens: list[int],
        extra: list[bytes],
        rows: np.ndarray | list[np.ndarray],
        start: int,
        priority: int | None,
        ahead: bool = False,
    ) -> PutResult | PendingPut:
        client = self.client
        stash = client._stash(self.ns_id)
        local = client._local if ahead else None
        if local is not None and len(stash) < len(rows):
            local.poll_owed()  # answers of earlier puts sent ahead bring more slots
            if len(stash) < len(rows):
                local.read_owed(client.timeout)
        request, staged = put_reserve(
            stash, arena, self.ns_id, tokens, extra, start, len(rows), priority, ahead
        )
        sent_at = time.monotonic()
        if staged is not None and request.commit:
            return self._send_ahead(arena, stash, request, staged, rows, start, sent_at)
        if staged is not None:  # every block into its staged slot while the Reserve flies
            bb = self.block_bytes
            try:
                reserved = client._call(
                    client._stub.Reserve,
                    request,
                    during=lambda: write_slots(arena.mapping, staged, rows, bb, start),
                )
            except BaseException:
                stash.drop(request, client._release_later)
                raise
        else:
            reserved = client._call(client._stub.Reserve, request)
            if arena.names_another_arena(reserved.arena_path):  # the daemon restarted
                if reserved.lease_id:
                    _abandon_quietly(client, reserved.lease_id)
                client._info = None  # the next call maps the new arena
                info, _ = client._refresh()
                return self._put_inline(info, tokens, extra, rows, start, priority)
        stash.answered(sent_at, request, reserved)
        slots = wire.slot_table(reserved)
        if reserved.lease_id:
            try:
                if staged is None:
                    write_slots(arena.mapping, slots, rows, self.block_bytes, start)
            except BaseException:
                _abandon_quietly(client, reserved.lease_id)
                raise
            commit = pb.CommitRequest(lease_id=reserved.lease_id)
            if write_through(client._info):  # wait: the answer says what is durable
                answer = client._call(client._stub.Commit, commit)
                return wire.committed_put(reserved, len(slots), answer)
            # nothing on the put's path needs the answer: this client's next call on
            # the connection reads it, and runs after the commit
            client._send(client._stub.Commit, commit)
        return PutResult(stored=len(slots), existing=reserved.existing, refused=reserved.refused)

    def _send_ahead(
        self,
        arena: ClientArena,
        stash: SlotStash,
        request: pb.ReserveRequest,
        staged: SlotTable,
        rows: np.ndarray | list[np.ndarray],
        start: int,
        sent_at: float,
    ) -> PendingPut:
        """Copy every block into its staged slot, then send the Reserve that commits
        them without waiting (:mod:`kvclient.puts_ahead`)."""
        client = self.client
        try:
            write_slots(arena.mapping, staged, rows, self.block_bytes, start)
        except BaseException:
            stash.drop(request, client._release_later)
            raise
        local = client._local
        pending = PendingPut(
            client.addr, None if local is None else lambda: local.read_owed(client.timeout)
        )
        on_answer = answer_handler(
            pending, stash, request, sent_at, client._checked, client._release_later
        )
        client._send(client._stub.Reserve, request, on_answer)
        return pending

    def _put_inline(
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
            client._settle()
            try:
                result = client._put_stream(messages, timeout=client.timeout)
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

    def claim(
        self,
        tokens: Sequence[int] | np.ndarray,
        start: int = 0,
        *,
        ttl_s: float | None = None,
        priority: int | None = None,
        extra_keys: wire.ExtraKeys = (),
    ) -> Claim:
        """Claim the full blocks of ``tokens`` from ``start`` that nobody has yet: they
        become pending (other sessions see them and may wait) and this session delivers
        them with ``Claim.fill`` as it computes them. See :mod:`kvclient.claims`.

        Raises OutOfSpaceError when no block can be claimed for lack of room (compute
        without storing).
        """
        request = reserve_request(
            self.ns_id,
            self.block_tokens,
            tokens,
            start,
            ttl_s,
            priority,
            wire.extra_bytes(extra_keys),
        )
        _, arena = self.client._arena_for_data()
        response = self.client._call(self.client._stub.Reserve, request)
        if arena is not None and arena.names_another_arena(response.arena_path):
            self.client._info = None  # the daemon restarted: deliver inline this time
            arena = None
        return Claim(self, response, start, arena)

    def resume_claim(self, ticket: ClaimTicket) -> Claim:
        """The claim of ``ticket`` (made by another client, :meth:`Claim.ticket`), to
        deliver its remaining blocks from this client. No call is made."""
        if ticket.ns_id != self.ns_id:
            raise InvalidArgumentError(
                f"the claim is of namespace {ticket.ns_id}, not of {self.ns_id}"
            )
        response = pb.ReserveResponse.FromString(ticket.response)
        _, arena = self.client._arena_for_data()
        if arena is not None and arena.names_another_arena(response.arena_path):
            arena = None  # made before the daemon restarted: its lease is gone anyway
        claim = Claim(self, response, ticket.start, arena)
        claim.delivered = ticket.delivered
        return claim

    # -- management -----------------------------------------------------------------

    def delete(
        self, tokens: Sequence[int] | np.ndarray, start: int = 0, *, extra_keys: wire.ExtraKeys = ()
    ) -> int:
        """Remove block ``start`` of the chain and everything below it; returns blocks removed."""
        request = pb.DeleteRequest(
            ns_id=self.ns_id,
            tokens=as_tokens(tokens).tolist(),
            extra_keys=wire.extra_bytes(extra_keys),
            start_block=check_start(start),
        )
        return int(self.client._call(self.client._stub.Delete, request).removed)

    def set_priority(
        self,
        tokens: Sequence[int] | np.ndarray,
        priority: int,
        duration_s: float | None = None,
        *,
        start: int = 0,
        extra_keys: wire.ExtraKeys = (),
    ) -> int:
        """Set the priority (0..100) of the stored blocks of ``tokens`` from ``start``;
        after ``duration_s`` they fall back to the default. Returns blocks changed."""
        check_priority(priority)
        request = pb.SetPriorityRequest(
            ns_id=self.ns_id,
            tokens=as_tokens(tokens).tolist(),
            extra_keys=wire.extra_bytes(extra_keys),
            start_block=check_start(start),
            priority=priority,
            duration_s=duration_s or 0.0,
        )
        return int(self.client._call(self.client._stub.SetPriority, request).changed)


class BlockLease(BlockViews):
    """A read lease on cached blocks with zero-copy views of them (from
    :meth:`Namespace.acquire`); released by ``with`` or :meth:`release`."""

    def __init__(
        self,
        client: KVClient,
        arena: ClientArena,
        table: Any,
        block_bytes: int,
        block_tokens: int,
        lease_id: int,
    ) -> None:
        super().__init__(arena.mapping, table, block_bytes, block_tokens, lease_id)
        self._client = client

    def release(self) -> None:
        """Give the blocks back (idempotent); the views must not be used after it."""
        if self.released:
            return
        self._forget()
        self._client._release_later(self.lease_id)

    def __enter__(self) -> BlockLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# -- helpers -------------------------------------------------------------------------


def commit_filled(
    client: KVClient, reserved: pb.ReserveResponse, n_slots: int, fill: Callable[[], object]
) -> PutResult:
    """The end of an arena put: ``fill`` the ``n_slots`` slots a Reserve answered, then
    Commit them; Abandon if anything raises (the pending blocks are dropped)."""
    answer = None
    if reserved.lease_id:
        try:
            fill()
            commit = pb.CommitRequest(lease_id=reserved.lease_id)
            answer = client._call(client._stub.Commit, commit)
        except BaseException:
            _abandon_quietly(client, reserved.lease_id)
            raise
    return wire.committed_put(reserved, n_slots, answer)


def _abandon_quietly(client: KVClient, lease_id: int) -> None:
    """Drop a write lease after a failed copy; the lease expiring does it otherwise."""
    try:
        client._call(client._stub.Abandon, pb.AbandonRequest(lease_id=lease_id))
    except KVStoreError as exc:
        log.warning("abandon of lease %d failed (%s); it expires on its own", lease_id, exc)
