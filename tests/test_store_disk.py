"""The store with its LMDB disk tier: demotion, promotion, admission, restart, corruption."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from kvstore.keys import NamespaceSpec
from kvstore.results import EventKind
from kvstore.store import Store, StoreConfig

BLOCK = 4096
TOKENS = 4


def payload(tag: int) -> bytes:
    return bytes([tag % 251]) * (BLOCK // 2) + bytes([(tag * 7) % 251]) * (BLOCK // 2)


def seq(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * TOKENS))


def make_store(tmp_path: Path, host_blocks: int, disk_blocks: int = 64, **kw: object) -> Store:
    # a 4 KiB block is accounted as 3 LMDB pages on disk: 2 overflow pages (4 KiB plus
    # LMDB's 16-byte header) and 1 for its key and metadata (DiskTier.footprint)
    config = StoreConfig(
        host_bytes=host_blocks * BLOCK,
        disk_dir=str(tmp_path / "lmdb"),
        disk_bytes=disk_blocks * 3 * BLOCK,
        shared_arena=False,
        **kw,  # type: ignore[arg-type]
    )
    return Store(config)


def open_ns(store: Store) -> str:
    return store.open_namespace(NamespaceSpec("m", block_tokens=TOKENS, block_bytes=BLOCK)).ns_id


def test_host_full_demotes_leaves_to_disk_and_reads_promote(tmp_path: Path) -> None:
    with make_store(tmp_path, host_blocks=4) as s:
        ns = open_ns(s)
        keys = s.keys_for(ns, seq(0, 6))
        # host holds 4 blocks; a 6-block put pushes the 2 oldest leaves... but the chain's
        # own blocks are leaves only at the tail, so the put itself demotes nothing of it:
        assert s.put(ns, keys[:4], [payload(i) for i in range(4)]).stored == 4
        other = s.keys_for(ns, seq(1000, 2))
        s.put(ns, other, [payload(10), payload(11)])
        # the chain's last 2 blocks (its leaves) went to disk; the prefix stayed in host
        look = s.lookup(ns, keys[:4])
        assert (look.ready_blocks, look.host_blocks, look.disk_blocks) == (4, 2, 2)
        s.verify_invariants()
        # reading the chain promotes the disk blocks back, parents first
        n, data = s.read(ns, keys[:4])
        assert n == 4 and bytes(data) == b"".join(payload(i) for i in range(4))
        assert s.lookup(ns, keys[:4]).host_blocks == 4
        kinds = [e.kind for e in s.events_since(0)]
        assert kinds.count(EventKind.DEMOTED) >= 2 and kinds.count(EventKind.PROMOTED) == 2
        s.verify_invariants()


def test_restart_keeps_committed_blocks(tmp_path: Path) -> None:
    with make_store(tmp_path, host_blocks=8) as s:
        ns = open_ns(s)
        keys = s.keys_for(ns, seq(0, 5))
        s.put(ns, keys, [payload(i) for i in range(5)], priority=60)
    # close() persisted the host tier; a new store rebuilds the index from LMDB
    with make_store(tmp_path, host_blocks=8) as s:
        assert [spec.ns_id for spec in s.namespaces()] == [ns]
        look = s.lookup(ns, keys)
        assert (look.ready_blocks, look.disk_blocks) == (5, 5)
        n, data = s.read(ns, keys)
        assert n == 5 and bytes(data) == b"".join(payload(i) for i in range(5))
        s.verify_invariants()


def test_a_namespaces_labels_survive_a_restart_and_a_reopen_relabels_it(tmp_path: Path) -> None:
    # labels (served model, tokenizer) are kept with the namespace on disk; a re-open
    # that declares others replaces them (kept across the next restart too), one that
    # declares none leaves them; the ns_id never changes
    def spec(**labels: str) -> NamespaceSpec:
        return NamespaceSpec("m", block_tokens=TOKENS, block_bytes=BLOCK, **labels)

    with make_store(tmp_path, host_blocks=8) as s:
        ns = s.open_namespace(spec(served_model="chat", tokenizer="/models/m")).ns_id
        assert ns == open_ns(s)
    with make_store(tmp_path, host_blocks=8) as s:
        (held,) = s.namespaces()
        assert (held.ns_id, held.served_model, held.tokenizer) == (ns, "chat", "/models/m")
        assert s.open_namespace(spec(served_model="chat-2")).served_model == "chat-2"
        assert s.open_namespace(spec()).tokenizer == "/models/m"
        assert [(n.served_model, n.tokenizer) for n in s.stats().namespaces] == [
            ("chat-2", "/models/m")
        ]
    with make_store(tmp_path, host_blocks=8) as s:
        assert s.namespace(ns).served_model == "chat-2"


def test_corrupt_disk_record_is_a_miss(tmp_path: Path) -> None:
    with make_store(tmp_path, host_blocks=8, persist_on_close=True) as s:
        ns = open_ns(s)
        keys = s.keys_for(ns, seq(0, 3))
        s.put(ns, keys, [payload(i) for i in range(3)])
    # flip one byte of block 1's payload directly in LMDB
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8)
    db = env.open_db(b"payload")
    with env.begin(write=True, db=db) as txn:
        value = bytearray(txn.get(keys[1]))
        value[100] ^= 0xFF
        txn.put(keys[1], bytes(value))
    env.close()
    with make_store(tmp_path, host_blocks=8) as s:
        assert s.lookup(ns, keys).ready_blocks == 3  # the index does not know yet
        n, data = s.read(ns, keys)
        # block 0 is served; block 1 fails its checksum: a miss, never the bad bytes
        assert n == 1 and bytes(data) == payload(0)
        assert s.lookup(ns, keys).ready_blocks == 1  # block 1 and its child are gone
        assert s.stats().corrupt_reads == 1
        assert EventKind.CORRUPT in [e.kind for e in s.events_since(0)]
        s.verify_invariants()


def test_disk_full_deletes_disk_leaves(tmp_path: Path) -> None:
    with make_store(tmp_path, host_blocks=2, disk_blocks=4) as s:
        ns = open_ns(s)
        for i in range(10):
            s.put(ns, s.keys_for(ns, seq(1000 * i, 1)), [payload(i)])
            disk = s.stats().tiers[1]
            assert disk.used_bytes <= disk.capacity_bytes
        # host 2 + disk 4: the 6 newest single-block prompts survive
        kept = [s.lookup(ns, s.keys_for(ns, seq(1000 * i, 1))).ready_blocks for i in range(10)]
        assert kept == [0] * 4 + [1] * 6
        s.verify_invariants()


def test_write_through_puts_every_block_on_disk(tmp_path: Path) -> None:
    with make_store(tmp_path, host_blocks=8, admission="write-through") as s:
        ns = open_ns(s)
        keys = s.keys_for(ns, seq(0, 3))
        s.put(ns, keys, [payload(i) for i in range(3)])
        s.flush()
        assert s.stats().tiers[1].blocks == 3
    # even without persisting on close, a restart finds them
    with make_store(tmp_path, host_blocks=8, persist_on_close=False) as s:
        assert s.read(ns, keys)[0] == 3


def test_clear_and_delete_return_with_their_disk_deletions_committed(tmp_path: Path) -> None:
    """A crash loses what the writer has not committed: a restart after a clear or a
    delete that answered may not find a cleared block again."""
    with make_store(tmp_path, host_blocks=8, admission="write-through") as s:
        ns = open_ns(s)
        first, second = s.keys_for(ns, seq(0, 3)), s.keys_for(ns, seq(500, 2))
        s.put(ns, first, [payload(i) for i in range(3)])
        s.put(ns, second, [payload(i) for i in range(2)])
        s.flush()
        assert s.delete(ns, first, start=1) == 2
        assert not s._parts.disk._s.ops  # nothing queued: the deletions are in LMDB already
        assert s.clear(ns) == 3
        assert not s._parts.disk._s.ops and s.stats().tiers[1].blocks == 0


def test_selective_admission_demotes_only_reused_blocks(tmp_path: Path) -> None:
    with make_store(tmp_path, host_blocks=2, admission="selective", selective_hits=1) as s:
        ns = open_ns(s)
        hot = s.keys_for(ns, seq(0, 1))
        cold = s.keys_for(ns, seq(500, 1))
        s.put(ns, hot, [payload(1)])
        s.put(ns, cold, [payload(2)])
        s.read(ns, hot)  # one hit
        s.put(ns, s.keys_for(ns, seq(900, 2)), [payload(3), payload(4)])  # evicts both
        assert s.lookup(ns, hot).disk_blocks == 1
        assert s.lookup(ns, cold).ready_blocks == 0


def test_low_priority_blocks_are_dropped_not_demoted(tmp_path: Path) -> None:
    with make_store(tmp_path, host_blocks=1, disk_min_priority=20) as s:
        ns = open_ns(s)
        low = s.keys_for(ns, seq(0, 1))
        s.put(ns, low, [payload(1)], priority=5)
        s.put(ns, s.keys_for(ns, seq(100, 1)), [payload(2)])
        assert s.lookup(ns, low).ready_blocks == 0


def test_acquire_promotes_disk_blocks_into_slots(tmp_path: Path) -> None:
    with make_store(tmp_path, host_blocks=4) as s:
        ns = open_ns(s)
        keys = s.keys_for(ns, seq(0, 2))
        s.put(ns, keys, [payload(0), payload(1)])
        s.put(ns, s.keys_for(ns, seq(100, 4)), [payload(i) for i in range(4)])
        assert s.lookup(ns, keys).disk_blocks == 2
        lease = s.acquire(ns, keys)
        arena = s.arena.array()
        got = [bytes(arena[x.offset : x.offset + BLOCK]) for x in lease.slots]
        assert got == [payload(0), payload(1)]
        s.release(lease.lease_id)
        s.verify_invariants()


@pytest.mark.parametrize("admission", ["write-back", "write-through"])
def test_demoted_parent_keeps_disk_children_usable(tmp_path: Path, admission: str) -> None:
    with make_store(tmp_path, host_blocks=3, admission=admission) as s:
        ns = open_ns(s)
        keys = s.keys_for(ns, seq(0, 3))
        s.put(ns, keys, [payload(i) for i in range(3)])
        for i in range(6):
            s.put(ns, s.keys_for(ns, seq(1000 * (i + 1), 1)), [payload(50 + i)])
            s.verify_invariants()
        n, data = s.read(ns, keys)
        assert n == 3 and bytes(data) == b"".join(payload(i) for i in range(3))



def test_making_disk_room_never_evicts_the_parent_of_the_block_being_written(
    tmp_path: Path,
) -> None:
    """Found by the state machine (these are its steps): an acquire promotes a chain
    that is on disk only, which demotes host leaves onto a full disk tier. Making room
    for a demoted block must not evict its parent, the only evictable disk leaf left:
    the block would sit on disk with no parent there. The parent is held meanwhile."""
    block = 512
    store = Store(
        StoreConfig(
            host_bytes=8 * block,
            disk_dir=str(tmp_path / "lmdb"),
            disk_bytes=6 * 8192,  # 6 blocks: a 512-byte block is accounted as 2 pages
            shared_arena=False,
        )
    )
    ns = store.open_namespace(NamespaceSpec("m", block_tokens=2, block_bytes=block)).ns_id
    for tokens in ([0, 0], [1, 0, 1, 2, 1, 2], [0] * 10, [0, 1, 0, 0, 0]):
        keys = store.keys_for(ns, tokens)
        store.put(ns, keys, [bytes([len(tokens)]) * block for _ in keys])
        store.verify_invariants()
    got = store.acquire(ns, store.keys_for(ns, [1, 0, 1, 2, 1, 2]))
    assert len(got.offsets) == 3
    store.verify_invariants()
    store.close()


def test_write_through_commit_is_durable_when_it_returns(tmp_path: Path) -> None:
    s = make_store(tmp_path, host_blocks=8, admission="write-through")
    ns = open_ns(s)
    keys = s.keys_for(ns, seq(0, 3))
    res = s.reserve(ns, keys)
    arena = s.arena.array()
    for i, offset in enumerate(res.offsets):
        arena[offset : offset + BLOCK] = list(payload(i))
    assert s.commit_durably(res.lease_id) == (3, 3)
    # durable means committed: another reader of the environment sees all three now,
    # before any flush or close
    # (another process: LMDB opens an environment once per process)
    reader = (
        "import lmdb, sys\n"
        "env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=8)\n"
        "with env.begin() as txn:\n"
        "    meta = env.open_db(b'meta', txn=txn, create=False)\n"
        "    print(sum(txn.get(bytes.fromhex(k), db=meta) is not None for k in sys.argv[2:]))\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", reader, str(tmp_path / "lmdb"), *[bytes(k).hex() for k in keys]],
        capture_output=True, text=True, check=True,
    )
    assert found.stdout.strip() == "3"
    s.close()


def test_other_admission_modes_promise_nothing_durable(tmp_path: Path) -> None:
    with make_store(tmp_path, host_blocks=8) as s:
        ns = open_ns(s)
        keys = s.keys_for(ns, seq(0, 2))
        res = s.reserve(ns, keys)
        assert s.commit_durably(res.lease_id) == (2, 0)


def test_release_owner_ends_every_lease_of_a_client(tmp_path: Path) -> None:
    with make_store(tmp_path, host_blocks=16) as s:
        ns = open_ns(s)
        stored = s.keys_for(ns, seq(0, 2))
        s.put(ns, stored, [payload(0), payload(1)])
        read = s.acquire(ns, stored)
        write = s.reserve(ns, s.keys_for(ns, seq(100, 3)), stage_more=4)
        s.own("local:1", [read.lease_id, write.lease_id, write.stage_lease_id])
        other = s.acquire(ns, stored)
        s.own("local:2", [other.lease_id])
        assert s.stats().leases == 3 and s.stats().pending_blocks == 3
        assert s.stats().staged_bytes > 0
        assert s.release_owner("local:1") == 3
        stats = s.stats()
        assert (stats.leases, stats.pending_blocks, stats.staged_bytes) == (1, 0, 0)
        assert s.release_owner("local:1") == 0  # nothing left, nothing else touched
        s.release(other.lease_id)
        s.verify_invariants()


def test_a_disk_dir_has_one_owner(tmp_path: Path) -> None:
    from kvstore.disk.files import DiskDirInUse

    with (
        make_store(tmp_path, host_blocks=4),
        pytest.raises(DiskDirInUse, match=f"pid {os.getpid()}"),
    ):
        make_store(tmp_path, host_blocks=4)
    make_store(tmp_path, host_blocks=4).close()  # free again once the first closed


def test_a_block_due_on_disk_is_never_evicted_unwritten(tmp_path: Path) -> None:
    # a one-block write queue: a put that must evict 32 blocks due on disk finds the
    # queue full after the first; with no wait allowed (put_wait_ms=0, overflow=wait)
    # it refuses what did not fit, and evicts nothing it could not write
    with make_store(
        tmp_path, host_blocks=32, disk_blocks=256, disk_queue_bytes=BLOCK, put_wait_ms=0
    ) as s:
        ns = open_ns(s)
        first = s.keys_for(ns, seq(0, 32))
        assert s.put(ns, first, [payload(i) for i in range(32)]).stored == 32
        second = s.keys_for(ns, seq(10_000, 32))
        result = s.put(ns, second, [payload(100 + i) for i in range(32)])
        assert result.refused > 0 and result.stored + result.refused == 32
        counters = s.stats().counters
        assert counters["writer_refused"] == result.refused
        assert counters["dirty_dropped"] == 0 and counters["dropped"] == 0
        s.flush()
        n, data = s.read(ns, first)  # every block of the first put is still somewhere
        assert n == 32 and bytes(data) == b"".join(payload(i) for i in range(32))
        s.verify_invariants()


def test_overflow_drop_evicts_unwritten_and_counts_it(tmp_path: Path) -> None:
    with make_store(
        tmp_path, host_blocks=32, disk_blocks=256, disk_queue_bytes=BLOCK, put_wait_ms=0,
        overflow="drop",
    ) as s:  # fmt: skip
        ns = open_ns(s)
        s.put(ns, s.keys_for(ns, seq(0, 32)), [payload(i) for i in range(32)])
        result = s.put(ns, s.keys_for(ns, seq(10_000, 32)), [payload(i) for i in range(32)])
        assert result.stored == 32
        counters = s.stats().counters
        assert counters["dirty_dropped"] > 0 and counters["writer_refused"] == 0
        s.verify_invariants()
