"""Local calls: the unary methods of ``kvstore.v1.KVStore`` over a plain unix socket.

Why: a gRPC unary round trip in Python costs 0.5-1 ms on a busy two-core machine
(HTTP/2 framing, grpc's completion queue and thread hops), a plain unix-socket round
trip about 0.05 ms. A same-host arena get is one short call (Acquire) and a put two
(Reserve, Commit), so with gRPC alone a 4 MiB get runs at a quarter of memcpy speed.
A daemon therefore also listens on a second unix socket, named by
``ServerInfoResponse.local_socket``, that carries the same request and response
messages with the same status codes in the minimal framing below. gRPC stays the
contract: every method is served there too, and only clients on the daemon's host
(those that map its arena) use local calls. Streams (Get, Put, WatchEvents) are gRPC
only.

Framing, all integers little-endian; one call at a time per connection, answered in
order::

    request:  u32 body_len | u8 name_len | name | body
    response: u32 body_len | u8 status   | body

``name`` is the ASCII method name (``Acquire``). A request's ``body`` is the serialized
request message. A response with ``status`` 0 (OK) carries the serialized response
message; any other ``status`` is the number of a gRPC status code and ``body`` is UTF-8
``kind`` NUL ``message``, where ``kind`` is what gRPC errors carry in the
``kvstore-error`` trailing metadata (the class of the daemon's error, may be empty).
A malformed or oversized frame closes the connection.

Tokens: no frame ever carries one; a client proves it knows its token and the daemon
proves it back (the challenge of :mod:`kvproto.v1.challenge`, ``purpose``
``LOCAL_CALLS``). On a daemon with tenants a connection's first frames are:

- ``name`` :data:`HELLO_NAME`, ``body`` the client's nonce; answered OK with the
  daemon's nonce (each a fresh one, ``NONCE_BYTES``);
- ``name`` :data:`AUTH_NAME`, ``body`` the client's proof; answered OK with the
  daemon's proof, or UNAUTHENTICATED (the token is not valid; or no ``@hello`` came
  first: each ``@hello`` answers one ``@auth``).

The client checks the daemon's proof before any call: a listener that cannot give it
is not the daemon, and gets nothing more. Every later call on the connection is that
tenant's; a call on a connection that did not authenticate is UNAUTHENTICATED. On a
daemon without tenants the exchange is answered with an empty proof and changes
nothing (a client with a token takes no such socket: it stays on gRPC).
"""

from __future__ import annotations

import socket
import struct

from kvproto.v1 import kvstore_pb2 as pb

HEADER = struct.Struct("<IB")
OK = 0
MAX_NAME_BYTES = 64
HELLO_NAME = b"@hello"  # not method names: the token challenge (see above)
AUTH_NAME = b"@auth"
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

_SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]

# method name -> (request class, response class), the unary methods of the service
UNARY_METHODS: dict[str, tuple[type, type]] = {
    m.name: (getattr(pb, m.input_type.name), getattr(pb, m.output_type.name))
    for m in _SERVICE.methods
    if not m.client_streaming and not m.server_streaming
}


def request_frame(name: bytes, body: bytes) -> bytes:
    return HEADER.pack(len(body), len(name)) + name + body


def response_frame(status: int, body: bytes) -> bytes:
    return HEADER.pack(len(body), status) + body


def error_body(kind: str, message: str) -> bytes:
    return kind.encode() + b"\0" + message.encode()


def parse_error(body: bytes) -> tuple[str, str]:
    """``(kind, message)`` of an error response's body."""
    kind, _, message = body.partition(b"\0")
    return kind.decode(errors="replace"), message.decode(errors="replace")


def peer_credentials(sock: socket.socket | None) -> tuple[int, int] | None:
    """(pid, uid) of the process at the other end of a unix socket (SO_PEERCRED): the
    daemon ties leases to the client's pid, the client checks the daemon's uid. None
    when unknown."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)  # type: ignore[union-attr]
        pid, uid, _ = _PEERCRED.unpack(raw)
    except (OSError, AttributeError, struct.error):
        return None
    return int(pid), int(uid)
