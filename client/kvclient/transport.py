"""The two ways a client reaches its daemon, behind one small interface.

A transport has ``call(name, request)``: one unary kvstore.v1 call by method name.
The client's core picks one per connection to the daemon (:meth:`Connection.refresh
<kvclient.connection.Connection.refresh>`): the daemon's local-call socket
(:mod:`kvclient.local_calls`) where it maps the daemon's arena, else gRPC; and it uses
gRPC for what only gRPC carries (the Get, Put and WatchEvents streams, the session),
and again for a call the local socket could not send.

A local transport also *sends* calls without waiting for their answers (``send``,
``poll_owed``, ``read_owed``: see :mod:`kvclient.local_calls`); over gRPC the core
waits for the answer instead.

:class:`GrpcTransport` serves both drivers: built on a blocking channel its methods
return answers, on a ``grpc.aio`` channel awaitables of them, which the async driver
awaits (:mod:`kvclient.effects`). The local socket is one class for both drivers too
(:class:`kvclient.local_calls.LocalCalls`): its calls are ops whose socket I/O the
driver does (blocking in the caller's thread, or on the event loop).
"""

from __future__ import annotations

from typing import Any

from kvclient.session import GrpcSession
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import kvstore_pb2_grpc as pb_grpc

GET_METHOD = "/kvstore.v1.KVStore/Get"
PUT_METHOD = "/kvstore.v1.KVStore/Put"
# calls whose leases end with the client's session (kvclient.session)
LEASING = frozenset({"Acquire", "Reserve"})


class GrpcTransport:
    """kvstore.v1 over one gRPC channel (blocking or ``grpc.aio``)."""

    def __init__(self, channel: Any, session: GrpcSession, timeout: float, wait: bool) -> None:
        """``wait``: a leasing call first waits (once, briefly) for the session to be
        registered (the blocking client; an event loop must not block)."""
        self.channel = channel
        self.stub = pb_grpc.KVStoreStub(channel)
        self.timeout = timeout
        self._session = session
        self._wait = wait
        # Get and Put with identity (de)serializers: the data chunks are framed by
        # kvclient.wire (kvproto.v1.data_frames)
        self._get = channel.unary_stream(
            GET_METHOD,
            request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=None,
        )
        self._put = channel.stream_unary(
            PUT_METHOD,
            request_serializer=None,
            response_deserializer=pb.PutResponse.FromString,
        )

    def call(self, name: str, request: Any) -> Any:
        method = getattr(self.stub, name)
        if name in LEASING:
            metadata = self._session.metadata(wait=self._wait)
            return method(request, timeout=self.timeout, metadata=metadata)
        return method(request, timeout=self.timeout)

    def put(self, messages: Any) -> Any:
        """A Put stream of serialized messages (kvclient.wire.put_messages)."""
        return self._put(messages, timeout=self.timeout)

    def get(self, request: pb.GetRequest) -> Any:
        """A started Get stream: its messages, serialized."""
        return self._get(request, timeout=self.timeout)

    def watch(self, request: pb.WatchEventsRequest, duration_s: float | None) -> Any:
        return self.stub.WatchEvents(request, timeout=duration_s)

    def close(self) -> Any:
        self._session.close()
        return self.channel.close()
