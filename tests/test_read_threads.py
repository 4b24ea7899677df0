"""The read side's threads (kvstore.read_threads): no thread waits on work queued
behind itself, and an acquire's wait for a running read-ahead has a bound (#66: every
read thread once waited on read-ahead queued to its own pool, and the daemon hung)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from kvstore.keys import BlockKey
from kvstore.read_threads import READ_AHEAD_THREADS, ReadThreads, run_shares


def test_a_pool_thread_that_reads_in_shares_never_waits_on_its_own_queue() -> None:
    # one thread: the shares it offers its own pool can only run if it takes them back
    with ThreadPoolExecutor(1) as pool:
        outer = pool.submit(run_shares, pool, lambda share: share * 10, [1, 2, 3, 4])
        assert outer.result(timeout=30) == [10, 20, 30, 40]


def test_read_ahead_is_skipped_when_busy_and_waited_for_with_a_bound() -> None:
    threads = ReadThreads(wait_s=0.1)
    gate = threading.Event()  # the running read-aheads read until it opens
    started = threading.Semaphore(0)
    keys = [BlockKey(bytes([i]) * 16) for i in range(READ_AHEAD_THREADS + 1)]

    def reading() -> None:
        started.release()
        gate.wait(30)

    try:
        for key in keys[:-1]:  # every read-ahead thread busy
            assert threads.read_ahead(key, reading)
        for _ in keys[:-1]:
            assert started.acquire(timeout=30)
        assert not threads.read_ahead(keys[0], reading)  # that window's is in flight
        assert not threads.read_ahead(keys[-1], reading)  # would queue: skipped
        assert threads.take(keys[-1], wait=True)  # none of that window: read it
        assert not threads.take(keys[0], wait=False)  # (a caller that must not wait)
        # running, and still reading past the bound: the acquire reads the window itself
        assert threads.take(keys[0], wait=True)
        assert not gate.is_set()
    finally:
        gate.set()
        threads.close()


def test_a_share_that_fails_ends_the_rest_only_after_the_running_ones() -> None:
    """The caller frees the slots its shares read into when one fails: the others must
    have stopped writing by then (started ones waited for, queued ones never run)."""
    started, release = threading.Event(), threading.Event()
    wrote: list[int] = []

    def work(share: int) -> int:
        if share == 0:
            assert started.wait(30)  # the pool's share runs before this one fails
            release.set()
            raise OSError("a disk read failed")
        started.set()
        assert release.wait(30)
        wrote.append(share)
        return share

    with ThreadPoolExecutor(1) as pool:
        try:
            run_shares(pool, work, [0, 1, 2])
        except OSError:
            ended_with = list(wrote)
        else:
            raise AssertionError("the failed share's error was not raised")
    assert ended_with == [1]  # share 1 finished before the error came out; 2 never ran
