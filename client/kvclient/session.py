"""A client's session with the daemon over gRPC: its leases end when the client does.

Why: a client that holds leases (a claim's pending blocks, an acquired prefix, staged
slots) and dies would hold them until their TTL runs out, and with large puts every
other client meets a full store meanwhile. Over the local-call socket the daemon sees
the connection close; over gRPC it sees nothing, so the client keeps a ``Session``
stream open for as long as it lives and names it in the metadata of the calls that
make leases (Acquire, Reserve). When the stream ends (the process died, the client
closed) the daemon ends every lease those calls made.

Protocol: a random id of 32 hex characters; a thread with its own channel opens
``Session(session_id)``, whose first message says the daemon registered it, and then
waits on the stream. When the stream breaks (the daemon restarted) it opens it again
after ``RETRY_S``. :meth:`GrpcSession.metadata` starts it on first use. A forked child
gets a session of its own.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from typing import Any

import grpc

from kvclient.security import Credentials
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

METADATA_KEY = "kvstore-session"
RETRY_S = 1.0
FIRST_WAIT_S = 1.0  # a blocking client waits this long for the first registration


class GrpcSession:
    """The session stream of one client (see the module docstring). Thread-safe."""

    def __init__(self, addr: str, options: Any, credentials: Credentials) -> None:
        self._addr = addr
        self._options = options
        self._credentials = credentials  # its channel carries the client's token too
        self._lock = threading.Lock()
        self._pid = -1
        self._id = ""
        self._registered = threading.Event()
        self._closed = threading.Event()
        self._call: Any = None

    def metadata(self, wait: bool) -> tuple[tuple[str, str], ...]:
        """The metadata that names this session, starting it if need be; ``wait``
        waits (once, up to FIRST_WAIT_S) until the daemon registered it."""
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child
                self._pid = os.getpid()
                self._id = secrets.token_hex(16)
                self._registered = threading.Event()
                self._closed = threading.Event()
                threading.Thread(
                    target=self._hold,
                    args=(self._id, self._registered, self._closed),
                    name="kvclient-session",
                    daemon=True,
                ).start()
            session_id, registered = self._id, self._registered
        if wait:
            registered.wait(FIRST_WAIT_S)
        return ((METADATA_KEY, session_id),)

    def close(self) -> None:
        """End the session: the daemon ends its leases."""
        with self._lock:
            if self._pid != os.getpid():
                return
            self._closed.set()
            call = self._call
        if call is not None:
            call.cancel()

    def _hold(self, session_id: str, registered: threading.Event, closed: threading.Event) -> None:
        while not closed.is_set():
            with self._credentials.channel(self._addr, self._options) as channel:
                request = pb.SessionRequest(session_id=session_id)
                call = pb_grpc.KVStoreStub(channel).Session(request)
                with self._lock:
                    self._call = call
                if closed.is_set():
                    call.cancel()
                try:
                    for _ in call:
                        registered.set()
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
                        log.debug("kvstored session stream ended: %s", exc.code().name)
            closed.wait(RETRY_S)
