"""Disk blocks read back: by the disk tier, a batch in one read transaction, and by
clients, always through the daemon (it promotes a disk-only prefix into host slots and
the client copies the slots; no client opens the disk tier's files).

The promises under test: a batch read stops at its first block that is missing or
damaged, drops the damaged one and reads none of its bytes into the answer; a get of
disk-only blocks returns their exact bytes, promoted once; a damaged block is a miss,
never its bytes; the daemon's quick path promotes only what the page cache holds and
its free room takes, and otherwise changes nothing.
"""

from __future__ import annotations

import asyncio
import os
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np
import pytest
import xxhash
from conftest import Daemon, damage_in_disk_file

from kvclient import AsyncKVClient, KVClient
from kvstore.disk import DiskRecord, DiskTier
from kvstore.keys import NamespaceSpec
from kvstore.store import Store, StoreConfig
from kvstore.store_config import QUICK_PROMOTE_BYTES

BLOCK = 64 << 10
TOKENS = 4


def block(tag: int, size: int = BLOCK) -> bytes:
    return np.random.default_rng(tag).integers(0, 256, size, dtype=np.uint8).tobytes()


def record(key: bytes, data: bytes) -> DiskRecord:
    return DiskRecord(key, b"n" * 32, b"", len(data), xxhash.xxh3_64_intdigest(data), 0, 0.0)


def written(tier: DiskTier, n: int, flush: bool = True) -> list[bytes]:
    """Blocks 0..n-1 written (keys ``bytes([i]) * 16``), committed unless not ``flush``."""
    keys = [bytes([i]) * 16 for i in range(n)]
    for i, key in enumerate(keys):
        tier.write(record(key, block(i)), block(i))
    if flush:
        tier.flush()
    return keys


def outputs(n: int) -> tuple[np.ndarray, list[memoryview]]:
    out = np.zeros((n, BLOCK), np.uint8)
    return out, [memoryview(row) for row in out]


# -- the disk tier ---------------------------------------------------------------------


def test_a_batch_is_read_whole_and_checked_block_by_block(tmp_path: Path) -> None:
    with DiskTier(str(tmp_path / "lmdb"), 64 << 20) as tier:
        keys = written(tier, 5)
        out, rows = outputs(5)
        assert tier.read_all(keys, rows) == 5
        assert [out[i].tobytes() for i in range(5)] == [block(i) for i in range(5)]
        assert tier.stats().reads == 5 and tier.stats().bytes_read == 5 * BLOCK


def test_a_batch_stops_at_a_damaged_block_and_drops_it(tmp_path: Path) -> None:
    directory = tmp_path / "lmdb"
    with DiskTier(str(directory), 64 << 20) as tier:
        keys = written(tier, 4)
    damage_in_disk_file(str(directory), block(2))
    with DiskTier(str(directory), 64 << 20) as tier:
        out, rows = outputs(4)
        assert tier.read_all(keys, rows) == 2  # blocks 0 and 1, then the damaged one
        assert [out[i].tobytes() for i in range(2)] == [block(0), block(1)]
        assert tier.stats().corrupt_reads == 1
        assert not tier.contains(keys[2]) and tier.contains(keys[3])


def test_a_batch_stops_at_a_missing_block(tmp_path: Path) -> None:
    with DiskTier(str(tmp_path / "lmdb"), 64 << 20) as tier:
        keys = written(tier, 3)
        tier.delete(keys[1])
        _, rows = outputs(3)
        assert tier.read_all(keys, rows) == 1
        assert tier.stats().read_misses == 1


def test_a_batch_reads_queued_and_committed_blocks_alike(tmp_path: Path) -> None:
    """Blocks still in the write queue are copied from it; the others from LMDB."""
    with DiskTier(str(tmp_path / "lmdb"), 64 << 20) as tier:
        keys = written(tier, 2)
        keys += [bytes([i]) * 16 for i in (2, 3)]
        for i in (2, 3):
            tier.write(record(keys[i], block(i)), block(i))  # maybe not committed yet
        out, rows = outputs(4)
        assert tier.read_all(keys, rows) == 4
        assert [out[i].tobytes() for i in range(4)] == [block(i) for i in range(4)]


def test_records_of_version_1_are_read_too(tmp_path: Path) -> None:
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
        out, rows = outputs(1)
        assert tier.read_all([key], rows) == 1 and out[0].tobytes() == block(5)


# -- the daemon and the clients ------------------------------------------------------------


def expected(c: int, blocks: int) -> bytes:
    return b"".join(block(c * 100 + i) for i in range(blocks))


def put_then_restart(kvstored: Daemon, n_chains: int, blocks: int) -> list[list[int]]:
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("direct", TOKENS, block_bytes=BLOCK)
        chains = [list(range(c * 10_000, c * 10_000 + blocks * TOKENS)) for c in range(n_chains)]
        for c, tokens in enumerate(chains):
            ns.put(tokens, np.frombuffer(expected(c, blocks), np.uint8).reshape(blocks, BLOCK))
    kvstored.restart()  # persists the host tier: every block is on disk only
    return chains


def test_gets_of_disk_blocks_are_promoted_once_then_host_hits(kvstored: Daemon) -> None:
    chains = put_then_restart(kvstored, 3, 8)
    with KVClient(kvstored.addr) as client:
        assert client.arena_in_use
        ns = client.namespace("direct", TOKENS, block_bytes=BLOCK)
        out = np.empty((8, BLOCK), np.uint8)
        for c, tokens in enumerate(chains):
            got = ns.get(tokens, out=out)
            assert got.blocks.shape[0] == 8 and got.blocks.tobytes() == expected(c, 8)
        stats = client.stats()
        assert stats.promotions == 24 and stats.tier("disk").hits == 24
        for c, tokens in enumerate(chains):  # now host hits
            assert ns.get(tokens, out=out).blocks.tobytes() == expected(c, 8)
        stats = client.stats()
        assert stats.promotions == 24 and stats.tier("host").hits == 24


def test_a_damaged_block_on_disk_is_a_miss_never_its_bytes(kvstored: Daemon) -> None:
    chains = put_then_restart(kvstored, 1, 6)
    damage_in_disk_file(kvstored.disk_dir, block(3))  # block 3 of chain 0
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("direct", TOKENS, block_bytes=BLOCK)
        got = ns.get(chains[0])
        # the daemon's read dropped block 3 (and its child): blocks 0-2 only
        assert got.blocks.shape[0] == 3 and got.blocks.tobytes() == expected(0, 3)
        assert client.stats().corrupt_reads == 1
        assert ns.lookup(chains[0]).blocks == 3


def test_async_gets_of_disk_blocks(kvstored: Daemon) -> None:
    chains = put_then_restart(kvstored, 2, 4)

    async def main() -> None:
        async with AsyncKVClient(kvstored.addr) as client:
            ns = await client.namespace("direct", TOKENS, block_bytes=BLOCK)
            for c, tokens in enumerate(chains):
                got = await ns.get(tokens)
                assert got.blocks.tobytes() == expected(c, 4)
            stats = await client.stats()
            assert stats.promotions == 8 and stats.tier("disk").hits == 8

    asyncio.run(main())


# -- promotions that never wait on the device (the daemon's quick path) --------------------


def disk_only_store(tmp_path: Path, n_blocks: int) -> tuple[Store, str, list]:
    """A store whose chain of ``n_blocks`` is on disk only (written, then restarted)."""
    config = StoreConfig(
        host_bytes=64 << 20, disk_dir=str(tmp_path / "disk"), disk_bytes=256 << 20,
        shared_arena=False,
    )  # fmt: skip
    with Store(config) as store:
        ns = store.open_namespace(NamespaceSpec(model="m", block_tokens=TOKENS, block_bytes=BLOCK))
        keys = store.keys_for(ns.ns_id, list(range(n_blocks * TOKENS)))
        store.put(ns.ns_id, keys, [block(i) for i in range(n_blocks)])
    store = Store(config)  # the host tier starts empty: every block is on disk only
    assert store.lookup(ns.ns_id, keys).disk_blocks == n_blocks
    return store, ns.ns_id, keys


def test_a_quick_acquire_promotes_blocks_the_page_cache_holds(tmp_path: Path) -> None:
    store, ns, keys = disk_only_store(tmp_path, 4)
    with store:
        got = store.acquire(ns, keys, host_only=True)
        assert got is not None and len(got.offsets) == 4 and got.lease_id
        arena = store.arena.array()
        assert [arena[o : o + BLOCK].tobytes() for o in got.offsets] == [block(i) for i in range(4)]
        assert store.stats().promotions == 4
        store.release(got.lease_id)
        store.verify_invariants()


def test_a_quick_acquire_that_would_wait_on_the_device_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, ns, keys = disk_only_store(tmp_path, 4)
    real = os.preadv

    def not_cached(fd: int, buffers: list, offset: int, flags: int = 0) -> int:
        if flags:  # RWF_NOWAIT: the pages are not in the page cache
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", not_cached)
    with store:
        used = store.arena.used_bytes
        assert store.acquire(ns, keys, host_only=True) is None
        stats = store.stats()
        assert stats.promotions == 0 and stats.leases == 0 and store.arena.used_bytes == used
        assert stats.tier("disk").hits == 0 and stats.tier("host").misses == 0
        store.verify_invariants()
        got = store.acquire(ns, keys)  # the pool's acquire waits for the device
        assert got is not None and len(got.offsets) == 4
        store.release(got.lease_id)


def test_a_quick_acquire_of_more_than_it_may_promote_changes_nothing(tmp_path: Path) -> None:
    n = QUICK_PROMOTE_BYTES // BLOCK + 1
    store, ns, keys = disk_only_store(tmp_path, n)
    with store:
        assert store.acquire(ns, keys, host_only=True) is None
        assert store.stats().promotions == 0 and store.stats().leases == 0
        store.verify_invariants()


def test_a_disk_tier_on_tmpfs_serves_arena_reads(kvstored_factory: Callable[..., Daemon]) -> None:
    """/dev/shm (tmpfs, like a memory-backed emptyDir) refuses RWF_NOWAIT: the quick
    read that must not wait reads plainly there, instead of failing the get."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(prefix="kvdisk", dir="/dev/shm") as disk_dir:
        kvstored = kvstored_factory(disk_dir=disk_dir)
        chains = put_then_restart(kvstored, 2, 4)
        with KVClient(kvstored.addr) as client:
            assert client.arena_in_use
            ns = client.namespace("direct", TOKENS, block_bytes=BLOCK)
            for c, tokens in enumerate(chains):
                assert ns.get(tokens).blocks.tobytes() == expected(c, 4)
            stats = client.stats()
            assert stats.tier("disk").hits == 8 and stats.corrupt_reads == 0
        kvstored.stop()
