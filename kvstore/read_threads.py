"""The read side's threads (:mod:`kvstore.store_reads`): shares of big promotions and
read-ahead of a long prefix's next window, arranged so that no thread ever waits on
work queued behind itself (issue 66: every read thread once waited on read-ahead it had
queued to its own pool, and the daemon hung for good).

Who waits on whom:

- a reading thread (a daemon worker, or a read-ahead) reads a big promotion in shares
  (:meth:`ReadThreads.shares`): it offers every share but the first to the promotion
  pool, reads the first itself, then takes back each share no promotion thread has
  started and reads it too. It waits only on shares a promotion thread is reading (a
  disk read, which ends), never on queued ones;
- promotion threads read shares and wait on nothing;
- read-aheads run on a pool of their own (:meth:`ReadThreads.read_ahead`); one that
  would wait in its queue (every read-ahead thread busy) is skipped: it is a hint;
- an acquire of a window takes over a read-ahead of it that has not started (it then
  does nothing), and waits for one that has at most ``wait_s`` (the store's
  ``put_wait_ms``), after which it reads the window itself (a block read twice is
  published once: the second reader frees its slot).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TypeVar

from kvstore.keys import BlockKey
from kvstore.store_config import PROMOTE_THREADS

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

# read-aheads at once (each mostly waits on its shares' disk reads); one more is skipped
READ_AHEAD_THREADS = PROMOTE_THREADS


@dataclass(slots=True, eq=False)
class _ReadAhead:
    """A read-ahead of one window: queued until a read-ahead thread ``started`` it;
    ``done`` once it ended (or found its window taken over by an acquire)."""

    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)


def run_shares(pool: ThreadPoolExecutor, work: Callable[[T], R], shares: Sequence[T]) -> list[R]:
    """``work(share)`` for each of ``shares``, in order: the first on this thread, the
    others offered to ``pool``; each share no pool thread has started by the time this
    thread comes to it is taken back and run here. This thread so waits only on shares
    that are running, never on work queued behind others (behind itself, when it is a
    thread of ``pool``): no pool can wait on its own queue.

    A share that raises ends the rest: those not started are cancelled, and those
    running are waited for before the error is raised, since the caller then frees the
    slots they write into."""
    futures: list[Future[R] | None] = []
    for share in shares[1:]:
        try:
            futures.append(pool.submit(work, share))
        except RuntimeError:  # the pool shut down (the store closes): run it here
            futures.append(None)
    try:
        results = [work(shares[0])]
        for share, future in zip(shares[1:], futures, strict=True):
            if future is None or future.cancel():
                results.append(work(share))
            else:
                results.append(future.result())  # running: a disk read, which ends
    except BaseException:
        running = [f for f in futures if f is not None and not f.cancel()]
        wait(running)  # disk reads, which end
        raise
    return results


class ReadThreads:
    """The promotion and read-ahead pools (made on first use) and the read-aheads
    queued or running, by the first key of their window (see the module docstring)."""

    def __init__(self, wait_s: float) -> None:
        self._wait_s = wait_s  # the longest an acquire waits for a running read-ahead
        self._lock = threading.Lock()
        self._promoters: ThreadPoolExecutor | None = None
        self._readers_ahead: ThreadPoolExecutor | None = None
        self._ahead: dict[BlockKey, _ReadAhead] = {}

    def shares(self, work: Callable[[T], R], shares: Sequence[T]) -> list[R]:
        """``work`` of each share (:func:`run_shares`) on this thread and the
        promotion threads."""
        with self._lock:
            if self._promoters is None:
                self._promoters = ThreadPoolExecutor(
                    PROMOTE_THREADS, thread_name_prefix="kvstore-promote"
                )
            pool = self._promoters
        return run_shares(pool, work, shares)

    def read_ahead(self, first: BlockKey, work: Callable[[], None]) -> bool:
        """Run ``work`` (the read-ahead of the window that starts with ``first``) on a
        read-ahead thread; False, having queued nothing, when one of that window is
        queued or running already, or every read-ahead thread is busy."""
        with self._lock:
            if first in self._ahead or len(self._ahead) >= READ_AHEAD_THREADS:
                return False
            ahead = self._ahead[first] = _ReadAhead()
            if self._readers_ahead is None:
                self._readers_ahead = ThreadPoolExecutor(
                    READ_AHEAD_THREADS, thread_name_prefix="kvstore-ahead"
                )
            pool = self._readers_ahead
        try:
            pool.submit(self._run, first, ahead, work)
        except RuntimeError:  # the pool shut down: the store closes
            self._end(first, ahead)
            return False
        return True

    def take(self, first: BlockKey, wait: bool) -> bool:
        """Whether the acquire of the window that starts with ``first`` may read it: no
        read-ahead of it is in flight (its blocks would else be read twice). One still
        queued is taken over (it will do nothing); one running is waited for with
        ``wait``, up to ``wait_s``, after which the acquire reads the window itself.
        False: one is running, and not ``wait``."""
        with self._lock:
            ahead = self._ahead.get(first)
            if ahead is None:
                return True
            if not ahead.started:
                del self._ahead[first]
                return True
        if not wait:
            return False
        if not ahead.done.wait(self._wait_s):
            log.debug("a read-ahead still reads after %.1f s: its acquire reads too", self._wait_s)
        return True

    def close(self) -> None:
        """Stop both pools (after the store closed: what their threads still do ends at
        its first look at the store); queued work is dropped."""
        for pool in (self._readers_ahead, self._promoters):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, first: BlockKey, ahead: _ReadAhead, work: Callable[[], None]) -> None:
        with self._lock:
            if self._ahead.get(first) is not ahead:  # taken over by its acquire
                ahead.done.set()
                return
            ahead.started = True
        try:
            work()
        finally:
            self._end(first, ahead)

    def _end(self, first: BlockKey, ahead: _ReadAhead) -> None:
        with self._lock:
            if self._ahead.get(first) is ahead:
                del self._ahead[first]
        ahead.done.set()
