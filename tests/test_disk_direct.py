"""Disk blocks read straight from the disk tier's file (``disk_direct`` gets).

The promises under test: an extent handed out under a snapshot keeps its bytes
whatever is deleted or written meanwhile; a disk-only block on its first read is
served from the file with no promotion, and a second read promotes it; a damaged
block is a miss, never its bytes; bad requests change nothing.

The clients here ask the daemon for the extents (``KVCLIENT_DISK_INDEX=0``): their
reads with no call at all are tests/test_disk_index.py's.
"""

from __future__ import annotations

import asyncio
import os
import struct
import time
from pathlib import Path

import grpc
import lmdb
import numpy as np
import pytest
import xxhash
from conftest import Daemon, damage_in_disk_file, kv_stub

from kvclient import AsyncKVClient, KVClient
from kvclient.disk_reads import DiskExtents, DiskFile
from kvproto.v1 import kvstore_pb2 as pb
from kvstore.disk import MAX_SNAPSHOTS, DiskRecord, DiskSnapshot, DiskTier
from kvstore.keys import NamespaceSpec
from kvstore.store import Store, StoreConfig

BLOCK = 64 << 10
TOKENS = 4


@pytest.fixture(autouse=True)
def extents_from_the_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCLIENT_DISK_INDEX", "0")


def block(tag: int, size: int = BLOCK) -> bytes:
    return np.random.default_rng(tag).integers(0, 256, size, dtype=np.uint8).tobytes()


def record(key: bytes, data: bytes) -> DiskRecord:
    return DiskRecord(key, b"n" * 32, b"", len(data), xxhash.xxh3_64_intdigest(data), 0, 0.0)


def pread(path: str, offset: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def snapshot_of_blocks(tier: DiskTier, n: int) -> tuple[list[bytes], DiskSnapshot, list]:
    """Write blocks 0..n-1 (keys ``bytes([i]) * 16``), commit them, open their extents."""
    keys = [bytes([i]) * 16 for i in range(n)]
    for i, key in enumerate(keys):
        tier.write(record(key, block(i)), block(i))
    tier.flush()
    got = tier.extents(keys)
    assert got is not None
    return keys, *got


# -- the disk tier ---------------------------------------------------------------------


def test_extents_keep_their_bytes_while_the_snapshot_is_open(tmp_path: Path) -> None:
    with DiskTier(str(tmp_path / "lmdb"), 64 << 20) as tier:
        keys, snapshot, extents = snapshot_of_blocks(tier, 8)
        assert [e.size for e in extents] == [BLOCK] * 8
        sums = [xxhash.xxh3_64_intdigest(block(i)) for i in range(8)]
        assert [e.checksum for e in extents] == sums
        assert tier.open_snapshots == 1
        # delete every block and write others over and over: freed pages would be reused
        for key in keys:
            tier.delete(key)
        for round_ in range(4):
            for i in range(8):
                key = bytes([100 + i]) * 16
                tier.write(record(key, block(1000 + round_ * 8 + i)), block(1000 + round_ * 8 + i))
            tier.flush()
            for i in range(8):
                tier.delete(bytes([100 + i]) * 16)
            tier.flush()
        for i, extent in enumerate(extents):
            assert pread(tier.data_path, extent.offset, extent.size) == block(i)
        snapshot.close()
        snapshot.close()  # idempotent
        assert tier.open_snapshots == 0


def test_a_map_resize_revokes_open_snapshots_instead_of_waiting(tmp_path: Path) -> None:
    # the map starts at 1 MiB: the writes below fill it and the writer must grow it,
    # which needs every read transaction closed; a snapshot held by a lease of a client
    # that crashed would otherwise hold the writer (and every put behind it) for its TTL
    with DiskTier(str(tmp_path / "lmdb"), 64 << 20, _map_size_override=1 << 20) as tier:
        first, snapshot, extents = snapshot_of_blocks(tier, 4)
        for i in range(4, 28):
            tier.write(record(bytes([i]) * 16, block(i)), block(i))
        try:
            tier.flush(timeout=10)  # waited for the snapshot to close before
        finally:
            revoked = tier.open_snapshots == 0
            snapshot.close()  # the holder's own close: a no-op once revoked
        assert revoked
        stats = tier.stats()
        assert stats.map_full_events >= 1 and stats.map_size_bytes > 1 << 20
        assert stats.revoked_snapshots == 1
        # the blocks are still live, so their extents still hold them (had they been
        # deleted, later commits could reuse the pages: the reader's checksum decides)
        disk = DiskFile.open(tier.data_path)
        assert disk is not None
        out = np.zeros((4, BLOCK), np.uint8)
        where = DiskExtents(
            list(range(4)), [e.offset for e in extents], [e.checksum for e in extents]
        )
        assert disk.read(out, where)
        disk.close()
        assert [row.tobytes() for row in out] == [block(i) for i in range(4)]
        # and new snapshots open again after the resize
        got = tier.extents(first[:1])
        assert got is not None
        got[0].close()


def test_extents_refuse_what_is_not_in_the_file(tmp_path: Path) -> None:
    with DiskTier(str(tmp_path / "lmdb"), 64 << 20, batch_bytes=1 << 30) as tier:
        committed, queued = b"c" * 16, b"q" * 16
        tier.write(record(committed, block(1)), block(1))
        tier.flush()
        assert tier.extents([b"x" * 16]) is None  # never written
        small = b"s" * 16
        tier.write(record(small, b"tiny"), b"tiny")
        tier.flush()
        assert tier.extents([committed, small]) is None  # shares a page: no extent
        tier.delete(committed)
        assert tier.extents([committed]) is None  # deleted (maybe still queued)
        tier.write(record(committed, block(1)), block(1))
        tier.write(record(queued, block(2)), block(2))
        # a key still in the write queue is not in the file yet (the writer may have
        # committed it already: then it has an extent)
        got = tier.extents([queued])
        if got is not None:
            got[0].close()
        assert tier.open_snapshots == 0
        tier.flush()
        held = []
        for _ in range(MAX_SNAPSHOTS):
            got = tier.extents([committed])
            assert got is not None
            held.append(got[0])
        assert tier.extents([committed]) is None  # at most MAX_SNAPSHOTS open
    # close() ended the snapshots still open
    assert all(s._txn is None for s in held)


def test_disk_file_checks_every_block(tmp_path: Path) -> None:
    path = tmp_path / "file"
    data = block(1, 4 * BLOCK)
    path.write_bytes(data)
    assert DiskFile.open("") is None and DiskFile.open(str(tmp_path / "missing")) is None
    disk = DiskFile.open(str(path))
    assert disk is not None
    out = np.zeros((4, BLOCK), np.uint8)
    sums = [xxhash.xxh3_64_intdigest(data[i * BLOCK : (i + 1) * BLOCK]) for i in range(4)]
    extents = DiskExtents([0, 2], [3 * BLOCK, BLOCK], [sums[3], sums[1]])
    assert disk.read(out, extents)
    assert out[0].tobytes() == data[3 * BLOCK :] and out[2].tobytes() == data[BLOCK : 2 * BLOCK]
    assert not out[1].any() and not out[3].any()
    assert not disk.read(out, DiskExtents([1], [0], [sums[1]]))  # wrong bytes there
    assert not disk.read(out, DiskExtents([1], [3 * BLOCK + 1], [sums[3]]))  # short read
    disk.close()


# -- the store ---------------------------------------------------------------------------


def make_store(tmp_path: Path) -> Store:
    config = StoreConfig(
        host_bytes=64 * BLOCK,
        disk_dir=str(tmp_path / "lmdb"),
        disk_bytes=256 * BLOCK,
        shared_arena=False,
        persist_on_close=True,
    )
    return Store(config)


def on_disk_only(tmp_path: Path, n: int) -> tuple[str, list[bytes]]:
    """A chain of n blocks put, then the store closed: a new store has them on disk only."""
    with make_store(tmp_path) as s:
        ns = s.open_namespace(NamespaceSpec("m", block_tokens=TOKENS, block_bytes=BLOCK)).ns_id
        keys = s.keys_for(ns, list(range(n * TOKENS)))
        s.put(ns, keys, [block(i) for i in range(n)])
    return ns, keys


def test_first_read_is_served_from_the_file_and_the_second_promotes(tmp_path: Path) -> None:
    ns, keys = on_disk_only(tmp_path, 6)
    with make_store(tmp_path) as s:
        got = s.acquire(ns, keys, disk_direct=True)
        assert got.offsets == (-1,) * 6 and [p for p, _ in got.disk] == list(range(6))
        assert s.disk_path is not None
        for position, extent in got.disk:
            assert pread(s.disk_path, extent.offset, extent.size) == block(position)
        stats = s.stats()
        disk = stats.tier("disk")
        assert disk is not None
        assert (stats.promotions, disk.hits, stats.leases) == (0, 6, 1)
        assert s.lookup(ns, keys).disk_blocks == 6  # still on disk only
        s.release(got.lease_id)
        assert s.stats().leases == 0 and s._disk is not None and s._disk.open_snapshots == 0
        # read again: the blocks earn their host slots back
        again = s.acquire(ns, keys, disk_direct=True)
        assert again.disk == () and min(again.offsets) >= 0
        assert s.stats().promotions == 6 and s.lookup(ns, keys).host_blocks == 6
        s.release(again.lease_id)
        s.verify_invariants()


def test_a_prefix_of_host_and_disk_blocks_mixes_slots_and_extents(tmp_path: Path) -> None:
    ns, keys = on_disk_only(tmp_path, 4)
    with make_store(tmp_path) as s:
        first = s.acquire(ns, keys[:2])  # promotes blocks 0 and 1
        s.release(first.lease_id)
        got = s.acquire(ns, keys, disk_direct=True)
        assert got.offsets[:2] == first.offsets and got.offsets[2:] == (-1, -1)
        assert [p for p, _ in got.disk] == [2, 3]
        s.release(got.lease_id)


def test_an_expired_direct_lease_closes_its_snapshot(tmp_path: Path) -> None:
    ns, keys = on_disk_only(tmp_path, 2)
    with make_store(tmp_path) as s:
        got = s.acquire(ns, keys, ttl_s=0.05, disk_direct=True)
        assert got.disk and s._disk is not None and s._disk.open_snapshots == 1
        deadline = time.monotonic() + 5
        while s._disk.open_snapshots and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s._disk.open_snapshots == 0 and s.stats().leases == 0


# -- the daemon and the clients ------------------------------------------------------------


def put_then_restart(kvstored: Daemon, n_chains: int, blocks: int) -> tuple[str, list[list[int]]]:
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("direct", TOKENS, block_bytes=BLOCK)
        chains = [list(range(c * 10_000, c * 10_000 + blocks * TOKENS)) for c in range(n_chains)]
        for c, tokens in enumerate(chains):
            ns.put(tokens, np.frombuffer(expected(c, blocks), np.uint8).reshape(blocks, BLOCK))
        ns_id = ns.ns_id
    kvstored.restart()  # persists the host tier: every block is on disk only
    return ns_id, chains


def expected(c: int, blocks: int) -> bytes:
    return b"".join(block(c * 100 + i) for i in range(blocks))


def test_gets_read_disk_blocks_from_the_file_then_from_host(kvstored: Daemon) -> None:
    ns_id, chains = put_then_restart(kvstored, 3, 8)
    with KVClient(kvstored.addr) as client:
        assert client.arena_in_use and client.server_info().disk_path.endswith("data.mdb")
        ns = client.namespace("direct", TOKENS, block_bytes=BLOCK)
        out = np.empty((8, BLOCK), np.uint8)
        for c, tokens in enumerate(chains):
            got = ns.get(tokens, out=out)
            assert got.blocks.shape[0] == 8 and got.blocks.tobytes() == expected(c, 8)
        stats = client.stats()
        assert stats.promotions == 0 and stats.tier("disk").hits >= 24
        for c, tokens in enumerate(chains):  # a second read promotes
            assert ns.get(tokens, out=out).blocks.tobytes() == expected(c, 8)
        assert client.stats().promotions == 24
        for c, tokens in enumerate(chains):  # now host hits
            assert ns.get(tokens, out=out).blocks.tobytes() == expected(c, 8)
        assert client.stats().promotions == 24


def test_a_damaged_block_in_the_file_is_a_miss_never_its_bytes(kvstored: Daemon) -> None:
    ns_id, chains = put_then_restart(kvstored, 1, 6)
    damage_in_disk_file(kvstored.disk_dir, block(3))  # block 3 of chain 0
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("direct", TOKENS, block_bytes=BLOCK)
        got = ns.get(chains[0])
        # the client's check failed, it asked again without disk_direct, and the
        # daemon's own read dropped block 3 (and its child): blocks 0-2 only
        assert got.blocks.shape[0] == 3 and got.blocks.tobytes() == expected(0, 3)
        assert client.stats().corrupt_reads == 1
        assert ns.lookup(chains[0]).blocks == 3


def test_async_gets_read_disk_blocks_from_the_file(kvstored: Daemon) -> None:
    ns_id, chains = put_then_restart(kvstored, 2, 4)

    async def main() -> None:
        async with AsyncKVClient(kvstored.addr) as client:
            ns = await client.namespace("direct", TOKENS, block_bytes=BLOCK)
            for c, tokens in enumerate(chains):
                got = await ns.get(tokens)
                assert got.blocks.tobytes() == expected(c, 4)
            stats = await client.stats()
            assert stats.promotions == 0 and stats.tier("disk").hits >= 8

    asyncio.run(main())


def test_disk_direct_needs_compact_slots_and_changes_nothing(kvstored: Daemon) -> None:
    ns_id, chains = put_then_restart(kvstored, 1, 4)
    stub = kv_stub(kvstored)
    with pytest.raises(grpc.RpcError) as err:
        stub.Acquire(pb.AcquireRequest(ns_id=ns_id, tokens=chains[0], disk_direct=True))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "disk_direct needs compact_slots" in (err.value.details() or "")
    stats = stub.Stats(pb.StatsRequest())
    assert stats.leases == 0 and stats.promotions == 0
    answer = stub.Acquire(
        pb.AcquireRequest(ns_id=ns_id, tokens=chains[0], disk_direct=True, compact_slots=True)
    )
    assert list(answer.disk_blocks) == [0, 1, 2, 3] and list(answer.slot_offsets) == [0] * 4
    disk_path = stub.ServerInfo(pb.ServerInfoRequest()).disk_path
    extents = zip(answer.disk_offsets, answer.disk_checksums, strict=True)
    for i, (offset, checksum) in enumerate(extents):
        data = pread(disk_path, offset, BLOCK)
        assert data == block(i) and xxhash.xxh3_64_intdigest(data) == checksum
    stub.Release(pb.ReleaseRequest(lease_id=answer.lease_id))


def test_records_of_version_1_are_read_and_located_too(tmp_path: Path) -> None:
    directory = str(tmp_path / "lmdb")
    key = b"k" * 32
    with DiskTier(directory, 64 << 20) as tier:
        tier.write(record(key, block(5)), block(5))
    # rewrite its meta record as version 1 wrote it: no payload offset
    env = lmdb.open(directory, max_dbs=8)
    meta = env.open_db(b"meta")
    with env.begin(write=True, db=meta) as txn:
        rec = record(key, block(5))
        v1 = struct.pack("<B32sB32sQQBd", 1, rec.ns_digest, 0, b"", BLOCK, rec.checksum, 0, 0.0)
        txn.put(key, v1)
    env.close()
    with DiskTier(directory, 64 << 20) as tier:
        (back,) = list(tier.records())
        assert (back.offset, back.size, back.checksum) == (0, BLOCK, rec.checksum)
        assert tier.read(key) == block(5)
        got = tier.extents([key])
        assert got is not None
        snapshot, (extent,) = got
        assert pread(tier.data_path, extent.offset, BLOCK) == block(5)
        snapshot.close()
