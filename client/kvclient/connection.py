"""The client's core: one client's link to one daemon, with no I/O of its own.

A :class:`Connection` holds what a client knows of its daemon (its ServerInfo, the
arena mapping, the transports, the staged slots of each namespace, the pending
accounting) and writes the client's plumbing as ops (:mod:`kvclient.effects`):

- :meth:`call`: one unary call. It sends the pending accounting first when the call's
  answer could depend on it (:mod:`kvclient.accounting`), goes over the local-call
  socket when there is one and over gRPC otherwise, and turns every failure into a
  :class:`kvclient.errors.KVStoreError`. A local call that certainly did not leave
  (the socket was gone) goes over gRPC instead, and the local socket is dropped until
  the next :meth:`refresh`. ``during`` is CPU work to run while the call is in
  flight (locally), or before it (gRPC); but a Reserve whose ``during`` copies into
  staged slots is not sent over gRPC after its local call failed (the socket gone: a
  daemon that restarted may never have given those slots): :class:`StagedSlotsLost`.
- :meth:`send`: a call whose answer nothing waits for (local socket), else a call.
- :meth:`refresh`: the daemon's ServerInfo (over gRPC: it names the local socket) and
  what follows from it: the arena mapping when the daemon is on this host and its
  arena maps (``use_arena``), the local socket, the slot epoch table.
  Asked again after the daemon was unreachable (:meth:`checked`) or when the mapped
  arena file is no longer the daemon's (a restart).

The operations of a namespace are in :mod:`kvclient.reads` and :mod:`kvclient.writes`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from kvclient import wire
from kvclient.accounting import UNORDERED, Accounting
from kvclient.arena_path import ClientArena, start_copy_threads
from kvclient.effects import Io, Op, Serial, Work
from kvclient.errors import (
    ArenaUnavailableError,
    DaemonUnavailableError,
    InvalidArgumentError,
    KVStoreError,
    NamespaceNotFoundError,
    error_from_rpc,
)
from kvclient.fork_safety import renew_in_child
from kvclient.local_calls import (
    LocalCallFailed,
    LocalCalls,
    LocalCallStatus,
    OnAnswer,
    Sockets,
    raise_local_failure,
)
from kvclient.puts_ahead import PendingPut
from kvclient.staged_slots import SlotStash
from kvclient.transport import GrpcTransport
from kvclient.unpinned_reads import LastSlots, epoch_table
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import result_messages
from kvproto.v1.host import host_id
from kvproto.v1.local_calls import UNARY_METHODS
from kvproto.v1.results import Event, NamespaceInfo, PutResult, ServerInfo, Stats
from kvstore.host.slot_epochs import SlotEpochs

log = logging.getLogger(__name__)
T = TypeVar("T")


class StagedSlotsLost(Exception):
    """A Reserve whose blocks go into staged slots found the local-call socket gone
    before it left: the daemon may have restarted, and those slots, and the staging
    lease, may no longer be this client's. Nothing was copied; the put starts again
    without them (:meth:`kvclient.writes.Put.send`)."""


class Connection:
    """The core of one client (see the module docstring)."""

    def __init__(
        self,
        addr: str,
        grpc_transport: GrpcTransport,
        sockets: Sockets,
        token: str,
        *,
        use_arena: bool | None,
        timeout: float,
        wake: Callable[[bool], None],
        drive: Callable[[Op[Any]], Any],
        new_event: Callable[[], Any],
    ) -> None:
        """What the driver supplies: ``sockets`` does the I/O of its local calls,
        ``wake`` is its accounting timer (kvclient.accounting), ``drive`` runs an op
        (returning the result, or an awaitable of it) and ``new_event`` makes an event
        its Wait effect waits on."""
        self.drive = drive
        self.new_event = new_event
        self.addr = addr
        self.use_arena = use_arena
        self.timeout = timeout
        self.grpc = grpc_transport
        self._sockets = sockets
        self._token = token
        self.info: ServerInfo | None = None  # None: ask the daemon again
        self.arena: ClientArena | None = None
        self.local: LocalCalls | None = None  # while the arena is mapped
        # unpinned gets (kvclient.unpinned_reads): the arena's epoch table, last slots
        self.epochs: SlotEpochs | None = None
        self.last_slots = LastSlots()
        self.accounting = Accounting(wake)
        self.closed = False
        self._lock = threading.Lock()
        self._stashes: dict[str, SlotStash] = {}  # arena puts' staged slots, per namespace
        self._opens: dict[str, Any] = {}  # ns_id -> the OpenNamespace that opened it
        renew_in_child(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self.accounting.renew()

    def pending_put(self) -> PendingPut:
        return PendingPut(self)

    def resolved(self, result: PutResult) -> PendingPut:
        """The outcome of a put that needed no answer to wait for."""
        pending = PendingPut(self)
        pending.resolve(result, None)
        return pending

    def stash(self, ns_id: str) -> SlotStash:
        with self._lock:
            return self._stashes.setdefault(ns_id, SlotStash())

    # -- calls ----------------------------------------------------------------------

    def call(self, name: str, request: Any, during: Callable[[], None] | None = None) -> Op[Any]:
        """One unary call (see the module docstring)."""
        if name not in UNORDERED and self.accounting.pending():
            yield from self.settle()
        return (yield from self._call(name, request, during))

    def _call(self, name: str, request: Any, during: Callable[[], None] | None = None) -> Op[Any]:
        local = self.local
        if local is not None and name in UNARY_METHODS:
            try:
                return (yield from local.call(name, request, self.timeout, during))
            except LocalCallStatus as exc:
                raise self.checked(exc.error(self.addr)) from None
            except LocalCallFailed as exc:
                self._local_failed(local, exc)  # raises unless gRPC may take the call
                if name == "Reserve" and during is not None:
                    raise StagedSlotsLost(str(exc)) from None
        if during is not None:
            yield Work(during)
        return (yield from self.over_grpc(Io(self.grpc.call, (name, request))))

    def over_grpc(self, io: Io) -> Op[Any]:
        """A gRPC call, its error as a KVStoreError."""
        try:
            return (yield io)
        except grpc.RpcError as exc:
            raise self.error(exc) from None

    def send(self, name: str, request: Any, on_answer: OnAnswer | None = None) -> Op[None]:
        """Send a call whose answer nothing waits for; ``on_answer`` gets the answer when
        it is read (or the error, which is raised here too)."""
        local = self.local
        try:
            if local is not None:
                try:
                    yield from local.send(name, request, self.timeout, on_answer)
                    return
                except LocalCallFailed as exc:
                    self._local_failed(local, exc)  # raises unless gRPC may take the call
            reply = yield from self.call(name, request)
        except KVStoreError as error:
            if on_answer is not None:
                on_answer(None, error)
            raise
        if on_answer is not None:
            on_answer(reply, None)

    def read_owed(self) -> Op[None]:
        """Read the answers of calls sent without waiting (kvclient.local_calls)."""
        local = self.local
        if local is not None:
            yield from local.read_owed(self.timeout)

    def settle(self) -> Op[None]:
        """Send the pending accounting now, after any message already being sent: a
        call made after this comes after every release and report."""
        if self.accounting.pending():
            yield Serial("settle", self._settle())

    def _settle(self) -> Op[None]:
        request = self.accounting.take()
        if request is None:
            return
        self.accounting.sending += 1
        try:
            yield from self._call("ReportReads", request)
        except KVStoreError as exc:  # the daemon restarted (its leases are gone), ...
            log.debug("accounting of %d leases and %d prefixes: %s",
                      len(request.release_lease_ids), len(request.prefixes), exc)  # fmt: skip
        finally:
            self.accounting.sending -= 1

    def error(self, exc: grpc.RpcError) -> KVStoreError:
        return self.checked(error_from_rpc(exc, self.addr))

    def checked(self, error: KVStoreError) -> KVStoreError:
        if isinstance(error, DaemonUnavailableError):
            self.info = None  # it may come back as a new process with a new arena
        return error

    def _local_failed(self, local: Any, exc: LocalCallFailed) -> None:
        """Stop using a local socket that failed; raise unless the call never left."""
        with self._lock:
            if self.local is local:
                self.local, self.info = None, None  # asked again at the next data call
        local.close()
        raise_local_failure(exc, self.addr, self.timeout)

    # -- the daemon and its arena ---------------------------------------------------

    def refresh(self) -> Op[tuple[ServerInfo, ClientArena | None]]:
        """The daemon's info and the arena mapping (see the module docstring)."""
        info, arena = self.info, self.arena
        if info is not None and (arena is None or arena.is_current()):
            return info, arena
        return (yield Serial("refresh", self._refresh()))

    def _refresh(self) -> Op[tuple[ServerInfo, ClientArena | None]]:
        info, arena = self.info, self.arena
        if info is not None and (arena is None or arena.is_current()):
            return info, arena  # another caller refreshed meanwhile
        io = Io(self.grpc.call, ("ServerInfo", pb.ServerInfoRequest()))
        info = result_messages.server_info((yield from self.over_grpc(io)))
        arena = None
        if self.use_arena is not False:
            arena = self.open_arena(info)
        local = None
        if arena is not None and info.local_socket:
            local = LocalCalls(info.local_socket, self._sockets, self._token, info.uid)
        old_arena, old_local = self.arena, self.local
        self.info, self.arena, self.local = info, arena, local
        self.epochs = epoch_table(arena, info) if arena is not None else None
        self.last_slots = LastSlots()
        if arena is not None:  # what a first get would pay, paid at connect
            start_copy_threads()
        if old_local is not None:
            old_local.close()
        if old_arena is not None:  # a restarted daemon's old arena: freed behind
            old_arena.close_behind()
        return info, arena

    def open_arena(self, info: ServerInfo) -> ClientArena | None:
        """A new mapping of the daemon's arena as ``info`` names it (ClientArena.open)."""
        return ClientArena.open(info, self._token, self.timeout)

    def arena_for_data(self) -> Op[tuple[ServerInfo, ClientArena | None]]:
        """:meth:`refresh`; ArenaUnavailableError when ``use_arena=True`` and the
        arena cannot be mapped."""
        info, arena = yield from self.refresh()
        if arena is None and self.use_arena:
            raise ArenaUnavailableError(
                f"the shared arena of kvstored at {self.addr} cannot be mapped here "
                f"(arena {info.arena_path or 'not shared'}, same host: "
                f"{info.host_id == host_id()})",
                addr=self.addr,
            )
        return info, arena

    def arena_in_use(self) -> Op[bool]:
        _, arena = yield from self.arena_for_data()
        return arena is not None

    def forget_arena(self) -> None:
        """An answer named another arena (the daemon restarted): map it at the next call."""
        self.info = None

    def close(self) -> Op[None]:
        """Give back every lease and staged slot, read the answers owed, close all."""
        if self.closed:
            return
        self.closed = True
        with self._lock:
            stashes = list(self._stashes.values())
        for stash in stashes:  # staging leases go with the read leases
            lease_id = stash.detach()
            if lease_id:
                self.accounting.release_later(lease_id)
        yield from self.settle()
        with contextlib.suppress(KVStoreError, OSError):
            yield from self.read_owed()  # the answers of puts sent ahead resolve them
        yield Io(self.grpc.close)
        for part in (self.arena, self.local):
            if part is not None:
                part.close()
        self.arena = self.local = None

    # -- daemon-wide calls ----------------------------------------------------------

    def server_info(self) -> Op[ServerInfo]:
        return result_messages.server_info(
            (yield from self.call("ServerInfo", pb.ServerInfoRequest()))
        )

    def stats(self) -> Op[Stats]:
        return result_messages.stats((yield from self.call("Stats", pb.StatsRequest())))

    def namespaces(self) -> Op[list[NamespaceInfo]]:
        response = yield from self.call("ListNamespaces", pb.ListNamespacesRequest())
        return [wire.namespace_info(ns) for ns in response.namespaces]

    def clear(self, ns: str | None) -> Op[int]:
        response = yield from self.call("Clear", pb.ClearRequest(ns_id=ns or ""))
        return int(response.removed)

    def open_namespace(self, name: str, request: Any) -> Op[NamespaceInfo]:
        """OpenNamespace or DescribeNamespace; maps the arena now (a connect step,
        not the first get's). An OpenNamespace is kept to open it again
        (:meth:`reopening`)."""
        info = wire.namespace_info((yield from self.call(name, request)))
        if name == "OpenNamespace":
            with self._lock:
                self._opens[info.ns_id] = request
        yield from self.refresh()
        return info

    def reopening(self, ns_id: str, make: Callable[[], Op[T]]) -> Op[T]:
        """The op ``make()`` of namespace ``ns_id``; where the daemon does not know the
        namespace (NOT_FOUND) and this client opened it, opened again and ``make()``
        once more.

        A daemon forgets a namespace it had no time to write to its disk tier (a
        kill -9 right after the open) and every namespace without a disk tier: after
        its restart the client's handles keep working as they did, with misses where
        the blocks went. A namespace opened by DescribeNamespace (its layout is not
        this client's to declare) stays NOT_FOUND."""
        try:
            return (yield from make())
        except NamespaceNotFoundError:
            with self._lock:
                request = self._opens.get(ns_id)
            if request is None:
                raise
            reopened = wire.namespace_info((yield from self.call("OpenNamespace", request)))
            if reopened.ns_id != ns_id:  # (a name bound to another namespace meanwhile)
                raise
            log.info("kvstored at %s did not know namespace %s (restarted): opened it "
                     "again", self.addr, ns_id)  # fmt: skip
        return (yield from make())

    # -- events ---------------------------------------------------------------------

    def watch(
        self, from_seq: int, ns_id: str, kinds: Any, from_now: bool, duration_s: float | None
    ) -> Any:
        """A started WatchEvents stream (blocking or asyncio, as the transport)."""
        try:
            request = pb.WatchEventsRequest(
                from_seq=from_seq, from_now=from_now, ns_id=ns_id,
                kinds=result_messages.event_kind_values(kinds),
            )  # fmt: skip
        except KeyError as exc:
            raise InvalidArgumentError(f"unknown event kind {exc}") from None
        return self.grpc.watch(request, duration_s)

    @contextlib.contextmanager
    def watching(self, call: Any, duration_s: float | None) -> Iterator[None]:
        """Around the reading of a WatchEvents stream: it ends quietly when cancelled or
        when ``duration_s`` passes; other errors become KVStoreErrors; it is cancelled
        when the reader stops."""
        try:
            yield
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            if code is grpc.StatusCode.CANCELLED:
                return
            if code is grpc.StatusCode.DEADLINE_EXCEEDED and duration_s is not None:
                return
            raise self.error(exc) from None
        finally:
            call.cancel()


def events_of(msg: pb.WatchEventsResponse) -> list[Event]:
    if msg.missed:
        log.warning("kvstored dropped %d events before they were sent", msg.missed)
    return result_messages.events(msg)
