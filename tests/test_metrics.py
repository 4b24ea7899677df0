"""The Prometheus endpoint of a real ``kvstored``: documented metrics that move.

Each test starts the daemon with ``metrics_listen = "127.0.0.1:0"`` and learns the bound
port from its start-up line ``metrics on http://127.0.0.1:PORT/metrics`` (logged
before health turns SERVING, so it is there when the fixture returns).
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import Daemon
from prometheus_client.parser import text_string_to_metric_families

from kvclient import KVClient, NamespaceNotFoundError
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import kvstore_pb2_grpc as pb_grpc
from kvstored import config

README = Path(__file__).resolve().parents[1] / "deploy" / "README.md"
SHARED = "kvstore_shared_"
METRICS_LINE = re.compile(r"metrics on (http://\S+/metrics)")
BLOCK_BYTES = 64 << 10  # the 1 MiB host tier holds 16 blocks
BLOCK_TOKENS = 4

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metrics_url(daemon: Daemon) -> str:
    found = METRICS_LINE.search(daemon.output())
    assert found, daemon.output()
    return found.group(1)


def scrape(url: str) -> Samples:
    """-> {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def rpc_count(samples: Samples, method: str, code: str = "OK") -> float:
    key = ("kvstore_rpc_duration_seconds_count",
           (("code", code), ("method", f"kvstore.v1.KVStore/{method}")))
    return samples.get(key, 0.0)


def tokens_of(seed: int, n_blocks: int) -> list[int]:
    return [seed * 100_000 + i for i in range(n_blocks * BLOCK_TOKENS)]


def blocks_of(n_blocks: int, fill: int) -> np.ndarray:
    return np.full((n_blocks, BLOCK_BYTES), fill, np.uint8)


def documented_metrics() -> dict[str, str]:
    """``deploy/README.md`` metric table: family name -> type."""
    found = {}
    for line in README.read_text().splitlines():
        m = re.match(r"^\| `((?:kvstore|process)_[a-z_]+)(?:\{[^}]*\})?` \| (\w+) \|", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def exposed(url: str) -> dict[str, str]:
    """Metric names as a scraper sees them (counters with ``_total``) -> their type.

    The ``*_created`` gauges prometheus_client adds beside its own counters and
    histograms are left out: they are documented once, in the notes of the table.
    """
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    names = {}
    for family in text_string_to_metric_families(text):
        if not family.name.endswith("_created"):
            suffix = "_total" if family.type == "counter" else ""
            names[family.name + suffix] = family.type
    return names


def test_metrics_follow_puts_gets_evictions_and_are_documented(kvstored_factory: Any) -> None:
    daemon: Daemon = kvstored_factory(
        host_bytes="1MiB", disk_bytes="64MiB", metrics_listen="127.0.0.1:0"
    )
    url = metrics_url(daemon)
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0/metrics")

    # inline data path: Put (client stream) and Get (server stream) cross the interceptor
    with KVClient(daemon.addr, use_arena=False) as client:
        ns = client.namespace("metrics-model", block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES)
        start = scrape(url)
        assert value(start, "kvstore_tier_capacity_bytes", tier="host") == 1 << 20
        assert value(start, "kvstore_tier_capacity_bytes", tier="disk") == 64 << 20
        assert value(start, "kvstore_tier_used_bytes", tier="host") == 0
        assert value(start, "kvstore_namespace_blocks", namespace=ns.ns_id) == 0

        # put 8 blocks (512 KiB): the host tier holds them
        a = tokens_of(1, 8)
        assert ns.put(a, blocks_of(8, 1)).stored == 8
        after_put = scrape(url)
        assert value(after_put, "kvstore_tier_blocks", tier="host") == 8
        assert value(after_put, "kvstore_tier_used_bytes", tier="host") == 8 * BLOCK_BYTES
        assert value(after_put, "kvstore_tier_bytes_in_total", tier="host") == 8 * BLOCK_BYTES
        assert value(after_put, "kvstore_namespace_blocks", namespace=ns.ns_id) == 8
        assert value(after_put, "kvstore_namespace_bytes", namespace=ns.ns_id) == 8 * BLOCK_BYTES
        assert rpc_count(after_put, "Put") == 1

        # get them back: 8 host hits; a chain nobody stored: 4 misses. (The miss goes
        # through the arena path, Acquire: an inline Get only reads the ready prefix
        # the lookup found, so it never counts a miss.)
        assert ns.get(a).tokens == len(a)
        assert ns.lookup(tokens_of(2, 4)).tokens == 0
        with KVClient(daemon.addr, use_arena=True) as local:
            assert local.open_namespace(ns.ns_id).get(tokens_of(2, 4)).tokens == 0
        after_get = scrape(url)
        hits = value(after_get, "kvstore_tier_hits_total", tier="host")
        assert hits - value(after_put, "kvstore_tier_hits_total", tier="host") == 8
        assert value(after_get, "kvstore_namespace_hits_total", namespace=ns.ns_id) >= 8
        assert value(after_get, "kvstore_tier_misses_total", tier="host") > value(
            after_put, "kvstore_tier_misses_total", tier="host"
        )
        assert value(after_get, "kvstore_namespace_misses_total", namespace=ns.ns_id) > 0
        assert value(after_get, "kvstore_tier_bytes_out_total", tier="host") >= 8 * BLOCK_BYTES
        assert rpc_count(after_get, "Get") >= 1 and rpc_count(after_get, "Lookup") == 1

        # put 16 more blocks: the host tier (16 blocks) must make room -> the first
        # chain's leaves are evicted from host and demoted to disk (write-back)
        b = tokens_of(3, 16)
        assert ns.put(b, blocks_of(16, 3)).stored == 16
        deadline = time.monotonic() + 10
        while True:
            full = scrape(url)
            if value(full, "kvstore_tier_blocks", tier="disk") >= 8 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert value(full, "kvstore_tier_evictions_total", tier="host") >= 8
        assert value(full, "kvstore_demotions_total") >= 8
        assert value(full, "kvstore_tier_blocks", tier="disk") >= 8
        assert value(full, "kvstore_tier_bytes_in_total", tier="disk") >= 8 * BLOCK_BYTES
        assert value(full, "kvstore_tier_used_bytes", tier="host") <= 1 << 20

        # the first chain again: served from disk, promoted back
        assert ns.get(a).tokens == len(a)
        again = scrape(url)
        assert value(again, "kvstore_tier_hits_total", tier="disk") > 0
        assert value(again, "kvstore_promotions_total") > 0
        assert value(again, "kvstore_tier_bytes_out_total", tier="disk") > 0

        # an error is counted under its status code
        with pytest.raises(NamespaceNotFoundError):
            client.open_namespace("no-such-namespace")
    final = scrape(url)
    assert rpc_count(final, "DescribeNamespace", "NOT_FOUND") == 1
    assert value(final, "kvstore_rpc_in_flight", method="kvstore.v1.KVStore/Put") == 0
    for name in ("kvstore_pending_blocks", "kvstore_leases", "kvstore_corrupt_reads_total",
                 "kvstore_disk_queue_bytes"):
        assert (name, ()) in final, name
    build = [k for k in final if k[0] == "kvstore_build_info"]
    assert build and dict(build[0][1])["version"]

    # every metric served is documented in deploy/README.md with its type, and back
    documented = documented_metrics()
    served = exposed(url)
    assert set(served) - set(documented) == set(), "served but not documented"
    # the shared tier's series exist only with a shared tier (test_shared_tier checks them),
    # the KV event publisher's with one (test_kv_events)
    only_with = (SHARED, "kvstore_kv_events_")
    unserved = {name for name in set(documented) - set(served) if not name.startswith(only_with)}
    assert unserved == set(), "documented but not served"
    assert {name: documented[name] for name in served} == served


def test_streaming_calls_are_timed_until_they_end_or_are_cancelled(kvstored_factory: Any) -> None:
    daemon: Daemon = kvstored_factory(
        host_bytes="8MiB", disk_bytes=0, metrics_listen="127.0.0.1:0"
    )
    url = metrics_url(daemon)
    stub = pb_grpc.KVStoreStub(daemon.channel())
    # a WatchEvents stream stays open: it is in flight until the watcher cancels it
    call = stub.WatchEvents(pb.WatchEventsRequest(from_now=True))
    method = "kvstore.v1.KVStore/WatchEvents"
    deadline = time.monotonic() + 10
    in_flight = ("kvstore_rpc_in_flight", (("method", method),))
    while scrape(url).get(in_flight) != 1:  # no series until the call has started
        assert time.monotonic() < deadline, "WatchEvents never counted in flight"
        time.sleep(0.05)
    call.cancel()
    with pytest.raises(grpc.RpcError):
        next(call)
    while True:
        samples = scrape(url)
        if rpc_count(samples, "WatchEvents", "CANCELLED") == 1:
            break
        assert time.monotonic() < deadline, "cancelled WatchEvents never recorded"
        time.sleep(0.05)
    assert value(samples, "kvstore_rpc_in_flight", method=method) == 0
    # its duration is the time it was open, not the time to its first message
    sum_key = ("kvstore_rpc_duration_seconds_sum", (("code", "CANCELLED"), ("method", method)))
    assert samples[sum_key] > 0.0


def test_metrics_listen_values_and_bind_failures(
    kvstored_factory: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    parse = config.KEYS_BY_NAME["metrics_listen"].parse
    assert config.KEYS_BY_NAME["metrics_listen"].default == "127.0.0.1:9464"
    assert parse("off") == parse("") == parse(" OFF ") == ""
    assert parse("0.0.0.0:9464") == "0.0.0.0:9464" and parse("[::1]:0") == "[::1]:0"
    for bad in ("9464", "localhost", "unix:///tmp/m.sock", "127.0.0.1:65536", ":9464"):
        with pytest.raises(ValueError):
            parse(bad)
    from kvstored.main import main

    assert main(["--print-config", "--metrics-listen", "localhost"]) == 2
    assert capsys.readouterr().err.startswith("kvstored: error: metrics_listen: ")

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # asked for explicitly and taken: start-up fails (exit 2), naming the key
        sock_dir = tempfile.mkdtemp(prefix="kv", dir="/tmp")
        proc = subprocess.run(
            [sys.executable, "-m", "kvstored", "--listen", f"unix://{sock_dir}/k.sock",
             "--host-bytes", "4MiB", "--disk-bytes", "0", "--arena-dir", sock_dir,
             "--metrics-listen", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        assert f"metrics_listen: 127.0.0.1:{port} is in use" in proc.stderr
        assert not Path(sock_dir, "k.sock").exists()

    # "off": no endpoint, no line
    daemon: Daemon = kvstored_factory(host_bytes="4MiB", disk_bytes=0, metrics_listen="off")
    assert "metrics on" not in daemon.output()
    assert daemon.stop() == 0


def test_a_taken_default_metrics_port_is_a_warning(kvstored_factory: Any) -> None:
    host, port = "127.0.0.1", 9464
    with socket.socket() as taken:
        try:
            taken.bind((host, port))
            taken.listen()
        except OSError:
            pass  # another process holds it: taken either way
        # metrics_listen=None drops the fixture's "off": the daemon's own default applies
        daemon: Daemon = kvstored_factory(host_bytes="4MiB", disk_bytes=0, metrics_listen=None)
        assert "metrics disabled: cannot listen on 127.0.0.1:9464" in daemon.output()
        assert daemon.stop() == 0


def test_inline_get_of_a_partly_cached_prompt_counts_misses(kvstored_factory: Any) -> None:
    daemon: Daemon = kvstored_factory(host_bytes="8MiB", disk_bytes=0)
    with KVClient(daemon.addr, use_arena=False) as client:
        ns = client.namespace("miss", block_tokens=4, block_bytes=4096)
        ns.put(list(range(8)), np.zeros((2, 4096), np.uint8))
        before = client.stats().tier("host")
        got = ns.get(list(range(16)))  # asks for 4 blocks, 2 are cached
        after = client.stats().tier("host")
    assert got.blocks.shape[0] == 2
    assert after.hits - before.hits == 2 and after.misses - before.misses == 2


def test_gets_served_from_known_slots_are_counted(kvstored_factory: Any) -> None:
    """A same-host get of a prefix whose slots the client knows makes no call, so the
    RPC histogram never sees it; the reads it reports afterwards count it."""
    daemon: Daemon = kvstored_factory(host_bytes="8MiB", metrics_listen="127.0.0.1:0")
    url = metrics_url(daemon)
    with KVClient(daemon.addr, use_arena=True) as client:
        ns = client.namespace("known", block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES)
        tokens = tokens_of(1, 4)
        ns.put(tokens, blocks_of(4, 7))
        out = np.empty((4, BLOCK_BYTES), np.uint8)
        for _ in range(4):  # the first asks (Acquire) and learns the slots
            assert ns.get(tokens, out=out).tokens == len(tokens)
        client.stats()  # sends the reports still pending first
        samples = scrape(url)
    assert rpc_count(samples, "Acquire") == 1
    assert value(samples, "kvstore_known_slot_gets_total") == 3
    assert value(samples, "kvstore_tier_hits_total", tier="host") == 16


def test_gets_of_disk_blocks_are_counted_as_disk_hits(kvstored_factory: Any) -> None:
    """A same-host first read of a prefix all on disk asks the daemon (one Acquire: it
    promotes the blocks), and counts as disk hits."""
    daemon: Daemon = kvstored_factory(host_bytes="8MiB", metrics_listen="127.0.0.1:0")
    with KVClient(daemon.addr, use_arena=True) as client:
        ns = client.namespace("files", block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES)
        chains = [tokens_of(seed, 4) for seed in (1, 2)]
        for chain in chains:
            ns.put(chain, blocks_of(4, 7))
    daemon.restart()  # every block on disk only
    url = METRICS_LINE.findall(daemon.output())[-1]  # the restarted daemon's endpoint
    with KVClient(daemon.addr, use_arena=True) as client:
        ns = client.namespace("files", block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES)
        for chain in chains:
            assert ns.get(chain).blocks.tobytes() == blocks_of(4, 7).tobytes()
        client.stats()  # sends the reports still pending first
        samples = scrape(url)
    assert rpc_count(samples, "Acquire") == 2
    assert value(samples, "kvstore_tier_hits_total", tier="disk") == 8
