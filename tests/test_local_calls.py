"""Local calls: the daemon's unary methods on its second unix socket (kvproto.v1.local_calls).

Every test talks to a real kvstored subprocess: raw frames on the socket for the
framing and its refusals, and kvclient clients that use local calls (same host, arena
mapped) beside clients that use gRPC only, which must see the same answers and errors.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import Daemon
from conftest import raw_call as client_call

from kvclient import (
    AsyncKVClient,
    InvalidArgumentError,
    KVClient,
    KVStoreError,
    LeaseError,
    NamespaceNotFoundError,
    RequestTimeoutError,
)
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import local_calls as frames

BLOCK_BYTES = 4096


@pytest.fixture(scope="module")
def daemon(kvstored_module_factory: Callable[..., Daemon]) -> Daemon:
    return kvstored_module_factory(host_bytes="8MiB", disk_bytes=0)


def local_path(daemon: Daemon) -> str:
    with KVClient(daemon.addr) as client:
        return client.server_info().local_socket


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes, or fewer only if the daemon closed the connection. (MSG_WAITALL is
    no guarantee here: a socket with a timeout is non-blocking underneath, and a recv
    then returns what has arrived.)"""
    data = bytearray()
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            break
        data += more
    return bytes(data)


def raw_call(sock: socket.socket, name: bytes, body: bytes) -> tuple[int, bytes]:
    sock.sendall(frames.request_frame(name, body))
    header = recv_exactly(sock, frames.HEADER.size)
    assert len(header) == frames.HEADER.size, "the daemon closed the connection"
    body_len, status = frames.HEADER.unpack(header)
    return status, recv_exactly(sock, body_len)


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def test_socket_is_private_and_named_by_server_info(daemon: Daemon) -> None:
    path = local_path(daemon)
    assert path == str(Path(daemon.socket_path).with_name("kvstored.local.sock"))
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_raw_frames_answer_like_grpc(daemon: Daemon) -> None:
    with KVClient(daemon.addr, use_arena=False) as client:
        ns = client.namespace("local-raw", 4, BLOCK_BYTES)
        ns.put(list(range(8)), np.full((2, BLOCK_BYTES), 7, np.uint8))
        by_grpc = client_call(
            client, "Lookup", pb.LookupRequest(ns_id=ns.ns_id, tokens=list(range(8)))
        )
    with connect(local_path(daemon)) as sock:
        request = pb.LookupRequest(ns_id=ns.ns_id, tokens=list(range(8)))
        status, body = raw_call(sock, b"Lookup", request.SerializeToString())
        assert status == frames.OK
        assert pb.LookupResponse.FromString(body) == by_grpc
        assert by_grpc.ready_blocks == 2
        # errors: the status number, then kind NUL message, as gRPC's code and details
        bad = pb.LookupRequest(ns_id="nope@000000000000", tokens=[1, 2, 3, 4])
        status, body = raw_call(sock, b"Lookup", bad.SerializeToString())
        assert status == grpc.StatusCode.NOT_FOUND.value[0]
        kind, message = frames.parse_error(body)
        assert kind == "UnknownNamespace" and "nope@000000000000" in message
        status, body = raw_call(sock, b"Lookup", b"\xff\xff\xff")
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "not a valid" in frames.parse_error(body)[1]
        # streams and unknown names are not local calls
        for name in (b"Get", b"Put", b"WatchEvents", b"NoSuchMethod"):
            status, body = raw_call(sock, name, b"")
            assert status == grpc.StatusCode.UNIMPLEMENTED.value[0], name
        # the connection still serves after every refusal
        status, _ = raw_call(sock, b"ServerInfo", b"")
        assert status == frames.OK


@pytest.mark.parametrize(
    "frame",
    [
        frames.HEADER.pack(0, 0),  # no method name
        frames.HEADER.pack(1 << 31, 6) + b"Lookup",  # body over max_message_bytes
        frames.HEADER.pack(0, 200) + b"x" * 200,  # name longer than any method's
    ],
    ids=["empty-name", "oversized-body", "long-name"],
)
def test_malformed_frame_closes_the_connection_and_changes_nothing(
    daemon: Daemon, frame: bytes
) -> None:
    with KVClient(daemon.addr, use_arena=False) as client:
        before = client.stats()
    with connect(local_path(daemon)) as sock:
        sock.sendall(frame)
        assert sock.recv(16) == b""  # closed without an answer
    with KVClient(daemon.addr) as client:
        after = client.stats()
        assert after.tier("host").blocks == before.tier("host").blocks
        assert after.leases == before.leases


def test_client_uses_local_calls_and_maps_errors_as_grpc_does(daemon: Daemon) -> None:
    tokens = list(range(100, 116))
    blocks = np.arange(4 * BLOCK_BYTES, dtype=np.uint32).astype(np.uint8).reshape(4, -1)
    with KVClient(daemon.addr) as local, KVClient(daemon.addr, use_arena=False) as remote:
        assert local.arena_in_use and local._conn.local is not None
        assert remote._conn.local is None
        ns_local = local.namespace("local-errors", 4, BLOCK_BYTES)
        ns_remote = remote.open_namespace(ns_local.ns_id)
        assert ns_local.put(tokens, blocks).stored == 4
        got = ns_remote.get(tokens)
        assert got.n_blocks == 4 and np.array_equal(got.blocks, blocks)
        assert ns_local.lookup(tokens) == ns_remote.lookup(tokens)
        out = np.zeros_like(blocks)
        assert ns_local.get(tokens, out=out).n_blocks == 4 and np.array_equal(out, blocks)

        def errors(client: KVClient) -> list[tuple[type, grpc.StatusCode | None, str]]:
            seen = []
            calls = [
                lambda: client.open_namespace("missing@000000000000"),
                lambda: client.namespace("local-errors", 1, BLOCK_BYTES),
                lambda: client_call(client, "Release", pb.ReleaseRequest(lease_id=424242)),
                lambda: client_call(client, "Commit", pb.CommitRequest(lease_id=0)),
            ]
            for call in calls:
                with pytest.raises(KVStoreError) as info:
                    call()
                seen.append((type(info.value), info.value.code, info.value.details))
            return seen

        local_errors, remote_errors = errors(local), errors(remote)
        assert local_errors == remote_errors
        kinds = [cls for cls, _, _ in local_errors]
        expected = [NamespaceNotFoundError, InvalidArgumentError, LeaseError, InvalidArgumentError]
        assert kinds == expected
        assert local._conn.local is not None  # still in use after errors


def test_local_calls_off_leaves_grpc_only(tmp_path: Path) -> None:
    d = Daemon(tmp_path, {"host_bytes": "8MiB", "disk_bytes": 0, "local_calls": "false"})
    d.start()
    try:
        assert not Path(d.socket_path).with_name("kvstored.local.sock").exists()
        with KVClient(d.addr) as client:
            assert client.server_info().local_socket == ""
            ns = client.namespace("no-local", 4, BLOCK_BYTES)
            assert client.arena_in_use and client._conn.local is None
            ns.put(list(range(8)), np.ones((2, BLOCK_BYTES), np.uint8))
            assert ns.get(list(range(8))).n_blocks == 2
    finally:
        d.cleanup()


def test_restart_reconnects_and_socket_is_removed_on_stop(tmp_path: Path) -> None:
    d = Daemon(tmp_path, {"host_bytes": "8MiB"})
    d.start()
    try:
        path = Path(d.socket_path).with_name("kvstored.local.sock")
        with KVClient(d.addr) as client:
            ns = client.namespace("restart-local", 4, BLOCK_BYTES)
            data = np.full((2, BLOCK_BYTES), 3, np.uint8)
            ns.put(list(range(8)), data)
            assert client._conn.local is not None and path.exists()
            d.stop()
            assert not path.exists()
            d.start()  # the blocks come back from the disk tier
            got = ns.get(list(range(8)))  # the idle connection is dead: gRPC, then local
            assert got.n_blocks == 2 and np.array_equal(got.blocks, data)
            assert ns.get(list(range(8))).n_blocks == 2
            assert client._conn.local is not None
    finally:
        d.cleanup()


def test_async_client_uses_local_calls(daemon: Daemon) -> None:
    async def run() -> None:
        async with AsyncKVClient(daemon.addr) as client:
            ns = await client.namespace("local-async", 4, BLOCK_BYTES)
            data = np.full((3, BLOCK_BYTES), 9, np.uint8)
            assert (await ns.put(list(range(12)), data)).stored == 3
            assert client._conn.local is not None
            got = await ns.get(list(range(12)))
            assert got.n_blocks == 3 and np.array_equal(got.blocks, data)
            with pytest.raises(NamespaceNotFoundError):
                await client.open_namespace("missing@000000000000")
            lookups = await asyncio.gather(*(ns.lookup(list(range(12))) for _ in range(8)))
            assert {r.blocks for r in lookups} == {3}

    asyncio.run(run())


def test_calls_sent_ahead_of_their_answers_are_all_answered_in_order(daemon: Daemon) -> None:
    """Thousands of calls sent before any answer is read (far more answers than the
    socket and the transport hold, so the daemon pauses that connection): other clients
    are served meanwhile, and every call is answered, in order, once the client reads."""
    calls = 5000
    frame = frames.request_frame(b"ServerInfo", b"")
    path = local_path(daemon)
    with connect(path) as greedy:
        greedy.sendall(frame * calls)
        with KVClient(daemon.addr) as other:  # not starved meanwhile
            ns = other.namespace("local-flow", 4, BLOCK_BYTES)
            ns.put(list(range(4)), np.ones((1, BLOCK_BYTES), np.uint8))
            assert other._conn.local is not None and ns.lookup(list(range(4))).blocks == 1
        for _ in range(calls):
            header = recv_exactly(greedy, frames.HEADER.size)
            body_len, status = frames.HEADER.unpack(header)
            assert status == frames.OK
            info = pb.ServerInfoResponse.FromString(recv_exactly(greedy, body_len))
            assert info.local_socket == path


def test_a_forked_child_opens_its_own_connections(daemon: Daemon) -> None:
    """After fork the parent's idle local-call connections stay the parent's: parent and
    child call at the same time and each reads its own answers."""
    tokens = list(range(40))
    with KVClient(daemon.addr) as client:
        ns = client.namespace("local-fork", 4, BLOCK_BYTES)
        ns.put(tokens, np.ones((10, BLOCK_BYTES), np.uint8))
        assert client._conn.local is not None and ns.lookup(tokens).blocks == 10
        pid = os.fork()
        if pid == 0:  # the child: local calls only (no gRPC across fork)
            code = 0
            try:
                for i in range(200):
                    if ns.lookup(tokens[: 4 * (1 + i % 10)]).blocks != 1 + i % 10:
                        code = 1
            except BaseException:
                code = 2
            os._exit(code)
        for i in range(200):
            assert ns.lookup(tokens[: 4 * (1 + (i + 5) % 10)]).blocks == 1 + (i + 5) % 10
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


def test_a_call_that_waits_holds_back_later_calls_on_its_connection_only(
    daemon: Daemon,
) -> None:
    """Most calls are answered as soon as they are read; one that waits (a Lookup for a
    pending block) is finished by a task: the calls behind it on its connection answer
    after it, in order, while other connections are served meanwhile."""
    path = local_path(daemon)
    tokens = list(range(1000, 1004))
    with KVClient(daemon.addr) as writer:
        ns = writer.namespace("local-wait", 4, BLOCK_BYTES)
        with connect(path) as waiting, connect(path) as other:
            status, body = raw_call(
                other,
                b"Reserve",
                pb.ReserveRequest(ns_id=ns.ns_id, tokens=tokens).SerializeToString(),
            )
            assert status == frames.OK
            lease = pb.ReserveResponse.FromString(body).lease_id
            lookup = pb.LookupRequest(ns_id=ns.ns_id, tokens=tokens, wait_pending_s=10)
            waiting.sendall(
                frames.request_frame(b"Lookup", lookup.SerializeToString())
                + frames.request_frame(b"ServerInfo", b"")
            )
            # the other connection is served while the Lookup waits, and commits
            status, _ = raw_call(other, b"ServerInfo", b"")
            assert status == frames.OK
            commit = pb.CommitRequest(lease_id=lease).SerializeToString()
            assert raw_call(other, b"Commit", commit)[0] == frames.OK
            for expect in (pb.LookupResponse, pb.ServerInfoResponse):
                header = recv_exactly(waiting, frames.HEADER.size)
                body_len, status = frames.HEADER.unpack(header)
                assert status == frames.OK
                answer = expect.FromString(recv_exactly(waiting, body_len))
                if expect is pb.LookupResponse:
                    assert answer.ready_blocks == 1  # answered after the commit


def test_an_async_call_that_outlives_its_timeout_is_a_request_timeout(daemon: Daemon) -> None:
    """A Lookup waiting for a pending block longer than the async client's timeout:
    RequestTimeoutError (DEADLINE_EXCEEDED), as gRPC gives, on every supported Python
    (asyncio.wait_for raises asyncio.TimeoutError, which is TimeoutError only from 3.11
    on; on 3.10 the raw asyncio error used to escape), and the client works on."""
    tokens = list(range(2000, 2004))
    with KVClient(daemon.addr) as writer:
        ns = writer.namespace("local-timeout", 4, BLOCK_BYTES)
        reserve = pb.ReserveRequest(ns_id=ns.ns_id, tokens=tokens)
        # the block stays pending until this lease is committed
        lease = client_call(writer, "Reserve", reserve).lease_id

        async def run() -> None:
            async with AsyncKVClient(daemon.addr, timeout=0.5) as client:
                ans = await client.namespace("local-timeout", 4, BLOCK_BYTES)
                assert (await ans.get(list(range(9000, 9004)))).n_blocks == 0  # maps the arena
                assert client._conn.local is not None  # the calls go over the local socket
                with pytest.raises(RequestTimeoutError) as timed_out:
                    await ans.lookup(tokens, wait_pending_s=5)
                assert timed_out.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
                assert (await ans.lookup(tokens)).pending_blocks == 1  # and it works on

        asyncio.run(run())
        client_call(writer, "Abandon", pb.AbandonRequest(lease_id=lease))


# --- LookupBatch: many lookups of one namespace in one call ----------------------------


@pytest.mark.parametrize("route", ["local", "grpc"])
def test_lookup_batch_answers_each_chain_as_its_own_lookup_would(
    daemon: Daemon, route: str
) -> None:
    """Hits, partial hits, misses, extra keys, chains shorter than a block, a pending
    block: each answer is the Lookup's. Chains past the daemon's bound
    (max_blocks_per_request: 8192 blocks) go in more than one call, answered in order."""
    with KVClient(daemon.addr, use_arena=None if route == "local" else False) as client:
        ns = client.namespace(f"batch-{route}", 4, BLOCK_BYTES)
        stored = list(range(3000, 3012))  # 3 blocks
        assert ns.put(stored, np.full((3, BLOCK_BYTES), 1, np.uint8)).stored == 3
        lora = [b"lora-1"]
        lora_blocks = np.full((2, BLOCK_BYTES), 2, np.uint8)
        assert ns.put(stored[:8], lora_blocks, extra_keys=lora).stored == 2
        pending = list(range(3100, 3104))
        client_call(client, "Reserve", pb.ReserveRequest(ns_id=ns.ns_id, tokens=pending))
        long = list(range(40_000, 40_000 + 4 * 3000))  # 3000 blocks, never stored
        prompts = [stored, stored[:6], stored + [1, 2, 3, 4], stored, stored[:8], stored[:3],
                   [], list(range(7, 19)), pending, long, long, long]  # fmt: skip
        extras = [(), (), (), [b"lora-2"], lora, (), (), (), (), (), lora, ()]
        batch = ns.lookup_batch(prompts, extra_keys=extras)
        assert [r.blocks for r in batch] == [3, 1, 3, 0, 2, 0, 0, 0, 0, 0, 0, 0]
        assert batch[8].pending_blocks == 1
        assert batch == [ns.lookup(p, extra_keys=e) for p, e in zip(prompts, extras, strict=True)]
        assert ns.lookup_batch(prompts[:3]) == batch[:3]  # extra keys: none by default
        assert ns.lookup_batch([]) == []
        assert (client._conn.local is not None) == (route == "local")
        with pytest.raises(InvalidArgumentError, match="2 prompts but 1 extra_keys"):
            ns.lookup_batch(prompts[:2], extra_keys=[()])

        async def run() -> None:  # the asyncio client's, over the same route
            use_arena = None if route == "local" else False
            async with AsyncKVClient(daemon.addr, use_arena=use_arena) as aclient:
                ans = await aclient.open_namespace(ns.ns_id)
                assert await ans.lookup_batch(prompts, extra_keys=extras) == batch

        asyncio.run(run())


def test_lookup_batch_refuses_a_bad_chain_or_too_much_and_changes_nothing(
    daemon: Daemon,
) -> None:
    """On the gRPC socket and the local one alike: a bad chain fails the whole call and
    names it; more than max_blocks_per_request chains, or blocks, is refused with the
    bound; an unknown namespace is NOT_FOUND. Nothing is pulled, counted or changed."""
    with KVClient(daemon.addr) as local, KVClient(daemon.addr, use_arena=False) as remote:
        ns = local.namespace("batch-refused", 4, BLOCK_BYTES)
        good = list(range(4000, 4008))
        assert ns.put(good, np.full((2, BLOCK_BYTES), 5, np.uint8)).stored == 2
        limit = local.server_info().max_blocks_per_request
        chain = pb.LookupBatchRequest.Chain
        many_blocks = list(range(5000, 5000 + 4 * (limit // 2 + 1)))  # half the bound, +1
        bad = [
            ([chain(tokens=good), chain(tokens=[1, 2, -3, 4])], InvalidArgumentError,
             "chains[1]: token"),
            ([chain(tokens=good, extra_keys=[b"\0kvstore.block-extra.v1\0\x01"])],
             InvalidArgumentError, "chains[0]: "),
            ([chain()] * (limit + 1), InvalidArgumentError,
             f"{limit + 1} chains in one LookupBatch, more than max_blocks_per_request={limit}"),
            ([chain(tokens=many_blocks)] * 2, InvalidArgumentError,
             f"{2 * (limit // 2 + 1)} blocks in one LookupBatch, more than "
             f"max_blocks_per_request={limit}"),
        ]  # fmt: skip
        before = local.stats()
        for client in (local, remote):
            for chains, error, words in bad:
                request = pb.LookupBatchRequest(ns_id=ns.ns_id, chains=chains)
                with pytest.raises(error, match=re.escape(words)):
                    client_call(client, "LookupBatch", request)
            unknown = pb.LookupBatchRequest(ns_id="nope@000000000000", chains=[chain(tokens=good)])
            with pytest.raises(NamespaceNotFoundError, match="nope@000000000000"):
                client_call(client, "LookupBatch", unknown)
        after = local.stats()
        assert after.tier("host") == before.tier("host") and after.leases == before.leases
        # and the same frames, raw, on the local socket
        with connect(local_path(daemon)) as sock:
            request = pb.LookupBatchRequest(ns_id=ns.ns_id, chains=[chain(tokens=good)] * 2)
            status, body = raw_call(sock, b"LookupBatch", request.SerializeToString())
            assert status == frames.OK
            answers = pb.LookupBatchResponse.FromString(body).answers
            assert [a.ready_blocks for a in answers] == [2, 2]
            request = pb.LookupBatchRequest(ns_id=ns.ns_id, chains=[chain()] * (limit + 1))
            status, body = raw_call(sock, b"LookupBatch", request.SerializeToString())
            assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "max_blocks_per_request" in frames.parse_error(body)[1]
