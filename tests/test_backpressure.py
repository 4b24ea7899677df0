"""Back-pressure from the disk writer, against a real kvstored: with write-back, a block
due on disk never leaves the host tier unwritten (puts wait for the writer instead), a
graceful stop writes the whole host tier, and ``overflow = drop`` counts what it loses.

The daemons here have a host tier of 16 MiB and a disk write queue of 1 MiB (its
smallest), so writers that outrun the disk hit the queue at once.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import Daemon

from kvclient import KVClient

BLOCK = 256 << 10
CHAIN_BLOCKS = 8
HOST = "16MiB"
CHAINS = 4 * 16 * 2**20 // (BLOCK * CHAIN_BLOCKS)  # four times the host tier

SMALL_QUEUE = {"host_bytes": HOST, "disk_queue_bytes": "1MiB", "admission": "write-back"}


def tokens_of(writer: int, chain: int) -> list[int]:
    return [writer * 10_000_000 + chain * 1000 + t for t in range(CHAIN_BLOCKS * 4)]


def blocks_of(writer: int, chain: int) -> np.ndarray:
    """Distinct bytes per block: every block's first 8 bytes say whose it is."""
    rng = np.random.default_rng(writer * 1000 + chain)
    data = rng.integers(0, 256, size=(CHAIN_BLOCKS, BLOCK), dtype=np.uint8)
    for i in range(CHAIN_BLOCKS):
        data[i, :8] = np.frombuffer(np.int64(writer * 10**6 + chain * 100 + i).tobytes(), np.uint8)
    return data


def write_chains(addr: str, writer: int, chains: int, results: list[int]) -> None:
    """Put ``chains`` chains as fast as one client can; count blocks answered stored."""
    with KVClient(addr) as client:
        ns = client.namespace("bp-model", block_tokens=4, block_bytes=BLOCK)
        stored = 0
        for chain in range(chains):
            stored += ns.put(tokens_of(writer, chain), blocks_of(writer, chain)).stored
        results[writer] = stored


def whole_chains(addr: str, writers: int, chains: int) -> tuple[int, int]:
    """(chains found whole, blocks found) after a run; every block found must be the
    exact bytes its writer put, in a prefix of its chain."""
    whole = blocks = 0
    with KVClient(addr) as client:
        ns = client.namespace("bp-model", block_tokens=4, block_bytes=BLOCK)
        for writer in range(writers):
            for chain in range(chains):
                got = ns.get(tokens_of(writer, chain))
                n = got.n_blocks
                assert np.array_equal(got.blocks, blocks_of(writer, chain)[:n])
                whole += n == CHAIN_BLOCKS
                blocks += n
    return whole, blocks


def counters(addr: str) -> dict[str, int]:
    with KVClient(addr) as client:
        return dict(client.stats().counters)


def run_writers(daemon: Daemon, writers: int) -> list[int]:
    stored = [0] * writers
    threads = [
        threading.Thread(target=write_chains, args=(daemon.addr, w, CHAINS, stored))
        for w in range(writers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a writer hung"
    return stored


@pytest.mark.parametrize("writers", [1, 3])
def test_writers_faster_than_the_disk_lose_nothing(
    kvstored_factory: Callable[..., Daemon], writers: int
) -> None:
    daemon = kvstored_factory(**SMALL_QUEUE)
    stored = run_writers(daemon, writers)
    # every block was stored (the default overflow = wait never refused: the writer
    # kept up within put_wait_ms), and every chain is there, whole and exact
    assert stored == [CHAINS * CHAIN_BLOCKS] * writers
    total = writers * CHAINS
    assert whole_chains(daemon.addr, writers, CHAINS) == (total, total * CHAIN_BLOCKS)
    seen = counters(daemon.addr)
    assert seen["dirty_dropped"] == 0 and seen["writer_refused"] == 0
    assert seen["put_waits"] > 0, "the queue never filled: the test did not test"
    assert daemon.stop() == 0


def test_overflow_drop_counts_what_it_loses(kvstored_factory: Callable[..., Daemon]) -> None:
    daemon = kvstored_factory(**SMALL_QUEUE, overflow="drop", put_wait_ms=0)
    stored = run_writers(daemon, 1)
    assert stored == [CHAINS * CHAIN_BLOCKS]  # drop never refuses a put: it evicts
    seen = counters(daemon.addr)
    whole, _ = whole_chains(daemon.addr, 1, CHAINS)
    # each dropped block cost the chain it belonged to (and nothing else did)
    assert seen["dirty_dropped"] > 0
    assert CHAINS - whole <= seen["dirty_dropped"]
    assert seen["put_waits"] == 0 and seen["writer_refused"] == 0
    text = subprocess.run(
        [sys.executable, "-m", "kvctl", "--addr", daemon.addr, "status"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert f"dropped unwritten {seen['dirty_dropped']}" in text
    assert daemon.stop() == 0
    assert daemon.output().count("the disk writer is behind") == 1  # once a minute at most


def test_a_graceful_stop_persists_a_host_tier_larger_than_the_queue(
    kvstored_factory: Callable[..., Daemon],
) -> None:
    # 12 MiB of host-only blocks, twelve times what the writer's queue takes at once
    daemon = kvstored_factory(**SMALL_QUEUE)
    stored = [0]
    write_chains(daemon.addr, 0, 6, stored)
    assert stored == [6 * CHAIN_BLOCKS]
    with KVClient(daemon.addr) as client:
        disk = next(t for t in client.stats().tiers if t.name == "disk")
    assert disk.blocks == 0, "blocks went to disk before the stop"
    assert daemon.stop() == 0
    assert "persisting the host tier: 48 blocks (12.0 MiB) due on disk" in daemon.output()
    assert "persisted 48 of 48 host blocks" in daemon.output()
    daemon.start()
    assert whole_chains(daemon.addr, 1, 6) == (6, 48)


def test_a_stop_out_of_time_exits_3_naming_what_it_lost(
    kvstored_factory: Callable[..., Daemon],
) -> None:
    daemon = kvstored_factory(**SMALL_QUEUE, persist_timeout_s=0)
    stored = [0]
    write_chains(daemon.addr, 0, 6, stored)
    assert daemon.stop() == 3
    log = daemon.output()
    lost = int(log.split("stopped uncleanly: ")[1].split()[0])
    # the queue took some blocks without waiting; the rest were counted, not hidden
    assert 0 < lost < 48
    assert f"persisted {48 - lost} of 48 host blocks" in log
    daemon.start()
    # what came back is exact prefixes of the chains: every block persisted, no other
    assert whole_chains(daemon.addr, 1, 6)[1] == 48 - lost


def test_puts_waiting_for_the_writer_never_hold_a_thread_a_waiting_lookup_needs(
    tmp_path: Path,
) -> None:
    """#56 item 7, in the daemon's dispatch with a real store: puts that wait for the
    disk writer run on a pool of their own. With every thread of the put-wait pool
    held (and more queued), a parked Lookup is still served, and the reverse: every thread of the
    Lookups' waiting pool held, a put that waits is still served. Before, both shared
    one pool, and one tenant's puts on a slow disk held another's lookups for seconds."""
    import asyncio

    from kvstore.store import Store
    from kvstored import config as kvconfig
    from kvstored.auth import ANYONE, Access, Tokens
    from kvstored.dispatch import WAIT_THREADS, Calls
    from kvstored.names import NamespaceNames

    cfg = kvconfig.load_config(
        ["--disk_bytes", "0", "--host_bytes", "8MiB", "--arena_dir", str(tmp_path)], env={}
    )[0]
    store = Store(cfg.store_config())
    names = NamespaceNames(None)
    calls = Calls(store, cfg, names, "test", Access(store, names, Tokens(())))
    release = threading.Event()

    async def run() -> None:
        def held() -> None:
            assert release.wait(60)

        # as many waiting puts as the Lookups' waiting pool has threads (a writer that
        # does not come back meanwhile)
        puts = [asyncio.ensure_future(calls.run(held, wait=True)) for _ in range(WAIT_THREADS)]
        # a parked lookup still gets a thread of its pool
        ran, value = await asyncio.wait_for(
            calls.run_parked(calls.wait_shares, ANYONE, lambda: "looked up"), 30
        )
        assert (ran, value) == (True, "looked up")
        release.set()
        await asyncio.gather(*puts)
        # the reverse: the waiting pool full (its share is all of it for one caller),
        # a put that waits still runs
        release.clear()
        parked = [
            asyncio.ensure_future(calls.run_parked(calls.wait_shares, ANYONE, held))
            for _ in range(WAIT_THREADS)
        ]
        assert await asyncio.wait_for(calls.run(lambda: "put", wait=True), 30) == "put"
        release.set()
        await asyncio.gather(*parked)

    try:
        asyncio.run(run())
    finally:
        release.set()
        calls.close()
        store.close()
