"""Disk hits with no call: a same-host client reads the daemon's LMDB environment.

The promises under test: a first read of a prefix that is all on disk (and in the page
cache) is served from the file with no call, counted by the daemon as disk hits, and
the second read promotes as before; a block out of the page cache, a damaged block, a
namespace the environment does not know, all go to the daemon; a get after clear or
delete never finds the blocks in the file; one environment handle per process, never
one beside an in-process DiskTier; the daemon's map resizes are followed.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import lmdb
import numpy as np
import pytest
import xxhash
from conftest import Daemon, damage_in_disk_file, in_forked_child

from kvclient import AsyncKVClient, InvalidArgumentError, KVClient
from kvclient.disk_index import DiskFirstReads, DiskIndex
from kvclient.disk_reads import DiskFile, read_first_from_file
from kvstore import disk_format
from kvstore.disk import DiskExtent, DiskRecord, DiskTier, committed_extent
from kvstore.keys import chain_keys

BLOCK = 64 << 10
TOKENS = 4


def block(tag: int) -> bytes:
    return np.random.default_rng(tag).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def expected(c: int, blocks: int) -> bytes:
    return b"".join(block(c * 100 + i) for i in range(blocks))


def put_then_restart(kvstored: Daemon, n_chains: int, blocks: int) -> list[list[int]]:
    """Chains of ``blocks`` blocks, on disk only after a restart (page cache warm)."""
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("files", TOKENS, block_bytes=BLOCK)
        chains = [list(range(c * 10_000, c * 10_000 + blocks * TOKENS)) for c in range(n_chains)]
        for c, tokens in enumerate(chains):
            ns.put(tokens, np.frombuffer(expected(c, blocks), np.uint8).reshape(blocks, BLOCK))
    kvstored.restart()  # persists the host tier: every block is on disk only
    return chains


def page_cached(path: str, offset: int) -> bool:
    """Whether the page of ``path`` at ``offset`` (page-aligned) is in the page cache,
    asked with mincore(2) on a mapping that touches nothing."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        view = np.frombuffer(mapped, np.uint8)
        vector = ctypes.create_string_buffer(1)
        failed = libc.mincore(ctypes.c_void_p(view.ctypes.data + offset), 4096, vector)
        del view  # the mapping closes only without views into it
        if failed:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return bool(vector.raw[0] & 1)


def file_gets(client: KVClient) -> int:
    return client.stats().counters["disk_file_gets"]  # stats() reports pending reads first


def test_a_first_read_from_disk_needs_no_call_and_the_second_promotes(kvstored: Daemon) -> None:
    chains = put_then_restart(kvstored, 3, 8)
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("files", TOKENS, block_bytes=BLOCK)
        out = np.empty((8, BLOCK), np.uint8)
        for c, tokens in enumerate(chains):
            assert ns.get(tokens, out=out).blocks.tobytes() == expected(c, 8)
        stats = client.stats()
        assert stats.counters["disk_file_gets"] == 3
        assert stats.tier("disk").hits == 24 and stats.promotions == 0
        assert stats.leases == 0  # no Acquire pinned anything
        for c, tokens in enumerate(chains):  # a second read: the daemon promotes
            assert ns.get(tokens, out=out).blocks.tobytes() == expected(c, 8)
        stats = client.stats()
        assert stats.promotions == 24 and stats.counters["disk_file_gets"] == 3
    with KVClient(kvstored.addr) as other:  # promoted, and still in the file
        ns = other.namespace("files", TOKENS, block_bytes=BLOCK)
        host_hits = other.stats().tier("host").hits
        assert ns.get(chains[0]).blocks.tobytes() == expected(0, 8)  # its first read
        stats = other.stats()  # from the file, counted where the blocks are now: host
        assert stats.counters["disk_file_gets"] == 4
        assert stats.tier("host").hits == host_hits + 8 and stats.promotions == 24


def test_a_prefix_longer_than_the_disk_part_asks_the_daemon(kvstored: Daemon) -> None:
    chains = put_then_restart(kvstored, 1, 4)
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("files", TOKENS, block_bytes=BLOCK)
        longer = chains[0] + list(range(90_000, 90_000 + 4 * TOKENS))  # 4 blocks more
        got = ns.get(longer)
        assert got.blocks.tobytes() == expected(0, 4)  # the cached prefix, from the daemon
        assert file_gets(client) == 0
        got = ns.get(chains[0], out=np.empty((2, BLOCK), np.uint8))  # max_blocks 2
        assert got.blocks.tobytes() == expected(0, 2) and file_gets(client) == 1


def test_blocks_out_of_the_page_cache_are_read_by_the_daemon(kvstored: Daemon) -> None:
    chains = put_then_restart(kvstored, 1, 8)
    data_path = os.path.join(kvstored.disk_dir, "data.mdb")
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("files", TOKENS, block_bytes=BLOCK)
        # where the chain's blocks lie, from their meta records alone (reading the
        # payload pages here would keep them in the page cache)
        index = DiskIndex.open(data_path)
        assert index is not None
        spec = index.spec(ns.ns_id)
        assert spec is not None
        located = Reads()
        assert index.read(chain_keys(spec, chains[0]), np.empty((8, BLOCK), np.uint8), located)
        index.close()
        fd = os.open(data_path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        # the block's last page (the daemon may map the first, its page header); asked
        # with mincore, since a read that misses would start readahead and bring it back
        last_page = (located.extents[0][0].offset + BLOCK - 1) // 4096 * 4096
        if page_cached(data_path, last_page):
            pytest.skip("this file system keeps the file in memory (no page cache to drop)")
        assert ns.get(chains[0]).blocks.tobytes() == expected(0, 8)
        stats = client.stats()
        assert stats.counters["disk_file_gets"] == 0 and stats.tier("disk").hits == 8


def test_a_damaged_block_is_the_daemons_to_drop(kvstored: Daemon) -> None:
    chains = put_then_restart(kvstored, 1, 6)
    damage_in_disk_file(kvstored.disk_dir, block(3))  # block 3 of chain 0
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("files", TOKENS, block_bytes=BLOCK)
        got = ns.get(chains[0])
        assert got.blocks.tobytes() == expected(0, 3)  # blocks 0-2; 3 and 4-5 dropped
        stats = client.stats()
        assert stats.counters["disk_file_gets"] == 0 and stats.corrupt_reads == 1


def test_clear_and_delete_reach_the_file_before_they_return(kvstored: Daemon) -> None:
    chains = put_then_restart(kvstored, 2, 6)
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("files", TOKENS, block_bytes=BLOCK)
        assert ns.delete(chains[0], start=2) == 4
        got = ns.get(chains[0])  # a first read: blocks 2-5 are not in the file any more
        assert got.blocks.tobytes() == expected(0, 2)
        assert client.clear(ns.ns_id) == 2 + 6
        assert ns.get(chains[1]).n_blocks == 0
        assert file_gets(client) == 0


def test_tokens_the_namespace_refuses_get_the_daemons_error_and_change_nothing(
    kvstored: Daemon,
) -> None:
    """Token ids past the namespace's vocabulary pass the client's own checks; its key
    derivation refuses them, and the daemon answers with the precise error."""
    tokens = list(range(4 * TOKENS))
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("vocab", TOKENS, block_bytes=BLOCK, vocab_size=1000)
        ns.put(tokens, np.frombuffer(expected(0, 4), np.uint8).reshape(4, BLOCK))
    kvstored.restart()
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("vocab", TOKENS, block_bytes=BLOCK, vocab_size=1000)
        before = client.stats()
        with pytest.raises(InvalidArgumentError, match="token ids must be < 1000"):
            ns.get([*tokens[:-1], 5000])
        after = client.stats()
        assert after.counters["disk_file_gets"] == 0 and after.tier("disk") == before.tier("disk")
        assert ns.get(tokens).blocks.tobytes() == expected(0, 4)  # and the chain is intact
        assert file_gets(client) == 1


def test_async_gets_read_the_file_with_no_call(kvstored: Daemon) -> None:
    chains = put_then_restart(kvstored, 2, 4)

    async def main() -> None:
        async with AsyncKVClient(kvstored.addr) as client:
            ns = await client.namespace("files", TOKENS, block_bytes=BLOCK)
            for c, tokens in enumerate(chains):
                assert (await ns.get(tokens)).blocks.tobytes() == expected(c, 4)
            stats = await client.stats()
            assert stats.counters["disk_file_gets"] == 2 and stats.promotions == 0
            assert stats.tier("disk").hits == 8

    asyncio.run(main())


# -- the index alone ----------------------------------------------------------------------


class Reads:
    """A stand-in file reader for the index alone: records the extents it is given."""

    def __init__(self) -> None:
        self.extents: list[list[DiskExtent]] = []

    def read_cached(self, blocks: np.ndarray, extents: list[DiskExtent]) -> bool:
        self.extents.append(list(extents))
        return True


def write_blocks(directory: Path, keys: list[bytes], map_size: int | None = None) -> None:
    """Write blocks with a DiskTier in another process (never two handles in one)."""
    script = (
        "import sys, xxhash\n"
        "from kvstore.disk import DiskTier, DiskRecord\n"
        "d, size, keys = sys.argv[1], int(sys.argv[2]), sys.argv[3:]\n"
        "kw = {'_map_size_override': size} if size else {}\n"
        "with DiskTier(d, 1 << 30, **kw) as tier:\n"
        "    for k in keys:\n"
        "        key = bytes.fromhex(k); data = key * (8192 // len(key))\n"
        "        sum_ = xxhash.xxh3_64_intdigest(data)\n"
        "        rec = DiskRecord(key, b'n' * 32, b'', len(data), sum_, 0, 0.0)\n"
        "        tier.write(rec, data)\n"
    )  # fmt: skip
    args = [str(directory), str(map_size or 0), *(key.hex() for key in keys)]
    subprocess.run([sys.executable, "-c", script, *args], check=True, timeout=60)


def test_one_handle_per_process_and_none_beside_an_own_disk_tier(tmp_path: Path) -> None:
    directory = tmp_path / "lmdb"
    write_blocks(directory, [b"a" * 16])
    data_path = str(directory / "data.mdb")
    first, second = DiskIndex.open(data_path), DiskIndex.open(data_path)
    assert first is not None and first is second
    first.close()
    assert second.read([b"a" * 16], np.empty((1, 8192), np.uint8), Reads())  # still open
    second.close()
    with pytest.raises(lmdb.Error):  # closed with its last user
        second._env.stat()
    with DiskTier(str(directory), 1 << 30):
        assert DiskIndex.open(data_path) is None  # LMDB must not be opened twice in one
    assert DiskIndex.open(str(tmp_path / "nothing" / "data.mdb")) is None


def test_the_index_follows_the_daemons_map_resizes(tmp_path: Path) -> None:
    directory = tmp_path / "lmdb"
    keys = [bytes([i]) * 16 for i in range(4)]
    write_blocks(directory, keys[:2], map_size=8 << 20)
    index = DiskIndex.open(str(directory / "data.mdb"))
    assert index is not None
    try:
        reads = Reads()
        rows = np.empty((2, 8192), np.uint8)
        assert index.read(keys[:2], rows, reads)
        assert not index.read(keys[2:], rows, reads)  # not written yet: no extents asked
        # another process grows the map, and writes past what this handle maps (10 MiB)
        filler = [(1000 + i).to_bytes(2, "little") * 8 for i in range(1600)]  # 12.5 MiB
        write_blocks(directory, keys[2:] + filler, map_size=64 << 20)
        assert index.read(keys[2:], rows, reads)  # after MDB_MAP_RESIZED: the new size
        assert index._env.info()["map_size"] >= 64 << 20
        sums = [xxhash.xxh3_64_intdigest(key * 512) for key in keys]
        assert [e.checksum for got in reads.extents for e in got] == sums
        assert not index.read(keys[:1], np.empty((1, 4096), np.uint8), reads)  # wrong size
        # threads read side by side (each its own transaction), while the map grows again
        results: list[bool] = []

        def reader() -> None:
            rows = np.empty((4, 8192), np.uint8)
            results.extend(index.read(keys, rows, Reads()) for _ in range(50))

        threads = [threading.Thread(target=reader) for _ in range(4)]
        for thread in threads:
            thread.start()
        write_blocks(directory, [b"z" * 16], map_size=256 << 20)
        for thread in threads:
            thread.join()
        assert len(results) == 200 and all(results)
    finally:
        index.close()


def test_the_disk_writer_frees_the_reader_slot_of_a_client_killed_mid_read(
    tmp_path: Path,
) -> None:
    """A dead reader's slot would keep LMDB from reusing any page its snapshot sees."""
    directory = tmp_path / "lmdb"
    with DiskTier(str(directory), 1 << 30) as tier:
        script = (
            "import sys, time, lmdb\n"
            "env = lmdb.open(sys.argv[1], readonly=True, lock=True, max_dbs=4)\n"
            "txn = env.begin()\n"
            "print('reading', flush=True)\n"
            "time.sleep(60)\n"
        )
        reader = subprocess.Popen(
            [sys.executable, "-c", script, str(directory)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert reader.stdout is not None and reader.stdout.readline() == "reading\n"
            assert tier._clear_stale_readers() == 0  # alive: its snapshot stays
        finally:
            reader.kill()
            reader.wait()
        assert tier._clear_stale_readers() == 1


def test_a_prefix_is_read_from_the_file_once_per_client() -> None:
    first = DiskFirstReads(entries=2)
    assert first.first("a") and not first.first("a")
    assert first.first("b") and first.first("c")  # "a" is forgotten (oldest out)
    assert first.first("a")


def test_a_record_names_its_extent_only_once_it_says_where() -> None:
    rec = DiskRecord(b"k" * 16, b"n" * 32, b"", 4096, 1234, 35, 0.0, offset=8192)
    assert committed_extent(disk_format.pack_record(rec)) == DiskExtent(8192, 4096, 1234)
    unknown = replace(rec, offset=0)  # not committed
    assert committed_extent(disk_format.pack_record(unknown)) is None
    assert committed_extent(disk_format.pack_record(rec)[:-8]) is None  # a version 1 record
    # an unknown version
    assert committed_extent(b"\x07" + disk_format.pack_record(rec)[1:]) is None


def test_the_switch_turns_reads_with_no_call_off(
    kvstored: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    chains = put_then_restart(kvstored, 1, 4)
    monkeypatch.setenv("KVCLIENT_DISK_INDEX", "0")
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("files", TOKENS, block_bytes=BLOCK)
        assert ns.get(chains[0]).blocks.tobytes() == expected(0, 4)  # disk_direct extents
        stats = client.stats()
        assert stats.counters["disk_file_gets"] == 0 and stats.tier("disk").hits == 4


def test_a_forked_child_never_uses_the_parents_handle(tmp_path: Path) -> None:
    """LMDB handles must not cross a fork; py-lmdb refuses a second handle for a path a
    process has open, so a child's reads go to the daemon."""
    directory = tmp_path / "lmdb"
    write_blocks(directory, [b"a" * 16])
    file = DiskFile.open(str(directory / "data.mdb"))
    assert file is not None
    try:
        parent_index = file.index
        assert parent_index is not None

        def child() -> bool:
            index = file.index
            got = read_first_from_file(
                file, DiskFirstReads(), "any", ("key",), np.arange(4), [], None, 8192, 1
            )
            return index is None and got is None

        assert in_forked_child(child) == 0
        assert file.index is parent_index
        assert parent_index.read([b"a" * 16], np.empty((1, 8192), np.uint8), Reads())
    finally:
        file.close()
