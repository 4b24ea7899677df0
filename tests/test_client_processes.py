"""Several client processes against one real kvstored: sharing, crashes, restarts.

Workers are separate Python processes (``python -c`` importing this module and
calling :func:`worker_main`), so they share nothing with the test but the daemon's
socket and, on the arena path, its shared-memory file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Daemon, in_forked_child, wait_for

from kvclient import KVClient, NamespaceNotFoundError, arena_path
from kvctl.cli import main as kvctl

BLOCK_TOKENS = 16
BLOCK_BYTES = 16 << 10
MODEL = "proc-model"
TESTS_DIR = str(Path(__file__).parent)


def blocks_for(tokens: list[int], n_blocks: int) -> np.ndarray:
    """Deterministic content of each block, a function of the prefix it ends: any
    process can check any other process's blocks."""
    out = np.empty((n_blocks, BLOCK_BYTES), dtype=np.uint8)
    for i in range(n_blocks):
        digest = hashlib.sha256(repr(tokens[: (i + 1) * BLOCK_TOKENS]).encode()).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        out[i] = rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8)
    return out


def full_blocks(tokens: list[int]) -> int:
    return len(tokens) // BLOCK_TOKENS


# -- worker processes ------------------------------------------------------------------


def put_until_cached(ns, tokens: list[int], deadline: float) -> None:
    """Put a prompt, resuming after blocks another session holds pending (early reuse)."""
    n = full_blocks(tokens)
    blocks = blocks_for(tokens, n)
    while True:
        have = ns.lookup(tokens, wait_pending_s=1.0).blocks
        if have == n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"prompt still at {have} of {n} blocks")
        ns.put(tokens, blocks[have:], start=have)


def worker_share(addr: str, use_arena: bool, own: list[list[int]], others: list[list[int]]) -> dict:
    deadline = time.monotonic() + 60
    with KVClient(addr, use_arena=use_arena) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        for tokens in own:
            put_until_cached(ns, tokens, deadline)
        verified = 0
        for tokens in others:  # wait for the other processes' prompts, then check bytes
            n = full_blocks(tokens)
            while ns.lookup(tokens).blocks < n:
                if time.monotonic() > deadline:
                    raise TimeoutError("another worker's prompt never appeared")
                time.sleep(0.05)
            got = ns.get(tokens)
            assert got.n_blocks == n and np.array_equal(got.blocks, blocks_for(tokens, n))
            verified += 1
        return {"arena": client.arena_in_use, "verified": verified}


def worker_put_and_hang(addr: str, tokens: list[int]) -> None:
    """Reserve and fill slots, say so, then hang before Commit (to be SIGKILLed)."""
    import kvclient.writes as writes

    copy = writes.write_slots

    def copy_then_hang(*args: object) -> None:
        copy(*args)
        print("RESERVED", flush=True)
        time.sleep(120)

    writes.write_slots = copy_then_hang  # type: ignore[assignment]
    with KVClient(addr, use_arena=True) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        ns.put(tokens, blocks_for(tokens, full_blocks(tokens)))


def worker_main(argv: list[str]) -> None:
    role, spec = argv[0], json.loads(argv[1])
    if role == "share":
        print(json.dumps(worker_share(**spec)), flush=True)
    elif role == "hang":
        worker_put_and_hang(**spec)


def start_worker(role: str, **spec: object) -> subprocess.Popen[str]:
    code = (
        f"import sys; sys.path.insert(0, {TESTS_DIR!r}); "
        "import test_client_processes as t; t.worker_main(sys.argv[1:])"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, role, json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# -- tests -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(kvstored_module_factory: Callable[..., Daemon]) -> Daemon:
    return kvstored_module_factory()


def test_processes_share_overlapping_prefixes(daemon: Daemon) -> None:
    # three processes, two on the arena path and one inline, each with its own prompt;
    # all prompts start with the same 8-block system prompt that they race to store
    system = list(range(50_000, 50_000 + 8 * BLOCK_TOKENS))
    prompts = [
        system + list(range(60_000 + 1000 * k, 60_000 + 1000 * k + 4 * BLOCK_TOKENS))
        for k in range(3)
    ]
    workers = [
        start_worker(
            "share",
            addr=daemon.addr,
            use_arena=k < 2,
            own=[prompts[k]],
            others=[p for j, p in enumerate(prompts) if j != k],
        )
        for k in range(3)
    ]
    for k, proc in enumerate(workers):
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
        assert json.loads(out) == {"arena": k < 2, "verified": 2}

    # a fourth process (this one) sees every prompt, and the system prompt stored once
    with KVClient(daemon.addr) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        for tokens in prompts:
            assert np.array_equal(ns.get(tokens).blocks, blocks_for(tokens, 12))
        stats = {n.ns_id: n for n in client.stats().namespaces}
        assert stats[ns.ns_id].blocks >= 8 + 3 * 4


def test_lookup_finds_another_sessions_prefix(daemon: Daemon) -> None:
    tokens = list(range(70_000, 70_000 + 6 * BLOCK_TOKENS))
    writer = start_worker("share", addr=daemon.addr, use_arena=True, own=[tokens], others=[])
    _, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    # the writer has exited: a new session with a longer prompt reuses its prefix
    longer = tokens + list(range(5, 5 + 3 * BLOCK_TOKENS))
    with KVClient(daemon.addr, use_arena=False) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        hit = ns.lookup(longer)
        assert (hit.tokens, hit.blocks, hit.host_blocks) == (6 * BLOCK_TOKENS, 6, 6)
        assert np.array_equal(ns.get(longer).blocks, blocks_for(tokens, 6))


def test_killed_writer_leaves_nothing_and_its_slots_return(
    kvstored_factory,
) -> None:
    daemon = kvstored_factory(lease_ttl_s=1)
    tokens = list(range(80_000, 80_000 + 4 * BLOCK_TOKENS))
    writer = start_worker("hang", addr=daemon.addr, tokens=tokens)
    try:
        assert writer.stdout is not None
        line = writer.stdout.readline()
        assert line.strip() == "RESERVED", writer.stderr.read() if writer.stderr else ""
        with KVClient(daemon.addr) as client:
            ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
            # reserved and written, not committed: pending, never readable
            hit = ns.lookup(tokens)
            assert (hit.blocks, hit.pending_blocks) == (0, 4)
            assert ns.get(tokens).n_blocks == 0
            host = client.stats().tier("host")
            assert host is not None and host.used_bytes >= 4 * BLOCK_BYTES

            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(10)

            # after the 1 s lease runs out the pending blocks are dropped, slots freed
            deadline = time.monotonic() + 10
            while True:
                hit = ns.lookup(tokens)
                host = client.stats().tier("host")
                assert host is not None
                if hit.pending_blocks == 0 and host.used_bytes == 0:
                    break
                assert time.monotonic() < deadline, f"still {hit} and {host}"
                time.sleep(0.2)
            assert hit.blocks == 0
            # the prompt can be stored again by anyone
            assert ns.put(tokens, blocks_for(tokens, 4)).stored == 4
    finally:
        writer.kill()
        writer.wait(10)


def test_restart_keeps_disk_blocks(kvstored, capsys: pytest.CaptureFixture[str]) -> None:
    tokens = list(range(90_000, 90_000 + 6 * BLOCK_TOKENS))
    blocks = blocks_for(tokens, 6)
    with KVClient(kvstored.addr) as client:  # auto: the arena path on this host
        assert client.arena_in_use
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        assert ns.put(tokens, blocks).stored == 6

        # SIGTERM writes host-only blocks to disk; the new process rebuilds its index
        kvstored.restart()
        capsys.readouterr()
        assert kvctl(["--addr", kvstored.addr, "status", "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        disk = next(t for t in status["tiers"] if t["name"] == "disk")
        assert disk["blocks"] >= 6 and disk["used_bytes"] >= 6 * BLOCK_BYTES

        # the same client follows the new daemon (and maps its new arena)
        hit = ns.lookup(tokens)
        assert (hit.blocks, hit.disk_blocks) == (6, 6)
        assert np.array_equal(ns.get(tokens).blocks, blocks)
        # a put through the old mapping would land in the dead daemon's arena file
        fresh = list(range(95_000, 95_000 + 3 * BLOCK_TOKENS))
        assert ns.put(fresh, blocks_for(fresh, 3)).stored == 3
    with KVClient(kvstored.addr, use_arena=False) as inline:
        ns = inline.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        assert np.array_equal(ns.get(tokens).blocks, blocks)
        assert np.array_equal(ns.get(fresh).blocks, blocks_for(fresh, 3))


def test_client_survives_a_killed_and_restarted_daemon(kvstored) -> None:
    # a client maps the arena, the daemon dies by SIGKILL (its arena file stays behind)
    # and comes back with a new arena: the client must not write into the old one
    rng = np.random.default_rng(5)
    with KVClient(kvstored.addr, use_arena=None) as client:
        ns = client.namespace("killed", block_tokens=4, block_bytes=4096)
        before = rng.integers(0, 256, (2, 4096), dtype=np.uint8)
        ns.put(list(range(8)), before)
        assert client.arena_in_use
        old_arena = os.stat(client.server_info().arena_path).st_ino
        kvstored.kill()
        kvstored.start()
        ns = client.namespace("killed", block_tokens=4, block_bytes=4096)
        # the dead daemon's arena is unmapped, behind the call that found the new one
        assert wait_for(lambda: not mapped_inode(old_arena))
        after = rng.integers(0, 256, (3, 4096), dtype=np.uint8)
        tokens = list(range(100, 112))
        assert ns.put(tokens, after).stored == 3
        got = ns.get(tokens)
        assert got.blocks.shape == (3, 4096) and np.array_equal(got.blocks, after)
        # the daemon that came back cleaned up the dead one's arena file
        leftovers = [p for p in os.listdir(kvstored.arena_dir) if p.startswith("kvstore-")]
        assert len(leftovers) == 1


@pytest.mark.parametrize("use_arena", [True, False], ids=["arena", "inline"])
def test_a_namespace_handle_keeps_working_after_its_daemon_forgot_the_namespace(
    kvstored_factory: Callable[..., Daemon], use_arena: bool
) -> None:
    """A daemon without a disk tier forgets its namespaces when it restarts (one with a
    disk tier forgets one it had no time to write before a kill -9): the handles of the
    clients that opened them got NOT_FOUND on every call (CI failure of #66's
    kill -9 test). The client opens the namespace again, and the calls answer as on a
    fresh daemon: a miss, then a put that is stored and read back. A handle of
    DescribeNamespace in a client that did not open it (whose layout that client never
    declared) stays NOT_FOUND."""
    daemon = kvstored_factory(disk_bytes=0)
    tokens = list(range(9000, 9000 + 3 * BLOCK_TOKENS))
    with KVClient(daemon.addr, use_arena=use_arena) as client, KVClient(daemon.addr) as other:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES, name="forgotten")
        described = other.open_namespace(ns.ns_id)
        assert ns.put(tokens, blocks_for(tokens, 3)).stored == 3
        daemon.kill()
        daemon.start()
        assert ns.lookup(tokens).blocks == 0
        assert ns.put(tokens, blocks_for(tokens, 3)).stored == 3
        assert np.array_equal(ns.get(tokens).blocks, blocks_for(tokens, 3))
        daemon.kill()
        daemon.start()
        assert ns.put_nowait(tokens, blocks_for(tokens, 3)).result(30).stored == 3
        assert ns.lookup(tokens).blocks == 3
        daemon.kill()
        daemon.start()
        with pytest.raises(NamespaceNotFoundError):
            described.lookup(tokens)


def mapped_inode(inode: int) -> bool:
    """Whether this process maps a file with ``inode`` (its arena mappings)."""
    with open("/proc/self/maps") as maps:
        return any(len(f) > 5 and f[4] == str(inode) for f in map(str.split, maps))


def test_a_client_forked_while_a_thread_holds_its_locks_works_in_the_child(
    daemon: Daemon,
) -> None:
    """A thread of the parent (the release flusher, say) holds the client's locks at
    the fork. The child has no such thread, so it would wait forever for those locks;
    it gets new ones instead, and its calls go through."""
    with KVClient(daemon.addr) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        tokens = list(range(5000, 5000 + 2 * BLOCK_TOKENS))
        ns.put(tokens, blocks_for(tokens, 2))

        def child() -> bool:  # a call settles first (the settling lock is held)
            got = ns.get(tokens)
            ok = got.n_blocks == 2 and np.array_equal(got.blocks, blocks_for(tokens, 2))
            return ok and client.stats().tier("host").blocks >= 2

        with held_by_another_thread(client._locks["settle"], client._timer_cond):
            assert in_forked_child(child) == 0


@contextlib.contextmanager
def held_by_another_thread(*locks: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    """``locks`` held by another thread of this process while the block runs (as they
    may be when some thread forks)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    try:
        yield
    finally:
        release.set()
        holder.join(10)


def test_a_forked_child_makes_its_own_copy_threads(daemon: Daemon) -> None:
    """Copies of PARALLEL_COPY_BYTES or more are split with the client's copy threads.
    A child forked after the parent made them has none of those threads: it must make
    its own, not hand its share of a copy to a pool that will never run it."""
    size = 1 << 20
    n = arena_path.PARALLEL_COPY_BYTES // size + 1
    rng = np.random.default_rng(11)
    with KVClient(daemon.addr) as client:
        ns = client.namespace("split-copies", BLOCK_TOKENS, size)
        tokens = list(range(7000, 7000 + n * BLOCK_TOKENS))
        blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
        assert ns.put(tokens, blocks).stored == n
        out = np.empty_like(blocks)
        assert np.array_equal(ns.get(tokens, out=out).blocks, blocks)
        if arena_path.COPY_THREADS < 2:
            pytest.skip("one CPU: copies are never split")
        assert arena_path._pool is not None  # the parent's copy threads exist

        def child() -> bool:
            more = list(range(8000, 8000 + n * BLOCK_TOKENS))
            assert ns.put(more, blocks[::-1]).stored == n
            got = ns.get(more, out=np.empty_like(blocks))
            return np.array_equal(got.blocks, blocks[::-1]) and np.array_equal(
                ns.get(tokens, out=np.empty_like(blocks)).blocks, blocks
            )

        assert in_forked_child(child) == 0


def test_a_client_forked_while_threads_hold_its_helpers_locks_works_in_the_child(
    daemon: Daemon,
) -> None:
    """The locks of the client's helpers (local calls, staged slots, the accounting, the
    copy pool's) held by a thread of the
    parent at the fork: the child gets new ones, and its puts and gets go through."""
    with KVClient(daemon.addr) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        tokens = list(range(9000, 9000 + 3 * BLOCK_TOKENS))
        ns.put(tokens, blocks_for(tokens, 3))
        assert np.array_equal(ns.get(tokens).blocks, blocks_for(tokens, 3))
        assert client._conn.local is not None and client._conn._stashes  # the helpers are in use
        locks = [
            client._conn.local._lock,
            client._conn._lock,
            client._conn.accounting._lock,
            client._conn.stash(ns.ns_id)._lock,
            arena_path._pool_lock,
        ]

        def child() -> bool:
            more = list(range(9500, 9500 + 2 * BLOCK_TOKENS))
            assert ns.put(more, blocks_for(more, 2)).stored == 2
            ok = np.array_equal(ns.get(more).blocks, blocks_for(more, 2))
            return ok and np.array_equal(ns.get(tokens).blocks, blocks_for(tokens, 3))

        with held_by_another_thread(*locks):
            assert in_forked_child(child) == 0
