"""The client end of local calls: unary kvstore.v1 calls over the daemon's local socket.

The framing, and why it exists, are in :mod:`kvproto.v1.local_calls`. A client uses
local calls only where it maps the daemon's arena (same host, same user), for every
unary call once it knows the socket (``ServerInfo.local_socket``); streams stay on
gRPC. Each connection carries one call at a time; a channel keeps the idle ones for
the next call (:class:`LocalCalls` for threads, :class:`AsyncLocalCalls` for one event
loop).

Failures are of two kinds. A status other than OK raises :class:`LocalCallStatus`,
which the client turns into the same :class:`kvclient.errors.KVStoreError` gRPC would
have given. A transport failure raises :class:`LocalCallFailed`; its ``sent`` says
whether any byte of the request left, since only a call that certainly did not reach
the daemon may be sent again over gRPC (a Commit must not run twice). The connection
of a failed call is closed, never reused.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import grpc

from kvclient.errors import (
    DaemonUnavailableError,
    KVStoreError,
    RequestTimeoutError,
    error_from_status,
)
from kvproto.v1 import local_calls as frames

_CODES = {code.value[0]: code for code in grpc.StatusCode}


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
        return frames.UNARY_METHODS[name][1].FromString(body)
    kind, message = frames.parse_error(body)
    raise LocalCallStatus(_CODES.get(status), message, kind)


class LocalCalls:
    """Blocking local calls to one daemon socket. Thread-safe, and safe across fork:
    a child process never uses its parent's connections (their answers would be read
    by whichever process reads first); it opens its own."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()

    def call(
        self, name: str, request: Any, timeout: float, during: Callable[[], None] | None = None
    ) -> Any:
        """``name``'s response to ``request``, or LocalCallStatus / LocalCallFailed.
        ``during`` runs once the request is sent, before the answer is read."""
        frame = _request(name, request)
        sock = self._take(timeout)
        sent = False
        try:
            sock.settimeout(timeout)
            # a send fails only when the daemon's end is closed (an idle connection to a
            # daemon that stopped): then it has not seen the request
            sock.sendall(frame)
            sent = True
            if during is not None:
                try:
                    during()
                except BaseException:
                    sock.close()  # its answer is still coming: the connection is spent
                    raise
            status, body = _receive(sock)
        except TimeoutError:
            sock.close()
            raise LocalCallFailed(
                f"no answer within {timeout} s", sent=sent, timed_out=True
            ) from None
        except OSError as exc:
            sock.close()
            raise LocalCallFailed(exc.strerror or str(exc), sent=sent) from None
        self._put_back(sock)
        return _response(status, body, name)

    def _take(self, timeout: float) -> socket.socket:
        with self._lock:
            if self._pid != os.getpid():  # forked: the idle sockets are the parent's
                for inherited in self._idle:
                    inherited.close()  # our copy of the fd only: the parent keeps its own
                self._idle, self._pid = [], os.getpid()
            if self._idle:
                return self._idle.pop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise LocalCallFailed(
                f"cannot connect to {self.path}: {exc.strerror or exc}", sent=False
            ) from None
        return sock

    def _put_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        """Close the idle connections; those in use close when their call ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


def _receive(sock: socket.socket) -> tuple[int, bytes]:
    """One response frame: (status, body). Usually a single recv."""
    data = bytearray()
    need = frames.HEADER.size
    status: int | None = None
    while True:
        while len(data) < need:
            more = sock.recv(max(need - len(data), 1 << 16))
            if not more:
                raise ConnectionResetError(0, "the daemon closed the local-call connection")
            data += more
        if status is not None:
            break
        body_len, status = frames.HEADER.unpack_from(data)
        need += body_len  # now read the body
    if len(data) > need:  # one call at a time: nothing may follow its answer
        raise ConnectionResetError(0, "the daemon sent more than one answer")
    return status, bytes(data[frames.HEADER.size :])


class AsyncLocalCalls:
    """Local calls for one asyncio event loop (the loop of the AsyncKVClient)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._closed = False

    async def call(
        self, name: str, request: Any, timeout: float, during: Callable[[], None] | None = None
    ) -> Any:
        """Like :meth:`LocalCalls.call`; ``during`` runs on a worker thread while the
        answer is awaited, and has finished whenever this returns or raises."""
        frame = _request(name, request)
        if self._idle:
            reader, writer = self._idle.pop()
        else:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(self.path), timeout
                )
            except (OSError, TimeoutError) as exc:
                reason = getattr(exc, "strerror", None) or str(exc) or "timed out"
                raise LocalCallFailed(
                    f"cannot connect to {self.path}: {reason}", sent=False
                ) from None
        if reader.at_eof() or writer.is_closing():  # the daemon closed an idle connection
            writer.close()
            raise LocalCallFailed("the local-call connection was closed", sent=False)
        early: asyncio.Future[None] | None = None
        try:
            writer.write(frame)
            if during is not None:
                early = asyncio.ensure_future(asyncio.to_thread(during))
            status, body = await asyncio.wait_for(_areceive(reader, writer), timeout)
            if early is not None:
                await early  # its error, if any, spends the connection below
        except TimeoutError:
            writer.close()
            raise LocalCallFailed(
                f"no answer within {timeout} s", sent=True, timed_out=True
            ) from None
        except (OSError, asyncio.IncompleteReadError) as exc:
            writer.close()
            raise LocalCallFailed(str(exc) or type(exc).__name__, sent=True) from None
        except BaseException:  # cancelled mid-call: the answer would confuse the next call
            writer.close()
            raise
        finally:
            if early is not None and not early.done():
                await asyncio.wait([early])  # never leave a copy running into the caller's rows
        if self._closed:
            writer.close()
        else:
            self._idle.append((reader, writer))
        return _response(status, body, name)

    def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()


async def _areceive(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> tuple[int, bytes]:
    await writer.drain()
    header = await reader.readexactly(frames.HEADER.size)
    body_len, status = frames.HEADER.unpack(header)
    return status, await reader.readexactly(body_len)
