"""Arena puts into staged slots, against a real daemon.

After a client's first arena put it holds a put's worth of staged slots: the next put
copies into them while its Reserve is in flight and sends its Commit without waiting.
These tests check what a user sees: the bytes, the counts, read-your-writes, other
clients, the slots coming back on close, a forked child, and refused bad input.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import ClientMaker, Daemon, in_forked_child, kv_stub, raw_call, store_snapshot

from kvclient import AsyncKVClient, InvalidArgumentError, KVClient, LeaseError
from kvclient.staged_slots import SlotStash
from kvproto.v1 import kvstore_pb2 as pb

BT = 4  # tokens per block


@pytest.fixture
def daemon(kvstored_factory) -> Iterator[Daemon]:  # type: ignore[no-untyped-def]
    yield kvstored_factory()


def blocks(seed: int, n: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


def tokens(first: int, n_blocks: int) -> list[int]:
    return list(range(first, first + n_blocks * BT))


def staged_bytes(client: KVClient) -> int:
    return client.stats().staged_bytes


def test_puts_after_the_first_use_staged_slots_and_read_back(
    daemon: Daemon, kv_client: ClientMaker
) -> None:
    with kv_client(daemon.addr, use_arena=True) as client:
        ns = client.namespace("staged", block_tokens=BT, block_bytes=8192)
        stash = client._conn.stash(ns.ns_id)
        data = [blocks(i, 6, ns.block_bytes) for i in range(4)]
        # first put: fresh slots, and 6 staged for the next one
        assert ns.put(tokens(0, 6), data[0]).stored == 6
        assert len(stash) == 6 and staged_bytes(client) == 6 * 8192
        for i in range(1, 4):  # each put uses the staged slots and stages as many again
            assert ns.put(tokens(1000 * i, 6), data[i]).stored == 6
            assert len(stash) == 6
            # read-your-writes: the commit sent without waiting runs before this get
            got = ns.get(tokens(1000 * i, 6))
            assert got.n_blocks == 6 and np.array_equal(got.blocks, data[i])
        got = ns.get(tokens(0, 6))
        assert np.array_equal(got.blocks, data[0])
        stats = client.stats()
        assert stats.pending_blocks == 0 and stats.leases == 0
    # closing released the staging lease: its slots are free again
    with kv_client(daemon.addr) as other:
        assert staged_bytes(other) == 0
        assert other.stats().tier("host").blocks == 24


def test_blocks_that_exist_keep_their_bytes_and_their_slots_stay_staged(
    daemon: Daemon, kv_client: ClientMaker
) -> None:
    with kv_client(daemon.addr, use_arena=True) as client:
        ns = client.namespace("overlap", block_tokens=BT, block_bytes=8192)
        first, second = blocks(1, 4, 8192), blocks(2, 8, 8192)
        ns.put(tokens(0, 4), first)
        ns.put(tokens(500, 8), second)  # stages 8
        # the first 4 blocks exist: staged slots hold copies of them, never committed
        result = ns.put(tokens(0, 8), second)
        assert (result.stored, result.existing, result.refused) == (4, 4, 0)
        got = ns.get(tokens(0, 8))
        assert np.array_equal(got.blocks[:4], first)  # not overwritten by the put
        assert np.array_equal(got.blocks[4:], second[4:])
        # the put asked for 8 more before it knew 4 blocks existed: their 4 slots come
        # back on top (a stash stays under two puts' worth)
        assert len(client._conn.stash(ns.ns_id)) == 12


def test_another_client_sees_the_blocks_once_committed(
    daemon: Daemon, kv_client: ClientMaker
) -> None:
    with kv_client(daemon.addr, use_arena=True) as writer, kv_client(daemon.addr) as reader:
        ns = writer.namespace("shared", block_tokens=BT, block_bytes=8192)
        theirs = reader.open_namespace(ns.ns_id)
        data = blocks(3, 5, 8192)
        ns.put(tokens(0, 5), blocks(4, 5, 8192))
        ns.put(tokens(100, 5), data)  # staged, commit sent without waiting
        # the blocks are pending or ready, never missing: a reader may wait for them
        hit = theirs.lookup(tokens(100, 5), wait_pending_s=5.0)
        assert hit.blocks == 5
        got = theirs.get(tokens(100, 5))
        assert np.array_equal(got.blocks, data)


def test_a_forked_child_does_not_write_the_parents_staged_slots(daemon: Daemon) -> None:
    with KVClient(daemon.addr, use_arena=True) as client:
        ns = client.namespace("fork", block_tokens=BT, block_bytes=8192)
        parent_data = blocks(5, 4, 8192)
        ns.put(tokens(0, 4), blocks(6, 4, 8192))  # stages 4
        staged = list(client._conn.stash(ns.ns_id)._offsets)

        def child() -> bool:  # its puts must take slots of its own
            child_data = blocks(7, 4, 8192)
            ns.put(tokens(700, 4), child_data)
            got = ns.get(tokens(700, 4))
            return bool(np.array_equal(got.blocks, child_data))

        assert in_forked_child(child) == 0
        # the parent's staged slots are still its own and untouched by the child
        assert list(client._conn.stash(ns.ns_id)._offsets) == staged
        assert ns.put(tokens(300, 4), parent_data).stored == 4
        assert np.array_equal(ns.get(tokens(300, 4)).blocks, parent_data)
        assert np.array_equal(ns.get(tokens(700, 4)).blocks, blocks(7, 4, 8192))


def test_async_client_puts_into_staged_slots(daemon: Daemon) -> None:
    async def main() -> None:
        async with AsyncKVClient(daemon.addr, use_arena=True) as client:
            ns = await client.namespace("async-staged", block_tokens=BT, block_bytes=8192)
            data = [blocks(10 + i, 3, 8192) for i in range(3)]
            for i in range(3):
                assert (await ns.put(tokens(100 * i, 3), data[i])).stored == 3
                got = await ns.get(tokens(100 * i, 3))
                assert np.array_equal(got.blocks, data[i])
            assert len(client._conn.stash(ns.ns_id)) == 3
            assert (await client.stats()).staged_bytes == 3 * 8192
        async with AsyncKVClient(daemon.addr) as other:
            assert (await other.stats()).staged_bytes == 0

    asyncio.run(main())


def test_bad_staged_slots_are_refused_over_grpc_and_change_nothing(
    daemon: Daemon, kv_client: ClientMaker
) -> None:
    with kv_client(daemon.addr, use_arena=True) as client:
        ns = client.namespace("bad", block_tokens=BT, block_bytes=8192)
        ns.put(tokens(0, 2), blocks(8, 2, 8192))  # stages 2
        stash = client._conn.stash(ns.ns_id)
        lease, staged = stash._lease_id, list(stash._offsets)
        stub = kv_stub(daemon)
        before = store_snapshot(stub)
        base = dict(ns_id=ns.ns_id, tokens=tokens(0, 3), start_block=1, compact_slots=True)
        bad = [
            (dict(stage_lease_id=lease, staged_offsets=staged[:1] + [12345]), "not held"),
            (dict(stage_lease_id=lease, staged_offsets=staged[:1]), "staged slots for"),
            (dict(staged_offsets=staged[:2]), "staging lease"),
            (dict(stage_lease_id=lease, stage_more=10**6), "stage_more"),
        ]
        for fields, message in bad:
            with pytest.raises(InvalidArgumentError, match=message):
                raw_call(client, "Reserve", pb.ReserveRequest(**base, **fields))
        with pytest.raises(LeaseError, match="not a staging lease|unknown lease"):
            raw_call(
                client,
                "Reserve",
                pb.ReserveRequest(**base, stage_lease_id=lease + 1, staged_offsets=staged[:2]),
            )
        assert store_snapshot(stub) == before


def test_the_stash_stops_using_slots_before_its_lease_could_run_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvclient.staged_slots as staged_slots

    now = [100.0]
    monkeypatch.setattr(staged_slots.time, "monotonic", lambda: now[0])
    stash, arena = SlotStash(), object()
    reply = pb.ReserveResponse(stage_lease_id=7, staged_offsets=[0, 4096], stage_ttl_s=20.0)
    assert stash.take(2, arena)[1] == []  # type: ignore[arg-type]
    stash.answered(now[0], pb.ReserveRequest(), reply)
    now[0] += 14.9  # within ttl - max(1 s, 25% of ttl) = 15 s of the send
    assert stash.take(1, arena) == (7, [0])  # type: ignore[arg-type]
    now[0] += 0.2
    assert stash.take(1, arena) == (0, [])  # type: ignore[arg-type]
    assert len(stash) == 0
    # another arena (the daemon restarted): nothing staged carries over
    stash.answered(now[0], pb.ReserveRequest(), reply)
    assert stash.take(1, object()) == (0, [])  # type: ignore[arg-type]
