"""Puts sent ahead: an arena put that returns once its bytes are in the arena.

Why: a waiting arena put (``Namespace.put``) copies its blocks into staged slots while
its Reserve is in flight, then waits for the Reserve's answer: the counts it returns
are in it. For a call of a few MiB that answer is the put's longest part on a busy
host (ninth round, 16 x 256 KiB: 0.58 ms in the Reserve call, of which 0.29 ms the
copy, against 0.22 ms for a memcpy of the same bytes). An engine offloading KV blocks
after a forward pass does not need the counts then; it needs the bytes out of its
buffers and the blocks findable soon after.

Protocol (``Namespace.put_nowait``):

1. The put takes a put's worth of staged slots (:mod:`kvclient.staged_slots`) and
   copies every block into its slot.
2. It sends one Reserve naming them with ``commit=true``, and does not wait: the
   daemon reserves and commits the new blocks on arrival, and sets aside slots for the
   puts after (the stash keeps two puts' worth, so a put does not wait for the answer
   of the one before).
3. The answer is read later: by this client's next call on that connection, by a later
   put that needs the slots the answer sets aside, or by :meth:`PendingPut.result`.
   It resolves the put's :class:`PendingPut` with the counts, or with the daemon's
   error (a namespace dropped meanwhile, a staging lease run out: then nothing of that
   put is stored, and a lookup reports a miss).

Ordering is that of the Commit a waiting put sends without waiting: the daemon runs
a connection's calls in order, and this client's next call takes the connection the
put used, so the client reads its own writes. Other clients see the blocks once the
daemon has handled the Reserve.

Without staged slots (the first put of a namespace, a client on another host, a put
larger than what is staged) ``put_nowait`` makes a waiting put and returns its result
already resolved.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvclient.errors import DaemonUnavailableError, KVStoreError, RequestTimeoutError
from kvclient.local_calls import LocalCallFailed, LocalCallStatus, OnAnswer
from kvclient.results import PutResult
from kvclient.staged_slots import SlotStash
from kvproto.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)

_O = TypeVar("_O", bound="_Outcome")


class _Outcome:
    """A put's counts or its error, once known (``_event`` is set then)."""

    _event: threading.Event | asyncio.Event

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self._result: PutResult | None = None
        self._error: KVStoreError | None = None

    @classmethod
    def of(cls: type[_O], result: PutResult, addr: str) -> _O:
        """One resolved already (a put that waited)."""
        pending = cls(addr)
        pending.resolve(result, None)
        return pending

    def done(self) -> bool:
        """Whether the answer has been read."""
        return self._event.is_set()

    def resolve(self, result: PutResult | None, error: KVStoreError | None) -> None:
        self._result, self._error = result, error
        self._event.set()

    def _timed_out(self, timeout: float | None) -> RequestTimeoutError:
        return RequestTimeoutError(
            f"the answer to a put sent ahead did not come within {timeout} s",
            code=grpc.StatusCode.DEADLINE_EXCEEDED,
            addr=self.addr,
        )

    def _outcome(self) -> PutResult:
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class PendingPut(_Outcome):
    """The outcome of a put sent ahead by :class:`kvclient.KVClient` (thread-safe)."""

    _event: threading.Event

    def __init__(self, addr: str, read_answers: Callable[[], None] | None = None) -> None:
        super().__init__(addr)
        self._event = threading.Event()
        self._read_answers = read_answers

    def result(self, timeout: float | None = None) -> PutResult:
        """The put's counts, reading its answer if nothing has yet; the daemon's error
        if it refused the put; RequestTimeoutError after ``timeout`` seconds."""
        if not self._event.is_set() and self._read_answers is not None:
            self._read_answers()  # those on a connection in use are read by its call
        if not self._event.wait(timeout):
            raise self._timed_out(timeout)
        return self._outcome()


class AsyncPendingPut(_Outcome):
    """The outcome of a put sent ahead by :class:`kvclient.AsyncKVClient` (one loop)."""

    _event: asyncio.Event

    def __init__(
        self, addr: str, read_answers: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        super().__init__(addr)
        self._event = asyncio.Event()
        self._read_answers = read_answers

    async def result(self, timeout: float | None = None) -> PutResult:
        """Like :meth:`PendingPut.result`."""
        if not self._event.is_set() and self._read_answers is not None:
            await self._read_answers()
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except asyncio.TimeoutError:  # not TimeoutError before Python 3.11
            raise self._timed_out(timeout) from None
        return self._outcome()


def answer_handler(
    pending: PendingPut | AsyncPendingPut,
    stash: SlotStash,
    request: pb.ReserveRequest,
    sent_at: float,
    to_error: Callable[[KVStoreError], KVStoreError],
    release: Callable[[int], None],
) -> OnAnswer:
    """What to do with the answer of a put sent ahead: keep the slots it set aside and
    resolve ``pending`` with the counts; or, on an error, drop the staged slots (the
    daemon may have given the named ones to blocks), release their lease (``release``)
    and resolve ``pending`` with the error (``to_error``: the client's view of it)."""

    def on_answer(reply: Any, failure: Exception | None) -> None:
        if failure is None:
            stash.answered(sent_at, request, reply)
            stored = len(reply.slot_offsets)
            pending.resolve(PutResult(stored, reply.existing, reply.refused, reply.durable), None)
            return
        stash.drop(request, release)
        error = to_error(_client_error(failure, pending.addr))
        log.warning("a put sent ahead of %d blocks failed: %s", len(request.staged_offsets), error)
        pending.resolve(None, error)

    return on_answer


def _client_error(failure: Exception, addr: str) -> KVStoreError:
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
