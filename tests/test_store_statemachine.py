"""Random operation sequences against a tiny two-tier store, invariants after every step.

After each step:
- every byte the store hands out (read, acquired slots) is exactly what was put for
  that key, or the block is missing: never other bytes;
- every tier is prefix-closed from the top and the index's counts add up
  (``Store.verify_invariants``), used <= capacity in both tiers;
- blocks under a live read lease are still ready in host; reserved blocks are still
  pending in host;
- after a restart, every block that was on disk before it is still there.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.store import Store, StoreConfig

BLOCK = 512
TOKENS = 2
TTL = 10.0
# prompts share prefixes heavily: up to 5 blocks over a 3-letter token alphabet
prompts = st.lists(st.integers(0, 2), min_size=TOKENS, max_size=5 * TOKENS)


def content(key: bytes) -> bytes:
    """The bytes a block must always have: derived from its key."""
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ReadLease:
    lease_id: int
    keys: list[BlockKey]
    expires_at: float


@dataclass
class WriteLease:
    lease_id: int
    keys: list[BlockKey]  # reserved, not yet committed
    offsets: list[int]
    expires_at: float


class StoreMachine(RuleBasedStateMachine):
    read_leases = Bundle("read_leases")
    write_leases = Bundle("write_leases")

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvsm")
        self.clock = FakeClock()
        self.store = self._open()
        self.ns = self.store.open_namespace(
            NamespaceSpec("sm", block_tokens=TOKENS, block_bytes=BLOCK)
        ).ns_id
        self.reads: dict[int, ReadLease] = {}
        self.writes: dict[int, WriteLease] = {}

    def _open(self) -> Store:
        config = StoreConfig(
            host_bytes=8 * BLOCK,  # 8 blocks
            disk_dir=self.dir,
            disk_bytes=6 * 8192,  # 6 blocks (a 512-byte block is accounted as 2 pages)
            shared_arena=False,
            lease_ttl_s=TTL,
        )
        return Store(config, clock=self.clock)

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def keys(self, tokens: list[int]) -> list[BlockKey]:
        return self.store.keys_for(self.ns, tokens)

    # ------------------------------------------------------------------ rules
    @rule(tokens=prompts, data=st.data())
    def put(self, tokens: list[int], data: st.DataObject) -> None:
        keys = self.keys(tokens)
        start = data.draw(st.integers(0, len(keys)), label="start")
        result = self.store.put(self.ns, keys, [content(k) for k in keys[start:]], start)
        assert result.stored + result.existing + result.refused == len(keys) - start

    @rule(tokens=prompts, data=st.data())
    def read(self, tokens: list[int], data: st.DataObject) -> None:
        keys = self.keys(tokens)
        start = data.draw(st.integers(0, len(keys)), label="start")
        n, got = self.store.read(self.ns, keys, start=start)
        assert bytes(got) == b"".join(content(k) for k in keys[start : start + n])

    @rule(tokens=prompts)
    def lookup(self, tokens: list[int]) -> None:
        result = self.store.lookup(self.ns, self.keys(tokens))
        assert result.host_blocks + result.disk_blocks == result.ready_blocks

    @rule(target=read_leases, tokens=prompts)
    def acquire(self, tokens: list[int]) -> int:
        keys = self.keys(tokens)
        acq = self.store.acquire(self.ns, keys)
        arena = self.store.arena.array()
        for slot in acq.slots:
            assert bytes(arena[slot.offset : slot.offset + BLOCK]) == content(slot.key)
        if acq.lease_id:
            got = [slot.key for slot in acq.slots]
            self.reads[acq.lease_id] = ReadLease(acq.lease_id, got, acq.expires_at)
        return acq.lease_id

    @rule(lease_id=consumes(read_leases))
    def release(self, lease_id: int) -> None:
        if lease_id in self.reads:
            self.store.release(lease_id)
            del self.reads[lease_id]

    @rule(target=write_leases, tokens=prompts)
    def reserve(self, tokens: list[int]) -> int:
        keys = self.keys(tokens)
        res = self.store.reserve(self.ns, keys)
        if not res.slots:
            return 0
        arena = self.store.arena.array()
        for slot in res.slots:  # the owner computes the blocks into the slots
            arena[slot.offset : slot.offset + BLOCK] = np.frombuffer(content(slot.key), np.uint8)
        self.writes[res.lease_id] = WriteLease(
            res.lease_id,
            [s.key for s in res.slots],
            [s.offset for s in res.slots],
            res.expires_at,
        )
        return res.lease_id

    @rule(lease_id=write_leases, count=st.integers(1, 3))
    def commit_some(self, lease_id: int, count: int) -> None:
        lease = self.writes.get(lease_id)
        if lease is None:
            return
        count = min(count, len(lease.keys))
        assert self.store.commit(lease_id, count) == count
        del lease.keys[:count], lease.offsets[:count]
        if not lease.keys:
            del self.writes[lease_id]

    @rule(lease_id=consumes(write_leases))
    def abandon(self, lease_id: int) -> None:
        if lease_id in self.writes:
            self.store.abandon(lease_id)
            del self.writes[lease_id]

    @rule(seconds=st.sampled_from([1.0, 6.0, 11.0]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.now += seconds
        self.store.expire()
        for table in (self.reads, self.writes):
            for lease_id in [i for i, lease in table.items() if lease.expires_at <= self.clock.now]:
                del table[lease_id]

    @rule(tokens=prompts, priority=st.integers(0, 100))
    def set_priority(self, tokens: list[int], priority: int) -> None:
        self.store.set_priority(self.ns, self.keys(tokens), priority, duration_s=5.0)

    @rule(tokens=prompts, data=st.data())
    def delete(self, tokens: list[int], data: st.DataObject) -> None:
        keys = self.keys(tokens)
        start = data.draw(st.integers(0, len(keys) - 1), label="start")
        self.store.delete(self.ns, keys, start)

    @precondition(lambda self: True)
    @rule()
    def restart(self) -> None:
        on_disk = [key for key, node in self.store._parts.index.nodes.items() if node.on_disk]
        self.store.close()
        self.reads.clear()
        self.writes.clear()
        self.store = self._open()
        for key in on_disk:
            node = self.store._parts.index.get(key)
            assert node is not None and node.on_disk and node.ready, "disk block lost"

    # ------------------------------------------------------------- invariants
    @invariant()
    def store_is_consistent(self) -> None:
        self.store.verify_invariants()

    @invariant()
    def leased_blocks_stay(self) -> None:
        index = self.store._parts.index
        for lease in self.reads.values():
            for key in lease.keys:
                node = index.get(key)
                assert node is not None and node.ready and node.in_host, "leased block evicted"
        for wlease in self.writes.values():
            for key, offset in zip(wlease.keys, wlease.offsets, strict=True):
                node = index.get(key)
                assert node is not None and not node.ready and node.host_offset == offset


StoreMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = StoreMachine.TestCase
