"""The client's core does no I/O: an operation is a generator of the I/O it needs.

Every client operation (lookup, get, put, acquire, claim, ...) is written once, as a
generator function (an *op*) in :mod:`kvclient.connection`, :mod:`kvclient.reads` and
:mod:`kvclient.writes`. It yields an *effect* each time it needs the outside world
and is sent back the effect's result (or has the effect's exception thrown into it);
its return value is the operation's result. A driver runs ops to their end:
:func:`run_blocking` for :class:`kvclient.KVClient`, :func:`run_async` for
:class:`kvclient.AsyncKVClient`. The two drivers are the only code that differs
between the blocking and the asyncio client.

The effects:

- :class:`Io`: call ``fn(*args)`` of a transport (:mod:`kvclient.transport`). The
  blocking transports return the answer; the asyncio ones return an awaitable of it,
  which the async driver awaits.
- :class:`Work`: CPU work (a copy between the caller's rows and the arena). The
  blocking driver runs it in place; the async driver on a worker thread, always to its
  end (a copy cancelled half-way would go on writing slots that are freed meanwhile).
- :class:`Serial`: run another op while holding the driver's lock of that name
  (``refresh``: the daemon's info and arena mapping; ``settle``: the accounting
  message), a ``threading.Lock`` or an ``asyncio.Lock``.
- :class:`Stream`: feed each message of a server stream to ``sink``.
- :class:`Wait`: wait for an event (``threading.Event`` / ``asyncio.Event``) up to a
  timeout; the result says whether it is set.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Io:
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class Work:
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class Serial:
    lock: str
    op: Generator[Any, Any, Any]


@dataclass(frozen=True, slots=True)
class Stream:
    call: Any  # a started server-streaming call: iterable, or async iterable
    sink: Callable[[Any], None]


@dataclass(frozen=True, slots=True)
class Wait:
    event: Any  # threading.Event or asyncio.Event
    timeout: float | None


Effect = Io | Work | Serial | Stream | Wait
Op = Generator[Effect, Any, T]
LOCKS = ("refresh", "settle")


class _Steps:
    """The asyncio driver's view of an op between two effects: iterate for its
    effects, hand each one's outcome back with :meth:`answer` inside ``with steps:``
    (which hands the op an exception instead); ``result`` is the op's value once the
    iteration ends."""

    def __init__(self, op: Op[Any]) -> None:
        self._op = op
        self._value: Any = None
        self._error: BaseException | None = None
        self.result: Any = None

    def __iter__(self) -> Iterator[Effect]:
        while True:
            value, error, self._value, self._error = self._value, self._error, None, None
            try:
                yield self._op.send(value) if error is None else self._op.throw(error)
            except StopIteration as stop:
                self.result = stop.value
                return

    def answer(self, value: Any) -> None:
        self._value = value

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> bool:
        """An exception raised inside ``with steps:`` (cancellation too) goes to the op,
        which may handle it. (A class, not contextlib: this runs once per effect.)"""
        if error is not None:
            self._error = error
        return True


def run_blocking(op: Op[T], locks: dict[str, threading.Lock]) -> T:
    """Run ``op`` to its end in this thread: each effect's outcome (its value, or the
    exception it raised) goes back into the op. A plain loop: it runs once per effect
    of every call."""
    step: Callable[[Any], Any] = op.send
    outcome: Any = None
    while True:
        try:
            effect = step(outcome)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            step, outcome = op.send, _do_blocking(effect, locks)
        except BaseException as error:  # handed to the op, which may handle it
            step, outcome = op.throw, error


def _do_blocking(effect: Effect, locks: dict[str, threading.Lock]) -> Any:
    if isinstance(effect, (Io, Work)):
        return effect.fn(*effect.args)
    if isinstance(effect, Serial):
        with locks[effect.lock]:
            return run_blocking(effect.op, locks)
    if isinstance(effect, Stream):
        for message in effect.call:
            effect.sink(message)
        return None
    return effect.event.wait(effect.timeout)


async def run_async(op: Op[T], locks: dict[str, asyncio.Lock]) -> T:
    """Run ``op`` to its end on the running event loop."""
    steps = _Steps(op)
    for effect in steps:
        with steps:
            steps.answer(await _do_async(effect, locks))
    return steps.result  # type: ignore[no-any-return]


async def _do_async(effect: Effect, locks: dict[str, asyncio.Lock]) -> Any:
    if isinstance(effect, Io):
        return await effect.fn(*effect.args)
    if isinstance(effect, Work):
        return await _to_the_end(effect.fn, *effect.args)
    if isinstance(effect, Serial):
        async with locks[effect.lock]:
            return await run_async(effect.op, locks)
    if isinstance(effect, Stream):
        async for message in effect.call:
            effect.sink(message)
        return None
    return await _wait(effect.event, effect.timeout)


async def _to_the_end(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a worker thread. Cancelled meanwhile, it waits for ``fn`` to
    end before raising."""
    running = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.wait([running])
        raise


async def _wait(event: asyncio.Event, timeout: float | None) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:  # not TimeoutError before Python 3.11
        return False
    return True
