"""Puts sent ahead: an arena put returns once its bytes are in the arena.

An engine offloading KV blocks after a forward pass needs its buffers free and the
blocks findable soon after, not the counts of what was stored. So every arena put
(:mod:`kvclient.writes`) copies its blocks into slots, sends the message that commits
them (a Reserve naming staged slots with ``commit=true``, or a Commit), and does not
wait: it returns a :class:`PendingPut` (``Namespace.put_nowait``). ``Namespace.put``
sends the same way and waits for that outcome (:meth:`kvclient.Namespace.put`).

The answer is read later: by this client's next call on that connection, by a later
put that needs the slots the answer sets aside, or by :meth:`PendingPut.result`. It
resolves the put with the counts, or with the daemon's error (a namespace dropped
meanwhile, a staging lease run out: then nothing of that put is stored, and a lookup
reports a miss).

Ordering: the daemon runs a connection's calls in order, and this client's next call
takes the connection the put used, so the client reads its own writes. Other clients
see the blocks once the daemon has handled the message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from kvclient import wire
from kvclient.effects import Op, Wait
from kvclient.errors import DaemonUnavailableError, KVStoreError, RequestTimeoutError
from kvclient.local_calls import LocalCallFailed, LocalCallStatus, OnAnswer
from kvclient.staged_slots import SlotStash
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1.results import PutResult

if TYPE_CHECKING:
    from kvclient.connection import Connection

log = logging.getLogger(__name__)


class PendingPut:
    """The outcome of a put: its counts or its error, once the answer is read.

    ``result()`` returns it with :class:`kvclient.KVClient`, an awaitable of it with
    :class:`kvclient.AsyncKVClient`."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.addr = conn.addr
        self._event = conn.new_event()
        self._result: PutResult | None = None
        self._error: KVStoreError | None = None

    def done(self) -> bool:
        """Whether the answer has been read."""
        return bool(self._event.is_set())

    def resolve(self, result: PutResult | None, error: KVStoreError | None) -> None:
        self._result, self._error = result, error
        self._event.set()

    def result(self, timeout: float | None = None) -> Any:
        """The put's counts, reading its answer if nothing has yet; the daemon's error
        if it refused the put; RequestTimeoutError after ``timeout`` seconds."""
        return self._conn.drive(self.wait(timeout))

    def wait(self, timeout: float | None) -> Op[PutResult]:
        if not self._event.is_set():
            yield from self._conn.read_owed()  # those on a connection in use: its call's
        if not (yield Wait(self._event, timeout)):
            raise RequestTimeoutError(
                f"the answer to a put sent ahead did not come within {timeout} s",
                code=grpc.StatusCode.DEADLINE_EXCEEDED,
                addr=self._conn.addr,
            )
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def __repr__(self) -> str:
        state = self._error or self._result or "pending"
        return f"PendingPut({state})"


def answer_handler(
    pending: PendingPut,
    stash: SlotStash,
    request: pb.ReserveRequest,
    sent_at: float,
    to_error: Callable[[KVStoreError], KVStoreError],
    release: Callable[[int], None],
) -> OnAnswer:
    """What to do with the answer of a Reserve that commits staged slots: keep the
    slots it set aside and resolve ``pending`` with the counts; or, on an error, drop
    the staged slots (the daemon may have given the named ones to blocks), release
    their lease (``release``) and resolve ``pending`` with the error (``to_error``:
    the client's view of it)."""

    def on_answer(reply: Any, failure: Exception | None) -> None:
        if failure is None:
            stash.answered(sent_at, request, reply)
            stored = len(reply.slot_offsets)
            pending.resolve(PutResult(stored, reply.existing, reply.refused, reply.durable), None)
            return
        stash.drop(request, release)
        error = to_error(_client_error(failure, pending))
        log.warning("a put of %d blocks failed: %s", len(request.staged_offsets), error)
        pending.resolve(None, error)

    return on_answer


def commit_handler(pending: PendingPut, reserved: pb.ReserveResponse, n_slots: int) -> OnAnswer:
    """What to do with the answer of a put's Commit (its Reserve answered ``n_slots``)."""

    def on_answer(reply: Any, failure: Exception | None) -> None:
        if failure is None:
            pending.resolve(wire.committed_put(reserved, n_slots, reply), None)
            return
        error = _client_error(failure, pending)
        log.warning("the commit of a put of %d blocks failed: %s", n_slots, error)
        pending.resolve(None, error)

    return on_answer


def _client_error(failure: Exception, pending: PendingPut) -> KVStoreError:
    addr = pending.addr
    if isinstance(failure, KVStoreError):
        return failure
    if isinstance(failure, LocalCallStatus):
        return failure.error(addr)
    reason = str(failure)
    if isinstance(failure, LocalCallFailed):
        reason = f"the connection broke before the answer ({reason}): it may or may not be stored"
    return DaemonUnavailableError(
        f"a put sent ahead to kvstored at {addr} got no answer: {reason}",
        code=grpc.StatusCode.UNAVAILABLE,
        addr=addr,
    )
