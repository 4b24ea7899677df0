"""Early reuse in the store: claims (reservations), pending blocks, waiting with deadlines.

A burst of sessions with one shared prompt: the first to reserve a block computes it,
the others see it pending and wait; each block becomes ready when its own bytes are
committed. An owner that dies (its lease runs out) releases the waiters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.errors import InvalidArgument, LeaseError
from kvstore.keys import NamespaceSpec
from kvstore.store import Store, StoreConfig

BLOCK = 4096
TOKENS = 4
PROMPT = list(range(8 * TOKENS))  # 8 shared blocks


def content(key: bytes) -> np.ndarray:
    return np.frombuffer((key * (BLOCK // len(key)))[:BLOCK], np.uint8)


@pytest.fixture
def store() -> Iterator[Store]:
    with Store(StoreConfig(host_bytes=256 * BLOCK, shared_arena=False, lease_ttl_s=5)) as s:
        yield s


def ns_of(store: Store) -> str:
    return store.open_namespace(NamespaceSpec("m", block_tokens=TOKENS, block_bytes=BLOCK)).ns_id


def session(store: Store, ns: str, computed: list[int], results: list[bytes]) -> None:
    """One engine request: claim what is missing, compute it chunk by chunk, or wait."""
    keys = store.keys_for(ns, PROMPT)
    while True:
        claim = store.reserve(ns, keys)
        if claim.slots:  # we own these blocks: "compute" them two at a time
            arena = store.arena.array()
            for i in range(0, len(claim.slots), 2):
                for slot in claim.slots[i : i + 2]:
                    arena[slot.offset : slot.offset + BLOCK] = content(slot.key)
                    computed.append(slot.index)
                time.sleep(0.01)  # the prefill of a chunk takes time
                store.commit(claim.lease_id, count=len(claim.slots[i : i + 2]))
        look = store.lookup(ns, keys)
        if look.ready_blocks == len(keys):
            break
        store.wait_ready(ns, keys, timeout=2.0)
    n, data = store.read(ns, keys)
    results.append(bytes(data[: n * BLOCK]))


def test_burst_computes_each_block_once(store: Store) -> None:
    ns = ns_of(store)
    computed: list[int] = []
    results: list[bytes] = []
    threads = [
        threading.Thread(target=session, args=(store, ns, computed, results)) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    # exactly one session computed each of the 8 blocks, and everyone got the same bytes
    assert sorted(computed) == list(range(8))
    expected = b"".join(content(k).tobytes() for k in store.keys_for(ns, PROMPT))
    assert results == [expected] * 8


def test_waiter_sees_blocks_ready_one_by_one(store: Store) -> None:
    ns = ns_of(store)
    keys = store.keys_for(ns, PROMPT)
    claim = store.reserve(ns, keys)
    arena = store.arena.array()
    slot = claim.slots[0]
    arena[slot.offset : slot.offset + BLOCK] = content(slot.key)
    store.commit(claim.lease_id, count=1)
    # block 0 is usable now, while blocks 1..7 are still being computed
    look = store.lookup(ns, keys)
    assert look.ready_blocks == 1 and len(look.pending_keys) == 7
    assert store.read(ns, keys)[0] == 1
    store.abandon(claim.lease_id)


def test_dead_owner_releases_waiters_before_their_deadline() -> None:
    with Store(StoreConfig(host_bytes=64 * BLOCK, shared_arena=False)) as s:
        ns = ns_of(s)
        keys = s.keys_for(ns, PROMPT)
        s.reserve(ns, keys, ttl_s=0.3)  # the owner dies: it never commits
        t0 = time.monotonic()
        look = s.wait_ready(ns, keys, timeout=5.0)
        waited = time.monotonic() - t0
        # released when the lease ran out, well before the 5 s deadline: compute yourself
        assert look.ready_blocks == 0 and look.pending_keys == ()
        assert waited < 2.0
        # nothing half-written is ever served, and the blocks can be claimed again
        assert s.read(ns, keys)[0] == 0
        assert len(s.reserve(ns, keys).slots) == 8


def test_waiter_never_waits_past_its_deadline(store: Store) -> None:
    ns = ns_of(store)
    keys = store.keys_for(ns, PROMPT)
    claim = store.reserve(ns, keys)  # owner alive, slow
    t0 = time.monotonic()
    look = store.wait_ready(ns, keys, timeout=0.2)
    assert time.monotonic() - t0 < 1.0
    assert len(look.pending_keys) == 8
    store.abandon(claim.lease_id)


def test_overlapping_claims_do_not_deadlock(store: Store) -> None:
    # two sessions share a 4-block prefix and diverge; each claims its whole prompt
    ns = ns_of(store)
    a = store.keys_for(ns, PROMPT[: 4 * TOKENS] + list(range(1000, 1000 + 4 * TOKENS)))
    b = store.keys_for(ns, PROMPT[: 4 * TOKENS] + list(range(2000, 2000 + 4 * TOKENS)))
    claim_a = store.reserve(ns, a)
    claim_b = store.reserve(ns, b)
    # A owns the shared prefix and its tail; B owns nothing yet (its first block is pending)
    assert len(claim_a.slots) == 8 and claim_b.slots == ()
    arena = store.arena.array()
    for slot in claim_a.slots:
        arena[slot.offset : slot.offset + BLOCK] = content(slot.key)
    store.commit(claim_a.lease_id, count=4)  # the shared prefix is ready
    # B waits for the shared prefix, then claims only its own tail
    assert store.wait_ready(ns, b, timeout=1.0).ready_blocks == 4
    claim_b = store.reserve(ns, b, start=4)
    assert [s.index for s in claim_b.slots] == [4, 5, 6, 7]
    store.commit(claim_a.lease_id)
    store.commit(claim_b.lease_id)
    assert store.lookup(ns, a).ready_blocks == 8 and store.lookup(ns, b).ready_blocks == 8


def test_fill_writes_and_commits_claimed_blocks_in_chunks(store: Store) -> None:
    # a client without the arena claims 8 blocks and delivers them 3 + 5
    ns = ns_of(store)
    keys = store.keys_for(ns, PROMPT)
    claim = store.reserve(ns, keys)
    first = [content(k).tobytes() for k in keys[:3]]
    assert store.fill(claim.lease_id, first) == 3
    assert store.lookup(ns, keys).ready_blocks == 3
    with pytest.raises(InvalidArgument, match="has 5 left"):
        store.fill(claim.lease_id, [content(k).tobytes() for k in keys])
    with pytest.raises(InvalidArgument, match="payload 0 is 10 bytes"):
        store.fill(claim.lease_id, [b"x" * 10])
    assert store.fill(claim.lease_id, [content(k).tobytes() for k in keys[3:]]) == 5
    n, data = store.read(ns, keys)
    assert n == 8 and bytes(data) == b"".join(content(k).tobytes() for k in keys)
    with pytest.raises(LeaseError):  # the lease ended with the last block
        store.fill(claim.lease_id, [])
