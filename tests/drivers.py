"""Both client drivers behind one blocking interface, so one test body checks both.

``KVClient`` is used as it is. An ``AsyncKVClient`` lives on an event loop of its own
(a thread), and :class:`OnLoop` drives it from the test's thread: every method call
runs on that loop, and what it returns is awaited there to its end; the client's
objects (namespaces, leases, puts sent ahead, claims, the events stream) come back
wrapped alike; ``with`` is ``async with`` and iteration ``async for``. Results and
errors come back as they are, so a test asserts the same things of both.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

from kvclient import AsyncKVClient, BlockLease, Claim, PendingPut
from kvclient.namespace import AsyncAcquire, AsyncNamespace

# what an asyncio client hands out that a test drives further
_DRIVEN = (AsyncKVClient, AsyncNamespace, AsyncAcquire, BlockLease, PendingPut, Claim)
# properties of KVClient that are coroutine methods of AsyncKVClient
_AWAITED_PROPERTIES = frozenset({"arena_in_use"})


class EventLoop:
    """An event loop running on a thread of its own until :meth:`close`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the loop, awaited to its end when it is awaitable."""

        async def call() -> Any:
            result = fn(*args, **kwargs)
            return (await result) if inspect.isawaitable(result) else result

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class OnLoop:
    """An object of an asyncio client, driven from another thread (see the module
    docstring)."""

    def __init__(self, target: Any, loop: EventLoop) -> None:
        self._target = target
        self._loop = loop

    @classmethod
    def client(cls, loop: EventLoop, *args: Any, **kwargs: Any) -> OnLoop:
        """A new AsyncKVClient, made on the loop (its channel belongs to it)."""
        return cls(loop.run(AsyncKVClient, *args, **kwargs), loop)

    def _wrap(self, value: Any) -> Any:
        if isinstance(value, _DRIVEN) or inspect.isasyncgen(value):
            return OnLoop(value, self._loop)
        return value

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._wrap(self._loop.run(fn, *args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name in _AWAITED_PROPERTIES:
            return self._run(attr)
        if callable(attr):
            return lambda *args, **kwargs: self._run(attr, *args, **kwargs)
        return attr

    def __enter__(self) -> Any:
        return self._run(self._target.__aenter__)

    def __exit__(self, *exc: object) -> None:
        self._run(self._target.__aexit__, *exc)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return self._run(self._target.__anext__)
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        """``close()`` of what it wraps; an async generator's is ``aclose()``."""
        if inspect.isasyncgen(self._target):
            self._run(self._target.aclose)
        else:
            self._run(self._target.close)
