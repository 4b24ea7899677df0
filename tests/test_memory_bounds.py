"""Every client-driven path holds memory within a configured bound (#66 item 3).

A real daemon; its memory is read from /proc/<pid>/status (VmRSS). The checks are
bounds derived from the configured caps, never timings:

- A tenant with a 16 MiB host quota opens Get streams of a 48 MiB chain (3x its room)
  and reads none of them. A get longer than the room copies one window per call
  (``truncated``: the client calls again), each window counted twice (its copy, the
  messages gRPC queues) against the tenant's share of ``get_buffer_bytes`` until its
  call is done; a Get past the share
  waits ``put_wait_ms`` and is refused (RESOURCE_EXHAUSTED). Before, each stream
  copied the whole chain (+48 MiB a stream).
- 64-byte blocks carrying 256 tokens each (1 KiB of token ids a block) churn through
  a 2 MiB host tier with KV events on and a subscriber that never reads: the token
  ids the index keeps stay within ``index_tokens_bytes``, the events queued within
  ``kv_events_buffer_bytes``, the chain cache of recent calls within its bytes (it
  held 1 KiB of token ids a block: 128 MiB), and the daemon's memory within what those
  and the index's nodes take. Before, the daemon grew 356 MiB.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import zmq
from conftest import Daemon, block_bytes_for, wait_for, write_secret

from kvbench.harness import free_tcp_port
from kvclient import KVClient
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import kvstore_pb2_grpc as pb_grpc

MiB = 1 << 20
GET_CHUNK = 4 * MiB  # a Get message's bytes at most (kvstored.config.GET_CHUNK_BYTES)


def rss_bytes(daemon: Daemon) -> int:
    for line in Path(f"/proc/{daemon.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


# --- Get streams nobody reads -----------------------------------------------------------

QUOTA = 16 * MiB  # tenant a's host room
GET_BUFFERS = 24 * MiB  # a, b and the admin: 8 MiB each
SHARE = GET_BUFFERS // 3
WINDOW = SHARE // 8  # a copied window: 1 MiB, held twice (the copy, the messages)
BLOCK = 256 << 10
TOKENS = 16
BLOCKS = 3 * QUOTA // BLOCK  # 48 MiB: 3x the tenant's room
STREAMS = 6


@pytest.fixture(scope="module")
def quota_daemon(
    kvstored_module_factory: Callable[..., Daemon], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Daemon, str]:
    folder = tmp_path_factory.mktemp("tokens")
    tokens = {who: secrets.token_hex(16) for who in ("a", "b", "admin")}
    for who, token in tokens.items():
        write_secret(folder / f"{who}.token", token + "\n")
    config = folder / "kvstored.toml"
    config.write_text(
        f'admin_token_file = "{folder / "admin.token"}"\n'
        f'[tenants.a]\ntoken_file = "{folder / "a.token"}"\nhost_bytes = "16 MiB"\n'
        f'[tenants.b]\ntoken_file = "{folder / "b.token"}"\n'
    )
    daemon = kvstored_module_factory(
        extra_args=("--config", str(config)),
        host_bytes="64MiB", disk_bytes="256MiB", put_wait_ms=300,
        get_buffer_bytes=GET_BUFFERS,
    )  # fmt: skip
    return daemon, tokens["a"]


def test_get_streams_nobody_reads_hold_one_window_each_within_the_tenants_share(
    quota_daemon: tuple[Daemon, str],
) -> None:
    daemon, token = quota_daemon
    tokens = list(range(BLOCKS * TOKENS))
    rows = np.frombuffer(
        b"".join(block_bytes_for(7, i, BLOCK) for i in range(BLOCKS)), np.uint8
    ).reshape(BLOCKS, BLOCK)
    with KVClient(daemon.addr, token=token) as client:
        ns = client.namespace("long", TOKENS, block_bytes=BLOCK)
        assert ns.put(tokens, rows).stored == BLOCKS  # window by window onto disk
        ns_id = ns.ns_id
    base = rss_bytes(daemon)
    # a reader that takes in no more than HTTP/2's first window (64 KiB) of a stream
    channel = grpc.insecure_channel(daemon.addr, options=[("grpc.http2.bdp_probe", 0)])
    stub = pb_grpc.KVStoreStub(channel)
    metadata = (("authorization", f"Bearer {token}"),)
    request = pb.GetRequest(ns_id=ns_id, tokens=tokens)
    streams, headers, refused = [], [], []
    try:
        for _ in range(STREAMS):  # each read up to its header, then left alone
            stream = stub.Get(request, metadata=metadata)
            try:
                headers.append(next(stream).header)
            except grpc.RpcError as e:
                refused.append(e)
                continue
            streams.append(stream)
        grown = rss_bytes(daemon) - base
        # what the daemon holds for them: their windows (within the tenant's share),
        # the message each has in flight, and room for the allocator's slack
        assert grown <= SHARE + STREAMS * GET_CHUNK + 32 * MiB, grown >> 20
        # each: one window of the chain, and the client is told to call again
        for header in headers:
            assert 0 < header.n_blocks * BLOCK <= WINDOW and header.truncated
            assert header.ready_blocks == BLOCKS
        # the share holds four windows; the other streams waited for one, then were
        # refused with the reason
        assert len(streams) == SHARE // (2 * WINDOW) == 4
        assert refused and all(
            e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "get_buffer_bytes" in e.details()
            for e in refused
        )
    finally:
        for stream in streams:
            stream.cancel()
        channel.close()
    # the streams ended: their windows are given back, and a reader gets the whole
    # chain, a window per call
    with KVClient(daemon.addr, token=token, use_arena=False) as client:
        assert wait_for(lambda: client.stats().counters["get_buffer_bytes"] == 0)
        got = client.open_namespace(ns_id).get(tokens)
        assert np.array_equal(got.blocks, rows)
        assert client.stats().counters["get_buffer_bytes"] == 0


# --- KV events of tiny blocks with many tokens ------------------------------------------

EVENT_BLOCK = 64
EVENT_TOKENS = 256  # 1 KiB of token ids for 64 bytes of block
EVENT_HOST = 2 * MiB
TOKENS_CAP = 4 * MiB
EVENTS_CAP = 8 * MiB
NODE_BYTES = 1024  # what the index takes for one block besides its tokens, generously
PUT_BLOCKS = 512
CHAIN_CACHE_BYTES = 16 * MiB  # kvstored.dispatch.CHAIN_CACHE_BYTES
EVENT_LOG_ROWS, EVENT_ROW_BYTES = 65536, 160  # event_buffer's default; a row, generously


@pytest.fixture
def stalled_subscriber() -> Iterator[tuple[str, zmq.Socket[bytes]]]:
    """A KV event subscriber of every topic that never reads."""
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    yield endpoint, sub
    sub.close(linger=0)
    ctx.term()


def test_events_of_tiny_blocks_with_many_tokens_stay_within_their_bounds(
    kvstored_factory: Callable[..., Daemon], stalled_subscriber: tuple[str, zmq.Socket[bytes]]
) -> None:
    endpoint, sub = stalled_subscriber
    daemon = kvstored_factory(
        host_bytes=EVENT_HOST, disk_bytes=0, kv_events_listen=endpoint,
        index_tokens_bytes=TOKENS_CAP, kv_events_buffer_bytes=EVENTS_CAP,
    )  # fmt: skip
    sub.connect(endpoint)
    host_blocks = EVENT_HOST // EVENT_BLOCK
    rng = np.random.default_rng(66)
    with KVClient(daemon.addr) as client:
        ns = client.namespace("tiny", EVENT_TOKENS, block_bytes=EVENT_BLOCK)
        base = rss_bytes(daemon)
        rows = np.zeros((PUT_BLOCKS, EVENT_BLOCK), np.uint8)
        peak, counted = 0, []
        for _ in range(2 * host_blocks // PUT_BLOCKS):  # the host tier twice over
            ns.put(rng.integers(1000, 1 << 30, PUT_BLOCKS * EVENT_TOKENS), rows)
            peak = max(peak, rss_bytes(daemon) - base)
            counters = client.stats().counters
            counted.append((counters["index_tokens_bytes"], counters["kv_events_queued_bytes"]))
        assert client.stats().counters["tokens_not_kept"] > 0  # the cap was reached
    assert max(t for t, _ in counted) <= TOKENS_CAP
    assert max(q for _, q in counted) <= EVENTS_CAP
    # the index's nodes, the tokens they keep, the feed and the batches kept and queued
    # for the subscriber, the chains of recent calls, the event log (WatchEvents), and
    # room for the allocator's slack
    bound = (
        host_blocks * NODE_BYTES + TOKENS_CAP + 3 * EVENTS_CAP + CHAIN_CACHE_BYTES
        + EVENT_LOG_ROWS * EVENT_ROW_BYTES + 32 * MiB
    )  # fmt: skip
    assert peak <= bound, (peak >> 20, bound >> 20)
