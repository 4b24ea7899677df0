"""What :class:`kvclient.KVClient` and :class:`kvclient.AsyncKVClient` share.

A client is its core (:class:`kvclient.connection.Connection`) plus a driver
(:mod:`kvclient.effects`). Every call builds an op (here, or in the core) and hands it
to the driver: :class:`kvclient.KVClient`'s methods return the result,
:class:`kvclient.AsyncKVClient`'s are coroutines of it. Each client class declares its
public methods with their own types; the ops behind them exist once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvclient.address import CHANNEL_OPTIONS, resolve_address
from kvclient.arena_path import ClientArena
from kvclient.connection import Connection
from kvclient.effects import Op
from kvclient.local_calls import Sockets
from kvclient.security import TLS, Credentials
from kvclient.session import GrpcSession
from kvclient.transport import GrpcTransport
from kvclient.wire import namespace_request
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1.results import NamespaceInfo, ServerInfo

DEFAULT_TIMEOUT_S = 30.0


class BaseClient:
    """The methods both clients share (see the module docstring)."""

    blocking = True  # a blocking gRPC channel, else grpc.aio
    sockets: Sockets  # the I/O of its local calls (kvclient.local_calls)
    event_class: Callable[[], Any]  # what a Wait effect waits on

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
        self._start_driver()
        self.addr = resolve_address(addr)
        self.use_arena = use_arena
        self.timeout = timeout
        # token, TLS and whose socket to trust: arguments, else the environment
        credentials = Credentials.resolve(token, tls, socket_owner)
        if self.blocking:
            self.channel = credentials.channel(self.addr, CHANNEL_OPTIONS)
        else:
            self.channel = credentials.aio_channel(self.addr, CHANNEL_OPTIONS)
        session = GrpcSession(self.addr, CHANNEL_OPTIONS, credentials)
        transport = GrpcTransport(self.channel, session, timeout, wait=self.blocking)
        self._conn = Connection(
            self.addr, transport, self.sockets, credentials.token,
            use_arena=use_arena, timeout=timeout, wake=self._wake, drive=self._drive,
            new_event=self.event_class,
        )  # fmt: skip

    # what each driver supplies
    def _start_driver(self) -> None:
        """The driver's locks and timer state, made before anything else."""

    def _drive(self, op: Op[Any]) -> Any:
        raise NotImplementedError

    def _wake(self, now: bool) -> None:
        raise NotImplementedError

    def open_arena(self, info: ServerInfo) -> ClientArena | None:
        """A mapping of the daemon's arena of this process's own, e.g. to pin it
        (kvclient.integrations.gpu); the caller closes it."""
        return self._conn.open_arena(info)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.addr!r}, use_arena={self.use_arena})"

    # -- what both drivers run ----------------------------------------------------------

    def _watch(
        self, from_seq: int, ns_id: str, kinds: Sequence[str], from_now: bool,
        duration_s: float | None,
    ) -> Callable[[], Any]:  # fmt: skip
        """What starts the WatchEvents stream of ``events`` (called when iterated)."""
        return lambda: self._conn.watch(from_seq, ns_id, kinds, from_now, duration_s)

    def _opened(self, model: str, block_tokens: int, block_bytes: int, name: str,
                layout: dict[str, Any]) -> Op[NamespaceInfo]:  # fmt: skip
        """OpenNamespace: the namespace's info (the arena mapped)."""
        request = namespace_request(model, block_tokens, block_bytes, name, layout)
        return self._conn.open_namespace("OpenNamespace", request)

    def _described(self, ns_id: str) -> Op[NamespaceInfo]:
        """DescribeNamespace of an existing namespace, by ns_id or bound name."""
        return self._conn.open_namespace(
            "DescribeNamespace", pb.DescribeNamespaceRequest(ns_id=ns_id)
        )
