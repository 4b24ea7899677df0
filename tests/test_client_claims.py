"""Early reuse through the daemon: claims, chunked delivery, waiting, dead owners.

Everything runs against the real kvstored (fixtures in conftest.py); concurrent
claimants are separate processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ClientMaker, Daemon, raw_put

from kvclient import InvalidArgumentError, KVClient, OutOfSpaceError

TOKENS = 4
BLOCK = 4096
PROMPT = list(range(8 * TOKENS))  # 8 shared blocks


def content(i: int) -> np.ndarray:
    """The bytes of block i of PROMPT, as every session would compute them."""
    return np.full(BLOCK, (i * 37 + 11) % 256, np.uint8)


@pytest.mark.parametrize("use_arena", [True, False])
def test_claim_delivers_chunks_that_become_ready_one_by_one(
    kvstored: Daemon, use_arena: bool, kv_client: ClientMaker
) -> None:
    with kv_client(kvstored.addr, use_arena=use_arena) as owner, kv_client(kvstored.addr) as other:
        ns = owner.namespace("claims", block_tokens=TOKENS, block_bytes=BLOCK)
        seen = other.namespace("claims", block_tokens=TOKENS, block_bytes=BLOCK)
        with ns.claim(PROMPT) as claim:
            assert (claim.first, claim.blocks, claim.existing) == (0, 8, 0)
            assert seen.lookup(PROMPT).pending_blocks == 8
            # the first chunk of the prefill is done: 3 blocks ready, 5 still pending
            assert claim.fill(np.stack([content(i) for i in range(3)])) == 3
            look = seen.lookup(PROMPT)
            assert (look.blocks, look.pending_blocks) == (3, 5)
            assert claim.fill(np.stack([content(i) for i in range(3, 8)])) == 5
        got = seen.get(PROMPT)
        assert np.array_equal(got.blocks, np.stack([content(i) for i in range(8)]))


@pytest.mark.parametrize("use_arena", [True, False])
def test_a_claim_made_by_one_client_is_delivered_by_another(
    kvstored: Daemon, use_arena: bool, kv_client: ClientMaker
) -> None:
    # a scheduler claims, a worker (its own client) computes and delivers
    with (
        kv_client(kvstored.addr) as scheduler,
        kv_client(kvstored.addr, use_arena=use_arena) as worker,
    ):
        claim = scheduler.namespace("claims", block_tokens=TOKENS, block_bytes=BLOCK).claim(PROMPT)
        ns = worker.namespace("claims", block_tokens=TOKENS, block_bytes=BLOCK)
        resumed = ns.resume_claim(claim.ticket())
        assert (resumed.first, resumed.blocks, resumed.delivered) == (0, 8, 0)
        assert resumed.fill(np.stack([content(i) for i in range(8)])) == 8
        got = scheduler.namespace("claims", block_tokens=TOKENS, block_bytes=BLOCK).get(PROMPT)
        assert np.array_equal(got.blocks, np.stack([content(i) for i in range(8)]))
        # a ticket is for its own namespace only
        other = worker.namespace("other", block_tokens=TOKENS, block_bytes=BLOCK)
        with pytest.raises(InvalidArgumentError, match="the claim is of namespace claims@"):
            other.resume_claim(claim.ticket())


def test_second_claimant_gets_nothing_and_waits(kvstored: Daemon, kv_client: ClientMaker) -> None:
    with kv_client(kvstored.addr) as a, kv_client(kvstored.addr) as b:
        ns_a = a.namespace("claims", block_tokens=TOKENS, block_bytes=BLOCK)
        ns_b = b.namespace("claims", block_tokens=TOKENS, block_bytes=BLOCK)
        first = ns_a.claim(PROMPT)
        second = ns_b.claim(PROMPT)
        assert second.blocks == 0 and second.pending_elsewhere
        first.fill(np.stack([content(i) for i in range(8)]))
        look = ns_b.lookup(PROMPT, wait_pending_s=5)
        assert look.blocks == 8 and look.pending_blocks == 0


def test_abandoned_claim_releases_the_blocks(kvstored: Daemon, kv_client: ClientMaker) -> None:
    with kv_client(kvstored.addr) as client:
        ns = client.namespace("claims", block_tokens=TOKENS, block_bytes=BLOCK)
        with ns.claim(PROMPT) as claim:
            claim.fill(np.stack([content(0), content(1)]))
        # leaving the block abandoned the 6 undelivered blocks: they can be claimed again
        look = ns.lookup(PROMPT)
        assert (look.blocks, look.pending_blocks) == (2, 0)
        again = ns.claim(PROMPT)
        assert (again.first, again.blocks) == (2, 6)
        again.abandon()


def test_claim_in_a_full_store_is_out_of_space(kvstored_factory, kv_client: ClientMaker) -> None:
    daemon = kvstored_factory(host_bytes="1MiB", disk_bytes=0)  # 256 blocks
    with kv_client(daemon.addr) as client:
        ns = client.namespace("claims", block_tokens=TOKENS, block_bytes=BLOCK)
        holder = ns.claim(list(range(1000, 1000 + 256 * TOKENS)))  # every slot pending
        assert holder.blocks == 256
        with pytest.raises(OutOfSpaceError):
            ns.claim(PROMPT)
        holder.abandon()


_SESSION = r"""
import json, sys, time
import numpy as np
from kvclient import KVClient
addr, use_arena = sys.argv[1], sys.argv[2] == "1"
TOKENS, BLOCK, PROMPT = 4, 4096, list(range(32))
def content(i): return np.full(BLOCK, (i * 37 + 11) % 256, np.uint8)
computed = []
with KVClient(addr, use_arena=use_arena) as client:
    ns = client.namespace("claims", block_tokens=TOKENS, block_bytes=BLOCK)
    print("ready", flush=True)
    sys.stdin.readline()  # start together
    while True:
        with ns.claim(PROMPT) as claim:
            for i in range(claim.first, claim.first + claim.blocks, 2):
                n = min(2, claim.first + claim.blocks - i)
                time.sleep(0.02)  # the prefill of a chunk
                claim.fill(np.stack([content(j) for j in range(i, i + n)]))
                computed.extend(range(i, i + n))
        look = ns.lookup(PROMPT, wait_pending_s=5)
        if look.blocks == 8:
            break
    got = ns.get(PROMPT)
    ok = bool(np.array_equal(got.blocks, np.stack([content(i) for i in range(8)])))
print(json.dumps({"computed": computed, "ok": ok}), flush=True)
"""


def test_concurrent_processes_compute_each_block_once(kvstored: Daemon) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SESSION, kvstored.addr, "1" if i % 2 else "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(6)
    ]
    try:
        for p in procs:  # every session connected before any starts
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = [json.loads(p.communicate(timeout=60)[0].splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            p.kill()
    computed = sorted(i for r in reports for i in r["computed"])
    assert computed == list(range(8))  # exactly one session computed each block
    assert all(r["ok"] for r in reports)  # and everyone got the owner's bytes


_DYING_OWNER = r"""
import os, sys
import numpy as np
from kvclient import KVClient
with KVClient(sys.argv[1]) as client:
    ns = client.namespace("claims", block_tokens=4, block_bytes=4096)
    claim = ns.claim(list(range(32)), ttl_s=1.0)
    claim.fill(np.stack([np.full(4096, (i * 37 + 11) % 256, np.uint8) for i in range(2)]))
    print("filled", flush=True)
    os.kill(os.getpid(), 9)  # dies mid-prefill, 6 blocks still pending
"""


def test_killed_owner_releases_waiters_and_serves_nothing_half_written(kvstored: Daemon) -> None:
    owner = subprocess.run(
        [sys.executable, "-c", _DYING_OWNER, kvstored.addr], capture_output=True, text=True
    )
    assert owner.returncode == -signal.SIGKILL and "filled" in owner.stdout
    with KVClient(kvstored.addr) as client:
        ns = client.namespace("claims", block_tokens=TOKENS, block_bytes=BLOCK)
        t0 = time.monotonic()
        look = ns.lookup(PROMPT, wait_pending_s=20)
        waited = time.monotonic() - t0
        # released when the dead owner's 1 s lease ran out, long before the 20 s deadline
        assert waited < 10
        assert (look.blocks, look.pending_blocks) == (2, 0)
        got = ns.get(PROMPT)  # only what was delivered, byte-exact
        assert np.array_equal(got.blocks, np.stack([content(0), content(1)]))
        claim = ns.claim(PROMPT)  # the waiter computes the rest itself
        assert (claim.first, claim.blocks) == (2, 6)
        claim.abandon()
    assert os.path.exists(kvstored.socket_path)


def test_async_claim_round_trip(kvstored: Daemon) -> None:
    import asyncio

    from kvclient import AsyncKVClient

    async def run(use_arena: bool) -> np.ndarray:
        async with AsyncKVClient(kvstored.addr, use_arena=use_arena) as client:
            ns = await client.namespace(
                f"async-{use_arena}", block_tokens=TOKENS, block_bytes=BLOCK
            )
            async with await ns.claim(PROMPT) as claim:
                assert claim.blocks == 8
                assert await claim.fill(np.stack([content(i) for i in range(4)])) == 4
                assert (await ns.lookup(PROMPT)).pending_blocks == 4
                assert await claim.fill(np.stack([content(i) for i in range(4, 8)])) == 4
            return (await ns.get(PROMPT)).blocks

    for use_arena in (True, False):
        got = asyncio.run(run(use_arena))
        assert np.array_equal(got, np.stack([content(i) for i in range(8)]))


def test_bad_inline_delivery_is_refused_and_changes_nothing(
    kvstored: Daemon, kv_client: ClientMaker
) -> None:
    from kvclient import InvalidArgumentError, LeaseError
    from kvclient import wire as kvwire
    from kvproto.v1 import kvstore_pb2 as pb

    with kv_client(kvstored.addr, use_arena=False) as client:
        ns = client.namespace("claims", block_tokens=TOKENS, block_bytes=BLOCK)
        claim = ns.claim(PROMPT)

        def deliver(lease_id: int, n_blocks: int, rows: np.ndarray) -> None:
            header = pb.PutHeader(ns_id=ns.ns_id, n_blocks=n_blocks, lease_id=lease_id)
            raw_put(client, kvwire.put_messages(header, rows, 1 << 20))

        one = np.stack([content(0)])
        with pytest.raises(LeaseError):  # FAILED_PRECONDITION: no such claim
            deliver(12345, 1, one)
        with pytest.raises(InvalidArgumentError, match="has 8 left"):
            deliver(claim.lease_id, 9, np.stack([content(i % 8) for i in range(9)]))
        with pytest.raises(InvalidArgumentError, match="expected n_blocks x block_bytes"):
            deliver(claim.lease_id, 2, one)  # 2 blocks announced, 1 sent
        # nothing changed: all 8 blocks still pending under the claim, none ready
        look = ns.lookup(PROMPT)
        assert (look.blocks, look.pending_blocks) == (0, 8)
        assert claim.fill(np.stack([content(i) for i in range(8)])) == 8
        assert np.array_equal(ns.get(PROMPT).blocks, np.stack([content(i) for i in range(8)]))


def test_a_put_refused_before_its_data_is_read_reports_the_refusal_to_an_async_client(
    kvstored: Daemon,
) -> None:
    """The daemon refuses a put by its header (here: no such claim) while the client is
    still sending the data. grpc.aio's client reported such a refusal as INTERNAL
    ("Internal error from Core") whenever one of its writes lost the race with the
    status (grpc/grpc#36066); the daemon reads the rest of a refused put before it
    answers, so every try reads as the refusal it is."""
    import asyncio

    from kvclient import AsyncKVClient, LeaseError
    from kvclient import wire as kvwire
    from kvproto.v1 import kvstore_pb2 as pb

    async def run() -> list[str]:
        answers = []
        async with AsyncKVClient(kvstored.addr, use_arena=False) as client:
            ns = await client.namespace("refused", block_tokens=TOKENS, block_bytes=BLOCK)
            rows = np.stack([content(i % 8) for i in range(64)])
            conn = client._conn
            from kvclient.effects import Io

            for _ in range(20):
                header = pb.PutHeader(ns_id=ns.ns_id, n_blocks=64, lease_id=12345)
                messages = kvwire.put_messages(header, rows, 2 * BLOCK)
                try:
                    await client._drive(conn.over_grpc(Io(conn.grpc.put, (messages,))))
                    answers.append("stored")
                except LeaseError:
                    answers.append("refused")
                except Exception as exc:  # noqa: BLE001 - the answer under test
                    answers.append(repr(exc))
        return answers

    assert asyncio.run(run()) == ["refused"] * 20
