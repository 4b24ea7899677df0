"""What :class:`kvclient.KVClient` and :class:`kvclient.AsyncKVClient` share.

A client is its core (:class:`kvclient.connection.Connection`) plus a driver
(:mod:`kvclient.effects`). Every method here builds an op and hands it to the driver:
a blocking client returns the result, an asyncio one an awaitable of it. The two
client classes add only what differs in kind: closing, the ``with`` forms, the event
stream, the accounting timer, the zero-copy lease's form.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvclient.address import CHANNEL_OPTIONS, resolve_address
from kvclient.connection import Connection
from kvclient.effects import Op
from kvclient.local_calls import Sockets
from kvclient.namespace import Namespace
from kvclient.security import TLS, Credentials
from kvclient.session import GrpcSession
from kvclient.transport import GrpcTransport
from kvclient.wire import namespace_request
from kvproto.v1 import kvstore_pb2 as pb

DEFAULT_TIMEOUT_S = 30.0


class BaseClient:
    """The methods both clients share (see the module docstring)."""

    namespace_class: type[Namespace] = Namespace
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

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.addr!r}, use_arena={self.use_arena})"

    def _follow(self, start: Callable[[], Any], duration_s: float | None) -> Any:
        """The events of the stream ``start()`` begins once iterated: an iterator, or
        an async iterator."""
        raise NotImplementedError

    # -- daemon-wide calls ----------------------------------------------------------

    def events(
        self,
        from_seq: int = 0,
        *,
        ns_id: str = "",
        kinds: Sequence[str] = (),
        from_now: bool = False,
        duration_s: float | None = None,
    ) -> Any:
        """Events with seq > ``from_seq``, following the stream until the caller stops
        (or ``duration_s`` passes): an iterator of Event from KVClient, an async
        iterator from AsyncKVClient. Leaving the loop cancels the call."""
        return self._follow(
            lambda: self._conn.watch(from_seq, ns_id, kinds, from_now, duration_s), duration_s
        )

    def server_info(self) -> Any:
        """The daemon's ServerInfo."""
        return self._drive(self._conn.server_info())

    def stats(self) -> Any:
        """Tier occupancy, hit counts and more: a Stats."""
        return self._drive(self._conn.stats())

    def namespaces(self) -> Any:
        """The namespaces this caller sees: a list of NamespaceInfo."""
        return self._drive(self._conn.namespaces())

    def clear(self, ns: str | None = None) -> Any:
        """Remove every block (of namespace ``ns``, or of all); returns blocks removed."""
        return self._drive(self._conn.clear(ns))

    # -- namespaces -----------------------------------------------------------------

    def namespace(
        self, model: str, block_tokens: int = 16, block_bytes: int = 0, *, name: str = "",
        **layout: Any,
    ) -> Any:  # fmt: skip
        """Open (or re-open) a namespace: a Namespace. ``layout``: num_layers,
        num_kv_heads, head_dim, dtype, rank, world_size, tenant_salt, hash_algorithm,
        vocab_size."""
        request = namespace_request(model, block_tokens, block_bytes, name, layout)
        return self._drive(self._opened("OpenNamespace", request))

    def open_namespace(self, ns_id: str) -> Any:
        """A handle on an existing namespace, by ns_id or bound name (NOT_FOUND if none)."""
        request = pb.DescribeNamespaceRequest(ns_id=ns_id)
        return self._drive(self._opened("DescribeNamespace", request))

    def _opened(self, method: str, request: Any) -> Op[Namespace]:
        info = yield from self._conn.open_namespace(method, request)
        return self.namespace_class(self, self._conn, info)
