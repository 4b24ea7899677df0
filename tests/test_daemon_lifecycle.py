"""Start, stop and restart of the real daemon process; the socket's permissions.

SIGTERM must drain, persist and exit 0; a daemon restarted on the same disk dir must
return every committed block byte for byte.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from conftest import Daemon, get_chain, kv_stub, open_ns, put_chain, put_requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvproto.v1 import kvstore_pb2 as pb


def test_socket_is_0600_in_a_0700_directory(kvstored_factory: Any, tmp_path: Path) -> None:
    base = tempfile.mkdtemp(prefix="kv", dir="/tmp")
    try:
        sock = os.path.join(base, "new", "kvstored.sock")  # "new" does not exist yet
        daemon = kvstored_factory(listen="unix://" + sock)
        assert stat.S_ISSOCK(os.stat(sock).st_mode)
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(sock)).st_mode) == 0o700
        assert daemon.stop() == 0
        assert not os.path.exists(sock), "the socket is removed on shutdown"
    finally:
        subprocess.run(["rm", "-rf", base], check=False)


def test_sigterm_exits_0_and_a_restart_returns_every_block(kvstored_factory: Any) -> None:
    # host 1 MiB with 64 KiB blocks (16 slots), write-back: the 3 x 8 blocks do not all
    # fit, so some live only on disk, some only in the host arena until shutdown.
    daemon: Daemon = kvstored_factory(host_bytes="1MiB", disk_bytes="64MiB")
    stub = kv_stub(daemon)
    info = open_ns(stub, block_bytes=64 << 10, name="restart-ns")
    chains = {seed: [seed * 1000 + i for i in range(32)] for seed in (1, 2, 3)}
    stored: dict[int, bytes] = {}
    for seed, tokens in chains.items():
        reply, stored[seed] = put_chain(stub, info, tokens, seed=seed)
        assert reply.stored == 8
    # plus a chain written through the shared-arena path (reserve + commit)
    res = stub.Reserve(pb.ReserveRequest(ns_id=info.ns_id, tokens=list(range(16))), timeout=5)
    arena = kv_stub(daemon).ServerInfo(pb.ServerInfoRequest(), timeout=5).arena_path
    reserved = b"".join(bytes([7 + s.index]) * s.size for s in res.slots)
    with open(arena, "r+b") as f:
        for slot in res.slots:
            f.seek(slot.offset)
            f.write(bytes([7 + slot.index]) * slot.size)
    assert stub.Commit(pb.CommitRequest(lease_id=res.lease_id), timeout=5).committed == 4

    assert daemon.stop(signal.SIGTERM) == 0
    assert "stopped" in daemon.output()

    daemon.restart()
    stub = kv_stub(daemon)
    # the name binding survived too
    assert open_ns(stub, block_bytes=64 << 10, name="restart-ns").ns_id == info.ns_id
    for seed, tokens in chains.items():
        header, data = get_chain(stub, info.ns_id, tokens)
        assert header.ready_blocks == 8, f"chain {seed}: {header}"
        assert data == stored[seed], f"chain {seed} differs after restart"
    header, data = get_chain(stub, info.ns_id, list(range(16)))
    assert header.n_blocks == 4 and data == reserved
    assert daemon.stop(signal.SIGINT) == 0


def test_sigterm_drains_health_not_serving_inflight_put_finishes_watchers_end(
    kvstored_factory: Any,
) -> None:
    daemon: Daemon = kvstored_factory(grace_s=10)
    stub = kv_stub(daemon)
    info = open_ns(stub, block_bytes=1 << 20)
    tokens = list(range(4 * 8))
    data = bytes(range(256)) * (8 << 12)  # 8 MiB

    # a health watcher and an event watcher are connected when SIGTERM comes
    health = health_pb2_grpc.HealthStub(daemon.channel())
    health_watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
    assert next(health_watch).status == health_pb2.HealthCheckResponse.SERVING
    events = stub.WatchEvents(pb.WatchEventsRequest(ns_id=info.ns_id), timeout=30)
    seen: list[Any] = []
    watcher = threading.Thread(target=lambda: seen.extend(e for b in events for e in b.events))
    watcher.start()

    # a Put whose stream is half sent when SIGTERM arrives
    go_on = threading.Event()

    def slow_stream() -> Any:
        for i, msg in enumerate(put_requests(info.ns_id, tokens, data, 8)):
            if i == 2:
                daemon.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
                go_on.wait(10)
            yield msg

    result: dict[str, Any] = {}
    putter = threading.Thread(target=lambda: result.update(reply=stub.Put(slow_stream())))
    putter.start()
    # health flips to NOT_SERVING while the put is still streaming
    assert next(health_watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    health_watch.cancel()
    go_on.set()
    putter.join(20)
    assert result["reply"].stored == 8, "the in-flight put finished during the grace period"
    # the event stream ended by itself, with the 8 blocks stored by that put
    watcher.join(10)
    assert not watcher.is_alive()
    assert len(seen) == 8
    started = time.monotonic()
    assert daemon.proc.wait(20) == 0  # type: ignore[union-attr]
    assert time.monotonic() - started < 5, "shutdown waited out the grace period"

    daemon.restart()
    header, got = get_chain(kv_stub(daemon), info.ns_id, tokens)
    assert header.n_blocks == 8 and got == data


def test_a_second_daemon_on_a_live_socket_exits_2_naming_listen(kvstored: Daemon) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvstored", "--listen", kvstored.addr, "--host-bytes", "8MiB",
         "--disk-bytes", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("kvstored: error: listen: another daemon is listening on ")
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    # the first daemon is unharmed
    stub = health_pb2_grpc.HealthStub(kvstored.channel())
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1


def test_a_stale_socket_file_is_replaced(kvstored_factory: Any) -> None:
    daemon: Daemon = kvstored_factory(start=False)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(daemon.socket_path)  # bound, never listening: nobody answers
    stale.close()
    daemon.start()
    assert kv_stub(daemon).Stats(pb.StatsRequest(), timeout=5).platform


def test_no_arguments_uses_the_xdg_default_socket(kvstored_factory: Any, tmp_path: Path) -> None:
    runtime = tempfile.mkdtemp(prefix="kv", dir="/tmp")
    try:
        daemon: Daemon = kvstored_factory(
            start=False,
            env={
                "XDG_RUNTIME_DIR": runtime,
                "XDG_DATA_HOME": str(tmp_path / "data"),
                # keep the test machine's memory and disk out of it
                "KVSTORED_HOST_BYTES": "16MiB",
                "KVSTORED_DISK_BYTES": "16MiB",
                "KVSTORED_ARENA_DIR": str(tmp_path),
            },
        )
        daemon.settings.clear()  # no flags at all
        daemon.socket_path = os.path.join(runtime, "kvstore", "kvstored.sock")
        daemon.addr = "unix://" + daemon.socket_path
        daemon.start()
        assert stat.S_IMODE(os.stat(os.path.dirname(daemon.socket_path)).st_mode) == 0o700
        assert "serving on unix://" + daemon.socket_path in daemon.output()
        assert (tmp_path / "data" / "kvstore").is_dir()
        assert daemon.stop() == 0
    finally:
        subprocess.run(["rm", "-rf", runtime], check=False)


def test_tcp_listen_on_loopback_when_asked(kvstored_factory: Any) -> None:
    with socket.socket() as probe:  # a free loopback port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon: Daemon = kvstored_factory(listen=f"127.0.0.1:{port}")
    assert f"serving on 127.0.0.1:{port};" in daemon.output()
    assert kv_stub(daemon).Stats(pb.StatsRequest(), timeout=5).platform
    assert daemon.stop() == 0
