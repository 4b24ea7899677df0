"""The client end of local calls: unary kvstore.v1 calls over the daemon's local socket.

The framing, and why it exists, are in :mod:`kvproto.v1.local_calls`. A client uses
local calls only where it maps the daemon's arena (same host, same user), for every
unary call once it knows the socket (``ServerInfo.local_socket``); streams stay on
gRPC. Each connection carries one call at a time; :class:`LocalCalls` keeps the idle
ones for the next call. Its calls are ops of the client's core (:mod:`kvclient.effects`):
they yield each connect, send and receive as an :class:`Io` of the driver's sockets
(:data:`BLOCKING_SOCKETS` in the caller's thread, :data:`ASYNC_SOCKETS` on the event
loop), so both clients share one implementation.

Failures are of two kinds. A status other than OK raises :class:`LocalCallStatus`,
which the client turns into the same :class:`kvclient.errors.KVStoreError` gRPC would
have given. A transport failure raises :class:`LocalCallFailed`; its ``sent`` says
whether any byte of the request left, since only a call that certainly did not reach
the daemon may be sent again over gRPC (a Commit must not run twice). The connection
of a failed call is closed, never reused.

A call may also be *sent* without waiting for its answer (:meth:`LocalCalls.send`: an
arena put's Commit, whose answer nothing on the put's path needs). Its connection goes
back to the idle ones owing that answer, and is the next one taken; the next call on
it reads the answers owed before its own (the daemon answers a connection's calls in
order, so that call also runs after the one sent). The answers owed can also be read
without a call (``poll_owed``: those that have arrived; ``read_owed``: all of them).
Each goes to the sender's ``on_answer`` (a put sent ahead resolves its
:class:`kvclient.puts_ahead.PendingPut`), or without one is logged if it is an error:
the blocks of a refused Commit are not stored, and a later lookup reports a miss. When
a connection breaks while answers are owed, their ``on_answer`` gets a LocalCallFailed:
the daemon may or may not have run those calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from kvclient.effects import Io, Op, Work
from kvclient.errors import (
    DaemonUnavailableError,
    KVStoreError,
    RequestTimeoutError,
    error_from_status,
)
from kvclient.fork_safety import renew_in_child
from kvproto.v1 import local_calls as frames
from kvproto.v1.challenge import LOCAL_CALLS, Transcript, new_nonce, token_key

_CODES = {code.value[0]: code for code in grpc.StatusCode}
T = TypeVar("T")

log = logging.getLogger(__name__)


class LocalCallStatus(Exception):
    """The daemon answered a status other than OK."""

    def __init__(self, code: grpc.StatusCode | None, details: str, kind: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.kind = kind

    def error(self, addr: str) -> KVStoreError:
        """The client error gRPC would have raised for the same answer."""
        return error_from_status(self.code, self.details, self.kind, addr)


class LocalCallFailed(Exception):
    """The call did not complete: connection refused, reset, closed or timed out."""

    def __init__(self, reason: str, *, sent: bool, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.sent = sent
        self.timed_out = timed_out


def raise_local_failure(exc: LocalCallFailed, addr: str, timeout: float) -> None:
    """Raise the client error of a failed local call, unless the request never left (the
    caller then sends it over gRPC)."""
    if exc.timed_out:
        raise RequestTimeoutError(
            f"kvstored at {addr} did not answer within {timeout} s",
            code=grpc.StatusCode.DEADLINE_EXCEEDED,
            addr=addr,
        )
    if exc.sent:
        raise DaemonUnavailableError(
            f"cannot reach kvstored at {addr}: local call failed: {exc}",
            code=grpc.StatusCode.UNAVAILABLE,
            addr=addr,
        )


def _request(name: str, request: Any) -> bytes:
    return frames.request_frame(name.encode(), request.SerializeToString())


def _response(status: int, body: bytes, name: str) -> Any:
    if status == frames.OK:
        response_type: Any = frames.UNARY_METHODS[name][1]
        return response_type.FromString(body)
    kind, message = frames.parse_error(body)
    raise LocalCallStatus(_CODES.get(status), message, kind)


# what a caller of ``send`` gets back: the response, or why there is none
# (LocalCallStatus: the daemon's error; LocalCallFailed: the connection broke first)
OnAnswer = Callable[[Any, Exception | None], None]


@dataclass(frozen=True, slots=True)
class _Owed:
    """A call sent without waiting, whose answer has not been read."""

    name: str
    on_answer: OnAnswer | None = None

    def answered(self, status: int, body: bytes) -> None:
        """Hand the answer to ``on_answer``; without one, log it if it is an error."""
        if self.on_answer is None:
            if status != frames.OK:
                _, message = frames.parse_error(body)
                log.warning(
                    "%s sent without waiting failed: %s %s", self.name, _CODES.get(status), message
                )
            return
        try:
            response = _response(status, body, self.name)
        except LocalCallStatus as exc:
            self._hand(None, exc)
            return
        self._hand(response, None)

    def lost(self, reason: str) -> None:
        """The connection broke before the answer came: the call's outcome is unknown."""
        if self.on_answer is not None:
            self._hand(None, LocalCallFailed(reason, sent=True))
        else:  # the daemon may have run it all the same
            log.debug("%s sent without waiting: no answer (%s)", self.name, reason)

    def _hand(self, response: Any, error: Exception | None) -> None:
        assert self.on_answer is not None
        try:
            self.on_answer(response, error)
        except Exception:  # it runs inside whichever call read the answer: never break that
            log.exception("handling the answer of %s sent without waiting", self.name)


class _Hello:
    """What a new local-call connection does first: make sure the process serving the
    socket runs as the daemon's user (another user's server could have taken the
    path), then, with a token, prove it and have the daemon prove it back, never
    sending it (kvproto.v1.challenge): a listener that took the path learns nothing
    it can use, and gets no call."""

    def __init__(self, path: str, token: str, daemon_uid: int | None) -> None:
        self.path = path
        self.daemon_uid = daemon_uid
        self.key = token_key(token) if token else b""

    def check_peer(self, sock: socket.socket) -> int | None:
        """The peer's uid (None: unknown); LocalCallFailed unless the daemon's or root."""
        peer = frames.peer_credentials(sock)
        uid = peer[1] if peer else None
        if self.daemon_uid is None:
            return uid
        if uid is not None and uid not in (self.daemon_uid, 0):
            log.warning(
                "not using %s: it is served by uid %d, not by the daemon's uid %d",
                self.path,
                uid,
                self.daemon_uid,
            )
            raise LocalCallFailed(
                f"{self.path} is served by uid {uid}, not the daemon's", sent=False
            )
        return uid

    def prove(self, conn: _Connection, peer_uid: int | None, timeout: float) -> Op[None]:
        """The challenge: LocalCallStatus when the daemon refuses the token, and
        LocalCallFailed (sent=False: the client stays on gRPC) when the peer cannot
        prove it knows the token, so is not the daemon."""
        nonce = new_nonce()
        hello = frames.request_frame(frames.HELLO_NAME, nonce)
        yield Io(conn.sockets.sendall, (conn.sock, hello, timeout))
        daemon_nonce = _answer((yield from conn.receive(timeout)))
        try:
            transcript = Transcript.of_client(LOCAL_CALLS, nonce, daemon_nonce, peer_uid)
        except ValueError:
            raise self._impostor("its nonce is not one") from None
        proof = frames.request_frame(frames.AUTH_NAME, transcript.client_proof(self.key))
        yield Io(conn.sockets.sendall, (conn.sock, proof, timeout))
        if not transcript.daemon_proved(self.key, _answer((yield from conn.receive(timeout)))):
            raise self._impostor("it did not prove that it knows the token")

    def _impostor(self, why: str) -> LocalCallFailed:
        log.warning("not using %s: %s, so it is not the daemon's socket", self.path, why)
        return LocalCallFailed(f"{self.path} is not the daemon's: {why}", sent=False)


def _answer(frame: tuple[int, bytes]) -> bytes:
    """The body of an OK answer to a challenge frame; LocalCallStatus otherwise."""
    status, body = frame
    if status != frames.OK:
        kind, message = frames.parse_error(body)
        raise LocalCallStatus(_CODES.get(status), message, kind)
    return body


class BlockingSockets:
    """Socket I/O in the caller's thread: the blocking client's."""

    @staticmethod
    def connect(sock: socket.socket, path: str, timeout: float) -> None:
        sock.settimeout(timeout)
        sock.connect(path)

    @staticmethod
    def sendall(sock: socket.socket, data: bytes, timeout: float) -> None:
        if sock.gettimeout() != timeout:
            sock.settimeout(timeout)
        sock.sendall(data)

    @staticmethod
    def recv(sock: socket.socket, size: int, timeout: float) -> bytes:
        if sock.gettimeout() != timeout:
            sock.settimeout(timeout)
        return sock.recv(size)


class AsyncSockets:
    """Socket I/O on the running event loop: the asyncio client's (the socket is
    non-blocking; running out of time raises TimeoutError as a blocking socket does)."""

    @staticmethod
    async def connect(sock: socket.socket, path: str, timeout: float) -> None:
        sock.setblocking(False)
        await _in_time(asyncio.get_running_loop().sock_connect(sock, path), timeout)

    @staticmethod
    async def sendall(sock: socket.socket, data: bytes, timeout: float) -> None:
        await _in_time(asyncio.get_running_loop().sock_sendall(sock, data), timeout)

    @staticmethod
    async def recv(sock: socket.socket, size: int, timeout: float) -> bytes:
        return await _in_time(asyncio.get_running_loop().sock_recv(sock, size), timeout)


async def _in_time(work: Awaitable[T], timeout: float) -> T:
    try:
        return await asyncio.wait_for(work, timeout)
    except asyncio.TimeoutError:  # not TimeoutError before Python 3.11
        raise TimeoutError(f"no answer within {timeout} s") from None


Sockets = BlockingSockets | AsyncSockets
BLOCKING_SOCKETS = BlockingSockets()
ASYNC_SOCKETS = AsyncSockets()


@dataclass(eq=False)
class _Connection:
    """One local-call connection: its socket, bytes received past the last answer read,
    and the calls sent on it whose answers have not been read (in order)."""

    sock: socket.socket
    sockets: Sockets
    buffer: bytearray = field(default_factory=bytearray)
    owed: list[_Owed] = field(default_factory=list)

    def receive(self, timeout: float) -> Op[tuple[int, bytes]]:
        """The next response frame: (status, body). Usually a single recv."""
        if len(self.buffer) < frames.HEADER.size:
            yield from self._fill(frames.HEADER.size, timeout)
        body_len, status = frames.HEADER.unpack_from(self.buffer)
        end = frames.HEADER.size + body_len
        if len(self.buffer) < end:
            yield from self._fill(end, timeout)
        return self._pop_frame()

    def read_owed(self, timeout: float) -> Op[None]:
        """Read the answers of the calls sent without waiting (see _Owed.answered)."""
        while self.owed:
            status, body = yield from self.receive(timeout)
            self.owed.pop(0).answered(status, body)

    def poll_owed(self) -> None:
        """Read the owed answers that have arrived, without waiting for the others (the
        socket is read non-blocking, whichever driver owns it)."""
        timeout = self.sock.gettimeout()
        self.sock.setblocking(False)
        try:
            while self.owed:
                if self._has_frame():
                    self.owed.pop(0).answered(*self._pop_frame())
                    continue
                try:
                    more = self.sock.recv(1 << 16)
                except (BlockingIOError, InterruptedError):
                    return
                if not more:
                    raise ConnectionResetError(0, "the daemon closed the connection")
                self.buffer += more
        finally:
            self.sock.settimeout(timeout)

    def close(self, reason: str) -> None:
        """Close the socket; the calls whose answers are owed learn they are lost."""
        self.sock.close()
        _lose(self.owed, reason)

    def _pop_frame(self) -> tuple[int, bytes]:
        """The whole frame at the head of the buffer, taken out of it."""
        body_len, status = frames.HEADER.unpack_from(self.buffer)
        end = frames.HEADER.size + body_len
        body = bytes(self.buffer[frames.HEADER.size : end])
        del self.buffer[:end]
        return status, body

    def _has_frame(self) -> bool:
        if len(self.buffer) < frames.HEADER.size:
            return False
        body_len, _ = frames.HEADER.unpack_from(self.buffer)
        return len(self.buffer) >= frames.HEADER.size + body_len

    def _fill(self, need: int, timeout: float) -> Op[None]:
        while len(self.buffer) < need:
            size = max(need - len(self.buffer), 1 << 16)
            more = yield Io(self.sockets.recv, (self.sock, size, timeout))
            if not more:
                raise ConnectionResetError(0, "the daemon closed the local-call connection")
            self.buffer += more


class LocalCalls:
    """Local calls to one daemon socket, for either driver (``sockets``). Thread-safe,
    and safe across fork: a child process never uses its parent's connections (their
    answers would be read by whichever process reads first); it opens its own."""

    def __init__(
        self, path: str, sockets: Sockets, token: str = "", daemon_uid: int | None = None
    ) -> None:
        self.path = path
        self._sockets = sockets
        self._hello = _Hello(path, token, daemon_uid)
        self._idle: list[_Connection] = []  # the last one put back is taken first
        self._lock = threading.Lock()  # never held across a yield
        self._closed = False
        self._pid = os.getpid()
        renew_in_child(self)

    def _after_fork_in_child(self) -> None:
        """New lock; the parent's idle connections closed here at once: the daemon ties
        leases to a connection and ends them when it closes, so a child that kept its
        copies open would keep a killed parent's leases alive until their TTL."""
        self._lock = threading.Lock()
        for inherited in self._idle:
            inherited.sock.close()  # our copy of the fd only: the parent keeps its own
        self._idle, self._pid = [], os.getpid()

    def call(
        self, name: str, request: Any, timeout: float, during: Callable[[], None] | None = None
    ) -> Op[Any]:
        """``name``'s response to ``request``, or LocalCallStatus / LocalCallFailed.
        ``during`` (a Work effect) runs once the request is sent, before the answer is
        read."""
        frame = _request(name, request)
        conn = self._idle_one() or (yield from self._connect(timeout))
        sent = False
        try:
            # a send fails only when the daemon's end is closed (an idle connection to a
            # daemon that stopped): then it has not seen the request
            yield Io(self._sockets.sendall, (conn.sock, frame, timeout))
            sent = True
            if during is not None:
                yield Work(during)
            if conn.owed:
                yield from conn.read_owed(timeout)
            status, body = yield from conn.receive(timeout)
            if conn.buffer:  # one call at a time: nothing may follow its answer
                raise ConnectionResetError(0, "the daemon sent more than one answer")
        except BaseException as exc:
            failure = _spent(conn, exc, sent, timeout)
            if failure is exc:
                raise
            raise failure from None
        self._put_back(conn)
        return _response(status, body, name)

    def send(
        self, name: str, request: Any, timeout: float, on_answer: OnAnswer | None = None
    ) -> Op[None]:
        """Send ``name(request)`` and return at once: its answer is read by the next
        call on the same connection, or by :meth:`poll_owed` / :meth:`read_owed`, and
        handed to ``on_answer`` (see the module docstring). LocalCallFailed when it
        could not be sent."""
        frame = _request(name, request)
        conn = self._idle_one() or (yield from self._connect(timeout))
        try:
            yield Io(self._sockets.sendall, (conn.sock, frame, timeout))
        except BaseException as exc:
            failure = _spent(conn, exc, False, timeout)
            if failure is exc:
                raise
            raise failure from None
        conn.owed.append(_Owed(name, on_answer))
        self._put_back(conn)

    def peer_gone(self) -> bool:
        """Whether the idle connection the next call takes was closed by the daemon
        (a daemon that was killed, or stopped): one non-blocking peek, no I/O effect.
        False when there is none to look at."""
        with self._lock:
            conn = self._idle[-1] if self._idle and self._pid == os.getpid() else None
            if conn is None:
                return False
            # (non-blocking for the peek: a socket with a timeout waits that long for a
            # byte before Python even tries the recv, MSG_DONTWAIT or not)
            timeout = conn.sock.gettimeout()
            conn.sock.setblocking(False)
            try:
                return conn.sock.recv(1, socket.MSG_PEEK) == b""
            except (BlockingIOError, InterruptedError):
                return False  # open, nothing to read
            except OSError:
                return True  # reset
            finally:
                conn.sock.settimeout(timeout)

    def poll_owed(self) -> None:
        """Read the owed answers that have arrived on the idle connections, without
        waiting for the rest (a connection that fails is closed: see _Owed.lost)."""
        for conn in self._owing():
            try:
                conn.poll_owed()
            except OSError as exc:
                conn.close(exc.strerror or str(exc) or type(exc).__name__)
                continue
            self._put_back(conn)

    def read_owed(self, timeout: float) -> Op[None]:
        """Read every owed answer of the idle connections, waiting up to ``timeout`` for
        each. Those owed on a connection in use are read by the call using it."""
        for conn in self._owing():
            try:
                yield from conn.read_owed(timeout)
            except OSError as exc:  # timed out or reset: those outcomes are unknown
                conn.close(exc.strerror or str(exc) or type(exc).__name__)
                continue
            self._put_back(conn)

    def _owing(self) -> list[_Connection]:
        """The idle connections that owe answers, taken out of the idle ones."""
        with self._lock:
            if self._pid != os.getpid():
                return []  # a forked child: nothing it sent is owed on the parent's sockets
            owing = [conn for conn in self._idle if conn.owed]
            self._idle = [conn for conn in self._idle if not conn.owed]
        return owing

    def _idle_one(self) -> _Connection | None:
        """The connection put back last, if any (no I/O)."""
        with self._lock:
            if self._pid != os.getpid():  # forked: the idle sockets are the parent's
                for inherited in self._idle:
                    inherited.sock.close()  # our copy of the fd only: the parent keeps its own
                self._idle, self._pid = [], os.getpid()
            return self._idle.pop() if self._idle else None

    def _connect(self, timeout: float) -> Op[_Connection]:
        """A new connection, its peer checked and its token proved (both ways)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn = _Connection(sock, self._sockets)
        failed = f"cannot connect to {self.path}"
        try:
            yield Io(self._sockets.connect, (sock, self.path, timeout))
            failed = f"local-call connection to {self.path} lost"
            peer_uid = self._hello.check_peer(sock)
            if self._hello.key:
                yield from self._hello.prove(conn, peer_uid, timeout)
        except OSError as exc:
            sock.close()
            raise LocalCallFailed(f"{failed}: {exc.strerror or exc}", sent=False) from None
        except BaseException:
            sock.close()
            raise
        return conn

    def _put_back(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        self._finish(conn)

    def close(self) -> None:
        """Close the idle connections, reading the answers that have arrived first
        (the client read the rest before: Connection.close); those in use close when
        their call ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            self._finish(conn)

    @staticmethod
    def _finish(conn: _Connection) -> None:
        if conn.owed:
            with contextlib.suppress(OSError):
                conn.poll_owed()
        conn.close("the client closed")  # the daemon has the calls all the same


def _spent(conn: _Connection, error: BaseException, sent: bool, timeout: float) -> BaseException:
    """Close the connection of a call that broke off (its answer, still coming, would
    confuse the next call); what to raise: a LocalCallFailed for a timeout or a broken
    socket, else ``error`` itself (cancelled, or ``during`` failed)."""
    if isinstance(error, TimeoutError):
        conn.close(f"no answer within {timeout} s")
        return LocalCallFailed(f"no answer within {timeout} s", sent=sent, timed_out=True)
    if isinstance(error, OSError):
        reason = error.strerror or str(error)
        conn.close(reason)
        return LocalCallFailed(reason, sent=sent)
    conn.close("a call on the connection was abandoned")
    return error


def _lose(owed: list[_Owed], reason: str) -> None:
    """Empty ``owed``, the calls sent on a connection now closed: each learns that its
    answer will not come (see _Owed.lost)."""
    lost, owed[:] = list(owed), []
    for call in lost:
        call.lost(reason)
