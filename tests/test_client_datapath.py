"""The fast data paths: slot runs, copies, framing, zero-copy views, batched releases.

Pure helpers are tested on their own (an anonymous mapping stands in for the arena);
the rest against real daemons: one served the way ``kvstored`` registers its service
today, and one whose Get and Put are registered framed (``service.add_to_server``),
each checked with kvclient and with the generated protobuf stubs, which must not see
any difference on the wire.
"""

from __future__ import annotations

import asyncio
import mmap
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import ClientMaker, Daemon, get_chain, kv_stub, open_ns, put_chain

from kvclient import ArenaUnavailableError, AsyncKVClient, KVClient, wire
from kvclient import arena_path as ap
from kvclient.accounting import DELAY_S as RELEASE_DELAY_S
from kvproto.v1 import data_frames
from kvproto.v1 import kvstore_pb2 as pb
from kvstore.host.mapping import ArenaMapping

BLOCK_TOKENS = 4
BB = 8192  # page multiple: adjacent arena slots make one run


def table(indices: list[int], offsets: list[int]) -> ap.SlotTable:
    return ap.SlotTable(np.array(indices, np.int64), np.array(offsets, np.int64))


def anon_mapping(size: int) -> ArenaMapping:
    return ArenaMapping(mmap.mmap(-1, size), None, writable=True)


@pytest.mark.parametrize("parallel", [False, True])
def test_write_then_read_slots_round_trips_every_run_kind(
    parallel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if parallel:  # split even these small copies between threads
        monkeypatch.setattr(ap, "PARALLEL_COPY_BYTES", 1)
        monkeypatch.setattr(ap, "COPY_THREADS", 3)
    mapping = anon_mapping(64 * BB)
    # chain positions 2..9: an upward run, a downward run, a strided run, a loner
    slots = table(
        [2, 3, 4, 5, 6, 7, 8, 9],
        [0, BB, 9 * BB, 8 * BB, 20 * BB, 22 * BB, 24 * BB, 40 * BB],
    )
    blocks = np.random.default_rng(1).integers(0, 256, (8, BB), dtype=np.uint8)
    ap.write_slots(mapping, slots, blocks, BB, first_index=2)
    arena = mapping.array()
    for i, offset in enumerate(slots.offsets.tolist()):
        assert np.array_equal(arena[offset : offset + BB], blocks[i])
    # rows given as separate buffers are copied as well
    rows = [np.ascontiguousarray(b[::-1]) for b in blocks]
    ap.write_slots(mapping, slots, rows, BB, first_index=2)
    out = np.zeros((8, BB), np.uint8)
    ap.read_slots(mapping, slots, out, BB, first_index=2)
    assert np.array_equal(out, np.stack(rows))


def test_views_are_read_only_and_share_the_arena() -> None:
    mapping = anon_mapping(16 * BB)
    arena = mapping.array()
    arena[:] = np.arange(arena.size, dtype=np.uint64).astype(np.uint8)
    rows, whole = ap.slot_views(mapping, table([0, 1, 2], [6 * BB, 5 * BB, 4 * BB]), BB)
    assert whole is not None and whole.shape == (3, BB) and not whole.flags.writeable
    for i, row in enumerate(rows):
        assert not row.flags.writeable and np.shares_memory(row, arena)
        assert np.array_equal(row, arena[(6 - i) * BB : (7 - i) * BB])
    with pytest.raises(ValueError):
        rows[0][0] = 1
    rows, whole = ap.slot_views(mapping, table([0, 2], [0, 4 * BB]), BB)  # two runs
    assert whole is None and len(rows) == 2


def test_offsets_outside_the_mapping_are_refused_not_mapped() -> None:
    mapping = anon_mapping(8 * BB)
    out = np.zeros((2, BB), np.uint8)
    with pytest.raises(ValueError, match="outside the arena"):
        ap.read_slots(mapping, table([0, 1], [7 * BB, 8 * BB]), out, BB)
    with pytest.raises(ValueError, match="outside the arena"):
        ap.read_slots(mapping, table([0, 1], [BB, 0 - BB]), out, BB)


# -- framing ---------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, (4 << 20) - (64 << 10)])
def test_framed_data_is_the_protobuf_encoding(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    half = size // 2
    framed = data_frames.framed([data[:half], memoryview(data)[half:]], size)
    assert framed == pb.GetResponse(data=data).SerializeToString()
    assert framed == pb.PutRequest(data=data).SerializeToString()
    offset, length = data_frames.data_span(framed) or (-1, -1)
    assert length == size and framed[offset:] == data
    assert bytes(wire.data_of(framed)) == data


def test_data_span_refuses_anything_but_one_data_field() -> None:
    header = pb.GetResponse(header=pb.GetHeader(n_blocks=3)).SerializeToString()
    assert data_frames.data_span(header) is None
    framed = data_frames.framed([b"abc"], 3)
    assert data_frames.data_span(framed + b"\x08\x01") is None  # a trailing field
    assert data_frames.data_span(framed[:-1]) is None  # short
    assert data_frames.data_span(b"") is None
    # another valid encoding (data, then the same field again) still parses
    twice = framed + data_frames.framed([b"xy"], 2)
    assert bytes(wire.data_of(twice)) == b"xy"  # protobuf: the last one wins


def test_put_messages_parse_as_put_requests() -> None:
    header = pb.PutHeader(ns_id="ns", tokens=[1, 2], n_blocks=3)
    blocks = np.random.default_rng(2).integers(0, 256, (3, 1000), dtype=np.uint8)
    for data in (blocks, [row for row in blocks]):
        messages = [pb.PutRequest.FromString(m) for m in wire.put_messages(header, data, 700)]
        assert messages[0].header == header
        chunks = [m.data for m in messages[1:]]
        assert all(0 < len(c) <= 700 for c in chunks)
        assert b"".join(chunks) == blocks.tobytes()


# -- against a daemon --------------------------------------------------------------------


class FramedDaemon(Daemon):
    """kvstored with its service registered by ``kvstored.service.add_to_server``."""

    LAUNCH = (
        "import sys, types; import kvstored.server as srv, kvstored.service as svc; "
        "srv.pb_grpc = types.SimpleNamespace(add_KVStoreServicer_to_server=svc.add_to_server); "
        "from kvstored.main import main; sys.exit(main(sys.argv[1:]))"
    )

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.LAUNCH, *self.args]


SETTINGS = {"max_transfer_bytes": "1MiB", "metrics_listen": None}


pytestmark = pytest.mark.usefixtures("get_route")


@pytest.fixture(scope="module", params=["generated", "framed"])
def daemon(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    get_route: str,
    kv_client: ClientMaker,
) -> Iterator[Daemon]:
    """A daemon per server kind, get route and client driver."""
    kind = FramedDaemon if request.param == "framed" else Daemon
    d = kind(Path(tmp_path_factory.mktemp(f"kv-{request.param}")), SETTINGS,
             env={"KVSTORED_METRICS_LISTEN": "off"})  # fmt: skip
    d.start()
    yield d
    d.cleanup()


def prompt(first: int, n_blocks: int) -> list[int]:
    return list(range(first, first + n_blocks * BLOCK_TOKENS))


def blocks_of(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BB), dtype=np.uint8)


def leases(client: KVClient) -> int:
    return client.stats().leases


@pytest.mark.parametrize("use_arena", [True, False])
def test_inline_and_arena_round_trips_cross_chunk_and_call_limits(
    daemon: Daemon, use_arena: bool, kv_client: ClientMaker
) -> None:
    # 200 blocks of 8 KiB = 1.6 MiB: two Put calls and two Gets (1 MiB per call), and
    # chunks that end inside blocks
    tokens = prompt(1_000_000 + 100_000 * use_arena, 200)
    blocks = blocks_of(3, 200)
    with kv_client(daemon.addr, use_arena=use_arena) as client:
        ns = client.namespace("dp", BLOCK_TOKENS, BB)
        assert ns.put(tokens, blocks).stored == 200
        out = np.zeros((256, BB), np.uint8)
        got = ns.get(tokens, out=out)
        assert got.n_blocks == 200 and np.shares_memory(got.blocks, out)
        assert np.array_equal(out[:200], blocks) and not out[200:].any()
        assert leases(client) == 0  # stats first releases what the get left pending


def test_generated_stubs_read_and_write_the_same_wire(
    daemon: Daemon, kv_client: ClientMaker
) -> None:
    stub = kv_stub(daemon)
    info = open_ns(stub, model="dp-stub", block_tokens=BLOCK_TOKENS, block_bytes=BB)
    tokens = prompt(2_000_000, 40)
    reply, data = put_chain(stub, info, tokens, seed=5)
    assert reply.stored == 40
    header, got = get_chain(stub, info.ns_id, tokens)
    assert header.n_blocks == 40 and got == data
    with kv_client(daemon.addr, use_arena=False) as client:  # framed reader, either server
        assert client.open_namespace(info.ns_id).get(tokens).blocks.tobytes() == data


def test_acquire_gives_read_only_views_of_the_arena_under_a_lease(
    daemon: Daemon, kv_client: ClientMaker
) -> None:
    tokens = prompt(3_000_000, 6)
    blocks = blocks_of(4, 6)
    with kv_client(daemon.addr, use_arena=True) as client:
        ns = client.namespace("dp", BLOCK_TOKENS, BB)
        ns.put(tokens, blocks)
        with ns.acquire(tokens + [1, 2]) as lease:
            assert (lease.n_blocks, lease.tokens) == (6, 6 * BLOCK_TOKENS)
            arena = client._conn.arena.mapping.array()  # type: ignore[union-attr]
            for i, view in enumerate(lease.views):
                assert not view.flags.writeable and np.shares_memory(view, arena)
                assert np.array_equal(view, blocks[i])
            assert lease.blocks is not None and np.array_equal(lease.blocks, blocks)
            out = np.zeros((8, BB), np.uint8)
            assert np.array_equal(lease.copy_to(out), blocks)
            # a part of the lease: blocks 2..5 land in rows 0..3
            part = np.zeros((3, BB), np.uint8)
            assert np.array_equal(lease.copy_to(part, 2, 3), blocks[2:5])
            with pytest.raises(ValueError, match=r"blocks 4\.\.7 are outside the lease's 6"):
                lease.copy_to(out, 4, 3)
            with pytest.raises(ValueError, match="out holds 3 blocks, 4 are copied"):
                lease.copy_to(part, 2)
            assert leases(client) == 1
        assert lease.released
        with pytest.raises(RuntimeError, match="released"):
            _ = lease.views
        assert leases(client) == 0
        # a miss: nothing pinned, nothing to release
        with ns.acquire(prompt(3_100_000, 2)) as empty:
            assert empty.n_blocks == 0 and empty.views == []


def test_acquire_needs_the_arena(daemon: Daemon, kv_client: ClientMaker) -> None:
    with kv_client(daemon.addr, use_arena=False) as client:
        ns = client.namespace("dp", BLOCK_TOKENS, BB)
        with pytest.raises(ArenaUnavailableError):
            ns.acquire(prompt(3_200_000, 1))


def test_async_acquire_with_and_without_async_with(daemon: Daemon) -> None:
    tokens = prompt(4_000_000, 3)
    blocks = blocks_of(6, 3)

    async def main() -> None:
        async with AsyncKVClient(daemon.addr, use_arena=True) as client:
            ns = await client.namespace("dp", BLOCK_TOKENS, BB)
            await ns.put(tokens, blocks)
            async with ns.acquire(tokens) as lease:
                assert all(not v.flags.writeable for v in lease.views)
                assert np.array_equal(np.stack(lease.views), blocks)
                assert (await client.stats()).leases == 1
            assert (await client.stats()).leases == 0
            lease = await ns.acquire(tokens, max_blocks=2)
            assert lease.n_blocks == 2
            await lease.release()
            await lease.release()  # idempotent
            got = await ns.get(tokens, out=np.zeros((3, BB), np.uint8))
            assert np.array_equal(got.blocks, blocks)
            await asyncio.sleep(RELEASE_DELAY_S * 4)  # the pending release is sent
            with KVClient(daemon.addr) as other:
                assert other.stats().leases == 0

    asyncio.run(main())


def test_a_get_lease_rides_on_the_next_acquire_or_goes_within_the_delay(
    daemon: Daemon, kv_client: ClientMaker
) -> None:
    tokens = prompt(5_000_000, 4)
    with kv_client(daemon.addr, use_arena=True) as client, kv_client(daemon.addr) as watcher:
        ns = client.namespace("dp", BLOCK_TOKENS, BB)
        ns.put(tokens, blocks_of(7, 4))
        for _ in range(5):  # each get's lease is released by the next get's Acquire
            assert ns.get(tokens).n_blocks == 4
        assert watcher.stats().leases <= 1
        deadline = time.monotonic() + 5
        while watcher.stats().leases and time.monotonic() < deadline:
            time.sleep(RELEASE_DELAY_S)
        assert watcher.stats().leases == 0  # the flusher released the last one


def test_release_and_acquire_take_lists_of_leases(daemon: Daemon, kv_client: ClientMaker) -> None:
    stub = kv_stub(daemon)
    info = open_ns(stub, model="dp-leases", block_tokens=BLOCK_TOKENS, block_bytes=BB)
    tokens = prompt(6_000_000, 2)
    put_chain(stub, info, tokens)
    ids = [
        stub.Acquire(pb.AcquireRequest(ns_id=info.ns_id, tokens=tokens), timeout=5).lease_id
        for _ in range(4)
    ]
    assert stub.Stats(pb.StatsRequest(), timeout=5).leases == 4
    # an Acquire releases the listed leases first; ended or unknown ones are skipped
    again = stub.Acquire(
        pb.AcquireRequest(ns_id=info.ns_id, tokens=tokens, release_lease_ids=[ids[0], 12345]),
        timeout=5,
    )
    assert stub.Stats(pb.StatsRequest(), timeout=5).leases == 4
    stub.Release(pb.ReleaseRequest(lease_id=ids[1], more_lease_ids=[ids[2], ids[0]]), timeout=5)
    assert stub.Stats(pb.StatsRequest(), timeout=5).leases == 2
    stub.Release(pb.ReleaseRequest(lease_id=again.lease_id, more_lease_ids=[ids[3]]), timeout=5)
    assert stub.Stats(pb.StatsRequest(), timeout=5).leases == 0


def test_the_get_route_is_the_one_switched_on(
    daemon: Daemon, get_route: str, kv_client: ClientMaker
) -> None:
    """KVCLIENT_READS=pinned turns the slot epoch table off: every get pins."""
    with kv_client(daemon.addr, use_arena=True) as client:
        ns = client.namespace("route", BLOCK_TOKENS, BB)
        tokens = prompt(4_000_000, 2)
        ns.put(tokens, blocks_of(9, 2))
        assert ns.get(tokens).n_blocks == 2
        assert (client._conn.epochs is None) == (get_route == "pinned")
        known = client.stats().counters["known_slot_gets"]
        for _ in range(3):
            ns.get(tokens)
        later = client.stats().counters["known_slot_gets"]
        assert (later == known) == (get_route == "pinned")
