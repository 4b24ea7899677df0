"""Tests of the LMDB disk tier (kvstore/disk/): tiny capacities, temp dirs, no GPU."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import time
from dataclasses import replace
from pathlib import Path

import lmdb
import numpy as np
import pytest
import xxhash
from conftest import wait_for

from kvstore.disk import DiskRecord, DiskTier
from kvstore.keys import NamespaceSpec

NS = NamespaceSpec(model="test-model", block_bytes=4096)
MiB = 1 << 20


def key(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def payload(i: int, size: int) -> bytes:
    """Deterministic, distinct bytes for block i."""
    seed = hashlib.sha256(f"payload-{i}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def record(i: int, data: bytes, *, parent: bytes = b"", priority: int = 35) -> DiskRecord:
    return DiskRecord(
        key=key(i),
        ns_digest=NS.digest,
        parent=parent,
        size=len(data),
        checksum=xxhash.xxh3_64_intdigest(data),
        priority=priority,
        last_access=1000.0 + i,
    )


def gate_writer(tier: DiskTier) -> threading.Event:
    """Hold the writer thread before each commit until the returned event is set."""
    release = threading.Event()
    commit = tier._writer._commit

    def gated(ops):  # type: ignore[no-untyped-def]
        release.wait(10)
        commit(ops)

    tier._writer._commit = gated  # type: ignore[method-assign]
    return release


def test_write_read_round_trip(tmp_path: Path) -> None:
    with DiskTier(str(tmp_path / "disk"), 16 * MiB) as tier:
        # three blocks of different sizes, one bigger than a page, one empty
        blobs = {i: payload(i, size) for i, size in enumerate([100_000, 4096, 0])}
        for i, data in blobs.items():
            tier.write(record(i, data), data)
        tier.flush()
        # read back as bytes
        for i, data in blobs.items():
            assert tier.read(key(i)) == data
        # read back into a caller buffer larger than the payload: out[:size] is returned
        out = memoryview(bytearray(200_000))
        got = tier.read(key(0), out)
        assert isinstance(got, memoryview) and got.obj is out.obj
        assert bytes(got) == blobs[0]
        # a key never written is a miss
        assert tier.read(key(99)) is None
        assert tier.read(key(99), out) is None
        s = tier.stats()
        assert (s.reads, s.read_misses, s.writes) == (4, 2, 3)
        assert s.bytes_read == 2 * 100_000 + 4096


def test_write_copies_payload_so_caller_may_reuse_buffer(tmp_path: Path) -> None:
    with DiskTier(str(tmp_path / "disk"), 16 * MiB) as tier:
        buf = bytearray(payload(1, 8192))
        tier.write(record(1, bytes(buf)), memoryview(buf))
        # the caller overwrites its buffer right after write() returns
        buf[:] = b"\x00" * len(buf)
        assert tier.read(key(1)) == payload(1, 8192)
        tier.flush()
        assert tier.read(key(1)) == payload(1, 8192)


def test_read_served_from_queue_before_flush(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path / "disk"), 16 * MiB)
    release = gate_writer(tier)
    try:
        data = payload(1, 50_000)
        tier.write(record(1, data), data)
        # the writer is held: nothing committed, yet the block is present and readable
        assert tier.contains(key(1))
        assert tier.read(key(1)) == data
        out = memoryview(bytearray(50_000))
        assert bytes(tier.read(key(1), out) or b"") == data
        assert tier.stats().writes == 0
        assert tier.stats().queue_bytes == 50_000
    finally:
        release.set()
    # once committed the queue is empty and the block is read from LMDB
    tier.flush()
    assert tier.stats().writes == 1 and tier.stats().queue_bytes == 0
    assert tier.read(key(1)) == data
    tier.close()


def test_delete_cancels_queued_write(tmp_path: Path) -> None:
    directory = str(tmp_path / "disk")
    tier = DiskTier(directory, 16 * MiB)
    # block 1 is committed first
    one = payload(1, 10_000)
    tier.write(record(1, one), one)
    tier.flush()
    release = gate_writer(tier)
    # hold the writer; queue block 2 and delete both
    two = payload(2, 10_000)
    tier.write(record(2, two), two)
    tier.delete(key(2))
    tier.delete(key(1))
    # both are gone at once: no longer present, readable or accounted
    assert not tier.contains(key(1)) and not tier.contains(key(2))
    assert tier.read(key(1)) is None and tier.read(key(2)) is None
    assert tier.used_bytes == 0
    assert tier.stats().queue_bytes == 0  # the cancelled payload was released
    # deleting an unknown key is a no-op
    tier.delete(key(3))
    release.set()
    tier.flush()
    tier.close()
    # after a restart neither block exists
    with DiskTier(directory, 16 * MiB) as reopened:
        assert list(reopened.records()) == []
        assert reopened.used_bytes == 0


def test_footprint_accounting(tmp_path: Path) -> None:
    with DiskTier(str(tmp_path / "disk"), 16 * MiB) as tier:
        page = 4096
        # payload pages (with LMDB's 16-byte overflow header) + one page of overhead
        assert tier.footprint(0) == 2 * page
        assert tier.footprint(page - 16) == 2 * page
        assert tier.footprint(page - 15) == 3 * page
        assert tier.footprint(2 * MiB) == (513 + 1) * page
        # used_bytes counts queued writes at once
        a, b = payload(1, 10_000), payload(2, 3 * page)
        tier.write(record(1, a), a)
        tier.write(record(2, b), b)
        assert tier.used_bytes == tier.footprint(10_000) + tier.footprint(3 * page)
        # overwriting a key replaces its footprint rather than adding to it
        bigger = payload(1, 20_000)
        tier.write(record(1, bigger), bigger)
        assert tier.used_bytes == tier.footprint(20_000) + tier.footprint(3 * page)
        assert tier.stats().records == 2
        # a delete drops its footprint immediately
        tier.delete(key(2))
        assert tier.used_bytes == tier.footprint(20_000)
        tier.flush()
        assert tier.read(key(1)) == bigger
        assert tier.stats().capacity_bytes == 16 * MiB


def test_touch_updates_metadata_visible_after_restart(tmp_path: Path) -> None:
    directory = str(tmp_path / "disk")
    tier = DiskTier(directory, 16 * MiB)
    a, b = payload(1, 5000), payload(2, 5000)
    # block 1 committed, then touched; block 2 touched while its write is still queued
    tier.write(record(1, a), a)
    tier.flush()
    tier.touch(key(1), 90, 5000.5)
    release = gate_writer(tier)
    tier.write(record(2, b), b)
    tier.touch(key(2), 7, 6000.25)
    # records() shows queued touches before they are committed
    seen = {r.key: (r.priority, r.last_access) for r in tier.records()}
    assert seen == {key(1): (90, 5000.5), key(2): (7, 6000.25)}
    release.set()
    # touching an unknown key is ignored; a priority out of range is refused
    tier.touch(key(3), 50, 1.0)
    with pytest.raises(ValueError):
        tier.touch(key(1), 101, 1.0)
    tier.close()
    # after a restart the touched fields are what LMDB holds
    with DiskTier(directory, 16 * MiB) as reopened:
        seen = {r.key: (r.priority, r.last_access) for r in reopened.records()}
        assert seen == {key(1): (90, 5000.5), key(2): (7, 6000.25)}


def test_touch_during_commit_is_not_lost(tmp_path: Path) -> None:
    directory = str(tmp_path / "disk")
    tier = DiskTier(directory, 16 * MiB)
    entered, release = threading.Event(), threading.Event()
    commit = tier._writer._commit

    def slow(ops):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(10)
        commit(ops)

    tier._writer._commit = slow  # type: ignore[method-assign]
    data = payload(1, 5000)
    tier.write(record(1, data), data)
    # the writer has taken the write into its transaction; a touch arrives meanwhile
    assert entered.wait(5)
    tier.touch(key(1), 66, 7777.0)
    release.set()
    tier.close()
    with DiskTier(directory, 16 * MiB) as reopened:
        (only,) = list(reopened.records())
        assert (only.priority, only.last_access) == (66, 7777.0)


def test_corrupt_payload_is_detected_and_dropped(tmp_path: Path) -> None:
    directory = str(tmp_path / "disk")
    data = payload(1, 30_000)
    with DiskTier(directory, 16 * MiB) as tier:
        tier.write(record(1, data), data)
        tier.write(record(2, payload(2, 30_000)), payload(2, 30_000))
    # flip one byte of block 1's payload behind the tier's back
    env = lmdb.open(directory, max_dbs=4)
    payload_db = env.open_db(b"payload")
    with env.begin(write=True) as txn:
        stored = bytearray(txn.get(key(1), db=payload_db) or b"")
        stored[12_345] ^= 0x01
        txn.put(key(1), bytes(stored), db=payload_db)
    env.close()
    with DiskTier(directory, 16 * MiB) as tier:
        # the corrupt block reads as a miss and is deleted; its neighbour is fine
        assert tier.contains(key(1))
        assert tier.read(key(1)) is None
        assert tier.stats().corrupt_reads == 1
        assert not tier.contains(key(1))
        assert tier.read(key(2)) == payload(2, 30_000)
        tier.flush()
    # the deletion was committed: it is gone after a restart
    with DiskTier(directory, 16 * MiB) as tier:
        assert [r.key for r in tier.records()] == [key(2)]


def test_restart_rebuilds_records_used_bytes_and_namespaces(tmp_path: Path) -> None:
    directory = str(tmp_path / "disk")
    other = NamespaceSpec(model="other", block_bytes=128, hash_algorithm="xxh3-128")
    # a chain of three blocks with parents and a 16-byte-key block of another namespace
    written = []
    with DiskTier(directory, 16 * MiB) as tier:
        parent = b""
        for i in range(3):
            data = payload(i, 9000 + i)
            rec = record(i, data, parent=parent, priority=10 * i)
            tier.write(rec, data)
            written.append(rec)
            parent = rec.key
        small = payload(7, 128)
        rec16 = DiskRecord(
            key(7)[:16], other.digest, b"", 128, xxhash.xxh3_64_intdigest(small), 0, 1.5
        )
        tier.write(rec16, small)
        written.append(rec16)
        tier.save_namespace(NS.digest, NS.to_dict())
        tier.save_namespace(other.digest, other.to_dict())
        used = tier.used_bytes
    # re-open: every committed record comes back with all of its fields
    with DiskTier(directory, 16 * MiB) as tier:
        back = sorted(tier.records(), key=lambda r: r.key)
        # ... and where its payload lies in data.mdb, for the ones in overflow runs
        assert [r.offset > 0 for r in back] == [r.size > 4096 for r in back]
        fd = os.open(tier.data_path, os.O_RDONLY)
        try:
            for r in back:
                if r.offset:
                    assert xxhash.xxh3_64_intdigest(os.pread(fd, r.size, r.offset)) == r.checksum
        finally:
            os.close(fd)
        back = [replace(r, offset=0) for r in back]
        assert back == sorted(written, key=lambda r: r.key)
        assert tier.used_bytes == used
        assert tier.stats().records == 4
        spaces = tier.namespaces()
        assert spaces == {NS.digest: NS.to_dict(), other.digest: other.to_dict()}
        assert NamespaceSpec.from_dict(spaces[other.digest]).digest == other.digest
        assert tier.read(key(7)[:16]) == small
        assert tier.read(key(2)) == payload(2, 9002)


def test_records_scan_spans_several_chunks(tmp_path: Path) -> None:
    # more records than one read transaction of records() takes (1024)
    with DiskTier(str(tmp_path / "disk"), 64 * MiB) as tier:
        for i in range(2100):
            tier.write(record(i, b"x"), b"x")
        tier.flush()
        tier.delete(key(5))
        keys = [r.key for r in tier.records()]
        assert len(keys) == len(set(keys)) == 2099
        assert key(5) not in keys


def test_map_full_is_handled_never_raised(tmp_path: Path) -> None:
    directory = str(tmp_path / "disk")
    # the tier believes it has 64 MiB, but its LMDB map starts at 1 MiB
    tier = DiskTier(directory, 64 * MiB, _map_size_override=1 * MiB)
    blobs: dict[int, bytes] = {}
    order: list[int] = []
    drained = 0
    for i in range(120):
        data = payload(i, 64 << 10)
        blobs[i] = data
        tier.write(record(i, data), data)
        order.append(i)
        # act as the store: after a map-full event, evict the oldest until it fits
        if tier.drain_shrunk():
            drained += 1
            while tier.used_bytes > tier.capacity_bytes and order:
                tier.delete(key(order.pop(0)))
        if i % 20 == 19:
            tier.flush()
    tier.flush()
    s = tier.stats()
    assert s.map_full_events >= 1 and drained >= 1
    assert s.capacity_bytes < 64 * MiB  # the effective capacity went down
    assert s.map_size_bytes > 1 * MiB  # the map grew, by a bounded amount
    assert s.map_size_bytes <= 2 * MiB
    # every block the tier reports as present reads back byte-exact
    present = [i for i in blobs if tier.contains(key(i))]
    assert present, "the tier should still hold the most recent blocks"
    for i in present:
        assert tier.read(key(i)) == blobs[i]
    tier.close()
    # and so it does after a restart
    with DiskTier(directory, 64 * MiB, _map_size_override=1 * MiB) as reopened:
        keys = {r.key for r in reopened.records()}
        assert keys == {key(i) for i in present}
        for i in present:
            assert reopened.read(key(i)) == blobs[i]


def test_single_write_larger_than_map_is_dropped_not_raised(tmp_path: Path) -> None:
    with DiskTier(str(tmp_path / "disk"), 64 * MiB, _map_size_override=1 * MiB) as tier:
        small = payload(1, 1000)
        tier.write(record(1, small), small)
        # 4 MiB can never fit a map limited to 1.5 MiB: dropped, counted, not raised
        huge = payload(2, 4 * MiB)
        tier.write(record(2, huge), huge)
        tier.flush()
        assert not tier.contains(key(2)) and tier.read(key(2)) is None
        assert tier.stats().dropped_writes == 1
        assert tier.read(key(1)) == small


def test_backpressure_with_tiny_queue_does_not_deadlock(tmp_path: Path) -> None:
    size = 32 << 10
    with DiskTier(str(tmp_path / "disk"), 64 * MiB, queue_bytes=2 * size, batch_bytes=size) as tier:
        # two threads write 80 blocks through a queue that holds two of them
        def produce(start: int) -> None:
            for i in range(start, start + 40):
                data = payload(i, size)
                assert tier.write(record(i, data), data, wait_s=20)

        threads = [threading.Thread(target=produce, args=(s,)) for s in (0, 40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
            assert not t.is_alive()
        # a payload larger than the whole queue is still taken (when the queue is empty)
        big = payload(100, 5 * size)
        assert tier.write(record(100, big), big, wait_s=20)
        tier.flush()
        assert tier.stats().queue_bytes == 0
        for i in [*range(80), 100]:
            assert tier.read(key(i)) == payload(i, 5 * size if i == 100 else size)


def test_write_never_waits_for_a_full_queue_unless_asked(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path / "disk"), 16 * MiB, queue_bytes=10_000)
    release = gate_writer(tier)
    # the first write fills the queue; the writer is held, so a second write is refused
    assert tier.write(record(1, payload(1, 8000)), payload(1, 8000))
    assert tier.write(record(2, payload(2, 8000)), payload(2, 8000)) is False
    assert not tier.contains(key(2)) and tier.stats().refused_writes == 1
    # wait_s waits for room: once the writer commits the first, the second goes through
    done = threading.Event()

    def second() -> None:
        if tier.write(record(2, payload(2, 8000)), payload(2, 8000), wait_s=5):
            done.set()

    thread = threading.Thread(target=second)
    thread.start()
    assert not done.wait(0.2)
    release.set()
    assert done.wait(5)
    thread.join()
    tier.close()


def test_concurrent_readers_while_writer_commits(tmp_path: Path) -> None:
    # a small map so that the writer also grows it while readers are active
    tier = DiskTier(str(tmp_path / "disk"), 64 * MiB, _map_size_override=2 * MiB)
    size = 16 << 10
    for i in range(20):
        tier.write(record(i, payload(i, size)), payload(i, size))
    tier.flush()
    stop = threading.Event()
    errors: list[str] = []
    reads = [0]

    def reader(seed: int) -> None:
        out = memoryview(bytearray(size))
        n = seed
        while not stop.is_set():
            n = (n * 7 + 3) % 20
            got = tier.read(key(n), out if n % 2 else None)
            # blocks 0..19 are never deleted: every read must hit, byte-exact
            if got is None or bytes(got) != payload(n, size):
                errors.append(f"block {n}: {'miss' if got is None else 'wrong bytes'}")
            reads[0] += 1
            time.sleep(0.0005)  # readers that never yield the GIL would starve the writer

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    # meanwhile write 150 more blocks, evicting as the store would
    for i in range(20, 170):
        tier.write(record(i, payload(i, size)), payload(i, size))
        if tier.drain_shrunk():
            for j in range(20, i - 10):
                tier.delete(key(j))
    tier.flush()
    stop.set()
    for t in threads:
        t.join()
    grown = tier.stats().map_size_bytes > 2 * MiB
    tier.close()
    assert errors == []
    assert reads[0] > 0
    assert grown, "the map should have been resized while the readers ran"


def test_failing_commits_stop_writes_then_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstore.disk import writer

    free = [0]  # the file system's free bytes, as the tier sees them: full, at first
    monkeypatch.setattr(writer, "free_bytes", lambda directory: free[0])
    tier = DiskTier(str(tmp_path / "disk"), 16 * MiB)
    committed = payload(9, 20_000)
    tier.write(record(9, committed), committed)
    tier.flush()
    commit = tier._writer._commit
    failing = threading.Event()
    failing.set()
    attempts = [0]

    def flaky(ops):  # type: ignore[no-untyped-def]
        if failing.is_set():
            attempts[0] += 1
            raise OSError(28, "No space left on device")
        commit(ops)

    tier._writer._commit = flaky  # type: ignore[method-assign]
    reserve = tmp_path / "disk" / "kvstored-reserve"
    assert reserve.stat().st_size >= 4 * MiB  # space set aside for a full disk's deletes
    data = payload(1, 20_000)
    with caplog.at_level(logging.DEBUG, logger="kvstore.disk"):
        assert tier.write(record(1, data), data)
        # the failing write stays readable from the queue while it is retried
        assert tier.read(key(1)) == data
        assert tier.wait_committed([key(1)], timeout=10) == 0  # a fault ends the wait
        stats = tier.stats()
        assert not stats.writable and "No space left" in stats.fault
        # capacity drops to what is committed; the store evicts down to it
        assert stats.capacity_bytes == tier.footprint(20_000)
        assert not reserve.exists()  # given back, so that deletes can commit
        assert tier.drain_shrunk() and not tier.drain_shrunk()
        # new writes are refused at once, never queued behind the fault
        other = payload(2, 20_000)
        assert tier.write(record(2, other), other) is False and not tier.contains(key(2))
        assert tier.read(key(9)) == committed  # what is committed stays readable
        free[0] = 1 << 30  # space comes back: the next retry commits and ends the fault
        failing.clear()
        deadline = time.monotonic() + 10
        while tier.fault and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tier.wait_committed([key(1)], timeout=10) == 1
        assert tier.stats().writable and tier.capacity_bytes == 16 * MiB
        assert reserve.exists()  # taken back: the file system had room for it
    assert attempts[0] >= 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and not errors[0].exc_info  # one line per state change
    assert any("takes writes again" in r.getMessage() for r in caplog.records)
    tier.close()


def test_a_write_that_keeps_failing_is_dropped_and_the_fault_ends(tmp_path: Path) -> None:
    # a write the file cannot take (a quota, a file size limit) while deletes still
    # commit: after _DROP_AFTER failed retries it is dropped, and the fault ends, rather
    # than the tier waiting on it until some eviction happens to make room
    tier = DiskTier(str(tmp_path / "disk"), 16 * MiB)
    commit = tier._writer._commit

    def writes_fail(ops):  # type: ignore[no-untyped-def]
        if any(op.key == key(1) and hasattr(op, "record") for op in ops):  # its write
            raise OSError(27, "File too large")
        commit(ops)

    tier._writer._commit = writes_fail  # type: ignore[method-assign]
    data = payload(1, 20_000)
    assert tier.write(record(1, data), data)
    assert wait_for(lambda: tier.stats().dropped_writes == 1)
    assert wait_for(lambda: not tier.fault)
    assert not tier.contains(key(1)) and tier.read(key(1)) is None  # a miss, never stale
    other = payload(2, 20_000)
    assert tier.write(record(2, other), other)  # it takes writes again
    assert tier.wait_committed([key(2)], timeout=10) == 1
    tier.close()


def test_close_counts_writes_it_could_not_persist(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path / "disk"), 16 * MiB)

    def broken(ops):  # type: ignore[no-untyped-def]
        raise OSError(5, "Input/output error")

    tier._writer._commit = broken  # type: ignore[method-assign]
    for i in range(3):
        data = payload(i, 10_000)
        tier.write(record(i, data), data)
    started = time.monotonic()
    tier.close()
    assert time.monotonic() - started < 10
    assert tier.stats().lost_writes == 3


def test_flush_timeout(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path / "disk"), 16 * MiB)
    release = gate_writer(tier)
    tier.write(record(1, b"abc"), b"abc")
    with pytest.raises(TimeoutError):
        tier.flush(timeout=0.05)
    release.set()
    tier.flush(timeout=5)
    tier.close()


def test_close_is_idempotent_and_final(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    tier = DiskTier(str(directory), 16 * MiB)
    # the environment directory is private to the daemon's user
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    tier.write(record(1, b"abc"), b"abc")
    # close flushes what is queued, and may be called again
    tier.close()
    tier.close()
    with pytest.raises(RuntimeError):
        tier.write(record(2, b"x"), b"x")
    with pytest.raises(RuntimeError):
        tier.read(key(1))
    with DiskTier(str(directory), 16 * MiB) as reopened:
        assert reopened.read(key(1)) == b"abc"


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with DiskTier(str(tmp_path / "disk"), 16 * MiB) as tier:
        data = payload(1, 100)
        with pytest.raises(ValueError):  # size does not match the payload
            tier.write(record(1, data), data + b"!")
        with pytest.raises(ValueError):  # keys are 16 or 32 bytes
            tier.write(DiskRecord(b"short", NS.digest, b"", 100, 0, 35, 0.0), data)
        with pytest.raises(ValueError):  # priority is 0..100
            tier.write(record(1, data, priority=101), data)
        tier.write(record(1, data), data)
        tier.flush()
        with pytest.raises(ValueError):  # out too small
            tier.read(key(1), memoryview(bytearray(10)))
        with pytest.raises(ValueError):
            tier.save_namespace(b"not a digest", {})
        assert tier.stats().records == 1


def test_records_keep_their_tokens_and_older_versions_still_read() -> None:
    from kvstore.disk.format import META_V1, META_V2, pack_record, unpack_fields, unpack_record

    tokens = np.arange(16, dtype="<u4").tobytes()
    rec = DiskRecord(key(1), NS.digest, key(0), 4096, 7, 35, 1.5, 8192, tokens, 2, 1)
    assert unpack_record(rec.key, pack_record(rec)) == rec
    fields = (NS.digest, 32, key(0), 4096, 7, 35, 1.5)
    v2 = META_V2.pack(2, *fields, 8192)
    v1 = META_V1.pack(1, *fields)
    assert unpack_fields(v2) == (NS.digest, key(0), 4096, 7, 35, 1.5, 8192, b"", 0, 0)
    assert unpack_fields(v1) == (NS.digest, key(0), 4096, 7, 35, 1.5, 0, b"", 0, 0)
    with pytest.raises(ValueError, match="tokens"):  # a count that is not what follows
        unpack_fields(pack_record(rec)[:-4])
