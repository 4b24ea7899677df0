"""Tenant groups in the store: quotas per tier, own-first eviction, usage counts.

The daemon-level behaviour (tokens, scoping, a flood over real sockets) is in
test_tenants.py; here the store alone, where each eviction can be seen.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.errors import InvalidArgument
from kvstore.keys import NamespaceSpec
from kvstore.store import Store, StoreConfig
from kvstore.tenants import Quota, tenant_of, tenant_salt

BLOCK = 4096
TOKENS = 4


def open_ns(store: Store, tenant: str) -> str:
    salt = tenant_salt(tenant, "") if tenant else ""
    spec = NamespaceSpec("m", block_tokens=TOKENS, block_bytes=BLOCK, tenant_salt=salt)
    return store.open_namespace(spec).ns_id


def put_chain(store: Store, ns: str, first_token: int, blocks: int) -> list:
    keys = store.keys_for(ns, list(range(first_token, first_token + blocks * TOKENS)))
    store.put(ns, keys, [bytes([first_token % 251]) * BLOCK] * blocks)
    return keys


def host_blocks(store: Store, ns: str, keys: list) -> int:
    return store.lookup(ns, keys).host_blocks


def usage(store: Store) -> dict[str, tuple[int, int]]:
    return {u.tenant: (u.host_bytes, u.disk_bytes) for u in store.stats().tenants}


def test_salt_names_its_tenant() -> None:
    assert tenant_of(tenant_salt("team-a", "x/y")) == "team-a"
    assert tenant_of("tenant-looking but not prefixed") == ""
    assert tenant_of(tenant_salt("a", "tenant:b/")) == "a"  # a client salt cannot re-own


def test_same_model_two_tenants_two_namespaces() -> None:
    with Store(StoreConfig(host_bytes=16 * BLOCK, shared_arena=False)) as store:
        a, b = open_ns(store, "a"), open_ns(store, "b")
        assert a != b
        keys = put_chain(store, a, 0, 2)
        assert store.lookup(a, keys).ready_blocks == 2
        assert store.lookup(b, store.keys_for(b, list(range(2 * TOKENS)))).ready_blocks == 0


def test_a_flood_over_quota_evicts_only_its_own_blocks() -> None:
    quotas = {"a": Quota(host_bytes=4 * BLOCK)}
    with Store(StoreConfig(host_bytes=16 * BLOCK, shared_arena=False, quotas=quotas)) as store:
        a, b = open_ns(store, "a"), open_ns(store, "b")
        kept = put_chain(store, b, 1000, 6)
        for i in range(20):  # 20 blocks of a's: five times its quota
            put_chain(store, a, i * 100, 1)
        assert host_blocks(store, b, kept) == 6
        assert usage(store)["a"] == (4 * BLOCK, 0)
        assert usage(store)["b"] == (6 * BLOCK, 0)
        newest = store.keys_for(a, list(range(1900, 1900 + TOKENS)))
        assert host_blocks(store, a, newest) == 1  # the newest of a's stayed
        assert {u.tenant: u.quota_evictions for u in store.stats().tenants}["a"] == 16
        store.verify_invariants()


def test_a_chain_longer_than_the_quota_is_cut_not_refused_whole() -> None:
    quotas = {"a": Quota(host_bytes=3 * BLOCK)}
    with Store(StoreConfig(host_bytes=16 * BLOCK, shared_arena=False, quotas=quotas)) as store:
        a = open_ns(store, "a")
        keys = store.keys_for(a, list(range(5 * TOKENS)))
        result = store.put(a, keys, [b"\1" * BLOCK] * 5)
        assert (result.stored, result.refused) == (3, 2)
        assert store.lookup(a, keys).ready_blocks == 3
        store.verify_invariants()


def test_pinned_blocks_of_a_tenant_at_quota_refuse_its_puts() -> None:
    quotas = {"a": Quota(host_bytes=2 * BLOCK)}
    with Store(StoreConfig(host_bytes=16 * BLOCK, shared_arena=False, quotas=quotas)) as store:
        a, b = open_ns(store, "a"), open_ns(store, "b")
        held = put_chain(store, a, 0, 2)
        lease = store.acquire(a, held, 30.0)
        other = store.keys_for(a, list(range(500, 500 + TOKENS)))
        assert store.put(a, other, [b"\2" * BLOCK]).stored == 0  # refused, nothing evicted
        assert put_chain(store, b, 900, 1) and usage(store)["b"] == (BLOCK, 0)
        store.release(lease.lease_id)
        assert store.put(a, other, [b"\2" * BLOCK]).stored == 1
        store.verify_invariants()


def test_disk_quota_keeps_a_tenant_to_its_share_of_the_disk(tmp_path: Path) -> None:
    quotas = {"a": Quota(disk_bytes=3 * BLOCK)}
    config = StoreConfig(
        host_bytes=4 * BLOCK,
        shared_arena=False,
        disk_dir=str(tmp_path),
        disk_bytes=64 << 20,
        quotas=quotas,
    )
    with Store(config) as store:
        a, b = open_ns(store, "a"), open_ns(store, "b")
        for i in range(12):  # each put pushes an older block out of the 4-block arena
            put_chain(store, a, i * 100, 1)
            put_chain(store, b, 5000 + i * 100, 1)
        store.flush()
        got = usage(store)
        assert got["a"][1] <= 3 * BLOCK
        assert got["b"][1] >= 8 * BLOCK  # b has no quota: its demoted blocks all stayed
        store.verify_invariants()


def test_global_eviction_takes_the_oldest_block_of_any_tenant() -> None:
    with Store(StoreConfig(host_bytes=4 * BLOCK, shared_arena=False)) as store:
        a, b = open_ns(store, "a"), open_ns(store, "b")
        oldest = put_chain(store, a, 0, 1)
        put_chain(store, b, 100, 1)
        put_chain(store, a, 200, 1)
        put_chain(store, b, 300, 1)
        put_chain(store, b, 400, 1)  # the arena is full: the oldest (a's) goes
        assert host_blocks(store, a, oldest) == 0
        assert usage(store) == {"a": (BLOCK, 0), "b": (3 * BLOCK, 0)}
        store.verify_invariants()


def test_bad_quota_names_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="tenant name"):
        StoreConfig(host_bytes=16 * BLOCK, quotas={"Not A Name": Quota(1)}).validate()


def test_staged_slots_count_against_the_host_quota() -> None:
    quotas = {"a": Quota(host_bytes=4 * BLOCK)}
    with Store(StoreConfig(host_bytes=32 * BLOCK, shared_arena=False, quotas=quotas)) as store:
        a, b = open_ns(store, "a"), open_ns(store, "b")
        stagings = [store.reserve(a, [], stage_more=8) for _ in range(5)]  # 40 slots asked
        assert sum(len(r.staged) for r in stagings) == 4  # the quota's worth, no more
        assert usage(store)["a"] == (4 * BLOCK, 0)
        # a put into staged slots turns them into blocks: still 4 in all
        first = next(r for r in stagings if r.staged)
        keys = store.keys_for(a, list(range(TOKENS)))
        put = store.reserve(
            a, keys, stage_lease_id=first.stage_lease_id, staged_offsets=first.staged[:1]
        )
        assert store.fill(put.lease_id, [b"\5" * BLOCK]) == 1  # copies and commits
        assert usage(store)["a"] == (4 * BLOCK, 0)
        store.verify_invariants()
        # b is not held back by a's staging
        assert sum(len(store.reserve(b, [], stage_more=8).staged) for _ in range(2)) == 16
        for r in stagings:
            if r.stage_lease_id:
                store.release(r.stage_lease_id)
        assert usage(store)["a"] == (BLOCK, 0)  # the one block stays
        store.verify_invariants()


def test_a_host_quota_is_the_tenants_own_region_and_others_never_evict_from_it() -> None:
    """a's blocks live only in its region (of its quota); b fills the common region
    over and over, evicting its own blocks only: a's stay, and a's new ones too."""
    quotas = {"a": Quota(host_bytes=4 * BLOCK)}
    with Store(StoreConfig(host_bytes=16 * BLOCK, shared_arena=False, quotas=quotas)) as store:
        a, b = open_ns(store, "a"), open_ns(store, "b")
        kept = put_chain(store, a, 0, 3)
        for i in range(30):  # 30 blocks of b's into a common region of 12
            put_chain(store, b, 1000 + i * 100, 1)
        assert host_blocks(store, a, kept) == 3
        assert usage(store)["b"] == (12 * BLOCK, 0)
        region = store.arena.regions["a"]
        located = store.locate(a, kept)
        assert located is not None
        assert all(region.base <= o < region.base + region.size for o in located.offsets)
        store.verify_invariants()


def test_host_quotas_must_leave_room_for_the_common_region() -> None:
    with pytest.raises(InvalidArgument, match="own arena regions"):
        StoreConfig(host_bytes=16 * BLOCK, quotas={"a": Quota(16 * BLOCK)}).validate()
