"""The disk tier's index loads behind the store's first answers (kvstore.index_load):
hits for what is loaded, misses for the rest, a block never visible without its
ancestors, writes during the load safe, and everything there once it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvstore.index_load as index_load
from kvstore.disk import DiskTier
from kvstore.disk.reads import DiskReads
from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.store import Store, StoreConfig

BLOCK = 4096
TOKENS = 4
CHAINS = 60
LENGTH = 6


def payload(chain: int, i: int) -> bytes:
    return bytes([(chain * 7 + i) % 251]) * BLOCK


def tokens(chain: int) -> list[int]:
    return [chain * 1000 + t for t in range(LENGTH * TOKENS)]


def make_store(tmp_path: Path, behind: bool = True, admission: str = "write-back") -> Store:
    """A store on the test's disk tier; ``behind``: its index loads in the background."""
    return Store(
        StoreConfig(
            host_bytes=64 * BLOCK,
            disk_dir=str(tmp_path / "lmdb"),
            disk_bytes=4096 * 3 * BLOCK,
            shared_arena=False,
            sync_index_bytes=0 if behind else 512 << 20,
            admission=admission,
        )
    )


def open_ns(store: Store, model: str = "m") -> str:
    spec = NamespaceSpec(model, block_tokens=TOKENS, block_bytes=BLOCK)
    return store.open_namespace(spec).ns_id


def fill(tmp_path: Path, models: tuple[str, ...] = ("m",)) -> None:
    with make_store(tmp_path, behind=False) as store:
        for model in models:
            ns = open_ns(store, model)
            for chain in range(CHAINS):
                keys = store.keys_for(ns, tokens(chain))
                blocks = [payload(chain, i) for i in range(LENGTH)]
                assert store.put(ns, keys, blocks).stored == LENGTH


class Paused:
    """Holds the load after its first chunk until :meth:`go` (a test's handle on the
    background thread; the load itself is the real one)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.first_chunk_done = threading.Event()
        self._go = threading.Event()
        scan = DiskReads.scan_chunks

        scans = iter(range(1 << 30))

        def paused(tier: DiskReads, chunk: int) -> Iterator[list[tuple[bytes, bytes]]]:
            first = next(scans) == 0  # the load's (a later scan, a clear's, runs on)
            for n, found in enumerate(scan(tier, chunk)):
                if n == 1 and first:
                    self.first_chunk_done.set()
                    assert self._go.wait(60), "the test never let the load go on"
                yield found

        monkeypatch.setattr(DiskReads, "scan_chunks", paused)
        monkeypatch.setattr(index_load, "CHUNK", 64)

    def go(self) -> None:
        self._go.set()

    def __enter__(self) -> Paused:
        return self

    def __exit__(self, *exc: object) -> None:
        self.go()  # a failed test must not leave the load waiting


def test_serves_while_loading_and_writes_during_the_load_are_safe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(tmp_path)
    paused = Paused(monkeypatch)
    with make_store(tmp_path) as store, paused:
        assert paused.first_chunk_done.wait(30)
        ns = store.namespaces()[0].ns_id  # registered before the first records
        counters = store.stats().counters
        assert 0 < counters["index_records_loaded"] < counters["index_records_total"]
        assert counters["index_records_total"] == CHAINS * LENGTH
        seen = [store.lookup(ns, store.keys_for(ns, tokens(c))).ready_blocks for c in range(CHAINS)]
        assert sum(seen) < CHAINS * LENGTH  # misses for what is not loaded yet
        for chain, found in enumerate(seen):  # what is served is a prefix: read it whole
            n, data = store.read(ns, store.keys_for(ns, tokens(chain)))
            assert n >= found
            assert bytes(data) == b"".join(payload(chain, i) for i in range(n))
        # writes during the load: a new chain, a chain put again before its records
        # loaded, a loaded chain deleted
        new = CHAINS + 1
        store.put(ns, store.keys_for(ns, tokens(new)), [payload(new, i) for i in range(LENGTH)])
        again = next(c for c, found in enumerate(seen) if found == 0)
        store.put(
            ns, store.keys_for(ns, tokens(again)), [payload(again, i) for i in range(LENGTH)]
        )
        # (a chain partly loaded: the rest of its records must not come back)
        gone = next(c for c, found in enumerate(seen) if found > 0)
        assert store.delete(ns, store.keys_for(ns, tokens(gone))) == LENGTH  # loaded or not
        paused.go()
        assert store.wait_loaded(60)
        store.verify_invariants()
        counters = store.stats().counters
        assert counters["index_records_loaded"] == counters["index_records_total"]
        for chain in [*range(CHAINS), new]:
            n, data = store.read(ns, store.keys_for(ns, tokens(chain)))
            want = 0 if chain == gone else LENGTH
            assert n == want, f"chain {chain}: {n} blocks"
            assert bytes(data) == b"".join(payload(chain, i) for i in range(n))
        store.flush()
        disk = store._parts.disk
        assert disk is not None
        exact = sum(disk.footprint(size) for size in disk._s.sizes.values())
        assert disk.used_bytes == exact
    # and the next start finds the same, with nothing indexed twice or orphaned
    monkeypatch.undo()
    with make_store(tmp_path, behind=False) as store:
        store.verify_invariants()
        ns = store.namespaces()[0].ns_id
        for chain in [*range(CHAINS), new]:
            found = store.lookup(ns, store.keys_for(ns, tokens(chain))).ready_blocks
            assert found == (0 if chain == gone else LENGTH)


def test_a_record_without_its_parent_is_never_indexed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(tmp_path)
    # take the first block of one chain out of the disk tier, behind the store's back
    with make_store(tmp_path, behind=False) as store:
        ns = store.namespaces()[0].ns_id
        first = store.keys_for(ns, tokens(3))[0]
    tier = DiskTier(str(tmp_path / "lmdb"), 4096 * 3 * BLOCK)
    tier.delete(first)
    tier.close()
    monkeypatch.setattr(index_load, "CHUNK", 16)
    with make_store(tmp_path) as store:
        assert store.wait_loaded(60)
        store.verify_invariants()
        assert store.lookup(ns, store.keys_for(ns, tokens(3))).ready_blocks == 0
        assert store.lookup(ns, store.keys_for(ns, tokens(4))).ready_blocks == LENGTH
        keys: list[BlockKey] = store.keys_for(ns, tokens(3))
        disk = store._parts.disk
        assert disk is not None
        assert not any(disk.contains(key) for key in keys)  # the orphans were deleted


def test_damage_found_by_the_background_check_costs_the_old_blocks_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvbench.torture_kit import damage_btree

    fill(tmp_path)
    assert damage_btree(tmp_path / "lmdb" / "data.mdb") > 0
    config = StoreConfig(
        host_bytes=8 * BLOCK,  # a put of 12 blocks sends some to the disk's queue
        disk_dir=str(tmp_path / "lmdb"),
        disk_bytes=4096 * 3 * BLOCK,
        shared_arena=False,
        check_disk_in_child=True,
        sync_index_bytes=0,
    )
    with Store(config) as store:
        ns = open_ns(store)  # before the check may have finished: nothing reads the file
        new = [CHAINS + 1, CHAINS + 2]
        for chain in new:
            blocks = [payload(chain, i) for i in range(LENGTH)]
            store.put(ns, store.keys_for(ns, tokens(chain)), blocks)
        assert store.wait_loaded(60)
        store.verify_invariants()
        assert [p.name for p in (tmp_path / "lmdb").glob("data.mdb.damaged-*")]
        for chain in new:  # what was written since the start is all there
            n, data = store.read(ns, store.keys_for(ns, tokens(chain)))
            assert n == LENGTH
            assert bytes(data) == b"".join(payload(chain, i) for i in range(n))
        assert store.lookup(ns, store.keys_for(ns, tokens(0))).ready_blocks == 0


def test_the_feed_of_tier_changes_waits_for_room_in_bytes_as_in_changes() -> None:
    """The index load waits for the feed's room before it tells a chunk of blocks: the
    room in bytes counts as the room in changes does (a wait that only counted changes
    would let the byte bound drop what it waited to tell)."""
    from kvstore.tier_events import CHANGE_BYTES, TierFeed

    spec = NamespaceSpec("m", block_tokens=TOKENS, block_bytes=BLOCK)
    feed = TierFeed(100, on=True, capacity_bytes=3 * CHANGE_BYTES)
    feed.cleared([spec] * 3)  # three changes without tokens: the bytes are full
    assert len(feed) == 3 and feed.dropped == 0
    assert feed.wait_room(1, 0.01)  # one more change would fit in count ...
    assert not feed.wait_room(1, 0.01, CHANGE_BYTES)  # ... not in bytes
    feed.take(1)
    assert feed.wait_room(1, 0.01, CHANGE_BYTES)


def held_blocks(store: Store, ns: str) -> list[int]:
    """How many blocks of each chain ``store`` serves, each checked byte for byte."""
    found = []
    for chain in range(CHAINS):
        n, data = store.read(ns, store.keys_for(ns, tokens(chain)))
        assert bytes(data) == b"".join(payload(chain, i) for i in range(n)), chain
        found.append(n)
    return found


def writes_during_the_load(tmp_path: Path, admission: str, kill: bool) -> list[int]:
    """Start a store whose index loads behind it, paused after its first chunk; put
    again the chains not loaded yet (half of them their first three blocks, half whole,
    the same bytes), delete two of them whole and one from its third block; let the
    load end. Then stop: cleanly, or (``kill``) with SIGKILL once the disk writer
    committed what it was given. The blocks each chain should have after a restart."""
    monkeypatch = pytest.MonkeyPatch()
    paused = Paused(monkeypatch)
    want = [LENGTH] * CHAINS
    with make_store(tmp_path, admission=admission) as store, paused:
        assert paused.first_chunk_done.wait(30)
        ns = store.namespaces()[0].ns_id
        seen = [store.lookup(ns, store.keys_for(ns, tokens(c))).ready_blocks for c in range(CHAINS)]
        unloaded = [c for c, n in enumerate(seen) if n == 0]
        assert len(unloaded) >= 10
        gone, cut, again = unloaded[:2], unloaded[2], unloaded[3:]
        for n, chain in enumerate(again):
            length = 3 if n % 2 else LENGTH
            blocks = [payload(chain, i) for i in range(length)]
            keys = store.keys_for(ns, tokens(chain))[:length]
            assert store.put(ns, keys, blocks).stored == length
        for chain in gone:
            assert store.delete(ns, store.keys_for(ns, tokens(chain))) == LENGTH
            want[chain] = 0
        assert store.delete(ns, store.keys_for(ns, tokens(cut)), start=2) == LENGTH - 2
        want[cut] = 2
        paused.go()
        assert store.wait_loaded(60)
        store.verify_invariants()
        assert held_blocks(store, ns) == want
        if kill:
            store.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    monkeypatch.undo()
    return want


@pytest.mark.parametrize(
    ("admission", "kill"),
    [("write-back", False), ("write-back", True), ("write-through", True)],
)
def test_puts_and_deletes_during_the_load_win_over_its_scan(
    tmp_path: Path, admission: str, kill: bool
) -> None:
    """What a put or a Delete does to a block the load has not reached wins over the
    scan: a block put again keeps its records (and its descendants theirs) and a
    record that waits for a parent the store holds is not an orphan; a deleted block
    is not loaded back. After the load, and after a restart (clean, or kill -9)."""
    fill(tmp_path)
    if kill:  # in a process of its own, which kills itself
        code = (
            "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
            "import test_index_load as t; "
            "t.writes_during_the_load(Path(sys.argv[2]), sys.argv[3], True)"
        )
        child = subprocess.run(
            [sys.executable, "-c", code, str(Path(__file__).parent), str(tmp_path), admission],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
        want = None
    else:
        want = writes_during_the_load(tmp_path, admission, kill=False)
    with make_store(tmp_path, behind=False) as store:
        store.verify_invariants()
        found = held_blocks(store, store.namespaces()[0].ns_id)
        if want is None:  # (the child's choice of chains: the ones it cut are short)
            assert sorted(found).count(LENGTH) == CHAINS - 3, found
            assert sorted(found)[:3] == [0, 0, 2], found
        else:
            assert found == want


def test_a_clear_during_the_load_wins_over_its_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Clear of one namespace while the index loads removes its blocks, loaded or
    not (and counts them), and keeps the other namespace's; after the load and after a
    restart. A chain put again after the clear stays."""
    fill(tmp_path, models=("m", "other"))
    paused = Paused(monkeypatch)
    with make_store(tmp_path) as store, paused:
        assert paused.first_chunk_done.wait(30)
        ns = open_ns(store, "other")
        assert store.clear(ns) == CHAINS * LENGTH
        blocks = [payload(0, i) for i in range(LENGTH)]
        assert store.put(ns, store.keys_for(ns, tokens(0)), blocks).stored == LENGTH
        paused.go()
        assert store.wait_loaded(60)
        store.verify_invariants()
        assert held_blocks(store, ns) == [LENGTH] + [0] * (CHAINS - 1)
        assert held_blocks(store, open_ns(store)) == [LENGTH] * CHAINS
    with make_store(tmp_path, behind=False) as store:
        store.verify_invariants()
        assert held_blocks(store, open_ns(store, "other")) == [LENGTH] + [0] * (CHAINS - 1)
        assert held_blocks(store, open_ns(store)) == [LENGTH] * CHAINS


def test_a_namespace_opened_before_the_load_registers_it_stays_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that opens its namespace before the load has read the disk's namespaces
    keeps it: the load does not register it a second time (its staged slots stay its
    own, its blocks stay in it, and it is counted once)."""
    fill(tmp_path)
    reading = threading.Event()
    go = threading.Event()
    saved = DiskReads.namespaces

    def held(reads: DiskReads) -> dict[bytes, dict[str, object]]:
        reading.set()
        assert go.wait(60), "the test never let the load go on"
        return saved(reads)

    monkeypatch.setattr(DiskReads, "namespaces", held)
    with make_store(tmp_path) as store:
        try:
            assert reading.wait(30)
            ns = open_ns(store)
            keys = store.keys_for(ns, tokens(CHAINS + 1))
            staged = store.reserve(ns, keys[:1], stage_more=2)
            store.abandon(staged.lease_id)
        finally:
            go.set()
        assert store.wait_loaded(60)
        store.verify_invariants()
        # the staged slots are still the namespace's own: a reserve into them is taken
        reserved = store.reserve(
            ns, keys[:2], stage_lease_id=staged.stage_lease_id, staged_offsets=staged.staged
        )
        assert len(reserved.offsets) == 2
        store.abandon(reserved.lease_id)
        assert held_blocks(store, ns) == [LENGTH] * CHAINS
        assert len(store.namespaces()) == 1
        assert store.stats().namespaces[0].blocks == CHAINS * LENGTH
