"""The store on the host tier: put/read, leases, pending blocks, eviction order.

Disk-tier behaviour (demotion, promotion, restart, corruption) is in test_store_disk.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvproto.v1.results import Event
from kvstore.errors import InvalidArgument, LeaseError, UnknownNamespace
from kvstore.keys import NamespaceSpec
from kvstore.results import EventKind, Tier
from kvstore.store import Store, StoreConfig
from kvstore.tenants import tenant_salt

BLOCK = 4096
TOKENS = 4  # tokens per block


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def payload(tag: int) -> bytes:
    return bytes([tag % 251]) * BLOCK


def make_store(blocks: int, clock: FakeClock | None = None, **config: object) -> Store:
    cfg = StoreConfig(host_bytes=blocks * BLOCK, shared_arena=False, **config)  # type: ignore[arg-type]
    return Store(cfg, clock=clock) if clock else Store(cfg)


@pytest.fixture
def store() -> Iterator[Store]:
    with make_store(16) as s:
        yield s


def open_ns(store: Store, **kw: object) -> str:
    return store.open_namespace(
        NamespaceSpec("m", block_tokens=TOKENS, block_bytes=BLOCK, **kw)
    ).ns_id  # type: ignore[arg-type]


def chain(store: Store, ns: str, *tokens: int) -> list:
    return store.keys_for(ns, list(tokens))


def seq(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * TOKENS))


def test_put_then_read_round_trip(store: Store) -> None:
    ns = open_ns(store)
    keys = store.keys_for(ns, seq(0, 5))
    assert store.put(ns, keys, [payload(i) for i in range(5)]).stored == 5
    n, data = store.read(ns, keys)
    assert n == 5
    assert bytes(data) == b"".join(payload(i) for i in range(5))


def test_read_into_caller_buffer(store: Store) -> None:
    ns = open_ns(store)
    keys = store.keys_for(ns, seq(0, 3))
    store.put(ns, keys, [payload(i) for i in range(3)])
    out = bytearray(4 * BLOCK)  # room for 4, only 3 stored
    n, view = store.read(ns, store.keys_for(ns, seq(0, 4)), out=memoryview(out))
    assert n == 3 and bytes(view) == bytes(out[: 3 * BLOCK])
    with pytest.raises(InvalidArgument, match="writable buffer"):
        store.read(ns, keys, out=memoryview(bytearray(BLOCK)))


def test_lookup_stops_at_divergence(store: Store) -> None:
    ns = open_ns(store)
    base = seq(0, 4)
    store.put(ns, store.keys_for(ns, base), [payload(i) for i in range(4)])
    other = base[:9] + [999] + base[10:]  # differs inside block 2
    result = store.lookup(ns, store.keys_for(ns, other))
    assert (result.ready_blocks, result.host_blocks, result.disk_blocks) == (2, 2, 0)


def test_put_suffix_needs_stored_parent(store: Store) -> None:
    ns = open_ns(store)
    keys = store.keys_for(ns, seq(0, 4))
    # blocks 2..3 offered without blocks 0..1 stored: refused, nothing changes
    result = store.put(ns, keys, [payload(2), payload(3)], start=2)
    assert (result.stored, result.refused) == (0, 2)
    assert store.stats().tiers[0].blocks == 0
    # with the parents stored, the suffix is accepted and existing blocks are not rewritten
    store.put(ns, keys[:2], [payload(0), payload(1)])
    result = store.put(ns, keys, [payload(1), payload(2), payload(3)], start=1)
    assert (result.stored, result.existing, result.refused) == (2, 1, 0)
    assert bytes(store.read(ns, keys)[1]) == b"".join(payload(i) for i in range(4))


def test_bad_payload_size_changes_nothing(store: Store) -> None:
    ns = open_ns(store)
    keys = store.keys_for(ns, seq(0, 2))
    before = store.stats()
    with pytest.raises(InvalidArgument, match="payload 1 is 10 bytes"):
        store.put(ns, keys, [payload(0), b"x" * 10])
    assert store.stats() == before


def test_unknown_namespace(store: Store) -> None:
    with pytest.raises(UnknownNamespace):
        store.lookup("nope@000000000000", [])


def test_too_many_blocks_refused() -> None:
    with make_store(4, max_blocks_per_request=3) as s:
        ns = open_ns(s)
        with pytest.raises(InvalidArgument, match="max_blocks_per_request=3"):
            s.keys_for(ns, seq(0, 4))


def test_reserve_commit_in_chunks_and_abandon(store: Store) -> None:
    ns = open_ns(store)
    keys = store.keys_for(ns, seq(0, 4))
    res = store.reserve(ns, keys)
    assert [s.index for s in res.slots] == [0, 1, 2, 3]
    # pending blocks are visible to lookups, none is ready yet
    assert len(store.lookup(ns, keys).pending_keys) == 4
    arena = store.arena.array()
    for slot in res.slots[:2]:
        arena[slot.offset : slot.offset + BLOCK] = np.frombuffer(payload(slot.index), np.uint8)
    assert store.commit(res.lease_id, count=2) == 2  # a chunked prefill commits as it goes
    look = store.lookup(ns, keys)
    assert look.ready_blocks == 2 and len(look.pending_keys) == 2
    assert store.abandon(res.lease_id) == 2
    assert store.lookup(ns, keys) == store.lookup(ns, keys[:2])
    assert store.stats().tiers[0].used_bytes == 2 * BLOCK  # abandoned slots are free again
    kinds = [e.kind for e in store.events_since(0)]
    assert kinds.count(EventKind.STORED) == 2 and kinds.count(EventKind.PENDING_DROPPED) == 2
    with pytest.raises(LeaseError, match="abandoned"):
        store.commit(res.lease_id)


def test_second_claimant_sees_pending_and_writes_nothing(store: Store) -> None:
    ns = open_ns(store)
    keys = store.keys_for(ns, seq(0, 3))
    first = store.reserve(ns, keys)
    second = store.reserve(ns, keys)
    assert second.slots == () and second.refused == 3
    store.commit(first.lease_id)
    assert store.reserve(ns, keys).existing == 3


def test_expired_write_lease_drops_pending_blocks() -> None:
    clock = FakeClock()
    with make_store(8, clock) as s:
        ns = open_ns(s)
        keys = s.keys_for(ns, seq(0, 2))
        res = s.reserve(ns, keys, ttl_s=5)
        clock.now += 6  # the owner died; its lease runs out
        assert s.lookup(ns, keys).pending_keys == ()
        assert s.stats().tiers[0].used_bytes == 0
        with pytest.raises(LeaseError, match="expired"):
            s.commit(res.lease_id)


def test_acquire_pins_against_eviction_and_release_twice_fails() -> None:
    with make_store(4) as s:
        ns = open_ns(s)
        a = s.keys_for(ns, seq(0, 2))
        s.put(ns, a, [payload(0), payload(1)])
        lease = s.acquire(ns, a)
        assert len(lease.slots) == 2
        # host holds 4 blocks; 2 are leased, so a put of 3 more gets only 2 in
        b = s.keys_for(ns, seq(1000, 3))
        assert s.put(ns, b, [payload(i) for i in range(3)]).stored == 2
        assert s.lookup(ns, a).ready_blocks == 2
        s.release(lease.lease_id)
        with pytest.raises(LeaseError, match="released"):
            s.release(lease.lease_id)
        with pytest.raises(LeaseError, match="unknown"):
            s.release(12345)


def test_full_store_refuses_put_and_keeps_serving_reads() -> None:
    with make_store(2) as s:
        ns = open_ns(s)
        a = s.keys_for(ns, seq(0, 2))
        s.put(ns, a, [payload(0), payload(1)])
        lease = s.acquire(ns, a)  # everything pinned: nothing can be evicted
        result = s.put(ns, s.keys_for(ns, seq(500, 1)), [payload(9)])
        assert (result.stored, result.refused) == (0, 1)
        assert s.read(ns, a)[0] == 2
        s.release(lease.lease_id)


def test_leaf_first_keeps_the_shared_prefix() -> None:
    with make_store(6) as s:
        ns = open_ns(s)
        # a 2-block system prompt, then continuations of 1 block each
        system = seq(0, 2)
        s.put(ns, s.keys_for(ns, system), [payload(0), payload(1)])
        for i in range(10):
            keys = s.keys_for(ns, system + seq(100 * (i + 1), 1))
            s.put(ns, keys, [payload(10 + i)], start=2)
        # host holds 6 blocks: the prompt (2) + the 4 newest continuations
        assert s.lookup(ns, s.keys_for(ns, system)).ready_blocks == 2
        newest = s.keys_for(ns, system + seq(1000, 1))
        assert s.lookup(ns, newest).ready_blocks == 3


def test_priority_orders_eviction_and_expires() -> None:
    clock = FakeClock()
    with make_store(3, clock) as s:
        ns = open_ns(s)
        a, b, c = (s.keys_for(ns, seq(1000 * i, 1)) for i in range(1, 4))
        s.put(ns, a, [payload(1)], priority=80)  # oldest but important
        s.put(ns, b, [payload(2)])
        s.put(ns, c, [payload(3)], priority=10)  # newest but unimportant
        s.put(ns, s.keys_for(ns, seq(9000, 1)), [payload(4)])
        assert [s.lookup(ns, k).ready_blocks for k in (a, b, c)] == [1, 1, 0]
        # a's high priority lasts 10 s, then it is an ordinary (and the oldest) block
        s.set_priority(ns, a, 80, duration_s=10)
        clock.now += 11
        s.put(ns, s.keys_for(ns, seq(9500, 1)), [payload(5)])
        assert s.lookup(ns, a).ready_blocks == 0
        assert s.lookup(ns, b).ready_blocks == 1


def test_bad_priority_refused(store: Store) -> None:
    ns = open_ns(store)
    keys = store.keys_for(ns, seq(0, 1))
    for bad in (-1, 101, 1.5):
        with pytest.raises(InvalidArgument, match="priority"):
            store.put(ns, keys, [payload(0)], priority=bad)  # type: ignore[arg-type]


def test_delete_removes_subtree_but_keeps_leased(store: Store) -> None:
    ns = open_ns(store)
    base = seq(0, 2)
    left = store.keys_for(ns, base + seq(100, 2))
    right = store.keys_for(ns, base + seq(200, 2))
    store.put(ns, left, [payload(i) for i in range(4)])
    store.put(ns, right, [payload(i) for i in range(2, 4)], start=2)
    lease = store.acquire(ns, right)
    # deleting from block 1 removes left's tail, keeps right (leased) and its ancestors
    assert store.delete(ns, left, start=1) == 2
    assert store.lookup(ns, left).ready_blocks == 2
    assert store.lookup(ns, right).ready_blocks == 4
    store.release(lease.lease_id)
    assert store.clear(ns) == 4
    assert store.stats().tiers[0].used_bytes == 0


def test_wait_ready_wakes_on_commit(store: Store) -> None:
    ns = open_ns(store)
    keys = store.keys_for(ns, seq(0, 2))
    res = store.reserve(ns, keys)
    timer = threading.Timer(0.1, store.commit, args=(res.lease_id,))
    timer.start()
    result = store.wait_ready(ns, keys, timeout=5)
    timer.join()
    assert result.ready_blocks == 2 and result.pending_keys == ()


def test_events_have_increasing_sequence_numbers(store: Store) -> None:
    ns = open_ns(store)
    store.put(ns, store.keys_for(ns, seq(0, 3)), [payload(i) for i in range(3)])
    events = store.events_since(0)
    assert [e.seq for e in events] == [1, 2, 3]
    assert store.events_since(3, timeout=0.01) == []
    assert [e.seq for e in store.events_since(1)] == [2, 3]
    keys = store.keys_for(ns, seq(0, 3))
    assert all(isinstance(e, Event) for e in events)
    assert [(e.kind, e.ns_id, e.key, e.tier) for e in events] == [
        (EventKind.STORED, ns, k, Tier.HOST) for k in keys
    ]


def test_each_tenant_has_a_ring_of_events_of_its_own() -> None:
    # a's churn (more events than the ring holds) leaves b's events whole, and each
    # tenant's are numbered on their own; every event's ring holds them all
    with make_store(64, event_buffer=16) as s:
        ns_a = open_ns(s, tenant_salt=tenant_salt("a", ""))
        ns_b = open_ns(s, tenant_salt=tenant_salt("b", ""))
        s.put(ns_b, s.keys_for(ns_b, seq(0, 4)), [payload(i) for i in range(4)])
        for start in range(0, 40 * TOKENS, 4 * TOKENS):
            s.put(ns_a, s.keys_for(ns_a, seq(start + 1, 4)), [payload(i) for i in range(4)])
        assert [e.seq for e in s.events_since(0, tenant="b")] == [1, 2, 3, 4]
        assert {e.ns_id for e in s.events_since(0, tenant="b")} == {ns_b}
        assert [e.seq for e in s.events_since(0, tenant="a")] == list(range(25, 41))
        assert s.last_event_seq("a") == 40 and s.last_event_seq() == 44
        assert s.events_since(0, tenant="c") == [] and s.last_event_seq("c") == 0


def test_used_never_exceeds_capacity_under_churn() -> None:
    rng = np.random.default_rng(7)
    with make_store(8) as s:
        ns = open_ns(s)
        for _ in range(300):
            start = int(rng.integers(0, 50)) * 1000
            n = int(rng.integers(1, 6))
            keys = s.keys_for(ns, seq(start, n))
            s.put(ns, keys, [payload(i) for i in range(n)])
            host = s.stats().tiers[0]
            assert host.used_bytes <= host.capacity_bytes
            assert host.blocks * BLOCK == host.used_bytes


def run_seed_workload(policy: str) -> tuple[int, int]:
    """A system prompt with many continuations under memory pressure.

    The engine offloads the 4-block system prompt once, then each request offloads only
    its own 2 new blocks (put with start=4), as engines that keep the hot prefix on the
    GPU do; between them, other users store unrelated 1-block prompts. The host tier
    holds 12 blocks; the workload needs 64. Returns (system prompt blocks still usable,
    blocks of the 2 newest continuations still usable).
    """
    with make_store(12, eviction_policy=policy) as s:
        ns = open_ns(s)
        system = seq(0, 4)
        s.put(ns, s.keys_for(ns, system), [payload(i) for i in range(4)])
        conts = [system + seq(10_000 * (i + 1), 2) for i in range(20)]
        for i, tokens in enumerate(conts):
            s.put(ns, s.keys_for(ns, tokens), [payload(100 + i), payload(200 + i)], start=4)
            s.put(ns, s.keys_for(ns, seq(900_000 + 1000 * i, 1)), [payload(300 + i)])
        kept_system = s.lookup(ns, s.keys_for(ns, system)).ready_blocks
        kept_conts = sum(s.lookup(ns, s.keys_for(ns, t)).ready_blocks - 4 for t in conts[-2:])
        return kept_system, max(kept_conts, 0)


def test_seed_scenario_leaf_first_keeps_system_prompt_plain_lru_loses_it() -> None:
    # leaf-first priority LRU: the prompt stays, the oldest continuations' leaves go
    system, recent = run_seed_workload("priority-lru")
    assert system == 4
    assert recent == 4  # the 2 newest continuations are whole
    # plain LRU on the same workload: the prompt is the oldest block, so it is evicted
    # first, and every continuation under it becomes unusable with it
    system, recent = run_seed_workload("plain-lru")
    assert system < 4
    assert recent == 0


def test_read_from_start_copies_only_the_tail(store: Store) -> None:
    ns = open_ns(store)
    keys = store.keys_for(ns, seq(0, 5))
    store.put(ns, keys[:4], [payload(i) for i in range(4)])
    # the caller has blocks 0..1; it asks for 2..4 of which 2..3 are stored
    n, data = store.read(ns, keys, start=2)
    assert n == 2 and bytes(data) == payload(2) + payload(3)
    assert store.read(ns, keys, start=5)[0] == 0
    with pytest.raises(InvalidArgument, match="start=6"):
        store.read(ns, keys, start=6)


def test_out_of_space_is_told_apart_from_a_missing_parent() -> None:
    with make_store(1) as s:
        ns = open_ns(s)
        keys = s.keys_for(ns, seq(0, 2))
        assert not s.put(ns, keys, [payload(1)], start=1).out_of_space  # parent missing
        s.put(ns, keys[:1], [payload(0)])
        lease = s.acquire(ns, keys[:1])  # the only slot is pinned
        result = s.put(ns, s.keys_for(ns, seq(100, 1)), [payload(2)])
        assert result.refused == 1 and result.out_of_space
        s.release(lease.lease_id)


def test_commit_lists_new_blocks_leaf_first_and_touches_their_prefix() -> None:
    """After a put the eviction order (oldest first) is: older blocks, the new blocks leaf
    first, then the prefix they extend, root last (a prefix is never older than its
    continuations)."""
    with make_store(16) as s:
        ns = open_ns(s)
        prompt = s.keys_for(ns, seq(0, 2))
        s.put(ns, prompt, [payload(0), payload(1)])
        other = s.keys_for(ns, seq(500, 1))
        s.put(ns, other, [payload(5)])
        longer = s.keys_for(ns, seq(0, 2) + seq(100, 3))
        s.put(ns, longer, [payload(i) for i in range(2, 5)], start=2)
        order = [node.key for node in s._parts.tiers.host.policy.candidates()]
        assert order == [other[0], longer[4], longer[3], longer[2], prompt[1], prompt[0]]
        s.verify_invariants()
