"""Serve the unary methods of ``kvstore.v1.KVStore`` as local calls on a unix socket.

The framing and the reason for it are in :mod:`kvproto.v1.local_calls`. Each
connection is an asyncio protocol that cuts frames out of what it receives and hands
them, one at a time and in order, to the same servicer methods gRPC calls: same
validation, same quick path on the event loop, same error mapping
(:mod:`kvstored.errors`), whose ``context.abort`` is captured here by a small stand-in
for grpc's ServicerContext. A call answered on the event loop costs no thread hop.

A connection's calls make leases owned by its client's process (``local:<pid>``, the
peer's pid from SO_PEERCRED): when the last connection of that process closes (the
client closed, or its process died), :meth:`KVStoreService.owner_closed` ends them,
so a killed client holds no slots for its leases' TTL.

On a daemon with tokens (kvstored.auth) a connection first proves its token without
sending it (``HELLO_NAME``, then ``AUTH_NAME``: kvproto.v1.challenge), and the daemon
proves it back; its calls are then that caller's. Until then every call on it is
UNAUTHENTICATED, as a gRPC call without a token is.

Life: :meth:`LocalCallServer.start` binds the socket (born 0600 under a umask, then
socket_mode, as the gRPC socket: kvstored.server.serve_beside; only the daemon's user
may connect unless socket_mode opens it to other users, whose every call then needs a
token), :meth:`stop` stops
accepting connections and answers further calls UNAVAILABLE while in-flight ones
finish, :meth:`close` drops the connections and removes the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvproto.v1 import local_calls as frames
from kvproto.v1.challenge import LOCAL_CALLS, NONCE_BYTES, Transcript, new_nonce
from kvstore.errors import Unauthenticated
from kvstored.auth import ANYONE, BAD_TOKENS, Caller
from kvstored.log_limits import LIMITED
from kvstored.peer_limits import ConnectionsPerUser
from kvstored.service import KVStoreService

log = logging.getLogger("kvstored.local_calls")

SERVICE_PREFIX = "kvstore.v1.KVStore/"

# observe(method, status name, seconds): the daemon's RPC metrics
Observer = Callable[[str, str, float], None]


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, kind: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.kind = kind


class _CallContext:
    """What the servicer's unary methods use of grpc.aio.ServicerContext: ``abort``;
    ``owner``: whose leases the call makes (see kvstored.owners.Owners.owner_of); ``caller``:
    whose call it is (None before the connection authenticated: see kvstored.auth);
    ``peer``: "" for every local caller."""

    def __init__(self, owner: str, caller: Caller | None) -> None:
        self.owner = owner
        self.caller = caller

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()  # no token but the connection's (Access.caller asks only without one)

    def peer(self) -> str:
        return ""  # the local socket (kvstored.auth.BadTokens)

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        kind = dict(trailing_metadata).get("kvstore-error", "")
        raise _Aborted(code, details, kind)


PRE_AUTH_S = 10.0  # on a daemon with tokens, a connection's time to prove its token


class LocalCallServer:
    """The local-call socket of one daemon, in front of its :class:`KVStoreService`."""

    def __init__(
        self,
        service: KVStoreService,
        max_frame_bytes: int,
        observe: Observer | None = None,
        max_per_user: int = 1024,
    ) -> None:
        """``max_per_user``: connections one uid may hold at once (another user's
        process must not take the daemon's file descriptors: kvstored.peer_limits); on
        a daemon with tokens a connection that proves none within ``PRE_AUTH_S`` is
        closed."""
        self._methods: dict[bytes, tuple[Callable[..., Any], Any, str]] = {
            name.encode(): (getattr(service, name), request_cls, SERVICE_PREFIX + name)
            for name, (request_cls, _) in frames.UNARY_METHODS.items()
        }
        self.max_frame_bytes = max_frame_bytes
        self._observe = observe
        self._service = service
        self.needs_token = service.access.tokens.enabled
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self._per_user = ConnectionsPerUser(max_per_user, "local-call")
        self._stopping = False
        self.path: Path | None = None

    async def start(self, path: Path) -> None:
        """Listen on ``path`` (cleared, and its mode set, by kvstored.server.serve_beside)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), str(path))
        self.path = path

    def stop(self) -> None:
        """No new connections; calls from now on answer UNAVAILABLE."""
        self._stopping = True
        if self._server is not None:
            self._server.close()

    def close(self) -> None:
        """Drop every connection and remove the socket file."""
        self.stop()
        for connection in list(self._connections):
            connection.close()
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()

    def opened(self, connection: _Connection, uid: int) -> bool:
        """Take a new connection of user ``uid``; False (it is to be closed) when that
        user holds ``max_per_user`` already, or the server stops."""
        if self._stopping or not self._per_user.admit(uid):
            return False
        self._connections.add(connection)
        self._service.owner_opened(connection.owner)
        return True

    def lost(self, connection: _Connection, uid: int) -> None:
        """A connection closed: the last one of its process ends that process's leases."""
        self._connections.discard(connection)
        self._per_user.release(uid)
        self._service.owner_closed(connection.owner)

    def hello(self, connection: _Connection, client_nonce: bytes) -> bytes:
        """A connection's ``@hello``: the daemon's fresh nonce, kept with the client's
        for the one ``@auth`` that may follow (kvproto.v1.challenge)."""
        if len(client_nonce) != NONCE_BYTES:
            connection.nonces = None
            return _error(grpc.StatusCode.UNAUTHENTICATED, "Unauthenticated",
                          f"a @hello carries a nonce of {NONCE_BYTES} bytes, not "
                          f"{len(client_nonce)}")  # fmt: skip
        daemon_nonce = new_nonce()
        connection.nonces = (client_nonce, daemon_nonce)
        return frames.response_frame(frames.OK, daemon_nonce)

    def authenticate(self, connection: _Connection, proof: bytes) -> tuple[bytes, float]:
        """A connection's ``@auth``: a proof of a token over the nonces of its last
        ``@hello`` (used up by it) makes the connection's calls that caller's, and is
        answered with the daemon's proof. The answer, and how long to hold it: a
        process that keeps guessing is answered late (kvstored.auth.BadTokens, counted
        per process)."""
        nonces, connection.nonces = connection.nonces, None
        try:
            if nonces is None:
                raise Unauthenticated(
                    "send @hello first: this daemon takes no token, only a proof of one "
                    "over its nonce (kvproto.v1.challenge)"
                )
            uid = connection.peer_uid
            transcript = Transcript.of_daemon(LOCAL_CALLS, *nonces, uid if uid >= 0 else None)
            caller, daemon_proof = self._service.access.tokens.answer_challenge(
                transcript, proof
            )
        except Unauthenticated as exc:
            delay = BAD_TOKENS.note(connection.owner)  # logged, rate-limited
            return _error(grpc.StatusCode.UNAUTHENTICATED, "Unauthenticated", str(exc)), delay
        connection.caller = caller
        return frames.response_frame(frames.OK, daemon_proof), 0.0

    async def call(
        self, name: bytes, body: bytes, owner: str = "", caller: Caller | None = None
    ) -> bytes:
        """Run one call; the response frame."""
        entry = self._methods.get(name)
        if entry is None:
            text = name.decode(errors="replace")
            return _error(grpc.StatusCode.UNIMPLEMENTED, "", f"no unary method {text!r}")
        method, request_cls, full_name = entry
        if self._stopping:
            return _error(grpc.StatusCode.UNAVAILABLE, "", "kvstored is shutting down")
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            request = request_cls.FromString(body)
        except DecodeError:
            code = grpc.StatusCode.INVALID_ARGUMENT
            frame = _error(code, "InvalidArgument", f"the body is not a valid {full_name} request")
        else:
            try:
                response = await method(request, _CallContext(owner, caller))
                frame = frames.response_frame(frames.OK, response.SerializeToString())
            except _Aborted as aborted:
                code = aborted.code
                frame = _error(code, aborted.kind, aborted.message)
            except Exception:  # grpc_errors maps every error: this is a bug
                LIMITED.error(log, f"internal:{full_name}", "local call %s failed", full_name,
                              exc_info=True)
                code = grpc.StatusCode.INTERNAL
                frame = _error(code, "", f"internal error in {full_name} (see the daemon log)")
        if self._observe is not None:
            self._observe(full_name, code.name, time.perf_counter() - started)
        return frame


# what a connection may send in one frame before its token frame on a daemon with
# tokens: a larger one is answered UNAUTHENTICATED and the connection closed at its
# header, so nobody without a token makes the daemon hold their bytes
UNAUTHENTICATED_FRAME_BYTES = 4096


def _error(code: grpc.StatusCode, kind: str, message: str) -> bytes:
    return frames.response_frame(code.value[0], frames.error_body(kind, message))


class _Connection(asyncio.Protocol):
    """One client connection: frames in, handled in order, answers out.

    Flow control: calls are handled one at a time, so a client that sends faster than
    it is answered fills ``_buffer``; reading pauses while it holds more than two of
    the largest frames. A client that does not read its answers fills the transport's
    write buffer; asyncio then calls ``pause_writing`` and no further call starts
    until ``resume_writing``. Either way the daemon's memory per connection is bounded.
    """

    def __init__(self, server: LocalCallServer) -> None:
        self._server = server
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._task: asyncio.Task[None] | None = None  # the call being handled
        self._reading = True
        self._writable = True
        self.owner = ""
        self.peer_uid = -1
        self._admitted = False
        self.nonces: tuple[bytes, bytes] | None = None  # of the last @hello
        # whose calls these are; None until the token frame on a daemon with tokens
        self.caller: Caller | None = None if server.needs_token else ANYONE

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = frames.peer_credentials(transport.get_extra_info("socket"))
        self.owner = f"local:{peer[0] if peer else 0}"
        self.peer_uid = peer[1] if peer else -1
        self._admitted = self._server.opened(self, self.peer_uid)
        if not self._admitted:
            transport.abort()
        elif self.caller is None:  # no token yet: it has PRE_AUTH_S to send one
            asyncio.get_running_loop().call_later(PRE_AUTH_S, self._no_token_in_time)

    def _no_token_in_time(self) -> None:
        if self.caller is None and self._transport is not None:
            LIMITED.warning(
                log, "local_call_no_token", "closing a local-call connection that proved no "
                "token in %.0f s", PRE_AUTH_S,
            )  # fmt: skip
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._admitted:
            self._server.lost(self, self.peer_uid)
        self._transport = None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._reading and len(self._buffer) > 2 * self._server.max_frame_bytes:
            assert self._transport is not None
            self._transport.pause_reading()
            self._reading = False
        if self._task is None:
            self._next()

    def pause_writing(self) -> None:
        self._writable = False

    def resume_writing(self) -> None:
        self._writable = True
        if self._task is None:
            self._next()

    def _next(self) -> None:
        """Handle the complete calls in the buffer, in order, until one has to wait."""
        while self._start_one():
            pass

    def _start_one(self) -> bool:
        """Handle the next complete call in the buffer; True when it was answered at
        once (so the one after it may start), False when there is none, it is still
        running (a task finishes it), or the connection may not take more now."""
        buffer = self._buffer
        if self._transport is None or not self._writable:
            return False
        if not self._reading and len(buffer) <= self._server.max_frame_bytes:
            self._transport.resume_reading()
            self._reading = True
        if len(buffer) < frames.HEADER.size:
            return False
        body_len, name_len = frames.HEADER.unpack_from(buffer)
        if not 0 < name_len <= frames.MAX_NAME_BYTES or body_len > self._server.max_frame_bytes:
            LIMITED.warning(
                log, "local_call_bad_frame",
                "closing a local-call connection: malformed frame (name %d bytes, body %d)",
                name_len, body_len,
            )  # fmt: skip
            self._transport.close()
            return False
        if self.caller is None and body_len > UNAUTHENTICATED_FRAME_BYTES:
            BAD_TOKENS.note("")
            self._transport.write(_error(
                grpc.StatusCode.UNAUTHENTICATED, "Unauthenticated",
                f"a frame of {body_len} bytes before the token frames (@hello, @auth): "
                "prove the token first",
            ))  # fmt: skip
            self._transport.close()
            buffer.clear()
            return False
        start = frames.HEADER.size + name_len
        end = start + body_len
        if len(buffer) < end:
            return False
        name = bytes(buffer[frames.HEADER.size : start])
        body = bytes(buffer[start:end])
        del buffer[:end]
        if name == frames.HELLO_NAME:
            self._transport.write(self._server.hello(self, body))
            return True
        if name == frames.AUTH_NAME:
            answer, delay = self._server.authenticate(self, body)
            if delay:  # held: nothing more of this connection is read meanwhile
                self._task = asyncio.get_running_loop().create_task(self._held(answer, delay))
                return False
            self._transport.write(answer)
            return True
        # Run the call right here: most finish without awaiting anything (the quick path
        # on the loop), and a task per call cost 20-25% of a short call's daemon CPU.
        call = self._server.call(name, body, self.owner, self.caller)
        try:
            waiting_on = call.send(None)
        except StopIteration as done:
            self._transport.write(done.value)
            return True
        self._task = asyncio.get_running_loop().create_task(self._serve(call, waiting_on))
        return False

    async def _held(self, frame: bytes, delay: float) -> None:
        """Answer ``frame`` ``delay`` seconds late (a refused token past the free ones)."""
        await asyncio.sleep(delay)
        if self._transport is not None:
            self._transport.write(frame)
        self._task = None
        self._next()

    async def _serve(self, call: Coroutine[Any, Any, bytes], waiting_on: Any) -> None:
        """Finish a call that awaited something, as the task running it would have."""
        frame = await _resume(call, waiting_on)
        if self._transport is not None:
            self._transport.write(frame)
        self._task = None
        self._next()


async def _resume(call: Coroutine[Any, Any, bytes], waiting_on: Any) -> bytes:
    """Drive ``call``, started by hand, to its result: ``waiting_on`` is what its first
    step yielded (an asyncio future it awaits, or None for a bare yield). Does for it
    what an asyncio Task does: wait for the future, then resume the coroutine."""
    try:
        while True:
            if waiting_on is None:
                await asyncio.sleep(0)
            else:
                waiting_on._asyncio_future_blocking = False
                await asyncio.wait([waiting_on])  # done: the coroutine reads its result
            try:
                waiting_on = call.send(None)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
    except BaseException:  # cancelled while waiting: let the call clean up, then go
        if waiting_on is not None:
            waiting_on.cancel()
        call.close()
        raise
