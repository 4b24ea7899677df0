"""Staged slots in the store: empty slots set aside for a writer's next put.

A reserve may ask for ``stage_more`` slots under a staging lease; the next reserve
names them (``staged_offsets``) and its new blocks take them, so a client can copy
while that reserve is in flight. Staged slots hold no block, are never evicted, and
come back when the lease is released or expires.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_store import BLOCK, FakeClock, make_store, open_ns, seq

from kvstore.errors import InvalidArgument, LeaseError
from kvstore.store import Store


def staged_put(store: Store, ns: str, tokens: list[int], lease: int, offsets: list[int]) -> int:
    """Reserve ``tokens`` into staged slots, write each block's tag, commit; stored count."""
    keys = store.keys_for(ns, tokens)
    res = store.reserve(ns, keys, stage_lease_id=lease, staged_offsets=offsets)
    array = store.arena.array()
    for slot in res.slots:
        array[slot.offset : slot.offset + BLOCK] = slot.index + 1
    return store.commit(res.lease_id) if res.slots else 0


def used(store: Store) -> int:
    return store.arena.stats().used_bytes


def test_a_reserve_stages_slots_and_the_next_put_fills_them() -> None:
    with make_store(16) as store:
        ns = open_ns(store)
        # first put: 2 blocks in fresh slots, and 2 more slots set aside for the next
        first = store.reserve(ns, store.keys_for(ns, seq(0, 2)), stage_more=2)
        store.commit(first.lease_id)
        assert first.stage_lease_id and len(first.staged) == 2
        assert used(store) == 4 * BLOCK  # 2 blocks + 2 staged slots
        assert store.lookup(ns, store.keys_for(ns, seq(0, 4))).ready_blocks == 2
        # the next put names them: its new blocks land in exactly those slots
        keys = store.keys_for(ns, seq(0, 4))
        res = store.reserve(
            ns, keys, 2, stage_lease_id=first.stage_lease_id, staged_offsets=list(first.staged)
        )
        assert [s.offset for s in res.slots] == list(first.staged)
        store.commit(res.lease_id)
        assert store.lookup(ns, keys).ready_blocks == 4
        assert used(store) == 4 * BLOCK  # no slot was allocated beside the staged ones
        store.verify_invariants()


def test_slots_of_blocks_that_exist_stay_staged() -> None:
    with make_store(16) as store:
        ns = open_ns(store)
        store.put(ns, store.keys_for(ns, seq(0, 1)), [bytes(BLOCK)])
        staged = store.reserve(ns, store.keys_for(ns, seq(100, 1)), stage_more=3)
        store.commit(staged.lease_id)
        lease, offsets = staged.stage_lease_id, list(staged.staged)
        # block 0 exists: its staged slot is not used, blocks 1 and 2 take theirs
        assert staged_put(store, ns, seq(0, 3), lease, offsets) == 2
        # the slot left over is still the lease's: a later put may name it
        assert staged_put(store, ns, seq(500, 1), lease, offsets[:1]) == 1
        store.verify_invariants()


def test_bad_staged_slots_are_refused_and_change_nothing() -> None:
    with make_store(16) as store:
        ns, other = open_ns(store), open_ns(store, tenant_salt=b"t2")
        res = store.reserve(ns, store.keys_for(ns, seq(0, 1)), stage_more=2)
        store.commit(res.lease_id)
        lease, offsets = res.stage_lease_id, list(res.staged)
        read = store.acquire(ns, store.keys_for(ns, seq(0, 1)))
        keys = store.keys_for(ns, seq(0, 3))
        before = (used(store), store.stats().leases, store.lookup(ns, keys))
        cases: list[tuple[type[Exception], dict[str, object]]] = [
            (LeaseError, dict(stage_lease_id=12345, staged_offsets=offsets)),
            (LeaseError, dict(stage_lease_id=read.lease_id, staged_offsets=offsets)),
            (InvalidArgument, dict(staged_offsets=offsets)),  # no lease named
            (InvalidArgument, dict(stage_lease_id=lease, staged_offsets=offsets[:1])),
            (InvalidArgument, dict(stage_lease_id=lease, staged_offsets=[offsets[0]] * 2)),
            (InvalidArgument, dict(stage_lease_id=lease, staged_offsets=[offsets[0], 999])),
            (InvalidArgument, dict(stage_lease_id=lease, stage_more=10**6)),
        ]
        for error, kwargs in cases:
            with pytest.raises(error):
                store.reserve(ns, keys, 1, **kwargs)  # type: ignore[arg-type]
        # another namespace may not use this lease's slots
        with pytest.raises(LeaseError, match="namespace"):
            store.reserve(
                other, store.keys_for(other, seq(0, 2)),
                stage_lease_id=lease, staged_offsets=offsets,
            )
        assert (used(store), store.stats().leases, store.lookup(ns, keys)) == before
        store.verify_invariants()


def test_release_and_expiry_free_staged_slots_and_use_renews_the_lease() -> None:
    clock = FakeClock()
    with make_store(16, clock=clock, lease_ttl_s=10.0) as store:
        ns = open_ns(store)
        res = store.reserve(ns, store.keys_for(ns, seq(0, 1)), stage_more=4)
        store.commit(res.lease_id)
        assert used(store) == 5 * BLOCK
        store.release(res.stage_lease_id)  # the client is done: the slots come back
        assert used(store) == BLOCK
        with pytest.raises(LeaseError, match="ended"):
            store.reserve(
                ns, store.keys_for(ns, seq(0, 2)), 1,
                stage_lease_id=res.stage_lease_id, staged_offsets=[res.staged[0]],
            )

        res = store.reserve(ns, store.keys_for(ns, seq(100, 1)), stage_more=4)
        store.commit(res.lease_id)
        lease, offsets = res.stage_lease_id, list(res.staged)
        clock.now += 8
        assert staged_put(store, ns, seq(200, 1), lease, offsets[:1]) == 1  # renews: +10 s
        clock.now += 8  # 16 s after staging, 8 s after the renewal
        assert staged_put(store, ns, seq(300, 1), lease, offsets[1:2]) == 1
        clock.now += 10.5  # past the last renewal: the two slots left are freed
        store.expire()
        assert used(store) == 4 * BLOCK  # blocks 0, 100, 200, 300
        assert store.stats().leases == 0
        store.verify_invariants()


def test_staging_is_bounded_and_staged_slots_are_never_evicted() -> None:
    # host holds 8 blocks; one lease may stage at most 3
    with make_store(8, max_staged_bytes=3 * BLOCK) as store:
        ns = open_ns(store)
        res = store.reserve(ns, store.keys_for(ns, seq(0, 1)), stage_more=5)
        store.commit(res.lease_id)
        assert len(res.staged) == 3
        # fill the rest of the host tier; with no disk tier, old leaves are dropped
        for i in range(1, 10):
            store.put(ns, store.keys_for(ns, seq(1000 * i, 1)), [bytes(BLOCK)])
        assert used(store) == 8 * BLOCK
        # the staged slots survived every eviction and still take a put
        lease, offsets = res.stage_lease_id, list(res.staged)
        assert staged_put(store, ns, seq(7, 3), lease, offsets) == 3
        keys = store.keys_for(ns, seq(7, 3))
        n, view = store.read(ns, keys)
        rows = np.frombuffer(view, np.uint8).reshape(n, BLOCK)
        assert n == 3 and [int(row[0]) for row in rows] == [1, 2, 3]
        store.verify_invariants()
