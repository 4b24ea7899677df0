"""The asyncio client of kvstored: the async driver of the client's core.

:class:`AsyncKVClient` runs the same ops as :class:`kvclient.KVClient`
(:mod:`kvclient.effects`) on the running event loop: calls over ``grpc.aio`` and
asyncio streams, copies on worker threads (run to their end even when the caller is
cancelled), the pending accounting sent by ``loop.call_later``. Same methods, same
protocol, same results and exceptions, each returning an awaitable; its namespaces
are :class:`kvclient.AsyncNamespace`.

Create the client inside the running event loop (``async with AsyncKVClient() as c``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Any, TypeVar

from kvclient.base_client import BaseClient
from kvclient.connection import events_of
from kvclient.effects import LOCKS, Op, run_async
from kvclient.local_calls import ASYNC_SOCKETS
from kvclient.namespace import AsyncNamespace, BlockLease
from kvproto.v1.results import Event

T = TypeVar("T")


class AsyncKVClient(BaseClient):
    """asyncio client of one kvstored; ``await client.close()`` (or ``async with``)."""

    namespace_class = AsyncNamespace
    blocking = False
    sockets = ASYNC_SOCKETS
    event_class = asyncio.Event

    def _start_driver(self) -> None:
        self._locks = {name: asyncio.Lock() for name in LOCKS}
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()

    def _drive(self, op: Op[T]) -> Awaitable[T]:
        return run_async(op, self._locks)

    def _wake(self, now: bool) -> None:
        """Work was queued: send it within the delay, or at once when due ``now``."""
        if self._conn.closed:
            return
        if now:
            self._send_now()
        elif self._timer is None:
            due = max(self._conn.accounting.due_in() or 0.0, 0.0)
            self._timer = asyncio.get_running_loop().call_later(due, self._send_now)

    def _send_now(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        task = asyncio.ensure_future(self._drive(self._conn.settle()))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    # -- what differs in kind -------------------------------------------------------

    async def close(self) -> None:
        """Give back leases and staged slots, close the channel, unmap the arena.
        Idempotent."""
        if self._timer is not None:
            self._timer.cancel()
        await self._drive(self._conn.close())

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def arena_in_use(self) -> bool:
        """Whether data calls go through the shared arena (asks the daemon once)."""
        return await self._drive(self._conn.arena_in_use())

    async def _follow(
        self, start: Callable[[], Any], duration_s: float | None
    ) -> AsyncIterator[Event]:
        call = start()
        with self._conn.watching(call, duration_s):
            async for msg in call:
                for event in events_of(msg):
                    yield event

    def _lease(self, op: Op[BlockLease]) -> AsyncAcquire:
        return AsyncAcquire(self._drive(op))


class AsyncAcquire:
    """What :meth:`AsyncNamespace.acquire` returns: await it for the lease, or use it
    in ``async with`` to have the lease released at the end of the block."""

    def __init__(self, pinning: Awaitable[BlockLease]) -> None:
        self._pinning = pinning
        self._lease: BlockLease | None = None

    def __await__(self) -> Generator[Any, None, BlockLease]:
        return self._pinning.__await__()

    async def __aenter__(self) -> BlockLease:
        self._lease = await self._pinning
        return self._lease

    async def __aexit__(self, *exc: object) -> None:
        if self._lease is not None:
            await self._lease.release()
