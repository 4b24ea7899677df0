"""Torture kvstore the way bad luck would, and write what held to docs/reliability.md.

Parts (each against a real kvstored on a unix socket in a temp dir):

- ``crash``: kill -9 cycles during mixed puts (arena, sent ahead, inline), per
  admission mode. Every chain a writer tried is read back after each restart:
  acknowledged blocks, durable ones, lost, corrupt served (bytes that differ from what
  was put), orphans held (blocks indexed but not reachable from their chain's root).
- ``client``: clients killed mid put / get / acquire / claim; how long until the
  store holds nothing of theirs (leases, pending blocks, staged slots).
- ``diskfull``: the disk tier on a small tmpfs (when this runs as root and may mount
  one), else behind a file size limit (RLIMIT_FSIZE: the same failed writes), under
  a stream of write-through puts, with the latency of every call while full.
- ``damage``: data.mdb truncated, emptied, its B-tree pages, a value, its free list or
  an overflow run's header overwritten, replaced by noise; whether the daemon starts,
  moves it aside, serves anything corrupt, and takes durable puts after.
- ``indexload``: kill -9 while a large disk tier's index loads behind the start;
  nothing committed lost, nothing indexed without its ancestors.
- ``tenants``: a hostile tenant against another on one daemon
  (:mod:`kvbench.torture_tenants`): its namespace by id, a stolen lease id, waits
  parked past the daemon's threads, event churn, a namespace flood, large calls
  without a token, guessed tokens.
- ``fuzz``: random and mutated requests over both sockets (gRPC and local calls).
- ``readers``: many tenants reading long prefixes at once, right after a restart
  (:mod:`kvbench.torture_readers`): how long until every read is whole, another
  tenant's calls meanwhile, a SIGTERM with the reads in flight, readers sharing one
  host room.
- ``load``: N processes of mixed traffic for a while: latency percentiles per call,
  errors, the daemon's memory.

Targets (from issue #25): 100 kill cycles with 0 corrupt or orphan blocks served and
0 durable blocks lost; no call slower than 1 s while the disk is full; the store
usable within 1 s after a client is killed; fuzzing: 0 UNKNOWN or INTERNAL, 0 crashes.

usage: python benchmarks/torture.py [--quick] [--parts crash,client,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvbench.torture_kit import (
    TOKENS,
    Kvstored,
    Section,
    block_of,
    chain_bytes,
    damage_btree,
    damage_free_list,
    damage_overflow,
    damage_value,
    local_call,
    mutate,
    percentile,
    tokens_of,
    valid_requests,
)
from kvbench.torture_readers import part_readers as long_readers
from kvbench.torture_tenants import part_tenants as tenant_attacks
from kvclient import KVClient
from kvclient.errors import KVStoreError
from kvproto.v1 import local_calls as frames

ROOT = Path(__file__).resolve().parent.parent

PARTS = (
    "crash", "client", "diskfull", "damage", "indexload", "tenants", "fuzz", "load", "readers",
)  # fmt: skip
MODEL = "torture"
BAD_CODES = ("UNKNOWN", "INTERNAL")


# --- crash: kill -9 cycles ----------------------------------------------------------------


@dataclass
class Chains:
    """What the writers tried and what the daemon acknowledged, per chain seed."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    tried: dict[int, int] = field(default_factory=dict)  # seed -> blocks
    acked: dict[int, int] = field(default_factory=dict)  # seed -> blocks answered durable
    size: int = 16 << 10


def writer(addr: str, kind: str, chains: Chains, seeds: Iterator[int], stop: threading.Event):
    try:
        client = KVClient(addr, use_arena=kind != "inline", timeout=5)
        ns = client.namespace(MODEL, block_tokens=TOKENS, block_bytes=chains.size)
        while not stop.is_set():
            seed = next(seeds)
            blocks = 1 + seed % 4
            rows = [block_of(seed, i, chains.size) for i in range(blocks)]
            with chains.lock:
                chains.tried[seed] = blocks
            if kind == "ahead":
                result = ns.put_nowait(tokens_of(seed, blocks), rows).result()
            else:
                result = ns.put(tokens_of(seed, blocks), rows)
            with chains.lock:
                chains.acked[seed] = result.durable
            time.sleep(0.002)
    except (KVStoreError, OSError):
        pass  # the daemon was killed under the call: not acknowledged
    finally:
        with contextlib.suppress(Exception):
            client.close()


def verify(addr: str, chains: Chains, seeds: list[int] | None = None) -> dict[str, int]:
    """Read back the chains tried (``seeds``, default all); counts of what is served,
    lost and wrong. Orphans are counted only over all chains."""
    counts = Counter[str]()
    with KVClient(addr, timeout=30) as client:
        ns = client.namespace(MODEL, block_tokens=TOKENS, block_bytes=chains.size)
        for seed in chains.tried if seeds is None else seeds:
            blocks = chains.tried[seed]
            got = ns.get(tokens_of(seed, blocks))
            n = got.n_blocks
            counts["served"] += n
            if got.blocks.tobytes() != chain_bytes(seed, n, chains.size):
                counts["corrupt"] += n
            if seed in chains.acked:
                counts["acked"] += blocks
                counts["lost"] += blocks - n
                durable = chains.acked[seed]
                counts["durable"] += durable
                counts["durable_lost"] += max(0, durable - n)
        if seeds is None:
            indexed = sum(n.blocks for n in client.stats().namespaces if n.model == MODEL)
            counts["orphans"] = max(0, indexed - counts["served"])
    return dict(counts)


def crash_cycles(work: Path, admission: str, cycles: int) -> dict[str, Any]:
    # the index is loaded before the daemon answers (sync_index_bytes): a read during a
    # background load misses what is not loaded yet, by design, and the indexload part
    # kills during one; here a miss must mean lost
    daemon = Kvstored(
        work, admission=admission, host_bytes="64MiB", disk_bytes="2GiB",
        sync_index_bytes="8GiB",
    )  # fmt: skip
    chains = Chains()
    seeds = iter(range(1, 10**9))  # shared by the writers: next() on it is atomic
    starts: list[float] = []
    worst = Counter[str]()
    last_cycle_first = 0
    try:
        for cycle in range(cycles):
            starts.append(daemon.start())
            if cycle:  # the last cycle's chains and a sample of the older ones
                older = [seed for seed in chains.tried if seed < last_cycle_first]
                recent = [seed for seed in chains.tried if seed >= last_cycle_first]
                sample = random.sample(older, min(len(older), 100)) + recent
                check = verify(daemon.addr, chains, sample)
                worst["corrupt"] = max(worst["corrupt"], check.get("corrupt", 0))
                worst["durable_lost"] = max(worst["durable_lost"], check.get("durable_lost", 0))
            last_cycle_first = max(chains.tried, default=0) + 1
            stop = threading.Event()
            threads = [
                threading.Thread(
                    target=writer, args=(daemon.addr, k, chains, seeds, stop), name=k
                )
                for k in ("arena", "ahead", "inline")
            ]
            for thread in threads:
                thread.start()
            time.sleep(random.uniform(0.2, 0.6))
            daemon.kill()
            stop.set()
            for thread in threads:
                thread.join(30)
                if thread.is_alive():
                    raise RuntimeError(f"a {thread.name} writer hung after the daemon was killed")
        starts.append(daemon.start())
        final = verify(daemon.addr, chains)
        daemon.stop()
    finally:
        daemon.close()
    return {
        "admission": admission, "cycles": cycles, "tried_chains": len(chains.tried),
        **final, "worst_corrupt": max(worst["corrupt"], final.get("corrupt", 0)),
        "worst_orphans": max(worst["orphans"], final.get("orphans", 0)),
        "worst_durable_lost": max(worst["durable_lost"], final.get("durable_lost", 0)),
        "restart_p50_s": statistics.median(starts), "restart_max_s": max(starts),
    }


def part_crash(work: Path, quick: bool) -> Section:
    cycles = 1 if quick else 100
    rows = [crash_cycles(work / f"crash-{mode}", mode, cycles) for mode in
            ("write-back", "write-through")]
    body = [
        "| admission | kill -9 cycles | chains tried | blocks acked | answered durable | "
        "durable lost | acked, not durable, lost | corrupt served | orphans held | "
        "restart p50 / max |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    checks = []
    for r in rows:
        body.append(
            f"| {r['admission']} | {r['cycles']} | {r['tried_chains']} | {r.get('acked', 0)} | "
            f"{r.get('durable', 0)} | {r['worst_durable_lost']} | {r.get('lost', 0)} | "
            f"{r['worst_corrupt']} | {r['worst_orphans']} | "
            f"{r['restart_p50_s']:.2f} / {r['restart_max_s']:.2f} s |"
        )
        bad = r["worst_corrupt"] + r["worst_orphans"] + r["worst_durable_lost"]
        checks.append((
            f"{r['admission']}: {cycles} kill cycles, 0 corrupt, 0 orphans, 0 durable lost",
            f"corrupt {r['worst_corrupt']}, orphans {r['worst_orphans']}, durable lost "
            f"{r['worst_durable_lost']}", bad == 0 and r["cycles"] >= cycles,
        ))
    body += [
        "",
        "Writers: three threads (arena put, put sent ahead, inline put) of 1-4 block chains "
        "of 16 KiB, killed 0.2-0.6 s into each cycle. After each restart the last cycle's "
        "chains and 100 older ones are read back (\"corrupt\" and \"durable lost\": the "
        "worst after any restart); after the last one every chain is, and \"orphans\" "
        "compares the blocks the daemon indexes with those reachable from a chain's root. "
        "Write-back loses what was only in the host tier by design (the Durability table).",
    ]
    return Section("Crashes: kill -9 during puts", body, checks)


# --- client: killed clients ----------------------------------------------------------------

CLIENT = """
import sys, time
from kvclient import KVClient
from kvclient.errors import KVStoreError
addr, op = sys.argv[1], sys.argv[2]
client = KVClient(addr, use_arena=op != "claim-inline")
ns = client.namespace("killed", block_tokens=4, block_bytes=262144)
row = bytes(262144)
print("go", flush=True)
i = 0
while True:
    i += 1
    tokens = [i * 1000 + t for t in range(32)]
    try:
        if op == "put":
            ns.put(tokens, [row] * 8)
        elif op == "get":
            ns.get(list(range(32)))
        elif op == "acquire":
            ns.acquire(list(range(32)))  # never released
        else:
            ns.claim(tokens)  # never delivered
    except KVStoreError:  # full of our own claims: hold them until killed
        time.sleep(0.01)
"""


def part_client(work: Path, quick: bool) -> Section:
    rounds = 1 if quick else 20
    daemon = Kvstored(work / "client", host_bytes="64MiB", disk_bytes=0, lease_ttl_s=60)
    daemon.start()
    released: dict[str, list[float]] = {}
    try:
        with KVClient(daemon.addr) as client:  # the prefix the getters read; closed:
            ns = client.namespace("killed", block_tokens=4, block_bytes=262144)
            ns.put(list(range(32)), [bytes(262144)] * 8)  # its staged slots go back
        with KVClient(daemon.addr) as client:  # makes no leases: only Stats
            for op in ("put", "get", "acquire", "claim", "claim-inline"):
                for _ in range(rounds):
                    child = subprocess.Popen(
                        [sys.executable, "-c", CLIENT, daemon.addr, op], stdout=subprocess.PIPE,
                        text=True,
                    )
                    assert child.stdout is not None and child.stdout.readline().strip() == "go"
                    time.sleep(random.uniform(0.1, 0.4))
                    child.kill()
                    killed = time.monotonic()
                    child.wait()
                    while True:
                        s = client.stats()
                        if not (s.leases or s.pending_blocks or s.staged_bytes):
                            break
                        if time.monotonic() - killed > 60:
                            break
                        time.sleep(0.005)
                    released.setdefault(op, []).append(time.monotonic() - killed)
    finally:
        daemon.stop()
        daemon.close()
    body = ["| killed mid | kills | released p50 | released max |", "|---|---|---|---|"]
    for op, times in released.items():
        body.append(f"| {op} | {len(times)} | {statistics.median(times) * 1000:.0f} ms | "
                    f"{max(times) * 1000:.0f} ms |")
    worst = max(max(t) for t in released.values())
    body += ["", "\"Released\": from the kill until the daemon holds no lease, pending block "
             "or staged slot of the client (lease TTL 60 s: without the release it would be "
             "60 s). `claim-inline` makes its claims over gRPC (its Session ends them); the "
             "others over the local-call socket."]
    return Section("Killed clients", body, [(
        "the store usable within 1 s after a client is killed", f"worst {worst * 1000:.0f} ms",
        worst <= 1.0,
    )])


# --- diskfull ----------------------------------------------------------------------------


@contextlib.contextmanager
def small_disk(where: Path, size_mib: int) -> Iterator[tuple[str, Callable[[], None] | None]]:
    """A directory on a full-able disk: a tmpfs of ``size_mib`` when we may mount one,
    else a plain directory and a file size limit for the daemon."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(where)],
        capture_output=True, check=False,
    ).returncode == 0
    if mounted:
        try:
            yield f"tmpfs of {size_mib} MiB (ENOSPC)", None
        finally:
            subprocess.run(["umount", "-l", str(where)], check=False)
        return
    limit = size_mib << 20

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    yield f"file size limit of {size_mib} MiB (RLIMIT_FSIZE: not root)", apply


def part_diskfull(work: Path, quick: bool) -> Section:
    seconds = 4 if quick else 20
    latencies: dict[str, list[float]] = {}
    errors = Counter[str]()
    with small_disk(work / "diskfull-mnt", 48) as (how, preexec):
        daemon = Kvstored(
            work / "diskfull", preexec=preexec, host_bytes="16MiB", disk_bytes="256MiB",
            admission="write-through", disk_dir=work / "diskfull-mnt" / "disk",
            arena_dir=work / "diskfull",
        )
        daemon.start()
        size = 256 << 10
        durable = stored = 0
        try:
            with KVClient(daemon.addr, timeout=30) as client:
                ns = client.namespace(MODEL, block_tokens=TOKENS, block_bytes=size)
                def put(s: int) -> Any:
                    return ns.put(tokens_of(s, 4), [block_of(s, i, size) for i in range(4)])

                calls: dict[str, Callable[[int], Any]] = {
                    "put": put,
                    "get": lambda s: ns.get(tokens_of(max(1, s - 7), 4)),
                    "lookup": lambda s: ns.lookup(tokens_of(max(1, s - 3), 4)),
                    "server_info": lambda s: client.server_info(),
                    "stats": lambda s: client.stats(),
                }
                end = time.monotonic() + seconds
                seed = 0
                while time.monotonic() < end:
                    seed += 1
                    for name, call in calls.items():
                        started = time.perf_counter()
                        try:
                            result = call(seed)
                        except KVStoreError as exc:
                            errors[f"{name}: {type(exc).__name__}"] += 1
                            continue
                        latencies.setdefault(name, []).append(time.perf_counter() - started)
                        if name == "put":
                            stored += result.stored
                            durable += result.durable
        finally:
            code = daemon.stop()
            log = daemon.text()
            daemon.close()
    faults = log.count("disk tier stopped taking writes")
    recoveries = log.count("disk tier takes writes again")
    worst = max(max(v) for v in latencies.values())
    body = [f"The disk tier on a {how}, write-through, {seconds} s of puts of 1 MiB "
            "chains with a get, a lookup, ServerInfo and Stats after each.", "",
            "| call | calls | p50 | p99 | max |", "|---|---|---|---|---|"]
    for name, values in latencies.items():
        body.append(f"| {name} | {len(values)} | {percentile(values, 0.5) * 1000:.1f} ms | "
                    f"{percentile(values, 0.99) * 1000:.1f} ms | {max(values) * 1000:.1f} ms |")
    body += ["", f"Blocks stored {stored}, answered durable {durable}; disk faults logged "
             f"{faults}, recoveries {recoveries}; errors: {dict(errors) or 'none'}; "
             f"exit code at stop {code} (3: blocks due on disk could not be written).",
             "", "Each fault gives back the disk tier's reserve (kvstore.disk.files): LMDB "
             "writes even a delete as new pages, so on a full file system the evictions "
             "could not commit without it. With it they do, and the tier goes on at the size "
             "that fits; it takes the reserve back once the file system has room for it."]
    return Section("A full disk", body, [
        ("no call slower than 1 s while the disk is full", f"slowest {worst * 1000:.0f} ms",
         worst <= 1.0 and not errors and faults > 0),
        ("a full disk: the disk tier resumes by itself at the size that fits",
         f"{faults} faults, {recoveries} recoveries, {durable} of {stored} blocks durable",
         recoveries > 0),
    ])


# --- damage -------------------------------------------------------------------------------


DAMAGES: dict[str, Callable[[Path], None]] = {
    "truncated to half": lambda p: os.truncate(p, p.stat().st_size // 2),
    "truncated to 0": lambda p: os.truncate(p, 0),
    "B-tree pages overwritten": damage_btree,
    "a value overwritten": damage_value,
    "the free list: a live page in it": damage_free_list,
    "an overflow run's header: past the file's end": damage_overflow,
    "replaced by noise": lambda p: p.write_bytes(os.urandom(p.stat().st_size)),
}


QUICK_DAMAGES = ["a value overwritten", "an overflow run's header: past the file's end",
                 "replaced by noise"]


def part_damage(work: Path, quick: bool) -> Section:
    size = 64 << 10
    body = ["| damage | started | moved aside | ERROR line | blocks served | corrupt served "
            "| durable puts after |", "|---|---|---|---|---|---|---|"]
    all_ok = True
    # --quick: the damages tests/test_faults.py does not start a daemon on itself
    names = QUICK_DAMAGES if quick else list(DAMAGES)
    for name in names:
        damage = DAMAGES[name]
        daemon = Kvstored(work / f"damage-{len(body)}", admission="write-through")
        try:
            daemon.start()
            with KVClient(daemon.addr) as client:
                ns = client.namespace(MODEL, block_tokens=TOKENS, block_bytes=size)
                for seed in range(1, 6):
                    ns.put(tokens_of(seed, 4), [block_of(seed, i, size) for i in range(4)])
            daemon.stop()
            damage(Path(daemon.disk_dir) / "data.mdb")
            started = True
            try:
                daemon.start()
            except RuntimeError:
                started = False
            served = corrupt = durable = 0
            if started:
                with KVClient(daemon.addr) as client:
                    ns = client.namespace(MODEL, block_tokens=TOKENS, block_bytes=size)
                    for seed in range(1, 6):
                        got = ns.get(tokens_of(seed, 4))
                        served += got.n_blocks
                        if got.blocks.tobytes() != chain_bytes(seed, got.n_blocks, size):
                            corrupt += got.n_blocks
                    for seed in range(50, 55):  # write-through: durable, or the disk failed
                        rows = [block_of(seed, i, size) for i in range(4)]
                        durable += ns.put(tokens_of(seed, 4), rows).durable
            aside = any(f.startswith("data.mdb.damaged-") for f in os.listdir(daemon.disk_dir))
            error_line = "was damaged" in daemon.text() or "is damaged" in daemon.text()
            body.append(f"| {name} | {'yes' if started else 'NO'} | {'yes' if aside else 'no'} | "
                        f"{'yes' if error_line else 'no'} | {served} of 20 | {corrupt} | "
                        f"{durable} of 20 |")
            all_ok &= started and corrupt == 0 and durable == 20
        finally:
            daemon.stop()
            daemon.close()
    body += ["", "Five chains of four 64 KiB blocks, put write-through, then the daemon is "
             "stopped, data.mdb damaged, the daemon started again; then five more chains put "
             "write-through. A damaged value is caught by its checksum when read (a miss; "
             "the block and its descendants are dropped); a damaged free list or overflow "
             "header by the start-up check of every page (kvstore.disk.pages)."]
    return Section("Damaged files", body, [
        ("start-up never dies on a damaged file; nothing corrupt served; puts durable "
         "after it", "see the table", all_ok)])


# --- indexload: kill -9 while a large disk tier's index loads ------------------------------

LOAD_MODEL = "torture-load"
LOAD_BLOCK = 512  # small records: many of them in a small file, a load of many chunks
LOAD_BLOCKS = 16  # blocks per filled chain


def load_payload(chain: int, block: int) -> bytes:
    return block_of(10**7 + chain, block, LOAD_BLOCK)


def load_progress(addr: str) -> tuple[int, int]:
    """(records loaded, total) of the daemon's disk index load."""
    with KVClient(addr, timeout=5) as client:
        counters = client.stats().counters
    return counters.get("index_records_loaded", 0), counters.get("index_records_total", 0)


@dataclass
class Churn:
    """Filled chains put again (the same bytes) and deleted while the index loads,
    by start (:func:`churn`): each start takes chains of its own."""

    picks: Iterator[int]
    per_start: int
    deleted: set[int] = field(default_factory=set)  # deletes answered
    unsure: set[int] = field(default_factory=set)  # put or deleted under a kill
    put_again: int = 0  # puts answered
    during: int = 0  # answers given while the load was under way
    durable: int = 0  # blocks of those puts answered durable


def churn(addr: str, work: Churn) -> str:
    """Put again ``per_start`` filled chains (every other one its first half only) and
    delete a fifth as many, as soon as the daemon answers: what the attack on the
    background load did (#56). A call cut by a kill leaves its chain unsure. The error
    that ended it early ("" when none did)."""
    from kvbench.disk_fill import chain_tokens

    chosen = [next(work.picks) for _ in range(work.per_start + work.per_start // 5)]
    try:
        with KVClient(addr, timeout=10) as client:
            ns = client.namespace(LOAD_MODEL, block_tokens=TOKENS, block_bytes=LOAD_BLOCK)
            for n, chain in enumerate(chosen):
                work.unsure.add(chain)
                tokens = chain_tokens(chain, LOAD_BLOCKS, TOKENS)
                if n < work.per_start:
                    length = LOAD_BLOCKS // 2 if n % 2 else LOAD_BLOCKS
                    rows = [load_payload(chain, i) for i in range(length)]
                    result = ns.put(tokens[: length * TOKENS], rows)
                    work.put_again += 1
                    work.durable += result.durable
                else:
                    ns.delete(tokens)
                    work.deleted.add(chain)
                work.unsure.discard(chain)
                loaded, total = load_progress(addr)
                work.during += not total or loaded < total
    except (KVStoreError, OSError) as exc:  # killed under the call, or a fault
        return f"{type(exc).__name__}: {exc}"
    return ""


def part_indexload(work: Path, quick: bool) -> Section:
    from kvbench.disk_fill import chain_tokens, fill_disk

    cycles = 1 if quick else 6
    chains = 4000 if quick else 40_000  # 64k or 640k records: a load of 8 or 80 chunks
    picks = list(range(chains))
    random.shuffle(picks)
    churned = Churn(iter(picks), 10 if quick else 100)
    daemon = Kvstored(
        work / "indexload", admission="write-through", disk_bytes="8GiB", sync_index_bytes=0
    )
    spec = {"model": LOAD_MODEL, "block_tokens": TOKENS, "block_bytes": LOAD_BLOCK}
    fill_disk(Path(daemon.disk_dir), chains, LOAD_BLOCKS, spec, load_payload)
    written = Chains()
    seeds = iter(range(1, 10**9))
    during = 0
    try:
        for _ in range(cycles):
            daemon.start()
            stop = threading.Event()
            thread = threading.Thread(
                target=writer, args=(daemon.addr, "arena", written, seeds, stop)
            )
            thread.start()
            churning = threading.Thread(target=churn, args=(daemon.addr, churned))
            churning.start()
            kill_at = random.uniform(0.1, 0.8)  # of the records loaded
            while True:
                loaded, total = load_progress(daemon.addr)
                if total and loaded < total and loaded >= kill_at * total:
                    during += 1
                    break
                if total and loaded >= total:
                    break
                time.sleep(0.005)
            daemon.kill()
            stop.set()
            thread.join(30)
            churning.join(30)
        daemon.start()  # and one clean stop during the load
        churn_error = churn(daemon.addr, churned)  # (no kill here: any error is one)
        stopped_during = load_progress(daemon.addr)
        assert daemon.stop() == 0, daemon.tail()
        daemon.start()
        while True:  # the last start loads to the end
            loaded, total = load_progress(daemon.addr)
            if total and loaded >= total:
                break
            time.sleep(0.05)
        final = verify(daemon.addr, written)
        lost = corrupt = 0
        with KVClient(daemon.addr, timeout=30) as client:
            ns = client.namespace(LOAD_MODEL, block_tokens=TOKENS, block_bytes=LOAD_BLOCK)
            back = unsure_served = 0  # blocks of deleted chains served again; of unsure ones
            for chain in range(chains):
                got = ns.get(chain_tokens(chain, LOAD_BLOCKS, TOKENS))
                want = b"".join(load_payload(chain, i) for i in range(got.n_blocks))
                corrupt += got.n_blocks * (got.blocks.tobytes() != want)
                if chain in churned.unsure:
                    unsure_served += got.n_blocks
                    continue
                if chain in churned.deleted:
                    back += got.n_blocks
                else:
                    lost += LOAD_BLOCKS - got.n_blocks
            indexed = sum(n.blocks for n in client.stats().namespaces if n.model == LOAD_MODEL)
        daemon.stop()
    finally:
        daemon.close()
    records = chains * LOAD_BLOCKS
    kept = records - LOAD_BLOCKS * len(churned.deleted | churned.unsure)
    # indexed but not reachable from a chain's root
    extra = indexed - (kept - lost) - unsure_served - back
    body = [
        "| records filled | kill -9 cycles | killed during the load | filled blocks lost | "
        "corrupt served | indexed without their chain | written during loads, answered "
        "durable | durable lost |",
        "|---|---|---|---|---|---|---|---|",
        f"| {records} | {cycles} | {during} | {lost} | {corrupt + final.get('corrupt', 0)} | "
        f"{extra + final.get('orphans', 0)} | {final.get('durable', 0)} | "
        f"{final.get('durable_lost', 0)} |",
        "",
        "| filled chains put again during loads (calls answered while a load ran) | blocks of them "
        "answered durable | filled chains deleted during loads | their blocks served again |",
        "|---|---|---|---|",
        f"| {churned.put_again} ({churned.during}) | {churned.durable} | "
        f"{len(churned.deleted)} | {back} |",
        "",
        f"A disk tier filled straight through LMDB with {chains} chains of {LOAD_BLOCKS} "
        f"blocks of {LOAD_BLOCK} bytes, its index loaded behind the first answers "
        "(`sync_index_bytes = 0`), a write-through writer putting chains meanwhile; each "
        "cycle starts the daemon and kills it (-9) at a random point of its background "
        "index load. Each start also puts filled chains again (the same bytes, whole or "
        "their first half) and deletes others as soon as it answers; one more start "
        f"does that and is stopped cleanly (at {stopped_during[0]} of "
        f"{stopped_during[1]} records loaded). After the last start has loaded the whole "
        "index, every filled chain and every chain the writer was answered durable for "
        "is read back: filled chains whole but the deleted ones, which serve nothing "
        "(a chain whose call a kill cut is left out).",
    ]
    ok = (
        during == cycles and lost == 0 and corrupt + final.get("corrupt", 0) == 0
        and extra + final.get("orphans", 0) == 0 and final.get("durable_lost", 0) == 0
        and back == 0 and churned.during > 0 and not churn_error
    )
    return Section("Killed while the index loads", body, [(
        f"{cycles} kill -9 during the background index load, filled chains put again "
        "and deleted meanwhile: nothing committed lost, nothing deleted back, nothing "
        "corrupt, nothing indexed without its ancestors",
        f"{during} kills during the load, {lost} filled blocks lost, {back} deleted blocks "
        f"back, {final.get('durable_lost', 0)} durable lost, {extra} extra indexed"
        + (f"; the clean start's puts and deletes failed: {churn_error}" if churn_error else ""),
        ok,
    )])


# --- fuzz ---------------------------------------------------------------------------------


def part_fuzz(work: Path, quick: bool) -> Section:
    count = 300 if quick else 5000
    rng = random.Random(25)
    daemon = Kvstored(work / "fuzz", host_bytes="32MiB", disk_bytes="128MiB")
    daemon.start()
    codes = {"gRPC": Counter[str](), "local calls": Counter[str]()}
    try:
        with KVClient(daemon.addr) as client:
            ns = client.namespace(MODEL, block_tokens=4, block_bytes=4096)
            ns.put(list(range(32)), [bytes(4096)] * 8)
            local_path = client.server_info().local_socket
        valid = {name: msg.SerializeToString() for name, msg in valid_requests(ns.ns_id).items()}
        names = sorted(valid)
        channel = grpc.insecure_channel(daemon.addr)
        for i in range(count):
            name = rng.choice(names)
            body = mutate(valid[name], rng)
            if i % 2 == 0:
                call = channel.unary_unary(f"/kvstore.v1.KVStore/{name}")
                try:
                    call(body, timeout=10)
                    codes["gRPC"]["OK"] += 1
                except grpc.RpcError as exc:
                    codes["gRPC"][exc.code().name] += 1
            else:
                noise = rng.random() < 0.1  # a malformed frame: the connection is dropped
                if noise:
                    frame = rng.randbytes(rng.randrange(1, 40))
                else:
                    frame = frames.request_frame(name.encode(), body)
                codes["local calls"][local_call(local_path, frame, noise)] += 1
        channel.close()
        alive = daemon.proc is not None and daemon.proc.poll() is None
    finally:
        code = daemon.stop()
        tracebacks = daemon.text().count("Traceback")
        daemon.close()
    bad = sum(c[b] for c in codes.values() for b in BAD_CODES)
    body = [f"{count} requests, half over each socket: valid requests of every unary method "
            "with random bytes changed, cut or inserted, or noise; on the local-call socket "
            "also malformed frames (the daemon closes such a connection).", "",
            "| socket | answers |", "|---|---|"]
    for sock, counter in codes.items():
        body.append(f"| {sock} | " + ", ".join(f"{k} {v}" for k, v in counter.most_common()) + " |")
    body += ["", f"Daemon alive afterwards: {'yes' if alive else 'NO'}; tracebacks in its log: "
             f"{tracebacks}; exit code at stop {code}."]
    return Section("Request fuzzing", body, [(
        "fuzzing: 0 UNKNOWN or INTERNAL, 0 crashes",
        f"{bad} UNKNOWN/INTERNAL, alive {alive}, tracebacks {tracebacks}",
        bad == 0 and alive and tracebacks == 0,
    )])


# --- load ---------------------------------------------------------------------------------

LOAD = """
import json, random, sys, time
from kvclient import KVClient
from kvclient.errors import KVStoreError
addr, seconds, me, out = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = random.Random(me)
client = KVClient(addr)
inline = KVClient(addr, use_arena=False)
size = 65536
ns = client.namespace("load", block_tokens=4, block_bytes=size)
nsi = inline.namespace("load", block_tokens=4, block_bytes=size)
row = bytes(range(256)) * (size // 256)
lat, errors = {}, {}
ops = ["get"] * 8 + ["put"] * 4 + ["lookup"] * 4 + ["put_nowait", "get_inline", "claim"]
end = time.monotonic() + seconds
while time.monotonic() < end:
    op = rng.choice(ops)
    prompt = rng.randrange(200)
    tokens = [prompt * 1000 + t for t in range(16)]
    started = time.perf_counter()
    try:
        if op == "get":
            ns.get(tokens)
        elif op == "put":
            ns.put(tokens, [row] * 4)
        elif op == "lookup":
            ns.lookup(tokens)
        elif op == "put_nowait":
            ns.put_nowait(tokens, [row] * 4).result()
        elif op == "get_inline":
            nsi.get(tokens)
        else:
            with ns.claim([me * 10**6 + prompt * 1000 + t for t in range(16)]) as claim:
                if claim.blocks:
                    claim.fill([row] * claim.blocks)
    except KVStoreError as exc:
        key = op + ": " + type(exc).__name__
        errors[key] = errors.get(key, 0) + 1
        continue
    lat.setdefault(op, []).append(time.perf_counter() - started)
with open(out, "w") as f:  # a file: thousands of latencies would fill a pipe
    json.dump({"lat": lat, "errors": errors}, f)
"""


def part_load(work: Path, quick: bool) -> Section:
    procs, seconds = (4, 3.0) if quick else (32, 60.0)
    daemon = Kvstored(work / "load", host_bytes="128MiB", disk_bytes="512MiB")
    daemon.start()
    rss: list[int] = [daemon.rss_bytes()]
    try:
        results = [work / "load" / f"child{i}.json" for i in range(procs)]
        children = [
            subprocess.Popen(
                [sys.executable, "-c", LOAD, daemon.addr, str(seconds), str(i), str(out)]
            )
            for i, out in enumerate(results)
        ]
        while any(child.poll() is None for child in children):
            rss.append(daemon.rss_bytes())
            time.sleep(0.5)
        outputs = [json.loads(out.read_text()) if out.exists() else {} for out in results]
        alive = daemon.proc is not None and daemon.proc.poll() is None
    finally:
        daemon.stop()
        daemon.close()
    lat: dict[str, list[float]] = {}
    errors = Counter[str]()
    for out in outputs:
        for op, values in out.get("lat", {}).items():
            lat.setdefault(op, []).extend(values)
        errors.update(out.get("errors", {}))
    failed = sum(1 for out in outputs if "lat" not in out)
    total = sum(len(v) for v in lat.values())
    body = [f"{procs} processes, {seconds:.0f} s, one namespace of 64 KiB blocks, 200 "
            "prompts of 4 blocks shared by all (so gets hit, puts mostly find their blocks "
            f"there), {total} calls ({total / seconds:.0f}/s).", "",
            "| call | calls | p50 | p99 |", "|---|---|---|---|"]
    for op, values in sorted(lat.items()):
        body.append(f"| {op} | {len(values)} | {percentile(values, 0.5) * 1000:.2f} ms | "
                    f"{percentile(values, 0.99) * 1000:.2f} ms |")
    body += ["", f"Errors: {dict(errors) or 'none'}; client processes that failed: {failed}; "
             f"daemon RSS {rss[0] >> 20} MiB at start, peak {max(rss) >> 20} MiB, "
             f"{rss[-1] >> 20} MiB at the end (host arena 128 MiB, shared memory)."]
    return Section("Mixed load", body, [(
        f"{procs} processes of mixed traffic: no errors, daemon alive",
        f"{sum(errors.values())} errors, {failed} failed processes, alive {alive}",
        not errors and not failed and alive,
    )])


# --- report -------------------------------------------------------------------------------

def part_tenants(work: Path, quick: bool) -> Section:
    body, checks = tenant_attacks(work, quick)
    return Section("A hostile tenant", body, checks)


def part_readers(work: Path, quick: bool) -> Section:
    body, checks = long_readers(work, quick)
    return Section("Many readers of long prefixes", body, checks)


RUNNERS: dict[str, Callable[[Path, bool], Section]] = {
    "crash": part_crash, "client": part_client, "diskfull": part_diskfull,
    "damage": part_damage, "indexload": part_indexload, "tenants": part_tenants,
    "fuzz": part_fuzz, "load": part_load, "readers": part_readers,
}


def render(sections: list[Section], quick: bool, elapsed: float, command: str) -> str:
    lines = [
        "# Reliability: kvstore under faults",
        "",
        f"Written by `{command}` on {time.strftime('%Y-%m-%d')} "
        f"({os.cpu_count()} cores, Python {sys.version.split()[0]}), in {elapsed:.0f} s"
        + (" (--quick: a short run, not the targets' full counts)." if quick else "."),
        "",
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]
    for section in sections:
        for target, measured, ok in section.checks:
            lines.append(f"| {target} | {measured} | {'yes' if ok else '**NO**'} |")
    lines += ["", "The durability each admission mode promises is in "
              "docs/operations/configuration.md (Durability) and deploy/README.md; the crash "
              "part checks it.", ""]
    for section in sections:
        lines += [f"## {section.title}", "", *section.body, ""]
    return "\n".join(lines)


# the rounds of attacks (#66 and on) are tables written from their tests and benchmarks,
# not by this program: a report keeps them from the file it replaces
KEPT_BY_HAND = "## Rounds of attacks"


def kept_by_hand(out: Path) -> str:
    """The part of ``out`` from :data:`KEPT_BY_HAND` on ("" when it has none)."""
    old = out.read_text() if out.exists() else ""
    at = old.find("\n" + KEPT_BY_HAND)
    return "" if at < 0 else old[at:].rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run of every part")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated parts")
    parser.add_argument("--out", default=str(ROOT / "docs" / "reliability.md"))
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    started = time.monotonic()
    sections = []
    with tempfile.TemporaryDirectory(prefix="kvtorture") as tmp:
        for part in parts:
            print(f"torture: {part} ...", file=sys.stderr, flush=True)
            section = RUNNERS[part](Path(tmp), args.quick)
            for target, measured, ok in section.checks:
                print(f"  {'ok ' if ok else 'NO '} {target}: {measured}", file=sys.stderr)
            sections.append(section)
    command = "python benchmarks/torture.py" + (" --quick" if args.quick else "")
    if args.parts != ",".join(PARTS):
        command += f" --parts {args.parts}"
    report = render(sections, args.quick, time.monotonic() - started, command)
    report += kept_by_hand(Path(args.out))
    Path(args.out).write_text(report)
    print(report)
    return 0 if all(ok for s in sections for _, _, ok in s.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
