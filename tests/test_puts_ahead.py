"""Puts sent ahead (``put_nowait``), against a real daemon.

A put sent ahead copies its blocks into staged slots and sends a Reserve that commits
them on arrival, without waiting for the answer (kvclient.puts_ahead). These tests
check what a user sees: the bytes, the counts once asked for, read-your-writes, other
clients, the daemon's errors arriving through the result, answers lost with their
connection, the async client, a forked child, and refused bad input.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import ClientMaker, Daemon, in_forked_child, kv_stub, raw_call, store_snapshot

from kvclient import AsyncKVClient, InvalidArgumentError, KVClient, LeaseError
from kvclient.effects import run_blocking
from kvclient.local_calls import BLOCKING_SOCKETS, LocalCallFailed, LocalCalls
from kvclient.puts_ahead import PendingPut
from kvclient.staged_slots import SlotStash
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import local_calls as frames

BT = 4  # tokens per block
BB = 8192  # bytes per block


@pytest.fixture
def daemon(kvstored_factory) -> Iterator[Daemon]:  # type: ignore[no-untyped-def]
    yield kvstored_factory()


def blocks(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BB), dtype=np.uint8)


def tokens(first: int, n_blocks: int) -> list[int]:
    return list(range(first, first + n_blocks * BT))


def test_puts_sent_ahead_store_the_bytes_and_resolve_with_the_counts(
    daemon: Daemon, kv_client: ClientMaker
) -> None:
    with kv_client(daemon.addr, use_arena=True) as client:
        ns = client.namespace("ahead", block_tokens=BT, block_bytes=BB)
        first = ns.put_nowait(tokens(0, 4), blocks(0, 4))  # nothing staged yet: it waits
        assert first.result().stored == 4
        # it asked for two puts' worth, so that a put need not wait for the one before
        assert len(client._conn.stash(ns.ns_id)) == 8
        data = [blocks(i, 4) for i in range(1, 9)]
        pending: list[PendingPut] = []
        for i, rows in enumerate(data):
            put = ns.put_nowait(tokens(1000 * (i + 1), 4), rows)
            assert not put.done()  # its answer is read later, never by the put itself
            pending.append(put)
        results = [put.result(timeout=10) for put in pending]
        assert [(r.stored, r.existing, r.refused) for r in results] == [(4, 0, 0)] * 8
        for i, rows in enumerate(data):
            got = ns.get(tokens(1000 * (i + 1), 4))
            assert got.n_blocks == 4 and np.array_equal(got.blocks, rows)
        stats = client.stats()
        assert stats.pending_blocks == 0 and stats.leases == 0
        assert stats.tier("host").blocks == 36
    with kv_client(daemon.addr) as other:  # closing released the staging lease
        assert other.stats().staged_bytes == 0


def test_the_caller_reads_its_own_writes_without_asking_for_the_result(
    daemon: Daemon, kv_client: ClientMaker
) -> None:
    with kv_client(daemon.addr, use_arena=True) as client:
        ns = client.namespace("ryw", block_tokens=BT, block_bytes=BB)
        ns.put(tokens(0, 3), blocks(20, 3))  # stages slots
        rows = blocks(21, 3)
        put = ns.put_nowait(tokens(500, 3), rows)
        rows[:] = 0  # the caller's buffer is its own again once put_nowait returns
        assert ns.lookup(tokens(500, 3)).blocks == 3  # runs after the put on the daemon
        assert np.array_equal(ns.get(tokens(500, 3)).blocks, blocks(21, 3))
        assert put.done()  # the lookup read the answer owed before its own
        assert put.result().stored == 3


def test_counts_of_existing_and_refused_blocks_come_with_the_result(
    daemon: Daemon, kv_client: ClientMaker
) -> None:
    with kv_client(daemon.addr, use_arena=True) as client:
        ns = client.namespace("counts", block_tokens=BT, block_bytes=BB)
        original = blocks(30, 4)
        ns.put(tokens(0, 4), original)
        ns.put(tokens(900, 8), blocks(31, 8))  # stages 16: two puts' worth of 8
        overlap = blocks(32, 8)
        result = ns.put_nowait(tokens(0, 8), overlap).result(timeout=10)
        assert (result.stored, result.existing, result.refused) == (4, 4, 0)
        got = ns.get(tokens(0, 8))
        assert np.array_equal(got.blocks[:4], original)  # existing blocks keep their bytes
        assert np.array_equal(got.blocks[4:], overlap[4:])
        # blocks after a missing ancestor are refused: nothing of them is stored
        orphan = ns.put_nowait(tokens(5000, 3), blocks(33, 2), start=1).result(timeout=10)
        assert (orphan.stored, orphan.existing, orphan.refused) == (0, 0, 2)
        assert ns.lookup(tokens(5000, 3)).blocks == 0
        # the slots the refused put named stay staged for the next one
        assert ns.put_nowait(tokens(6000, 2), blocks(34, 2)).result(timeout=10).stored == 2


def test_another_client_sees_the_blocks_once_the_answer_is_in(
    daemon: Daemon, kv_client: ClientMaker
) -> None:
    with kv_client(daemon.addr, use_arena=True) as writer, kv_client(daemon.addr) as reader:
        ns = writer.namespace("shared-ahead", block_tokens=BT, block_bytes=BB)
        theirs = reader.open_namespace(ns.ns_id)
        ns.put(tokens(0, 5), blocks(40, 5))
        data = blocks(41, 5)
        assert ns.put_nowait(tokens(100, 5), data).result(timeout=10).stored == 5
        assert theirs.lookup(tokens(100, 5)).blocks == 5
        assert np.array_equal(theirs.get(tokens(100, 5)).blocks, data)


def test_a_refused_put_raises_from_its_result_and_stores_nothing(
    daemon: Daemon, kv_client: ClientMaker
) -> None:
    """The staging lease is gone from the daemon (released behind the client's back, as
    if it had run out): the put sent ahead is refused, its result raises the daemon's
    error, none of its blocks is stored, and the next put stages slots afresh."""
    with kv_client(daemon.addr, use_arena=True) as client:
        ns = client.namespace("refused-ahead", block_tokens=BT, block_bytes=BB)
        ns.put(tokens(0, 2), blocks(50, 2))
        stash = client._conn.stash(ns.ns_id)
        lease = stash._lease_id
        kv_stub(daemon).Release(pb.ReleaseRequest(lease_id=lease))
        put = ns.put_nowait(tokens(300, 2), blocks(51, 2))
        with pytest.raises(LeaseError, match=str(lease)):
            put.result(timeout=10)
        with pytest.raises(LeaseError):  # asked again: the same error
            put.result()
        assert ns.lookup(tokens(300, 2)).blocks == 0
        assert len(stash) == 0 and stash._lease_id == 0
        again = blocks(52, 2)
        assert ns.put_nowait(tokens(300, 2), again).result(timeout=10).stored == 2
        assert np.array_equal(ns.get(tokens(300, 2)).blocks, again)
        assert stash._lease_id not in (0, lease)


def test_closing_the_client_reads_the_answers_still_owed(
    daemon: Daemon, kv_client: ClientMaker
) -> None:
    client = kv_client(daemon.addr, use_arena=True)
    ns = client.namespace("close-ahead", block_tokens=BT, block_bytes=BB)
    ns.put(tokens(0, 2), blocks(60, 2))
    pending = [ns.put_nowait(tokens(100 * (i + 1), 2), blocks(61 + i, 2)) for i in range(3)]
    client.close()
    assert all(put.done() for put in pending)
    assert [put.result().stored for put in pending] == [2, 2, 2]
    with kv_client(daemon.addr) as other:
        theirs = other.open_namespace(ns.ns_id)
        assert all(theirs.lookup(tokens(100 * (i + 1), 2)).blocks == 2 for i in range(3))
        assert other.stats().staged_bytes == 0


def test_bad_input_is_refused_before_anything_is_sent(
    daemon: Daemon, kv_client: ClientMaker
) -> None:
    with kv_client(daemon.addr, use_arena=True) as client:
        ns = client.namespace("bad-ahead", block_tokens=BT, block_bytes=BB)
        ns.put(tokens(0, 2), blocks(70, 2))
        before = store_snapshot(kv_stub(daemon))
        with pytest.raises(InvalidArgumentError):
            ns.put_nowait(tokens(0, 2), np.zeros((2, BB - 1), np.uint8))  # wrong block size
        with pytest.raises(InvalidArgumentError):
            ns.put_nowait(tokens(0, 1), blocks(71, 2))  # more blocks than tokens cover
        assert store_snapshot(kv_stub(daemon)) == before
        # a Reserve that asks to commit slots it does not name is refused by the daemon
        with pytest.raises(InvalidArgumentError, match="commit=true needs staged_offsets"):
            raw_call(
                client,
                "Reserve",
                pb.ReserveRequest(ns_id=ns.ns_id, tokens=tokens(800, 1), commit=True),
            )
        assert store_snapshot(kv_stub(daemon)) == before


def test_a_forked_child_puts_ahead_with_slots_of_its_own(daemon: Daemon) -> None:
    with KVClient(daemon.addr, use_arena=True) as client:
        ns = client.namespace("fork-ahead", block_tokens=BT, block_bytes=BB)
        ns.put(tokens(0, 2), blocks(80, 2))
        parent_put = ns.put_nowait(tokens(100, 2), blocks(81, 2))  # owed on the parent's socket

        def child() -> bool:
            rows = blocks(82, 2)
            results = [ns.put_nowait(tokens(700 + 100 * i, 2), rows) for i in range(3)]
            stored = [put.result(timeout=10).stored for put in results]
            got = ns.get(tokens(900, 2))
            return stored == [2, 2, 2] and np.array_equal(got.blocks, rows)

        assert in_forked_child(child) == 0
        assert parent_put.result(timeout=10).stored == 2  # the child did not read it
        assert np.array_equal(ns.get(tokens(100, 2)).blocks, blocks(81, 2))


def test_async_client_puts_ahead(daemon: Daemon) -> None:
    async def main() -> None:
        async with AsyncKVClient(daemon.addr, use_arena=True) as client:
            ns = await client.namespace("async-ahead", block_tokens=BT, block_bytes=BB)
            assert (await (await ns.put_nowait(tokens(0, 3), blocks(90, 3))).result()).stored == 3
            data = [blocks(91 + i, 3) for i in range(4)]
            pending = [await ns.put_nowait(tokens(100 * (i + 1), 3), data[i]) for i in range(4)]
            assert not pending[-1].done()
            counts = [(await put.result(timeout=10)).stored for put in pending]
            assert counts == [3, 3, 3, 3]
            for i in range(4):
                got = await ns.get(tokens(100 * (i + 1), 3))
                assert np.array_equal(got.blocks, data[i])
            last = await ns.put_nowait(tokens(5000, 3), blocks(99, 3))
        assert last.done() and (await last.result()).stored == 3  # close read the answer
        async with AsyncKVClient(daemon.addr) as other:
            assert (await other.stats()).staged_bytes == 0
            theirs = await other.open_namespace(ns.ns_id)
            assert (await theirs.lookup(tokens(5000, 3))).blocks == 3

    asyncio.run(main())


def test_answers_lost_with_their_connection_reach_the_sender(tmp_path: Path) -> None:
    """A local-call server that takes two calls sent ahead and closes without answering
    (a daemon that died): each sender learns that its call's outcome is unknown."""
    path = str(tmp_path / "dies.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    taken = threading.Event()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            received = b""
            frame = frames.request_frame(b"ServerInfo", b"")
            while len(received) < 2 * len(frame):
                received += conn.recv(4096)
            taken.set()

    thread = threading.Thread(target=serve)
    thread.start()
    calls = LocalCalls(path, BLOCKING_SOCKETS)
    outcomes: list[tuple[Any, Exception | None]] = []
    try:
        for _ in range(2):
            sent = calls.send(
                "ServerInfo", pb.ServerInfoRequest(), 5.0, lambda r, e: outcomes.append((r, e))
            )
            run_blocking(sent, {})
        assert taken.wait(5)
        thread.join(5)
        run_blocking(calls.read_owed(5.0), {})
    finally:
        calls.close()
        server.close()
    assert len(outcomes) == 2
    for response, error in outcomes:
        assert response is None and isinstance(error, LocalCallFailed) and error.sent


def test_a_failed_reserve_under_a_lease_dropped_already_keeps_the_new_lease() -> None:
    """Answers come late: a put sent ahead under lease 5 fails after the stash moved on
    to lease 7. That failure must not drop lease 7's slots; and a success that comes
    under a dropped lease must not bring that lease's slots back."""
    stash, arena = SlotStash(), object()
    stash.take(0, arena)  # type: ignore[arg-type]  # binds the stash to this arena
    reply = pb.ReserveResponse(stage_lease_id=7, staged_offsets=[0, 4096], stage_ttl_s=30.0)
    stash.answered(time.monotonic(), pb.ReserveRequest(stage_more=2), reply)
    assert len(stash) == 2
    assert stash.forget(pb.ReserveRequest(stage_lease_id=5, staged_offsets=[8192])) == 0
    assert len(stash) == 2 and stash._lease_id == 7
    assert stash.forget(pb.ReserveRequest(stage_lease_id=7, staged_offsets=[0])) == 7
    assert len(stash) == 0 and stash._lease_id == 0
    late = pb.ReserveResponse(stage_lease_id=7, staged_offsets=[12288], stage_ttl_s=30.0)
    stash.answered(time.monotonic(), pb.ReserveRequest(stage_lease_id=7), late)
    assert len(stash) == 0 and stash._lease_id == 0


def test_a_cancelled_async_copy_ends_before_the_cancellation_returns() -> None:
    """The async client frees a put's slots when the put is cancelled: the copy running
    on a worker thread must have ended by then, or it would write slots given to other
    blocks meanwhile."""
    from kvclient.effects import _to_the_end as _copy_to_the_end

    ended = threading.Event()

    def slow_copy() -> None:
        time.sleep(0.3)
        ended.set()

    async def main() -> None:
        task = asyncio.ensure_future(_copy_to_the_end(slow_copy))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ended.is_set()

    asyncio.run(main())
