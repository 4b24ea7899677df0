"""The asyncio client of kvstored: the async driver of the client's core.

:class:`AsyncKVClient` runs the same ops as :class:`kvclient.KVClient`
(:mod:`kvclient.effects`) on the running event loop: calls over ``grpc.aio`` and
asyncio streams, copies on worker threads (run to their end even when the caller is
cancelled), the pending accounting sent by ``loop.call_later``. Same methods, same
protocol, same results and exceptions, each method a coroutine; its namespaces are
:class:`kvclient.AsyncNamespace`.

Create the client inside the running event loop (``async with AsyncKVClient() as c``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import Any, TypeVar

from kvclient.base_client import BaseClient
from kvclient.connection import events_of
from kvclient.effects import LOCKS, Op, run_async
from kvclient.local_calls import ASYNC_SOCKETS
from kvclient.namespace import AsyncNamespace
from kvproto.v1.results import Event, NamespaceInfo, ServerInfo, Stats

T = TypeVar("T")


class AsyncKVClient(BaseClient):
    """asyncio client of one kvstored; ``await client.close()`` (or ``async with``)."""

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

    # -- daemon-wide calls: :class:`kvclient.KVClient`'s, awaited ----------------------

    async def events(
        self,
        from_seq: int = 0,
        *,
        ns_id: str = "",
        kinds: Sequence[str] = (),
        from_now: bool = False,
        duration_s: float | None = None,
    ) -> AsyncGenerator[Event, None]:
        """:meth:`KVClient.events` as an async iterator."""
        call = self._watch(from_seq, ns_id, kinds, from_now, duration_s)()
        with self._conn.watching(call, duration_s):
            async for msg in call:
                for event in events_of(msg):
                    yield event

    async def server_info(self) -> ServerInfo:
        return await self._drive(self._conn.server_info())

    async def stats(self) -> Stats:
        return await self._drive(self._conn.stats())

    async def namespaces(self) -> list[NamespaceInfo]:
        return await self._drive(self._conn.namespaces())

    async def clear(self, ns: str | None = None) -> int:
        return await self._drive(self._conn.clear(ns))

    async def namespace(
        self, model: str, block_tokens: int = 16, block_bytes: int = 0, *, name: str = "",
        **layout: Any,
    ) -> AsyncNamespace:  # fmt: skip
        """:meth:`KVClient.namespace`: an :class:`AsyncNamespace`."""
        opened = self._opened(model, block_tokens, block_bytes, name, layout)
        return AsyncNamespace(self, self._conn, await self._drive(opened))

    async def open_namespace(self, ns_id: str) -> AsyncNamespace:
        return AsyncNamespace(self, self._conn, await self._drive(self._described(ns_id)))
