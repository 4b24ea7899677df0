"""kvclient raises typed exceptions, never grpc.RpcError, and keeps the status on them.

Bad input the client can judge alone (token ids, block sizes, priorities) fails
before anything is sent; the rest comes back from the real daemon as a status code
that the client maps to one exception class.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from conftest import ClientMaker, Daemon, raw_call

from kvclient import (
    DaemonUnavailableError,
    InvalidArgumentError,
    KVClient,
    KVStoreError,
    LayoutMismatchError,
    LeaseError,
    NamespaceNotFoundError,
    OutOfSpaceError,
)
from kvproto.v1 import kvstore_pb2 as pb

BLOCK_BYTES = 4096


@pytest.fixture(scope="module")
def daemon(kvstored_module_factory: Callable[..., Daemon], kv_client: ClientMaker) -> Daemon:
    # host tier of 1 MiB and no disk: 256 slots of 4 KiB, easy to fill; one per driver
    return kvstored_module_factory(host_bytes="1MiB", disk_bytes=0)


def test_client_side_checks(daemon: Daemon, kv_client: ClientMaker) -> None:
    with kv_client(daemon.addr) as client:
        ns = client.namespace("err-model", 4, BLOCK_BYTES)
        one = np.zeros((1, BLOCK_BYTES), dtype=np.uint8)
        bad_calls = {
            "negative token": lambda: ns.lookup([1, -2, 3, 4]),
            "token >= 2**32": lambda: ns.get([2**32, 1, 2, 3]),
            "nested tokens": lambda: ns.lookup([[1, 2], [3, 4]]),
            "wrong block size": lambda: ns.put([1, 2, 3, 4], np.zeros((1, 100), np.uint8)),
            "wrong bytes size": lambda: ns.put([1, 2, 3, 4], [b"short"]),
            "too few tokens": lambda: ns.put([1, 2, 3], one),
            "priority > 100": lambda: ns.put([1, 2, 3, 4], one, priority=101),
            "negative start": lambda: ns.delete([1, 2, 3, 4], start=-1),
            "bad out array": lambda: ns.get([1, 2, 3, 4], out=np.zeros((1, 8), np.uint8)),
            "unknown layout": lambda: client.namespace("m", 4, BLOCK_BYTES, num_layerz=2),
            "empty model": lambda: client.namespace("", 4, BLOCK_BYTES),
            "unknown event kind": lambda: next(client.events(kinds=["nope"])),
        }
        for what, call in bad_calls.items():
            with pytest.raises(InvalidArgumentError) as info:
                call()
            assert not isinstance(info.value, grpc.RpcError), what
            assert info.value.code is None, what  # caught before anything was sent
        # nothing reached the store
        assert ns.lookup([1, 2, 3, 4]).blocks == 0


def test_daemon_side_errors_keep_code_and_details(daemon: Daemon, kv_client: ClientMaker) -> None:
    with kv_client(daemon.addr) as client:
        # the daemon judges these: block_tokens out of range, layout contradicting block_bytes
        with pytest.raises(InvalidArgumentError) as info:
            client.namespace("err-model", 1, BLOCK_BYTES)
        assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "block_tokens" in info.value.details
        with pytest.raises(InvalidArgumentError):
            client.namespace("err-model", 4, 1000, num_layers=2, num_kv_heads=2, head_dim=8)

        with pytest.raises(NamespaceNotFoundError) as missing:
            client.open_namespace("no-such-model@000000000000")
        assert missing.value.code is grpc.StatusCode.NOT_FOUND

        # a bound name re-opened with another layout
        client.namespace("err-model", 4, BLOCK_BYTES, name="err-bound")
        with pytest.raises(LayoutMismatchError) as mismatch:
            client.namespace("err-model", 4, 2 * BLOCK_BYTES, name="err-bound")
        assert mismatch.value.code is grpc.StatusCode.FAILED_PRECONDITION

        # a lease the daemon never handed out (only reachable through the raw stub)
        with pytest.raises(LeaseError) as lease:
            raw_call(client, "Release", pb.ReleaseRequest(lease_id=987654321))
        assert lease.value.code is grpc.StatusCode.FAILED_PRECONDITION


def test_full_store_refuses_with_out_of_space(daemon: Daemon, kv_client: ClientMaker) -> None:
    with kv_client(daemon.addr, use_arena=False) as client:
        ns = client.namespace("err-full", 4, 64 << 10)  # 16 slots fill the 1 MiB host
        # another session reserves every slot (pending blocks cannot be evicted)
        tokens = list(range(16 * 4))
        reserve = pb.ReserveRequest(ns_id=ns.ns_id, tokens=tokens, ttl_s=30)
        reserved = raw_call(client, "Reserve", reserve)
        assert len(reserved.slots) == 16
        try:
            blocks = np.ones((2, 64 << 10), dtype=np.uint8)
            with pytest.raises(OutOfSpaceError) as info:
                ns.put(list(range(1000, 1008)), blocks)
            assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            raw_call(client, "Abandon", pb.AbandonRequest(lease_id=reserved.lease_id))
        # with the reservation gone the same put is admitted
        assert ns.put(list(range(1000, 1008)), blocks).stored == 2


def test_unreachable_daemon_names_the_address(tmp_path, kv_client: ClientMaker) -> None:
    addr = str(tmp_path / "nobody-listens.sock")
    with kv_client(addr, timeout=5) as client:
        for call in (
            client.stats,
            client.server_info,
            lambda: client.namespace("m", 4, BLOCK_BYTES),
            lambda: next(client.events()),
        ):
            with pytest.raises(DaemonUnavailableError) as info:
                call()
            assert isinstance(info.value, KVStoreError)
            assert not isinstance(info.value, grpc.RpcError)
            assert info.value.code is grpc.StatusCode.UNAVAILABLE
            assert addr in str(info.value)


class SlowHandshakeProxy:
    """A unix socket in front of the daemon's that relays each connection only after
    ``delay`` seconds: a daemon (or host) slow to answer a new connection's handshake."""

    def __init__(self, target: str, delay: float) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvslow", dir="/tmp")
        self.path = os.path.join(self._dir, "slow.sock")
        self._target, self._delay = target, delay
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(16)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            relay = threading.Thread(target=self._relay, args=(conn,), daemon=True)
            self._threads.append(relay)
            relay.start()

    def _relay(self, conn: socket.socket) -> None:
        time.sleep(self._delay)
        with conn, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as upstream:
            upstream.connect(self._target)
            pair = {conn: upstream, upstream: conn}
            while not self._stop.is_set():
                ready, _, _ = select.select(list(pair), [], [], 0.1)
                for sock in ready:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    pair[sock].sendall(data)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(5)
        shutil.rmtree(self._dir, ignore_errors=True)


def test_a_daemon_slow_to_answer_a_new_connection_is_waited_for(daemon: Daemon) -> None:
    """The handshake of a new connection takes 0.6 s (a busy daemon, a loaded host): the
    call waits for it, within its timeout, instead of failing UNAVAILABLE at once."""
    proxy = SlowHandshakeProxy(daemon.socket_path, delay=0.6)
    try:
        with KVClient(proxy.path, use_arena=False, timeout=10) as client:
            started = time.monotonic()
            info = client.server_info()
            assert info.version and time.monotonic() - started >= 0.5
            ns = client.namespace("slow-handshake", 4, BLOCK_BYTES)
            block = np.full((1, BLOCK_BYTES), 7, np.uint8)
            assert ns.put([1, 2, 3, 4], block).stored == 1
            assert np.array_equal(ns.get([1, 2, 3, 4]).blocks, block)
    finally:
        proxy.close()
