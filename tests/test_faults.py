"""Faults against a real kvstored: a full disk, crashes, killed clients, damaged and
shared disk files, undecodable requests. Each test checks the answer the fault gets
(status code, log line, exit code) and that nothing else changed.

A full disk is a file size limit on the daemon (RLIMIT_FSIZE: writes past it fail
as a full file system's do, and every test machine can set it); benchmarks/torture.py
also runs it on a small tmpfs where it may mount one.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from conftest import (
    Daemon,
    block_bytes_for,
    get_chain,
    kv_stub,
    open_ns,
    put_chain,
    store_snapshot,
    wait_for,
)

from kvbench.torture_kit import damage_btree, damage_free_list
from kvproto.v1 import kvstore_pb2 as pb
from kvstored.config import DISK_SIZE_FILE

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 256 << 10
TOKENS = 4  # per block


def chain_tokens(seed: int, blocks: int) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * TOKENS)]


def file_size_limit(limit: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def stats(stub: object) -> pb.StatsResponse:
    return stub.Stats(pb.StatsRequest(), timeout=10)  # type: ignore[attr-defined]


# --- a full disk ------------------------------------------------------------------------


FAULT_LINE = "disk tier stopped taking writes"
RECOVERED_LINE = "disk tier takes writes again"


def fill_until_fault(daemon: Daemon, stub: object, info: object) -> int:
    """Put 8-block chains until the daemon logs that the disk tier stopped taking
    writes; the last seed put. Every call answers meanwhile (timeouts: no wedge)."""
    for seed in range(1, 60):
        reply, _ = put_chain(stub, info, chain_tokens(seed, 8), seed=seed)
        assert reply.stored == 8
        stub.ServerInfo(pb.ServerInfoRequest(), timeout=10)  # type: ignore[attr-defined]
        if FAULT_LINE in daemon.output():
            return seed
    pytest.fail("the disk tier never reported the full disk")


def test_full_disk_never_wedges_and_recovers(kvstored_factory: Callable[..., Daemon]) -> None:
    daemon = kvstored_factory(
        start=False, host_bytes="16MiB", disk_bytes="256MiB", admission="write-through"
    )
    daemon.preexec = file_size_limit(24 << 20)  # data.mdb cannot grow past 24 MiB
    daemon.start()
    stub = kv_stub(daemon)
    info = open_ns(stub, block_bytes=BLOCK, block_tokens=TOKENS)
    last = fill_until_fault(daemon, stub, info)

    # calls keep answering while the disk is full: puts store in host; what is on
    # disk (or still in host) reads back byte-exact, the rest is a miss
    durable: dict[int, int] = {}
    for seed in range(last + 1, last + 9):
        reply, _ = put_chain(stub, info, chain_tokens(seed, 8), seed=seed)
        assert reply.stored == 8
        durable[seed] = reply.durable
    for seed in range(1, last + 9):
        header, got = get_chain(stub, info.ns_id, chain_tokens(seed, 8))
        n = header.ready_blocks
        assert got == b"".join(block_bytes_for(seed, i, BLOCK) for i in range(n))
    assert any(count < 8 for count in durable.values())  # the full disk made some not durable

    # it recovers by itself once evictions freed room; one line per state change,
    # never a traceback per retry
    assert wait_for(lambda: RECOVERED_LINE in daemon.output()), daemon.output()[-3000:]
    log = daemon.output()
    assert 0 <= log.count(FAULT_LINE) - log.count(RECOVERED_LINE) <= 1
    # each fault keeps more of the file free: the tier does not go off and on with every
    # batch (it did when it regained the file system's free space, which a file size
    # limit does not lower)
    assert log.count(FAULT_LINE) <= 4, log
    assert "Traceback" not in log
    assert wait_for(lambda: stats(stub).disk_writable), daemon.output()[-3000:]
    counters = stats(stub).counters
    assert counters["disk_refused_writes"] > 0
    assert daemon.stop() == 0


@pytest.fixture
def small_tmpfs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A 48 MiB tmpfs (a file system that really fills up; another size by indirect
    parametrization); skipped where this cannot mount one (not root, or no mount
    permission in the container)."""
    where = tmp_path / "small"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    size = getattr(request, "param", "48m")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True, check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_file_system_does_not_keep_the_tier_off(
    kvstored_factory: Callable[..., Daemon], small_tmpfs: Path
) -> None:
    # LMDB writes even a delete as new pages: without the reserve the disk tier gives
    # back at its first fault, the evictions could not commit on a full file system
    daemon = kvstored_factory(
        host_bytes="16MiB", disk_bytes="256MiB", admission="write-through",
        disk_dir=str(small_tmpfs / "disk"),
    )
    stub = kv_stub(daemon)
    info = open_ns(stub, block_bytes=BLOCK, block_tokens=TOKENS)
    for seed in range(1, 400):  # as an engine would: puts, and reads of older prompts
        put_chain(stub, info, chain_tokens(seed, 4), seed=seed)
        get_chain(stub, info.ns_id, chain_tokens(max(1, seed - 7), 4))
        if RECOVERED_LINE in daemon.output():
            break
    assert RECOVERED_LINE in daemon.output(), daemon.output()[-3000:]
    assert wait_for(lambda: stats(stub).disk_writable)
    reply, _ = put_chain(stub, info, chain_tokens(9000, 2), seed=9000)
    assert (reply.stored, reply.durable) == (2, 2)  # durable again, on the same full disk
    assert daemon.stop() == 0


@pytest.mark.parametrize(
    ("small_tmpfs", "disk_bytes"), [("48m", "32MiB"), ("288m", None)], indirect=["small_tmpfs"]
)  # None: the automatic size, which a full file system cannot give from its free space
def test_a_fresh_disk_dir_on_a_full_file_system_starts_without_the_disk_tier(
    kvstored_factory: Callable[..., Daemon], small_tmpfs: Path, disk_bytes: str | None
) -> None:
    ballast = small_tmpfs / "ballast"
    chunk = bytes(16 << 20)
    with open(ballast, "wb") as fill, contextlib.suppress(OSError):
        while True:  # until the file system is full
            fill.write(chunk)
    daemon = kvstored_factory(
        host_bytes="16MiB", disk_bytes=disk_bytes, admission="write-through",
        disk_dir=str(small_tmpfs / "disk"),
    )  # fmt: skip
    assert "disk tier off: no room at" in daemon.output()
    if disk_bytes is None:  # 25% of the file system's size, for this start only
        assert not (small_tmpfs / "disk" / DISK_SIZE_FILE).exists()
    stub = kv_stub(daemon)
    assert not stats(stub).disk_writable  # (kvstore_disk_writable 0, kvctl status says why)
    info = open_ns(stub, block_bytes=BLOCK, block_tokens=TOKENS)
    reply, _ = put_chain(stub, info, chain_tokens(1, 4), seed=1)
    assert (reply.stored, reply.durable) == (4, 0)  # served from host meanwhile
    ballast.unlink()  # room again: the tier attaches by itself
    assert wait_for(lambda: stats(stub).disk_writable), daemon.output()[-2000:]
    assert "disk tier attached" in daemon.output()
    reply, _ = put_chain(stub, info, chain_tokens(2, 4), seed=2)
    assert (reply.stored, reply.durable) == (4, 4)
    assert daemon.stop() == 0


def test_capacity_comes_back_after_a_full_file_system(small_tmpfs: Path) -> None:
    """Other files and data.mdb fill the file system under a disk tier of 32 MiB, and
    the fault lowers its capacity to what is committed. Evictions then delete 3 of
    every 4 blocks: their pages are free inside data.mdb (the file never shrinks, so
    the file system stays full), and the tier counts them as free again: its fault
    ends and its capacity is 90% of what data.mdb holds (about 29 of the 32 MiB; it
    had fallen to what was committed, when that was less) with no one's help."""
    import xxhash

    from kvstore.disk import DiskRecord, DiskTier

    (small_tmpfs / "ballast").write_bytes(bytes(12 << 20))  # the file system's other files
    configured, size = 32 << 20, 128 << 10
    with DiskTier(str(small_tmpfs / "disk"), configured) as tier:
        keys: list[bytes] = []
        for i in range(2 * configured // size):  # (queued past capacity: no store evicts)
            data = i.to_bytes(4, "little") * (size // 4)
            key = i.to_bytes(4, "little") * 8
            record = DiskRecord(key, b"n" * 32, b"", size, xxhash.xxh3_64_intdigest(data), 0, 0.0)
            if not tier.write(record, data, wait_s=10):
                break
            keys.append(key)
        assert wait_for(lambda: bool(tier.fault)), "the file system never filled"
        lowered = tier.stats().capacity_bytes
        assert lowered < configured
        for key in keys[: len(keys) * 3 // 4]:  # what the store's evictions do
            tier.delete(key)
        data_mdb = small_tmpfs / "disk" / "data.mdb"
        assert data_mdb.stat().st_size > 0.85 * configured  # it filled the file system
        assert wait_for(
            lambda: not tier.fault
            and tier.stats().capacity_bytes >= int(0.9 * data_mdb.stat().st_size)
        ), (tier.fault, lowered, tier.stats().capacity_bytes)


def test_stop_with_a_failing_disk_counts_what_was_lost_and_exits_3(
    kvstored_factory: Callable[..., Daemon],
) -> None:
    # files may not grow past 6 MiB: the 4 MiB arena fits, the disk tier hardly does
    daemon = kvstored_factory(
        start=False, host_bytes="4MiB", disk_bytes="64MiB", admission="write-back"
    )
    daemon.preexec = file_size_limit(6 << 20)
    daemon.start()
    stub = kv_stub(daemon)
    info = open_ns(stub, block_bytes=BLOCK, block_tokens=TOKENS)
    for seed in range(1, 4):
        put_chain(stub, info, chain_tokens(seed, 8), seed=seed)  # host only, due at stop
    code = daemon.stop()
    assert code == 3, daemon.output()[-3000:]
    assert "stopped uncleanly" in daemon.output()


# --- crashes --------------------------------------------------------------------------


def test_write_through_durable_puts_survive_kill_9(
    kvstored_factory: Callable[..., Daemon],
) -> None:
    from kvclient import KVClient

    daemon = kvstored_factory(host_bytes="16MiB", admission="write-through")
    durable: dict[int, int] = {}
    for cycle in range(3):
        with KVClient(daemon.addr) as client:
            ns = client.namespace("crash-model", block_tokens=TOKENS, block_bytes=BLOCK)
            for seed in range(cycle * 10, cycle * 10 + 6):
                rows = [block_bytes_for(seed, i, BLOCK) for i in range(3)]
                result = ns.put(chain_tokens(seed, 3), rows)
                assert result.stored == 3
                durable[seed] = result.durable
        daemon.kill()  # SIGKILL: no shutdown, no persisting
        daemon.start()
    assert all(count == 3 for count in durable.values()), durable
    with KVClient(daemon.addr) as client:
        ns = client.namespace("crash-model", block_tokens=TOKENS, block_bytes=BLOCK)
        for seed in durable:
            got = ns.get(chain_tokens(seed, 3))
            assert got.n_blocks == 3, f"durable chain {seed} lost"
            assert got.blocks.tobytes() == b"".join(
                block_bytes_for(seed, i, BLOCK) for i in range(3)
            )


# --- a killed client --------------------------------------------------------------------

HOLDER = """
import sys, time
from kvclient import KVClient
addr, mode, arena = sys.argv[1], sys.argv[2], sys.argv[3] == "arena"
client = KVClient(addr, use_arena=arena)
ns = client.namespace("holder-model", block_tokens=4, block_bytes=262144)
tokens = list(range(4 * 40))
if mode == "claim":
    held = ns.claim(tokens)          # 40 pending blocks, never delivered
elif mode == "acquire":
    ns.put(tokens[:16], [bytes([7]) * 262144] * 4)
    held = ns.acquire(tokens[:16])   # a read lease, never released
elif mode == "stage":
    for i in range(3):               # puts that leave staged slots set aside
        ns.put([9000 + i * 64 + t for t in range(16)], [bytes([i]) * 262144] * 4)
elif mode == "fork":                 # a claim, then a child that outlives this process
    held = ns.claim(tokens)
    import os
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print(child, flush=True)
print("holding", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(
    ("mode", "arena"),
    [("claim", True), ("claim", False), ("acquire", True), ("stage", True), ("fork", True)],
    ids=["claim-local", "claim-grpc", "acquire-local", "staged-local", "forked-child-local"],
)
def test_a_killed_clients_leases_end_with_it(
    kvstored: Daemon, mode: str, arena: bool
) -> None:
    stub = kv_stub(kvstored)
    before = store_snapshot(stub)
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, kvstored.addr, mode, "arena" if arena else "inline"],
        stdout=subprocess.PIPE, text=True,
    )
    forked = 0  # ("fork": a child of the holder, alive after the holder is killed)
    try:
        assert child.stdout is not None
        line = child.stdout.readline().strip()
        if mode == "fork":
            forked, line = int(line), child.stdout.readline().strip()
        assert line == "holding"
        held = stats(stub)
        assert held.leases + held.pending_blocks + held.staged_bytes > 0
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert wait_for(
            lambda: (s := stats(stub)).leases == 0
            and s.pending_blocks == 0
            and s.staged_bytes == 0,
            timeout=5,
        ), stats(stub)
    finally:
        child.kill()
        child.wait()
        if forked:
            os.kill(forked, signal.SIGKILL)
    after = store_snapshot(stub)
    assert after["pending_blocks"] == before["pending_blocks"] == 0
    assert "leases of a client that went away" in kvstored.output()


# --- damaged files ----------------------------------------------------------------------


def put_some(daemon: Daemon, seeds: range) -> object:
    stub = kv_stub(daemon)
    info = open_ns(stub, block_bytes=BLOCK, block_tokens=TOKENS)
    for seed in seeds:
        put_chain(stub, info, chain_tokens(seed, 4), seed=seed)
    return info


def damaged_copies(disk_dir: str) -> list[str]:
    return [name for name in os.listdir(disk_dir) if name.startswith("data.mdb.damaged-")]


@pytest.mark.parametrize("cut", ["half", "zero"])
def test_a_truncated_disk_file_is_moved_aside_at_start(
    kvstored_factory: Callable[..., Daemon], cut: str
) -> None:
    daemon = kvstored_factory(admission="write-through")
    put_some(daemon, range(1, 5))
    assert daemon.stop() == 0
    data = Path(daemon.disk_dir) / "data.mdb"
    os.truncate(data, data.stat().st_size // 2 if cut == "half" else 0)
    daemon.start()  # no SIGBUS: it starts, with an empty disk tier
    stub = kv_stub(daemon)
    disk = [t for t in stats(stub).tiers if t.name == "disk"][0]
    assert disk.blocks == 0
    assert len(damaged_copies(daemon.disk_dir)) == 1
    log = daemon.output()
    assert "was damaged" in log and "moved it aside" in log
    info = put_some(daemon, range(10, 12))  # and the new tier works
    header, _ = get_chain(stub, info.ns_id, chain_tokens(10, 4))  # type: ignore[attr-defined]
    assert header.ready_blocks == 4
    assert daemon.stop() == 0


def overwrite_btree_pages(disk_dir: str) -> int:
    """benchmarks/torture.py's damage_btree on the daemon's data.mdb; pages hit."""
    return damage_btree(Path(disk_dir) / "data.mdb")


def test_damaged_btree_pages_are_found_at_start(
    kvstored_factory: Callable[..., Daemon],
) -> None:
    daemon = kvstored_factory(admission="write-through")
    put_some(daemon, range(1, 4))
    assert daemon.stop() == 0
    assert overwrite_btree_pages(daemon.disk_dir) > 0
    daemon.start()
    assert len(damaged_copies(daemon.disk_dir)) == 1
    assert "was damaged" in daemon.output()
    assert daemon.stop() == 0


def test_a_damaged_free_list_is_moved_aside_at_start(
    kvstored_factory: Callable[..., Daemon],
) -> None:
    # LMDB would hand a live page to the next commit (or, past the file, fail every
    # commit on every restart): the start-up check reads the free list too
    daemon = kvstored_factory(admission="write-through")
    put_some(daemon, range(1, 4))
    assert daemon.stop() == 0
    damage_free_list(Path(daemon.disk_dir) / "data.mdb")
    daemon.start()
    assert wait_for(lambda: len(damaged_copies(daemon.disk_dir)) == 1), daemon.output()[-3000:]
    assert "free list" in daemon.output()
    stub = kv_stub(daemon)
    info = open_ns(stub, block_bytes=BLOCK, block_tokens=TOKENS)
    reply, _ = put_chain(stub, info, chain_tokens(20, 4), seed=20)
    assert (reply.stored, reply.durable) == (4, 4)  # durable again, on a sound file
    assert daemon.stop() == 0


def test_a_page_damaged_while_running_is_a_miss_not_an_error(
    kvstored_factory: Callable[..., Daemon],
) -> None:
    daemon = kvstored_factory(host_bytes="4MiB", admission="write-through")
    info = put_some(daemon, range(1, 8))  # 7 MiB: most of it only on disk now
    stub = kv_stub(daemon)
    overwrite_btree_pages(daemon.disk_dir)
    for seed in range(1, 8):
        try:
            header, got = get_chain(stub, info.ns_id, chain_tokens(seed, 4))  # type: ignore[attr-defined]
        except grpc.RpcError as exc:  # pragma: no cover - the failure this test guards
            pytest.fail(f"a damaged page made Get fail: {exc.code()} {exc.details()}")
        expected = b"".join(block_bytes_for(seed, i, BLOCK) for i in range(header.ready_blocks))
        assert got == expected  # a prefix of the right bytes, or a miss
    assert "internal error" not in daemon.output()
    assert daemon.running


# --- two daemons, one disk_dir ------------------------------------------------------------


def test_a_second_daemon_on_the_same_disk_dir_refuses_to_start(
    kvstored_factory: Callable[..., Daemon],
) -> None:
    first = kvstored_factory()
    second = kvstored_factory(start=False, disk_dir=first.disk_dir)
    done = subprocess.run(
        second.command(), capture_output=True, text=True, timeout=60, env=second.env, check=False
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"pid {first.pid}" in lines[0] and first.disk_dir in lines[0]
    assert first.running


# --- bad bytes --------------------------------------------------------------------------

UNARY = ["OpenNamespace", "Lookup", "LookupBatch", "Acquire", "Release", "ReportReads", "Reserve",
         "Commit", "Abandon", "Delete", "Clear", "SetPriority", "Stats"]


def test_undecodable_requests_get_invalid_argument_and_no_traceback(kvstored: Daemon) -> None:
    channel = kvstored.channel()
    stub = kv_stub(kvstored)
    open_ns(stub)
    before = store_snapshot(stub)
    garbage = b"\xff\xff\xff\xff\x0f\x08"  # a field with a truncated varint
    for name in UNARY:
        call = channel.unary_unary(f"/kvstore.v1.KVStore/{name}")
        with pytest.raises(grpc.RpcError) as failed:
            call(garbage, timeout=10)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    for name in ("Get", "WatchEvents", "Session"):
        stream = channel.unary_stream(f"/kvstore.v1.KVStore/{name}")
        with pytest.raises(grpc.RpcError) as failed:
            list(stream(garbage, timeout=10))
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    put = channel.stream_unary("/kvstore.v1.KVStore/Put")
    with pytest.raises(grpc.RpcError) as failed:
        put(iter([garbage]), timeout=10)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert store_snapshot(stub) == before
    assert "Traceback" not in kvstored.output()


def test_report_reads_cannot_claim_more_than_a_client_could_read(kvstored: Daemon) -> None:
    from kvproto.v1.limits import MAX_READS_PER_PREFIX

    stub = kv_stub(kvstored)
    info = open_ns(stub)
    tokens = list(range(8))
    put_chain(stub, info, tokens)
    hits = [t.hits for t in stats(stub).tiers if t.name == "host"][0]
    prefix = pb.PrefixReads(ns_id=info.ns_id, tokens=tokens, n_blocks=2)
    prefix.reads = 10**9
    with pytest.raises(grpc.RpcError) as failed:
        stub.ReportReads(pb.ReportReadsRequest(prefixes=[prefix]), timeout=10)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [t.hits for t in stats(stub).tiers if t.name == "host"][0] == hits
    prefix.reads = MAX_READS_PER_PREFIX
    stub.ReportReads(pb.ReportReadsRequest(prefixes=[prefix]), timeout=10)
    assert [t.hits for t in stats(stub).tiers if t.name == "host"][0] == hits + 2 * prefix.reads


# --- the torture program, short ---------------------------------------------------------


def test_torture_quick_run_meets_every_target(tmp_path: Path) -> None:
    """benchmarks/torture.py --quick: a kill cycle per admission mode, a client killed
    per operation, a few seconds of a full disk, the damages no test here starts a
    daemon on, a hostile tenant, 300 fuzzed requests, 4 processes of load, 6 tenants
    reading long prefixes at once after a restart. Exit 0 means every target line says
    yes."""
    report = tmp_path / "reliability.md"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "torture.py"), "--quick", "--out", str(report)],
        capture_output=True, text=True, timeout=900, check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    text = report.read_text()
    for title in ("Crashes", "Killed clients", "A full disk", "Damaged files",
                  "A hostile tenant", "Request fuzzing", "Mixed load",
                  "Many readers of long prefixes"):
        assert f"## {title}" in text
    assert "**NO**" not in text
