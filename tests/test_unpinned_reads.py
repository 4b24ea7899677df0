"""Unpinned gets: slot epochs in the store, the client's check, and the real daemon.

The promise under test: an unpinned get returns the blocks the daemon's answer names,
byte for byte, or falls back to a pinned get; it never returns bytes of a slot that
was freed, reused or being written while it copied.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import Daemon, kv_stub

from kvclient import AsyncKVClient, KVClient, unpinned_reads
from kvclient.arena_path import ClientArena
from kvclient.unpinned_reads import LastSlots, Slots, UnpinnedGet
from kvproto.v1 import kvstore_pb2 as pb
from kvstore.errors import InvalidArgument
from kvstore.host.mapping import ArenaMapping, map_arena
from kvstore.host.slot_epochs import SlotEpochs
from kvstore.keys import NamespaceSpec
from kvstore.store import Store, StoreConfig

BLOCK = 8192
TOKENS = 4


# -- the epoch table -------------------------------------------------------------------


def test_epoch_entries_spread_slots_of_any_stride() -> None:
    epochs = SlotEpochs(np.zeros(1 << 18, np.uint64))
    for stride in (4096, 256 << 10, 2 << 20):
        offsets = np.arange(8192, dtype=np.int64) * stride
        entries = epochs.entries(offsets)
        assert entries.min() >= 0 and entries.max() < epochs.count
        assert np.unique(entries).size > 8000  # a plain offset >> 6 would give 64 for 256 KiB
    assert np.array_equal(epochs.entries([4096, 8192]), epochs.entries(np.array([4096, 8192])))


def test_bumps_count_every_offset_even_in_one_entry() -> None:
    epochs = SlotEpochs(np.zeros(64, np.uint64))
    entry = epochs.entries([4096])
    epochs.bump([4096])
    epochs.bump([4096, 4096, 8192])
    assert int(epochs.read(entry)[0]) == 3
    assert int(epochs.read(epochs.entries([8192]))[0]) >= 1


@pytest.mark.parametrize("count", [0, 1, 3, 100])
def test_epoch_table_needs_a_power_of_two_of_uint64(count: int) -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        SlotEpochs(np.zeros(count, np.uint64))
    with pytest.raises(ValueError, match="power-of-two"):
        SlotEpochs(np.zeros(64, np.int64))


# -- the store ---------------------------------------------------------------------------


@pytest.fixture
def store() -> Iterator[Store]:
    with Store(StoreConfig(host_bytes=8 * BLOCK, shared_arena=False)) as s:
        yield s


def open_ns(store: Store) -> str:
    return store.open_namespace(NamespaceSpec("m", block_tokens=TOKENS, block_bytes=BLOCK)).ns_id


def payloads(tag: int, n: int) -> list[bytes]:
    return [bytes([(tag * 16 + i) % 251]) * BLOCK for i in range(n)]


def epoch_of(store: Store, offset: int) -> int:
    epochs = store.arena.epochs
    return int(epochs.read(epochs.entries([offset]))[0])


def test_commit_and_free_bump_the_slot_and_locate_reports_it(store: Store) -> None:
    ns = open_ns(store)
    keys = store.keys_for(ns, list(range(3 * TOKENS)))
    reservation = store.reserve(ns, keys)
    offsets = [slot.offset for slot in reservation.slots]
    before = [epoch_of(store, o) for o in offsets]
    store.commit(reservation.lease_id)
    ready = [epoch_of(store, o) for o in offsets]
    assert all(r > b for r, b in zip(ready, before, strict=True))  # ready: bumped

    located = store.locate(ns, keys)
    assert located is not None
    assert list(located.offsets) == offsets
    assert located.epochs.tolist() == ready
    assert store.stats().leases == 0  # nothing pinned

    store.delete(ns, keys, start=2)
    assert epoch_of(store, offsets[2]) > ready[2]  # freed: bumped again
    again = store.locate(ns, keys)
    assert again is not None and list(again.offsets) == offsets[:2]


@pytest.mark.parametrize("how", ["locate", "note_reads"])
def test_a_read_counts_hits_and_touches_the_prefix(store: Store, how: str) -> None:
    """locate (an unpinned read) and note_reads (reads a client served from slots it
    knew, reported afterwards) count and touch as a read does."""
    ns = open_ns(store)
    old = store.keys_for(ns, list(range(2 * TOKENS)))
    store.put(ns, old, payloads(1, 2))
    other = store.keys_for(ns, list(range(100, 100 + 6 * TOKENS)))
    store.put(ns, other, payloads(2, 6))  # the arena is full: 8 blocks
    hits = store.stats().tiers[0].hits
    if how == "locate":
        assert store.locate(ns, old) is not None  # touched: `other` is now older
        assert store.stats().tiers[0].hits == hits + 2
    else:
        assert store.note_reads(ns, old, reads=3) == 2
        assert store.stats().tiers[0].hits == hits + 6  # 3 reads of 2 blocks
        assert store.stats().counters["known_slot_gets"] == 3
    store.put(ns, store.keys_for(ns, list(range(200, 200 + 2 * TOKENS))), payloads(3, 2))
    assert store.lookup(ns, old).ready_blocks == 2  # the LRU victims came from `other`


def test_an_acquire_of_a_read_counted_already_pins_and_counts_nothing(store: Store) -> None:
    """acquire(count=False): the retry of a get whose unpinned answer was counted pins
    the same prefix, and its hits and misses are not counted a second time."""
    ns = open_ns(store)
    keys = store.keys_for(ns, list(range(5 * TOKENS)))
    store.put(ns, keys[:3], payloads(4, 3))
    before = store.stats()
    got = store.acquire(ns, keys, count=False)
    assert got is not None and got.lease_id and len(got.offsets) == 3
    after = store.stats()
    assert after.tiers == before.tiers and after.leases == before.leases + 1
    store.release(got.lease_id)
    counted = store.acquire(ns, keys)  # the same read, counted: 3 hits, 2 misses
    assert counted is not None
    host = store.stats().tiers[0]
    assert (host.hits, host.misses) == (before.tiers[0].hits + 3, before.tiers[0].misses + 2)
    store.release(counted.lease_id)


def test_note_reads_counts_only_blocks_still_in_host(store: Store) -> None:
    ns = open_ns(store)
    old = store.keys_for(ns, list(range(2 * TOKENS)))
    store.put(ns, old, payloads(1, 2))
    # blocks no longer in the host tier are not counted, nor anything after them
    store.delete(ns, old, start=1)
    assert store.note_reads(ns, old, reads=1) == 1
    store.delete(ns, old)
    assert store.note_reads(ns, old, reads=1) == 0
    hits = store.stats().tiers[0].hits
    with pytest.raises(InvalidArgument, match="block keys"):
        store.note_reads(ns, [b"short"], reads=1)
    assert store.stats().tiers[0].hits == hits


def test_locate_answers_none_for_a_block_on_disk_only(tmp_path) -> None:  # noqa: ANN001
    config = StoreConfig(
        host_bytes=4 * BLOCK, shared_arena=False, disk_dir=str(tmp_path), disk_bytes=1 << 24
    )
    with Store(config) as s:
        ns = open_ns(s)
        first = s.keys_for(ns, list(range(2 * TOKENS)))
        s.put(ns, first, payloads(1, 2))
        s.put(ns, s.keys_for(ns, list(range(50, 50 + 4 * TOKENS))), payloads(2, 4))
        s.flush()
        assert s.lookup(ns, first).disk_blocks > 0
        assert s.locate(ns, first) is None
        assert s.stats().leases == 0


# -- the client's check, against a store in this process ---------------------------------


class _Harness:
    """A store with a shared arena, and the client's view of it."""

    def __init__(self, tmp_path) -> None:  # noqa: ANN001
        self.store = Store(
            StoreConfig(host_bytes=8 * BLOCK, arena_dir=str(tmp_path), shared_arena=True)
        )
        self.ns = open_ns(self.store)
        path = self.store.arena_path
        assert path is not None
        self.arena = ClientArena(map_arena(path), path, None)
        mapping: ArenaMapping = self.arena.mapping
        region = self.store.arena.regions[""]
        self.epochs = SlotEpochs.in_region(
            mapping.array(), region.epochs_offset, region.epoch_count
        )

    def answer(self, keys: list) -> pb.AcquireResponse:  # noqa: ANN401
        located = self.store.locate(self.ns, keys)
        assert located is not None
        msg = pb.AcquireResponse()
        msg.slot_offsets.extend(located.offsets)
        msg.slot_epochs.extend(located.epochs.tolist())
        return msg

    def slots(self, answer: pb.AcquireResponse) -> Slots:
        offsets = np.array(answer.slot_offsets, np.int64)
        return Slots.of(offsets, self.epochs, BLOCK, np.array(answer.slot_epochs, np.uint64))

    def stored(self, first_token: int, tag: int, n: int) -> list:
        """Keys of ``n`` blocks from ``first_token`` on, put with payloads of ``tag``."""
        keys = self.store.keys_for(self.ns, list(range(first_token, first_token + n * TOKENS)))
        self.store.put(self.ns, keys, payloads(tag, n))
        return keys

    def copied_early(self, last: Slots | None) -> UnpinnedGet:
        """A get that copied the slots it remembered (``last``) before any answer."""
        get = UnpinnedGet(self.epochs, self.arena, last, None, BLOCK, 0, 0)
        get.copy_early()
        return get

    @staticmethod
    def finished(get: UnpinnedGet, answer: pb.AcquireResponse) -> bytes:
        """The bytes a get returns, finished with ``answer`` (it must trust them)."""
        done = get.finish(answer)
        assert done is not None
        return bytes(done[0].tobytes())

    def close(self) -> None:
        self.arena.close()
        self.store.close()


@pytest.fixture
def harness(tmp_path) -> Iterator[_Harness]:  # noqa: ANN001
    h = _Harness(tmp_path)
    yield h
    h.close()


def test_early_copy_of_unchanged_slots_is_kept(harness: _Harness) -> None:
    keys = harness.stored(0, 1, 3)
    get = harness.copied_early(harness.slots(harness.answer(keys)))
    assert harness.finished(get, harness.answer(keys)) == b"".join(payloads(1, 3))


def test_slots_reused_by_other_blocks_before_the_answer_are_copied_again(
    harness: _Harness,
) -> None:
    s, ns = harness.store, harness.ns
    keys = harness.stored(0, 1, 2)
    get = harness.copied_early(harness.slots(harness.answer(keys)))  # blocks of tag 1 ...
    s.delete(ns, keys)  # ... whose slots now go to other blocks
    harness.stored(500, 7, 2)
    s.put(ns, keys, payloads(1, 2))  # the prefix is back, in other slots or the same
    assert harness.finished(get, harness.answer(keys)) == b"".join(payloads(1, 2))


def test_an_early_copy_of_another_block_in_the_same_slot_is_not_kept(
    harness: _Harness,
) -> None:
    s, ns = harness.store, harness.ns
    a = harness.stored(0, 1, 2)
    last = harness.slots(harness.answer(a))
    s.delete(ns, a)
    b = harness.stored(700, 2, 2)  # b takes a's slots ...
    assert harness.slots(harness.answer(b)).offsets.tolist() == last.offsets.tolist()
    get = harness.copied_early(last)  # ... so this copies b's bytes
    s.delete(ns, b)
    s.put(ns, a, payloads(1, 2))  # and a is back in the very same slots
    answer = harness.answer(a)
    assert list(answer.slot_offsets) == last.offsets.tolist()
    assert harness.finished(get, answer) == b"".join(payloads(1, 2))


def test_a_slot_rewritten_during_the_copy_is_never_returned(harness: _Harness) -> None:
    s, ns = harness.store, harness.ns
    keys = harness.stored(0, 1, 2)
    answer = harness.answer(keys)  # the daemon answered: slots and epochs
    get = harness.copied_early(None)  # nothing remembered: the copy happens in finish

    real_read = harness.epochs.read
    calls = 0

    def read_then_reuse(entries: np.ndarray) -> np.ndarray:
        # the slots are freed and reused between the answer and the check after the copy
        nonlocal calls
        calls += 1
        s.delete(ns, keys)
        s.put(ns, s.keys_for(ns, list(range(900, 900 + 2 * TOKENS))), payloads(9, 2))
        return real_read(entries)

    harness.epochs.read = read_then_reuse  # type: ignore[method-assign]
    assert get.finish(answer) is None  # not trusted: the caller pins
    assert calls == 1


def test_last_slots_are_bounded_and_forget_empty_answers() -> None:
    last = LastSlots(entries=2)
    epochs = SlotEpochs(np.zeros(64, np.uint64))
    keys = [LastSlots.key("ns", np.arange(i, i + 4), [], 0) for i in range(3)]
    for key in keys:
        offsets = np.array([0, 8192], np.int64)
        last.remember(key, Slots.of(offsets, epochs, BLOCK, np.zeros(2, np.uint64)))
    assert last.get(keys[0]) is None and last.get(keys[2]) is not None
    none = np.array([], np.int64)
    last.remember(keys[2], Slots.of(none, epochs, BLOCK, np.array([], np.uint64)))
    assert last.get(keys[2]) is None
    assert LastSlots.key("ns", np.arange(4), [b"x"], 0) != LastSlots.key("ns", np.arange(4), [], 0)


# -- the real daemon ----------------------------------------------------------------------


def block_of(prompt: int, index: int, size: int) -> np.ndarray:
    return np.full(size, (prompt * 31 + index * 7) % 251, dtype=np.uint8)


def test_unpinned_acquire_answers_epochs_and_no_lease(kvstored: Daemon) -> None:
    stub = kv_stub(kvstored)
    info = stub.ServerInfo(pb.ServerInfoRequest(), timeout=10)
    assert info.slot_epochs_count > 0 and info.slot_epochs_offset >= info.arena_bytes
    assert info.arena_prefaulted  # the default: the daemon faults its pages in
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("raw", block_tokens=TOKENS, block_bytes=BLOCK)
        ns.put(np.arange(2 * TOKENS), np.stack([block_of(3, i, BLOCK) for i in range(2)]))
        request = pb.AcquireRequest(
            ns_id=ns.ns_id, tokens=list(range(2 * TOKENS)), compact_slots=True, unpinned=True
        )
        answer = stub.Acquire(request, timeout=10)
        assert answer.lease_id == 0 and len(answer.slot_offsets) == 2
        assert len(answer.slot_epochs) == 2 and min(answer.slot_epochs) > 0
        request.unpinned = False
        pinned = stub.Acquire(request, timeout=10)
        assert pinned.lease_id != 0 and not pinned.slot_epochs

        # unpinned without compact_slots: refused, and the lease to release is kept
        bad = pb.AcquireRequest(
            ns_id=ns.ns_id,
            tokens=list(range(2 * TOKENS)),
            unpinned=True,
            release_lease_ids=[pinned.lease_id],
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub.Acquire(bad, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unpinned needs compact_slots" in (refused.value.details() or "")
        assert client.stats().leases == 1
        bad.compact_slots, bad.ttl_s = True, -1.0  # a bad ttl: refused the same way
        with pytest.raises(grpc.RpcError) as refused:
            stub.Acquire(bad, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ttl_s must be" in (refused.value.details() or "")
        assert client.stats().leases == 1
        stub.Release(pb.ReleaseRequest(lease_id=pinned.lease_id), timeout=10)
        assert client.stats().leases == 0


def test_server_info_says_when_the_arena_is_not_prefaulted(kvstored_factory) -> None:  # noqa: ANN001
    daemon = kvstored_factory(prefault_arena="false")
    info = kv_stub(daemon).ServerInfo(pb.ServerInfoRequest(), timeout=10)
    assert not info.arena_prefaulted and info.slot_epochs_count > 0
    with KVClient(daemon.addr) as client:
        ns = client.namespace("lazy", block_tokens=TOKENS, block_bytes=BLOCK)
        block = block_of(4, 0, BLOCK)[None, :]
        ns.put(np.arange(TOKENS), block)
        assert np.array_equal(ns.get(np.arange(TOKENS)).blocks, block)


def test_gets_through_the_daemon_pin_nothing(kvstored: Daemon) -> None:
    with KVClient(kvstored.addr) as client, KVClient(kvstored.addr) as observer:
        ns = client.namespace("unpinned", block_tokens=TOKENS, block_bytes=BLOCK)
        tokens = np.arange(6 * TOKENS)
        blocks = np.stack([block_of(1, i, BLOCK) for i in range(6)])
        ns.put(tokens, blocks)
        out = np.zeros_like(blocks)
        for _ in range(3):  # the first get learns the slots, the others copy early
            got = ns.get(tokens, out=out)
            assert got.tokens == 6 * TOKENS and np.array_equal(got.blocks, blocks)
            # a pinned get leaves its lease to be released later; the observer's Stats
            # does not release this client's leases
            assert observer.stats().leases == 0
        assert np.array_equal(ns.get(tokens).blocks, blocks)  # no out: a new array

        # the answer, not the remembered slots, says how long the prefix is
        longer = np.arange(8 * TOKENS)
        ns.put(longer, np.stack([block_of(1, i, BLOCK) for i in range(6, 8)]), start=6)
        assert ns.get(longer).tokens == 8 * TOKENS
        ns.delete(tokens[: 4 * TOKENS], start=3)
        got = ns.get(longer)
        assert got.tokens == 3 * TOKENS
        assert np.array_equal(got.blocks, blocks[:3])


@pytest.mark.parametrize("client_kind", ["sync", "async"])
def test_a_get_whose_unpinned_copy_fails_its_check_counts_once(
    kvstored: Daemon, monkeypatch: pytest.MonkeyPatch, client_kind: str
) -> None:
    """The check of an unpinned copy fails (a slot changed under it: forced here in
    the client), so the get acquires again, pinned: the daemon counted the first
    answer, and must not count the same get again."""
    tokens = np.arange(4 * TOKENS)
    blocks = np.stack([block_of(7, i, BLOCK) for i in range(4)])
    with KVClient(kvstored.addr) as writer:
        writer.namespace("once", block_tokens=TOKENS, block_bytes=BLOCK).put(tokens, blocks)
        before = writer.stats().tier("host")
    checks: list[object] = []

    def fails_its_check(self: UnpinnedGet, answer: object) -> None:
        checks.append(answer)
        return None

    monkeypatch.setattr(UnpinnedGet, "finish", fails_its_check)
    longer = np.arange(6 * TOKENS)  # 4 blocks cached, 2 not: hits and misses
    if client_kind == "sync":
        with KVClient(kvstored.addr) as client:
            ns = client.namespace("once", block_tokens=TOKENS, block_bytes=BLOCK)
            got = ns.get(longer)
            after = client.stats().tier("host")
    else:

        async def run() -> tuple[object, object]:
            async with AsyncKVClient(kvstored.addr) as client:
                ns = await client.namespace("once", block_tokens=TOKENS, block_bytes=BLOCK)
                return await ns.get(longer), (await client.stats()).tier("host")

        got, after = asyncio.run(run())
    assert len(checks) == 1  # the unpinned answer came, and was not used
    assert got.tokens == 4 * TOKENS and np.array_equal(got.blocks, blocks)  # pinned retry
    assert (after.hits, after.misses) == (before.hits + 4, before.misses + 2)


def test_async_gets_are_unpinned_too(kvstored: Daemon) -> None:
    async def run() -> None:
        async with AsyncKVClient(kvstored.addr) as client:
            ns = await client.namespace("async-unpinned", block_tokens=TOKENS, block_bytes=BLOCK)
            tokens = np.arange(4 * TOKENS)
            blocks = np.stack([block_of(5, i, BLOCK) for i in range(4)])
            await ns.put(tokens, blocks)
            out = np.zeros_like(blocks)
            with KVClient(kvstored.addr) as observer:
                for _ in range(3):
                    got = await ns.get(tokens, out=out)
                    assert got.tokens == 4 * TOKENS and np.array_equal(got.blocks, blocks)
                    assert observer.stats().leases == 0
            await ns.delete(tokens, start=1)
            got = await ns.get(tokens, out=out)
            assert got.tokens == TOKENS and np.array_equal(got.blocks, blocks[:1])

    asyncio.run(run())


def test_concurrent_eviction_never_returns_other_bytes(
    kvstored_factory,
    monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    """A writer cycles prompts through a small arena (each put evicts others) while a
    reader gets them: every block returned is the one asked for. The race this guards
    must happen: the reader's copies are slowed (as on a loaded host) and it goes on
    until some of them failed their epoch check and were read again, pinned (the
    daemon's ``repeated_gets``)."""
    daemon = kvstored_factory(host_bytes="4MiB", disk_bytes=0)
    copy = unpinned_reads.read_runs

    def slow_copy(*args: Any, **kwargs: Any) -> None:
        copy(*args, **kwargs)
        time.sleep(0.002)  # the slot may be evicted and refilled meanwhile

    monkeypatch.setattr(unpinned_reads, "read_runs", slow_copy)
    size, n_blocks, prompts = 512 << 10, 2, 10  # 10 MiB of prompts in a 4 MiB arena
    stop = threading.Event()
    errors: list[str] = []

    def tokens_of(prompt: int) -> np.ndarray:
        return np.arange(n_blocks * TOKENS) + prompt * 1000

    def write() -> None:
        with KVClient(daemon.addr) as client:
            ns = client.namespace("churn", block_tokens=TOKENS, block_bytes=size)
            p = 0
            while not stop.is_set():
                ns.put(tokens_of(p), np.stack([block_of(p, i, size) for i in range(n_blocks)]))
                p = (p + 1) % prompts

    checked = repeated = 0
    writer = threading.Thread(target=write)
    writer.start()
    try:
        with KVClient(daemon.addr) as client:
            ns = client.namespace("churn", block_tokens=TOKENS, block_bytes=size)
            out = np.empty((n_blocks, size), np.uint8)
            deadline = time.monotonic() + 60.0
            p = gets = 0
            while time.monotonic() < deadline and (repeated < 3 or checked < 200):
                got = ns.get(tokens_of(p), out=out)
                for i in range(got.tokens // TOKENS):
                    if not np.array_equal(got.blocks[i], block_of(p, i, size)):
                        errors.append(f"prompt {p} block {i}: wrong bytes")
                checked += got.tokens // TOKENS
                p = (p + 3) % prompts
                gets += 1
                if gets % 50 == 0:
                    repeated = client.stats().counters["repeated_gets"]
    finally:
        stop.set()
        writer.join(timeout=30)
    assert not errors, errors[:5]
    assert checked > 0
    assert repeated >= 3, f"{repeated} of {gets} gets failed their check in 60 s: no race ran"


# -- gets from known slots: no call at all -----------------------------------------------


def test_a_complete_prefix_is_read_from_known_slots_without_a_call(kvstored: Daemon) -> None:
    """Once an answer named every block a get asks for, the same get copies those slots
    while their epochs say they still hold them: it needs no daemon at all (stopped
    here), and the daemon counts the reads afterwards."""
    assert kvstored.proc is not None
    with KVClient(kvstored.addr) as client, KVClient(kvstored.addr) as observer:
        ns = client.namespace("known", block_tokens=TOKENS, block_bytes=BLOCK)
        tokens = np.arange(3 * TOKENS)
        blocks = np.stack([block_of(2, i, BLOCK) for i in range(3)])
        ns.put(tokens, blocks)
        out = np.zeros_like(blocks)
        assert ns.get(tokens, out=out).tokens == 3 * TOKENS  # learns the slots
        hits = client.stats().tier("host").hits
        kvstored.proc.send_signal(signal.SIGSTOP)
        try:
            for _ in range(5):
                out[:] = 0
                got = ns.get(tokens, out=out)
                assert got.tokens == 3 * TOKENS and np.array_equal(got.blocks, blocks)
        finally:
            kvstored.proc.send_signal(signal.SIGCONT)
        assert client.stats().tier("host").hits == hits + 15  # reported before Stats

        # another client sees them within the report delay, without this client calling
        ns.get(tokens, out=out)
        deadline = time.monotonic() + 5
        while observer.stats().tier("host").hits < hits + 18 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert observer.stats().tier("host").hits == hits + 18

        # a delete by another client frees the slots: the next get asks the daemon
        observer.open_namespace(ns.ns_id).delete(tokens, start=1)
        got = ns.get(tokens, out=out)
        assert got.tokens == TOKENS and np.array_equal(got.blocks, blocks[:1])


def test_a_partial_prefix_is_always_asked_for(kvstored: Daemon) -> None:
    """An answer short of what the get asks for may grow: the next get asks again."""
    with KVClient(kvstored.addr) as client, KVClient(kvstored.addr) as writer:
        ns = client.namespace("partial", block_tokens=TOKENS, block_bytes=BLOCK)
        tokens = np.arange(4 * TOKENS)
        blocks = np.stack([block_of(6, i, BLOCK) for i in range(4)])
        ns.put(tokens, blocks[:2])
        assert ns.get(tokens).tokens == 2 * TOKENS
        assert ns.get(tokens).tokens == 2 * TOKENS
        writer.open_namespace(ns.ns_id).put(tokens, blocks[2:], start=2)
        got = ns.get(tokens)
        assert got.tokens == 4 * TOKENS and np.array_equal(got.blocks, blocks)
        # a shorter out asks for fewer blocks: complete at its size, and kept apart
        out = np.zeros((1, BLOCK), np.uint8)
        for _ in range(2):
            got = ns.get(tokens, out=out)
            assert got.tokens == TOKENS and np.array_equal(got.blocks, blocks[:1])


def test_async_gets_read_known_slots_and_report_them(kvstored: Daemon) -> None:
    async def run() -> None:
        async with AsyncKVClient(kvstored.addr) as client:
            ns = await client.namespace("async-known", block_tokens=TOKENS, block_bytes=BLOCK)
            tokens = np.arange(2 * TOKENS)
            blocks = np.stack([block_of(8, i, BLOCK) for i in range(2)])
            await ns.put(tokens, blocks)
            await ns.get(tokens)
            hits = (await client.stats()).tier("host").hits
            assert kvstored.proc is not None
            kvstored.proc.send_signal(signal.SIGSTOP)
            try:
                for _ in range(3):
                    got = await ns.get(tokens)
                    assert np.array_equal(got.blocks, blocks)
            finally:
                kvstored.proc.send_signal(signal.SIGCONT)
            assert (await client.stats()).tier("host").hits == hits + 6

    asyncio.run(run())


def test_report_reads_refuses_bad_prefixes_and_changes_nothing(kvstored: Daemon) -> None:
    stub = kv_stub(kvstored)
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("report", block_tokens=TOKENS, block_bytes=BLOCK)
        tokens = list(range(2 * TOKENS))
        ns.put(np.array(tokens), np.stack([block_of(1, i, BLOCK) for i in range(2)]))
        good = pb.PrefixReads(ns_id=ns.ns_id, tokens=tokens, n_blocks=2, reads=2)
        cases = [
            (
                pb.PrefixReads(ns_id=ns.ns_id, tokens=tokens, n_blocks=3, reads=1),
                grpc.StatusCode.INVALID_ARGUMENT,
                "prefixes[1]: n_blocks=3",
            ),
            (
                pb.PrefixReads(ns_id="no-such-ns", tokens=tokens, n_blocks=1, reads=1),
                grpc.StatusCode.NOT_FOUND,
                "no-such-ns",
            ),
            (
                pb.PrefixReads(tokens=tokens, n_blocks=1, reads=1),
                grpc.StatusCode.INVALID_ARGUMENT,
                "ns_id is required",
            ),
        ]
        # a read lease the reports carry for release (the batched accounting message)
        held = stub.Acquire(pb.AcquireRequest(ns_id=ns.ns_id, tokens=tokens), timeout=10)
        leases = client.stats().leases
        hits = client.stats().tier("host").hits
        for bad, code, words in cases:
            request = pb.ReportReadsRequest(prefixes=[good, bad], release_lease_ids=[held.lease_id])
            with pytest.raises(grpc.RpcError) as refused:
                stub.ReportReads(request, timeout=10)
            assert refused.value.code() == code
            assert words in (refused.value.details() or "")
            assert client.stats().tier("host").hits == hits  # the good one was not counted
            assert client.stats().leases == leases  # nor the lease released
        request = pb.ReportReadsRequest(prefixes=[good], release_lease_ids=[held.lease_id])
        answer = stub.ReportReads(request, timeout=10)
        assert answer.blocks_counted == 4
        assert client.stats().tier("host").hits == hits + 4
        assert client.stats().leases == leases - 1
