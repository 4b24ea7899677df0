"""kvclient against a real kvstored: put/get round trips over both data paths.

Every test here talks to one daemon per module over its real unix socket; each test
uses its own token ranges, so they do not see each other's blocks. ``use_arena=True``
forces the shared-arena path (Reserve -> copy -> Commit, Acquire -> copy -> Release),
``use_arena=False`` the inline Put/Get streams. The daemon's max_transfer_bytes is
1 MiB, so multi-MiB transfers below exercise the client's batching (several Put calls,
truncated Gets) and chunking.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from conftest import ClientMaker, Daemon

from kvclient import (
    ArenaUnavailableError,
    AsyncKVClient,
    KVClient,
    Namespace,
    PutResult,
)

BLOCK_TOKENS = 16
BLOCK_BYTES = 16 << 10  # page multiple: adjacent arena slots are copied as one run

PATHS = [pytest.param(True, id="arena"), pytest.param(False, id="inline")]


pytestmark = pytest.mark.usefixtures("get_route")


@pytest.fixture(scope="module")
def daemon(
    kvstored_module_factory: Callable[..., Daemon], get_route: str, kv_client: ClientMaker
) -> Daemon:
    """A daemon per get route (the route is the client's, set by the fixture) and
    driver."""
    return kvstored_module_factory(max_transfer_bytes="1MiB")


def prompt(first: int, n_tokens: int) -> list[int]:
    return list(range(first, first + n_tokens))


@contextmanager
def rt_namespace(kv_client: ClientMaker, daemon: Daemon, use_arena: bool) -> Iterator[Namespace]:
    """The tests' namespace, through a client of the given driver and path."""
    with kv_client(daemon.addr, use_arena=use_arena) as client:
        yield client.namespace("rt-model", BLOCK_TOKENS, BLOCK_BYTES)


def blocks_for(tokens: list[int], n_blocks: int, block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    """Deterministic content of each block, a function of the prefix it ends."""
    out = np.empty((n_blocks, block_bytes), dtype=np.uint8)
    for i in range(n_blocks):
        digest = hashlib.sha256(repr(tokens[: (i + 1) * BLOCK_TOKENS]).encode()).digest()
        out[i] = np.random.default_rng(int.from_bytes(digest[:8], "little")).integers(
            0, 256, block_bytes, dtype=np.uint8
        )
    return out


@pytest.mark.parametrize("use_arena", PATHS)
def test_put_get_round_trip_is_byte_exact(
    daemon: Daemon, use_arena: bool, kv_client: ClientMaker
) -> None:
    tokens = prompt(1_000 + 10_000 * use_arena, 12 * BLOCK_TOKENS + 5)  # 12 full blocks
    blocks = blocks_for(tokens, 12)
    with kv_client(daemon.addr, use_arena=use_arena) as client:
        assert client.arena_in_use is use_arena
        ns = client.namespace("rt-model", BLOCK_TOKENS, BLOCK_BYTES)

        # nothing cached yet: a miss is an empty result, not an error
        assert ns.lookup(tokens).blocks == 0
        assert ns.get(tokens).blocks.shape == (0, BLOCK_BYTES)

        assert ns.put(tokens, blocks) == PutResult(stored=12, existing=0, refused=0)
        hit = ns.lookup(tokens)
        assert (hit.tokens, hit.blocks, hit.host_blocks, hit.disk_blocks) == (192, 12, 12, 0)
        got = ns.get(tokens)
        assert got.tokens == 192 and got.blocks.dtype == np.uint8
        assert np.array_equal(got.blocks, blocks)

        # the same blocks again are found, not written
        assert ns.put(tokens, blocks) == PutResult(stored=0, existing=12, refused=0)


@pytest.mark.parametrize("use_arena", PATHS)
def test_blocks_as_bytes_or_any_dtype(
    daemon: Daemon, use_arena: bool, kv_client: ClientMaker
) -> None:
    tokens = prompt(2_000 + 10_000 * use_arena, 6 * BLOCK_TOKENS)
    raw = blocks_for(tokens, 6)
    with rt_namespace(kv_client, daemon, use_arena) as ns:
        # a list of bytes-likes for the first three, a float16 array for the rest
        as_bytes = [bytes(raw[0]), bytearray(raw[1]), memoryview(raw[2])]
        assert ns.put(tokens, as_bytes).stored == 3
        half = raw[3:].view(np.float16)  # [3, BLOCK_BYTES // 2]
        assert ns.put(tokens, half, start=3).stored == 3
        assert np.array_equal(ns.get(tokens).blocks, raw)


@pytest.mark.parametrize("use_arena", PATHS)
def test_put_continues_a_stored_prefix(
    daemon: Daemon, use_arena: bool, kv_client: ClientMaker
) -> None:
    tokens = prompt(3_000 + 10_000 * use_arena, 8 * BLOCK_TOKENS)
    blocks = blocks_for(tokens, 8)
    with rt_namespace(kv_client, daemon, use_arena) as ns:
        # blocks 6..7 without their parents are refused: a block needs its ancestors
        refused = ns.put(tokens, blocks[6:], start=6)
        assert refused.stored == 0 and refused.refused == 2
        assert ns.lookup(tokens).blocks == 0

        assert ns.put(tokens[: 4 * BLOCK_TOKENS], blocks[:4]).stored == 4
        assert ns.put(tokens, blocks[4:], start=4).stored == 4
        assert ns.lookup(tokens).tokens == 8 * BLOCK_TOKENS
        assert np.array_equal(ns.get(tokens).blocks, blocks)


@pytest.mark.parametrize("use_arena", PATHS)
def test_get_returns_the_longest_cached_prefix(
    daemon: Daemon, use_arena: bool, kv_client: ClientMaker
) -> None:
    tokens = prompt(4_000 + 10_000 * use_arena, 5 * BLOCK_TOKENS)
    blocks = blocks_for(tokens, 5)
    with rt_namespace(kv_client, daemon, use_arena) as ns:
        ns.put(tokens, blocks)

        # a prompt that diverges inside block 2 shares blocks 0 and 1 only
        other = tokens[: 2 * BLOCK_TOKENS + 3] + [7] * (3 * BLOCK_TOKENS)
        assert ns.lookup(other).blocks == 2
        got = ns.get(other)
        assert got.tokens == 2 * BLOCK_TOKENS
        assert np.array_equal(got.blocks, blocks[:2])

        # a caller's buffer caps the blocks and is filled in place (reuse across calls)
        out = np.zeros((3, BLOCK_BYTES), dtype=np.uint8)
        got = ns.get(tokens, out=out)
        assert got.n_blocks == 3 and np.shares_memory(got.blocks, out)
        assert np.array_equal(out, blocks[:3])


@pytest.mark.parametrize("use_arena", PATHS)
def test_multi_mib_transfers_are_batched(
    daemon: Daemon, use_arena: bool, kv_client: ClientMaker
) -> None:
    # 40 x 64 KiB = 2.5 MiB: several Put calls and truncated Gets under the 1 MiB limit
    block_bytes = 64 << 10
    tokens = prompt(5_000 + 10_000 * use_arena, 40 * BLOCK_TOKENS)
    blocks = blocks_for(tokens, 40, block_bytes)
    with kv_client(daemon.addr, use_arena=use_arena) as client:
        ns = client.namespace("rt-big", BLOCK_TOKENS, block_bytes)
        assert ns.put(tokens, blocks).stored == 40
        assert np.array_equal(ns.get(tokens).blocks, blocks)


def test_both_paths_see_the_same_blocks(daemon: Daemon, kv_client: ClientMaker) -> None:
    first = prompt(6_000, 4 * BLOCK_TOKENS)
    second = prompt(7_000, 4 * BLOCK_TOKENS)
    with (
        kv_client(daemon.addr, use_arena=True) as arena,
        kv_client(daemon.addr, use_arena=False) as inline,
    ):
        ns_a = arena.namespace("rt-model", BLOCK_TOKENS, BLOCK_BYTES)
        ns_i = inline.namespace("rt-model", BLOCK_TOKENS, BLOCK_BYTES)
        assert ns_a.ns_id == ns_i.ns_id
        ns_a.put(first, blocks_for(first, 4))
        ns_i.put(second, blocks_for(second, 4))
        assert np.array_equal(ns_i.get(first).blocks, blocks_for(first, 4))
        assert np.array_equal(ns_a.get(second).blocks, blocks_for(second, 4))


@pytest.mark.parametrize("use_arena", PATHS)
def test_delete_and_set_priority(daemon: Daemon, use_arena: bool, kv_client: ClientMaker) -> None:
    tokens = prompt(8_000 + 10_000 * use_arena, 6 * BLOCK_TOKENS)
    with rt_namespace(kv_client, daemon, use_arena) as ns:
        ns.put(tokens, blocks_for(tokens, 6))
        assert ns.set_priority(tokens, 90, duration_s=60) == 6
        # deleting block 4 removes it and everything below it
        assert ns.delete(tokens, start=4) == 2
        assert ns.lookup(tokens).blocks == 4


@pytest.mark.parametrize("use_arena", PATHS)
def test_async_client_round_trip(daemon: Daemon, use_arena: bool) -> None:
    tokens = prompt(9_000 + 10_000 * use_arena, 6 * BLOCK_TOKENS)
    blocks = blocks_for(tokens, 6)

    async def scenario() -> None:
        async with AsyncKVClient(daemon.addr, use_arena=use_arena) as client:
            assert await client.arena_in_use() is use_arena
            ns = await client.namespace("rt-model", BLOCK_TOKENS, BLOCK_BYTES)
            assert (await ns.put(tokens, blocks)).stored == 6
            hit = await ns.lookup(tokens)
            assert hit.blocks == 6 and hit.tokens == 6 * BLOCK_TOKENS
            got = await ns.get(tokens)
            assert np.array_equal(got.blocks, blocks)
            assert await ns.delete(tokens, start=3) == 3
            assert (await client.stats()).tier("host") is not None
            # the event stream is an async iterator; leaving it cancels the call
            kinds = []
            async for event in client.events(0):
                kinds.append(event.kind)
                if len(kinds) == 3:
                    break
            assert kinds == ["stored"] * 3

    asyncio.run(scenario())


def test_arena_required_but_not_shared(tmp_path_factory: pytest.TempPathFactory) -> None:
    # a daemon with an anonymous arena: no client can map it
    d = Daemon(tmp_path_factory.mktemp("kvstored-noshm"), {"shared_arena": "false"})
    d.start()
    try:
        tokens = prompt(100, 2 * BLOCK_TOKENS)
        blocks = blocks_for(tokens, 2)
        with KVClient(d.addr, use_arena=True) as client:
            ns = client.namespace("rt-model", BLOCK_TOKENS, BLOCK_BYTES)
            with pytest.raises(ArenaUnavailableError, match="cannot be mapped"):
                ns.put(tokens, blocks)
        # auto: falls back to the inline streams
        with KVClient(d.addr) as client:
            assert client.arena_in_use is False
            ns = client.namespace("rt-model", BLOCK_TOKENS, BLOCK_BYTES)
            assert ns.put(tokens, blocks).stored == 2
            assert np.array_equal(ns.get(tokens).blocks, blocks)
    finally:
        d.cleanup()
