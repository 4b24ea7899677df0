"""Two tenants and an admin on one real daemon: tokens on every call, each tenant sees
only its own namespaces, the salt never leaves the daemon, quotas hold under a flood.

One daemon for the module, configured with tenants ``a`` (host and disk quotas) and
``b``, and an admin token. The store-level quota mechanics are in test_store_quotas.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import Daemon, in_forked_child, wait_for, write_secret

from kvbench.harness import free_tcp_port
from kvclient import (
    AsyncKVClient,
    AuthenticationError,
    KVClient,
    NamespaceNotFoundError,
)
from kvclient.errors import KVStoreError
from kvclient.namespace import Namespace
from kvproto.v1 import challenge, gpu_pb2
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import local_calls as frames

MiB = 1 << 20
BLOCK_TOKENS = 4
SECRET_SALT = "salt-only-the-daemon-knows"


@dataclass
class Tenancy:
    daemon: Daemon
    tokens: dict[str, str]  # "a", "b", "admin"
    token_files: dict[str, Path]
    metrics_url: str

    def client(self, who: str, **kw: object) -> KVClient:
        return KVClient(self.daemon.addr, token=self.tokens[who], **kw)  # type: ignore[arg-type]


def write_tenants(folder: Path) -> tuple[Path, dict[str, str], dict[str, Path]]:
    """A config with tenants a (quotas) and b and an admin token, and the token files."""
    tokens = {who: secrets.token_hex(16) for who in ("a", "b", "admin")}
    files = {}
    for who, token in tokens.items():
        files[who] = folder / f"{who}.token"
        write_secret(files[who], token + "\n")
    config = folder / "kvstored.toml"
    config.write_text(
        f'admin_token_file = "{files["admin"]}"\n'
        "[tenants.a]\n"
        f'token_file = "{files["a"]}"\n'
        'host_bytes = "8 MiB"\n'
        'disk_bytes = "16 MiB"\n'
        "[tenants.b]\n"
        f'token_file = "{files["b"]}"\n'
    )
    return config, tokens, files


@pytest.fixture(scope="module")
def tenancy(
    kvstored_module_factory: Callable[..., Daemon], tmp_path_factory: pytest.TempPathFactory
) -> Tenancy:
    config, tokens, files = write_tenants(tmp_path_factory.mktemp("tokens"))
    port = free_tcp_port()
    daemon = kvstored_module_factory(
        extra_args=("--config", str(config)), metrics_listen=f"127.0.0.1:{port}"
    )
    return Tenancy(daemon, tokens, files, f"http://127.0.0.1:{port}/metrics")


def tokens_of(seed: int, blocks: int) -> list[int]:
    return [seed * 10_000 + i for i in range(blocks * BLOCK_TOKENS)]


def blocks_of(n: int, size: int, tag: int) -> np.ndarray:
    return np.full((n, size), tag % 251, dtype=np.uint8)


# --- tokens ---------------------------------------------------------------------------


def _call_every_method(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> dict:
    """Call each method of KVStore and KVGpu with an empty request -> {method: code}."""
    codes = {}
    for service, module in (("KVStore", pb), ("KVGpu", gpu_pb2)):
        descriptor = module.DESCRIPTOR.services_by_name[service]
        for method in descriptor.methods:
            path = f"/{descriptor.full_name}/{method.name}"
            request = getattr(module, method.input_type.name)()
            response = getattr(module, method.output_type.name)
            try:
                if method.client_streaming:
                    call = channel.stream_unary(
                        path, lambda m: m.SerializeToString(), response.FromString
                    )
                    call(iter([request]), timeout=5, metadata=metadata)
                elif method.server_streaming:
                    call = channel.unary_stream(
                        path, lambda m: m.SerializeToString(), response.FromString
                    )
                    next(iter(call(request, timeout=5, metadata=metadata)))
                else:
                    call = channel.unary_unary(
                        path, lambda m: m.SerializeToString(), response.FromString
                    )
                    call(request, timeout=5, metadata=metadata)
                codes[method.name] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                codes[method.name] = exc.code()
    return codes


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789abcdef"])
def test_every_grpc_call_without_a_valid_token_is_unauthenticated(
    tenancy: Tenancy, token: str | None
) -> None:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    codes = _call_every_method(tenancy.daemon.channel(), metadata)
    assert len(codes) > 20
    let_through = {name for name, code in codes.items() if code != grpc.StatusCode.UNAUTHENTICATED}
    assert let_through == set()


def _local_call(sock: socket.socket, name: bytes, body: bytes) -> tuple[int, bytes]:
    sock.sendall(frames.request_frame(name, body))
    header = sock.recv(frames.HEADER.size, socket.MSG_WAITALL)
    size, status = frames.HEADER.unpack(header)
    return status, sock.recv(size, socket.MSG_WAITALL) if size else b""


def test_local_calls_need_the_token_frame_first(tenancy: Tenancy) -> None:
    with tenancy.client("a") as client:
        path = client.server_info().local_socket
    assert path
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED.value[0]
    for name in frames.UNARY_METHODS:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(path)
            status, _ = _local_call(sock, name.encode(), b"")
            assert status == unauthenticated, name
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        # a token in clear, as clients sent it before #66: refused, and it says why
        status, body = _local_call(sock, frames.AUTH_NAME, tenancy.tokens["b"].encode())
        assert status == unauthenticated
        assert "send @hello first" in frames.parse_error(body)[1]
        status, body = _prove(sock, "not-the-token-at-all")
        assert status == unauthenticated
        assert "not valid" in frames.parse_error(body)[1]
        status, _ = _local_call(sock, b"ServerInfo", b"")  # still nobody
        assert status == unauthenticated
        # the right token, but a proof over another uid than this connection's: what
        # a relay between a client of that uid and the daemon would pass on
        status, body = _prove(sock, tenancy.tokens["b"], client_uid=65534)
        assert status == unauthenticated
        assert "not valid" in frames.parse_error(body)[1]
        status, _ = _prove(sock, tenancy.tokens["b"])
        assert status == frames.OK  # (and the daemon proved it back: _prove checks)
        status, body = _local_call(sock, b"ServerInfo", b"")
        assert status == frames.OK
        assert pb.ServerInfoResponse.FromString(body).tenant == "b"


def _prove(sock: socket.socket, token: str, client_uid: int | None = None) -> tuple[int, bytes]:
    """The client's side of the local-call challenge (kvproto.v1.challenge) -> the
    answer to its @auth; an OK answer must carry the daemon's proof. ``client_uid``:
    the uid the proof claims (default: this process's)."""
    nonce = challenge.new_nonce()
    status, daemon_nonce = _local_call(sock, frames.HELLO_NAME, nonce)
    assert status == frames.OK
    peer = frames.peer_credentials(sock)
    transcript = challenge.Transcript(
        challenge.LOCAL_CALLS, nonce, daemon_nonce,
        os.geteuid() if client_uid is None else client_uid, peer[1] if peer else -1,
    )  # fmt: skip
    key = challenge.token_key(token)
    status, body = _local_call(sock, frames.AUTH_NAME, transcript.client_proof(key))
    if status == frames.OK:
        assert transcript.daemon_proved(key, body)
    return status, body


def test_clients_without_or_with_a_wrong_token_get_authentication_errors(
    tenancy: Tenancy,
) -> None:
    with KVClient(tenancy.daemon.addr, token="") as client, pytest.raises(
        AuthenticationError, match="needs a token"
    ):
        client.server_info()
    with KVClient(tenancy.daemon.addr, token="x" * 32) as client, pytest.raises(
        AuthenticationError, match="not valid"
    ):
        client.stats()

    async def run() -> None:
        async with AsyncKVClient(tenancy.daemon.addr, token="y" * 32) as client:
            with pytest.raises(AuthenticationError):
                await client.server_info()

    asyncio.run(run())


# --- isolation ------------------------------------------------------------------------


def test_a_tenant_cannot_list_read_write_or_clear_anothers_blocks(tenancy: Tenancy) -> None:
    tokens = tokens_of(1, 4)
    with tenancy.client("a") as a, tenancy.client("b") as b, tenancy.client("admin") as admin:
        mine = a.namespace("iso-model", block_tokens=BLOCK_TOKENS, block_bytes=4096, name="shared")
        assert mine.put(tokens, blocks_of(4, 4096, 7)).stored == 4
        # b binds the same name to another layout: names are per tenant
        theirs = b.namespace(
            "iso-model", block_tokens=BLOCK_TOKENS, block_bytes=8192, name="shared"
        )
        assert theirs.ns_id != mine.ns_id
        same_model = b.namespace("iso-model", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        assert same_model.ns_id != mine.ns_id  # same spec, other tenant: other keys
        assert same_model.get(tokens).n_blocks == 0

        assert mine.ns_id not in {info.ns_id for info in b.namespaces()}
        assert mine.ns_id not in {ns.ns_id for ns in b.stats().namespaces}
        stolen = Namespace(b, b._conn, mine.info)  # b names a's namespace by its id
        for attempt in (
            lambda: stolen.lookup(tokens),
            lambda: stolen.lookup_batch([tokens, tokens_of(2, 1)]),
            lambda: stolen.get(tokens),
            lambda: stolen.put(tokens_of(2, 1), blocks_of(1, 4096, 9)),
            lambda: stolen.delete(tokens),
            lambda: stolen.set_priority(tokens, 90),
            lambda: b.clear(mine.ns_id),
            lambda: b.open_namespace(mine.ns_id),
        ):
            with pytest.raises(NamespaceNotFoundError) as caught:
                attempt()
            assert "open it first" in str(caught.value)
        with pytest.raises(NamespaceNotFoundError) as unknown:
            b.open_namespace("iso-model@000000000000")
        assert str(caught.value).replace(mine.ns_id, "X") == str(unknown.value).replace(
            "iso-model@000000000000", "X"
        )  # another's namespace reads exactly like one that does not exist
        b.clear()  # a tenant's clear-all is its own namespaces only
        assert a.namespace("iso-model", block_tokens=BLOCK_TOKENS, block_bytes=4096).get(
            tokens
        ).n_blocks == 4
        events = list(b.events(duration_s=0.5))
        assert mine.ns_id not in {e.ns_id for e in events}
        assert mine.ns_id in {e.ns_id for e in admin.events(duration_s=0.5)}
        assert {mine.ns_id, theirs.ns_id} <= {info.ns_id for info in admin.namespaces()}
        assert admin.open_namespace(mine.ns_id).get(tokens).n_blocks == 4


def test_the_salt_appears_in_no_answer_and_no_metric(tenancy: Tenancy) -> None:
    stub_channel = tenancy.daemon.channel()
    secret_model = "model-of-tenant-a"
    answers: list[bytes] = []

    def raw(who: str, name: str, request: object) -> bytes:
        """The serialized answer of one call, as the wire carries it."""
        method = stub_channel.unary_unary(
            f"/kvstore.v1.KVStore/{name}", lambda m: m.SerializeToString(), lambda b: b
        )
        md = (("authorization", f"Bearer {tenancy.tokens[who]}"),)
        return method(request, metadata=md, timeout=5)  # type: ignore[no-any-return]

    for who in ("a", "admin"):
        call = lambda name, req, _: raw(who, name, req)  # noqa: E731, B023
        if who == "a":
            spec = pb.NamespaceSpec(
                model=secret_model, block_tokens=BLOCK_TOKENS, block_bytes=4096,
                tenant_salt=SECRET_SALT,
            )
            opened = call("OpenNamespace", pb.OpenNamespaceRequest(spec=spec), None)
            answers.append(opened)
            ns_id = pb.NamespaceInfo.FromString(opened).ns_id
            assert pb.NamespaceInfo.FromString(opened).spec.tenant_salt == ""
        answers.append(call("DescribeNamespace", pb.DescribeNamespaceRequest(ns_id=ns_id), None))
        answers.append(call("ListNamespaces", pb.ListNamespacesRequest(), None))
        answers.append(call("Stats", pb.StatsRequest(), None))
        answers.append(call("ServerInfo", pb.ServerInfoRequest(), None))
    for raw in answers:
        assert SECRET_SALT.encode() not in raw
        assert b"tenant:" not in raw  # the daemon's own salt prefix neither
    with urllib.request.urlopen(tenancy.metrics_url, timeout=5) as reply:
        metrics = reply.read().decode()
    assert "kvstore_tier_used_bytes" in metrics
    for leak in (SECRET_SALT, ns_id, secret_model, "tenant"):
        assert leak not in metrics, leak


def test_a_flood_from_one_tenant_over_its_quota_leaves_the_others_blocks(
    tenancy: Tenancy,
) -> None:
    block = 1 * MiB
    kept = tokens_of(30, 10)
    with tenancy.client("a") as a, tenancy.client("b") as b, tenancy.client("admin") as admin:
        ns_b = b.namespace("flood-model", block_tokens=BLOCK_TOKENS, block_bytes=block)
        assert ns_b.put(kept, blocks_of(10, block, 3)).stored == 10
        ns_a = a.namespace("flood-model", block_tokens=BLOCK_TOKENS, block_bytes=block)
        for seed in range(100, 124):  # 24 chains of 4 MiB: 96 MiB, more than the arena
            ns_a.put(tokens_of(seed, 4), blocks_of(4, block, seed))
        hit = ns_b.lookup(kept)
        assert (hit.blocks, hit.host_blocks) == (10, 10)
        assert np.all(ns_b.get(kept).blocks == 3)
        usage = {t.tenant: t for t in admin.stats().tenants}
        assert usage["a"].host_bytes <= 8 * MiB and usage["a"].disk_bytes <= 16 * MiB
        assert usage["a"].quota_evictions > 0
        assert usage["b"].quota_evictions == 0 and usage["b"].host_bytes >= 10 * MiB
        assert b.stats().tenants == ()  # usage per tenant is the admin's view only


def test_the_arena_path_works_for_a_tenant_and_stays_in_its_namespaces(
    tenancy: Tenancy,
) -> None:
    tokens = tokens_of(50, 3)
    with tenancy.client("a", use_arena=True) as a, tenancy.client("b", use_arena=True) as b:
        ns_a = a.namespace("arena-model", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        assert ns_a.put(tokens, blocks_of(3, 4096, 11)).stored == 3
        assert a.arena_in_use
        assert np.all(ns_a.get(tokens).blocks == 11)
        with pytest.raises(NamespaceNotFoundError):
            Namespace(b, b._conn, ns_a.info).get(tokens)

    async def run() -> None:
        async with AsyncKVClient(tenancy.daemon.addr, token=tenancy.tokens["a"]) as client:
            ns = await client.namespace("arena-model", block_tokens=BLOCK_TOKENS, block_bytes=4096)
            got = await ns.get(tokens)
            assert got.n_blocks == 3 and np.all(got.blocks == 11)

    asyncio.run(run())


def test_a_process_of_another_user_reads_no_arena_disk_file_salt_or_token(
    tenancy: Tenancy,
) -> None:
    """Tenants that must not see each other run as other users: a process of another
    user can open neither the arena (b's bytes), the disk tier's files (b's bytes and
    the salts in namespace records and names), the token files, nor the daemon's
    environment, and cannot reach the unix socket either (only TCP, inline bytes)."""
    import os

    if os.geteuid() != 0:
        pytest.skip("switching to another user needs root")
    with tenancy.client("b", use_arena=False) as b:
        ns = b.namespace("private-model", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        ns.put(tokens_of(70, 2), blocks_of(2, 4096, 70))
        named = b.namespace(
            "private-model", block_tokens=BLOCK_TOKENS, block_bytes=4096, name="private"
        )
        assert named.ns_id == ns.ns_id
        arena = b.server_info().arena_path
    disk = Path(tenancy.daemon.disk_dir)
    assert tenancy.daemon.proc is not None
    private = [
        (arena, os.O_RDWR), (arena, os.O_RDONLY),
        (str(disk / "data.mdb"), os.O_RDONLY), (str(disk / "namespace-names.jsonl"), os.O_RDONLY),
        (str(tenancy.token_files["b"]), os.O_RDONLY),
        (f"/proc/{tenancy.daemon.proc.pid}/environ", os.O_RDONLY),
    ]  # fmt: skip
    assert all(Path(path).exists() for path, _ in private)
    socket_path = tenancy.daemon.addr.removeprefix("unix://")

    def as_nobody() -> bool:
        os.setgid(65534)
        os.setuid(65534)
        for path, flags in private:
            try:
                os.close(os.open(path, flags))
                return False
            except PermissionError:
                pass
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(socket_path)
            return False
        except PermissionError:
            return True
        finally:
            probe.close()

    assert in_forked_child(as_nobody) == 0


def test_a_tenant_of_another_user_maps_only_its_own_arena_region(
    kvstored_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """With socket_mode 0666, tenants running as other users use the arena path, and
    each maps only its own region, handed over by fd: a process of another user with
    a's token finds a's blocks in what it was handed and none of b's, and cannot open
    the arena file or the daemon's fds (where b's region is)."""
    import os

    from kvclient.arena_path import map_handed_out
    from kvproto.v1.arena_handout import fetch_region

    if os.geteuid() != 0:
        pytest.skip("switching to another user needs root")
    tokens = {who: secrets.token_hex(16) for who in ("a", "b", "admin")}
    lines = ['socket_mode = "0666"']
    for who, token in tokens.items():
        write_secret(tmp_path / f"{who}.token", token + "\n")
    lines.append(f'admin_token_file = "{tmp_path / "admin.token"}"')
    for who in ("a", "b"):
        lines += [f"[tenants.{who}]", f'token_file = "{tmp_path / f"{who}.token"}"',
                  'host_bytes = "4 MiB"']  # fmt: skip
    (tmp_path / "kvstored.toml").write_text("\n".join(lines) + "\n")
    daemon = kvstored_factory(extra_args=("--config", str(tmp_path / "kvstored.toml")))
    os.chmod(os.path.dirname(daemon.socket_path), 0o711)  # other users may reach it
    assert daemon.proc is not None
    tokens_a, tokens_b = tokens_of(81, 3), tokens_of(82, 3)
    with KVClient(daemon.addr, token=tokens["a"], use_arena=True) as a, KVClient(
        daemon.addr, token=tokens["b"], use_arena=True
    ) as b, KVClient(daemon.addr, token=tokens["admin"]) as admin:
        ns_a = a.namespace("own-region", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        ns_b = b.namespace("own-region", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        assert ns_a.put(tokens_a, blocks_of(3, 4096, 11)).stored == 3
        assert ns_b.put(tokens_b, blocks_of(3, 4096, 77)).stored == 3
        assert a.arena_in_use and b.arena_in_use
        assert np.all(ns_b.get(tokens_b).blocks == 77)
        info_a, info_b = a.server_info(), b.server_info()
        assert info_a.arena_path.startswith("fd:") and info_b.arena_path.startswith("fd:")
        assert info_a.arena_path != info_b.arena_path and info_a.arena_socket
        # the admin maps the common arena: a's blocks come to it inline
        assert np.all(Namespace(admin, admin._conn, ns_a.info).get(tokens_a).blocks == 11)
        common = admin.server_info().arena_path
    assert Path(common).exists()
    daemon_fds = f"/proc/{daemon.proc.pid}/fd"

    def as_nobody() -> bool:
        os.setgid(65534)
        os.setuid(65534)
        mapping, _ = map_handed_out(info_a.arena_socket, tokens["a"], 10, 0)
        region = mapping.array()[mapping.start :]
        found_a = int(np.count_nonzero(region == 11)) >= 3 * 4096
        found_b = bool(np.any(region == 77))
        refused = 0
        for path in (common, daemon_fds, *(f"{daemon_fds}/{n}" for n in range(3, 64))):
            try:
                os.close(os.open(path, os.O_RDONLY))
            except PermissionError:
                refused += 1
            except FileNotFoundError:
                refused += 1
        try:
            map_handed_out(info_a.arena_socket, "not-a-token-0123456789", 10, 0)
            handed_to_a_stranger = True
        except ValueError:
            handed_to_a_stranger = False
        # the region's fd is sealed: neither shrunk (the daemon's next touch of it
        # would be a SIGBUS) nor grown
        fd, _ = fetch_region(info_a.arena_socket, tokens["a"], 10, 0)
        resized = 0
        for size in (0, 1 << 30):
            try:
                os.ftruncate(fd, size)
                resized += 1
            except PermissionError:
                pass
        os.close(fd)
        return (found_a and not found_b and refused == 63 and not handed_to_a_stranger
                and resized == 0)  # fmt: skip

    assert in_forked_child(as_nobody) == 0
    # and the daemon goes on serving every tenant, its region untouched
    with KVClient(daemon.addr, token=tokens["a"], use_arena=True) as a, KVClient(
        daemon.addr, token=tokens["b"], use_arena=True
    ) as b:
        ns_a = a.namespace("own-region", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        ns_b = b.namespace("own-region", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        assert np.all(ns_a.get(tokens_a).blocks == 11) and ns_a.get(tokens_a).n_blocks == 3
        assert np.all(ns_b.get(tokens_b).blocks == 77) and ns_b.get(tokens_b).n_blocks == 3
        assert ns_b.put(tokens_of(83, 2), blocks_of(2, 4096, 5)).stored == 2
    assert daemon.proc.poll() is None


def test_kvctl_status_tenants_is_for_the_admin(tenancy: Tenancy) -> None:
    def kvctl(who: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvctl", "--addr", tenancy.daemon.addr, "status",
             "--tenants", "--token-file", str(tenancy.token_files[who])],
            capture_output=True, text=True, timeout=60,
        )

    admin = kvctl("admin")
    assert admin.returncode == 0, admin.stderr
    rows = {line.split()[0] for line in admin.stdout.splitlines()[1:]}
    assert {"a", "b"} <= rows
    tenant = kvctl("a")
    assert tenant.returncode == 1
    assert tenant.stderr.count("\n") == 1 and "admin token" in tenant.stderr


def test_inline_streams_of_both_clients_carry_the_token(tenancy: Tenancy) -> None:
    tokens = tokens_of(60, 2)
    with tenancy.client("a", use_arena=False) as a:
        ns = a.namespace("inline-model", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        assert ns.put(tokens, blocks_of(2, 4096, 21)).stored == 2  # a Put stream
        assert np.all(ns.get(tokens).blocks == 21)  # a Get stream

    async def run() -> None:
        async with AsyncKVClient(
            tenancy.daemon.addr, token=tenancy.tokens["a"], use_arena=False
        ) as client:
            ns = await client.namespace("inline-model", block_tokens=BLOCK_TOKENS,
                                        block_bytes=4096)
            more = tokens_of(61, 2)
            assert (await ns.put(more, blocks_of(2, 4096, 22))).stored == 2
            got = await ns.get(more)
            assert got.n_blocks == 2 and np.all(got.blocks == 22)

    asyncio.run(run())


def test_a_tenants_grpc_leases_end_with_its_session(
    kvstored_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Without local calls the leases ride on the Session stream, which carries the
    token too: when the client closes, the daemon ends them at once (TTL is 30 s)."""
    config, tokens, _ = write_tenants(tmp_path)
    daemon = kvstored_factory(extra_args=("--config", str(config)), local_calls=False)
    with KVClient(daemon.addr, token=tokens["admin"]) as admin:
        client = KVClient(daemon.addr, token=tokens["a"], use_arena=True)
        ns = client.namespace("lease-model", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        ns.put(tokens_of(70, 2), blocks_of(2, 4096, 5))
        lease = ns.acquire(tokens_of(70, 2))
        assert lease.tokens == 2 * BLOCK_TOKENS and admin.stats().leases >= 1
        client.close()
        deadline = time.monotonic() + 5
        while admin.stats().leases and time.monotonic() < deadline:
            time.sleep(0.05)
        assert admin.stats().leases == 0


def test_a_leaked_lease_id_or_ticket_is_unknown_to_another_tenant(tenancy: Tenancy) -> None:
    """Tenant a holds tenant b's lease ids (a leaked ClaimTicket): delivering into b's
    claim, committing, abandoning or releasing it reads exactly like an unknown lease,
    and b's claim is untouched."""
    from kvclient import LeaseError
    from kvclient.claims import ClaimTicket
    from kvproto.v1.kvstore_pb2_grpc import KVStoreStub

    tokens = tokens_of(40, 4)
    with tenancy.client("a", use_arena=False) as a, tenancy.client("b", use_arena=False) as b:
        theirs = b.namespace("lease-model", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        mine = a.namespace("lease-model", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        claim = theirs.claim(tokens)
        leaked = claim.ticket()
        stolen = mine.resume_claim(ClaimTicket(mine.ns_id, leaked.start, leaked.response))
        with pytest.raises(LeaseError, match=f"^unknown lease {claim.lease_id} "):
            stolen.fill(blocks_of(4, 4096, 66))
        assert stolen.abandon() == 0  # (the client takes an unknown lease as ended)
        stub = KVStoreStub(tenancy.daemon.channel())
        as_a = (("authorization", f"Bearer {tenancy.tokens['a']}"),)
        for lease_id in (claim.lease_id, 987_654_321):  # b's, and one that never was
            for call, request in (
                (stub.Commit, pb.CommitRequest(lease_id=lease_id)),
                (stub.Release, pb.ReleaseRequest(lease_id=lease_id)),
                (stub.Abandon, pb.AbandonRequest(lease_id=lease_id)),
            ):
                with pytest.raises(grpc.RpcError) as caught:
                    call(request, metadata=as_a)
                assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert caught.value.details() == f"unknown lease {lease_id}"
        assert claim.fill(blocks_of(4, 4096, 5)) == 4
        got = theirs.get(tokens)
        assert got.n_blocks == 4 and bool((got.blocks == 5).all())


def test_a_tenant_parking_waits_cannot_starve_anothers_lookups_or_events(
    tenancy: Tenancy,
) -> None:
    """a parks 70 waiting Lookups on a block of its own that never comes (more than
    the daemon's waiting threads): b's waiting Lookup is answered as soon as b's block
    is filled, and b's event stream tells it; a's parked waits are answered at once
    past a's share (still pending), and all of them when a abandons."""
    import threading

    from kvproto.v1.kvstore_pb2_grpc import KVStoreStub

    stub = KVStoreStub(tenancy.daemon.channel())
    as_a = (("authorization", f"Bearer {tenancy.tokens['a']}"),)
    as_b = (("authorization", f"Bearer {tenancy.tokens['b']}"),)
    with tenancy.client("a", use_arena=False) as a, tenancy.client("b", use_arena=False) as b:
        ns_a = a.namespace("wait-model", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        ns_b = b.namespace("wait-model", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        tokens = tokens_of(50, 2)
        hold = ns_a.claim(tokens)  # never filled while a waits on it
        request_a = pb.LookupRequest(ns_id=ns_a.ns_id, tokens=tokens, wait_pending_s=60)
        parked = [stub.Lookup.future(request_a, metadata=as_a) for _ in range(70)]
        deadline = time.monotonic() + 20
        answered_at_once = 0
        while time.monotonic() < deadline and answered_at_once == 0:
            answered_at_once = sum(f.done() for f in parked)
            time.sleep(0.05)
        assert answered_at_once, "a got every thread: none of its waits was answered at once"
        assert all(f.result().pending_blocks == 2 for f in parked if f.done())

        theirs = ns_b.claim(tokens)
        events: list[object] = []
        watcher = threading.Thread(
            target=lambda: events.extend(b.events(from_now=True, duration_s=2.5)), daemon=True
        )
        watcher.start()
        request_b = pb.LookupRequest(ns_id=ns_b.ns_id, tokens=tokens, wait_pending_s=30)
        waiting = stub.Lookup.future(request_b, metadata=as_b)
        time.sleep(0.5)  # (b's lookup is parked by now: what it must not be is starved)
        assert theirs.fill(blocks_of(2, 4096, 1)) == 2
        filled = time.monotonic()
        assert waiting.result(timeout=20).ready_blocks == 2
        assert time.monotonic() - filled < 1.0
        watcher.join(20)
        assert {e.ns_id for e in events} >= {ns_b.ns_id}  # type: ignore[attr-defined]
        hold.abandon()
        assert all(f.result(timeout=20).ready_blocks == 0 for f in parked)


def test_a_tenants_events_are_numbered_on_their_own(tenancy: Tenancy) -> None:
    """a cannot count b's writes: a's event numbers, in its stream and its Stats, move
    with its own blocks only (the admin's count every tenant's)."""
    with tenancy.client("a") as a, tenancy.client("b") as b, tenancy.client("admin") as admin:
        ns_a = a.namespace("seq-model", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        ns_b = b.namespace("seq-model", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        seq_a, seq_all = a.stats().counters["event_seq"], admin.stats().counters["event_seq"]
        assert ns_b.put(tokens_of(60, 3), blocks_of(3, 4096, 60)).stored == 3
        assert admin.stats().counters["event_seq"] >= seq_all + 3
        assert a.stats().counters["event_seq"] == seq_a  # b's blocks: not in a's numbers
        assert ns_a.put(tokens_of(61, 2), blocks_of(2, 4096, 61)).stored == 2
        assert a.stats().counters["event_seq"] == seq_a + 2
        mine = list(a.events(from_seq=seq_a, duration_s=0.5))
        assert [e.seq for e in mine] == [seq_a + 1, seq_a + 2]
        assert {e.ns_id for e in mine} == {ns_a.ns_id}


def test_a_tenant_opens_and_names_at_most_tenant_max_namespaces(
    kvstored_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    config, tokens, _ = write_tenants(tmp_path)
    daemon = kvstored_factory(extra_args=("--config", str(config)), tenant_max_namespaces=2)
    with KVClient(daemon.addr, token=tokens["a"]) as a, KVClient(
        daemon.addr, token=tokens["b"]
    ) as b:
        for model in ("m1", "m2"):
            a.namespace(model, block_tokens=BLOCK_TOKENS, block_bytes=4096)
        with pytest.raises(KVStoreError) as refused:
            a.namespace("m3", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant_max_namespaces" in str(refused.value)
        a.namespace("m1", block_tokens=BLOCK_TOKENS, block_bytes=4096)  # open already: fine
        for name in ("first", "second"):
            a.namespace("m1", block_tokens=BLOCK_TOKENS, block_bytes=4096, name=name)
        with pytest.raises(KVStoreError, match="tenant_max_namespaces"):
            a.namespace("m1", block_tokens=BLOCK_TOKENS, block_bytes=4096, name="third")
        b.namespace("m3", block_tokens=BLOCK_TOKENS, block_bytes=4096)  # b's own count
    names = (Path(daemon.disk_dir) / "namespace-names.jsonl").read_text().splitlines()
    assert len(names) == 2  # one line a bind (a log, never rewritten whole)
    assert (Path(daemon.disk_dir) / "namespace-names.jsonl").stat().st_mode & 0o077 == 0
    assert daemon.stop() == 0


def test_a_flood_of_bad_tokens_is_logged_rate_limited_and_held_back(tenancy: Tenancy) -> None:
    """Past BAD_TOKEN_FREE refusals, each call with a bad token from that peer is
    answered BAD_TOKEN_DELAY_S late, and the log tells refusals in a few lines."""
    from kvproto.v1.kvstore_pb2_grpc import KVStoreStub
    from kvstored.auth import BAD_TOKEN_DELAY_S, BAD_TOKEN_FREE

    stub = KVStoreStub(tenancy.daemon.channel())
    guess = (("authorization", "Bearer " + "0" * 32),)
    calls = held = 0
    # (earlier tests' refusals count too, and a window of BAD_TOKEN_LOG_S may end
    # between these calls on a slow machine: then the count starts again)
    while held < 5 and calls < 4 * BAD_TOKEN_FREE:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            stub.Stats(pb.StatsRequest(), metadata=guess)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        held += time.monotonic() - started >= BAD_TOKEN_DELAY_S
        calls += 1
    assert held == 5, f"{held} of {calls} refusals were held back"
    lines = [line for line in tenancy.daemon.output().splitlines() if "refused for a" in line]
    # one line per BAD_TOKEN_LOG_S at most: this module's daemon refused 60 calls with
    # bad tokens before these, and it has not run anywhere near 200 s
    assert 1 <= len(lines) < 20, lines


def test_a_large_first_frame_without_a_token_is_refused_at_its_header(tenancy: Tenancy) -> None:
    """A local connection that announces a 50 MiB call before its token frame is
    answered UNAUTHENTICATED and closed as soon as the header arrives: the daemon
    never holds the bytes of someone without a token."""
    with tenancy.client("a") as client:
        path = client.server_info().local_socket
    name = b"Reserve"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(20)
        sock.connect(path)
        sock.sendall(frames.HEADER.pack(50 << 20, len(name)) + name)  # the body to follow
        header = sock.recv(frames.HEADER.size, socket.MSG_WAITALL)
        size, status = frames.HEADER.unpack(header)
        assert status == grpc.StatusCode.UNAUTHENTICATED.value[0]
        body = sock.recv(size, socket.MSG_WAITALL)
        assert "before the token frame" in frames.parse_error(body)[1]
        with pytest.raises((ConnectionResetError, BrokenPipeError)):  # closed
            for _ in range(100):
                sock.sendall(bytes(1 << 20))


def test_token_less_large_calls_leave_the_daemons_memory_as_it_was(
    kvstored_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """20 calls without a token, each with a 60 MiB request: refused before their
    requests are read, so the daemon's resident memory grows by a few MiB at most."""
    config, _, _ = write_tenants(tmp_path)
    daemon = kvstored_factory(extra_args=("--config", str(config)))
    assert daemon.proc is not None
    status = Path(f"/proc/{daemon.proc.pid}/status")

    def rss() -> int:
        line = next(x for x in status.read_text().splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) << 10

    lookup = daemon.channel().unary_unary("/kvstore.v1.KVStore/Lookup")
    baseline = 0
    for size in (16, *[60 << 20] * 20):
        with pytest.raises(grpc.RpcError) as caught:
            lookup(bytes(size), timeout=60)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        baseline = baseline or rss()  # after a first refusal: what the daemon holds anyway
    # (measured: +11 MiB, most of it once, at the first large calls; +400 MiB before)
    assert rss() - baseline < 32 << 20, (baseline >> 20, rss() >> 20)


def test_token_guesses_on_the_local_socket_are_held_back_too(tenancy: Tenancy) -> None:
    """The promise of docs/operations/tenants.md on the local socket as on gRPC (#56 item 13): past
    BAD_TOKEN_FREE refusals, a process that keeps guessing tokens over one connection
    is answered BAD_TOKEN_DELAY_S late each time (before: never held)."""
    from kvstored.auth import BAD_TOKEN_DELAY_S, BAD_TOKEN_FREE

    with tenancy.client("a") as client:
        path = client.server_info().local_socket
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED.value[0]
    calls = held = 0
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        # (a window of BAD_TOKEN_LOG_S may end between these calls on a slow machine:
        # then the count starts again)
        while held < 5 and calls < 4 * BAD_TOKEN_FREE:
            started = time.monotonic()
            status, _ = _local_call(sock, frames.AUTH_NAME, b"0" * 32)
            assert status == unauthenticated
            held += time.monotonic() - started >= BAD_TOKEN_DELAY_S
            calls += 1
    assert held == 5, f"{held} of {calls} refusals were held back"
    with tenancy.client("a") as client:  # another process's token is taken at once
        assert client.server_info().tenant == "a"


def test_one_user_cannot_take_the_daemons_connections(
    kvstored_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """The local-call socket: a user past max_connections_per_user has its next
    connection closed at once, and, on a daemon with tokens, a connection that sends
    no token is closed after PRE_AUTH_S, so idle connections cannot pile up until the
    daemon is out of descriptors (#56, item 6). Every other client is served."""
    from kvbench.torture_kit import closed_by_peer
    from kvstored.local_calls import PRE_AUTH_S

    config, tokens, _ = write_tenants(tmp_path)
    daemon = kvstored_factory(
        extra_args=("--config", str(config)), max_connections_per_user=4
    )
    with KVClient(daemon.addr, token=tokens["a"]) as client:
        path = client.server_info().local_socket
    assert path

    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(path)
        return sock

    held = [connect() for _ in range(4)]
    try:
        extra = connect()
        assert closed_by_peer(extra, 30)  # the fifth, at once
        extra.close()
        # the four idle ones sent no token: each is closed after PRE_AUTH_S
        started = time.monotonic()
        assert all(closed_by_peer(sock, PRE_AUTH_S + 30) for sock in held)
        assert time.monotonic() - started >= PRE_AUTH_S - 1
    finally:
        for sock in held:
            sock.close()
    # the user's count went down with them: a client connects and is served
    with KVClient(daemon.addr, token=tokens["b"]) as client:
        ns = client.namespace("after-flood", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        assert ns.put(tokens_of(91, 2), blocks_of(2, 4096, 3)).stored == 2
        assert client.arena_in_use or client.server_info().local_socket
    assert "max_connections_per_user" in daemon.output()


def test_a_tenants_first_put_after_a_kill_9_restart_succeeds(
    kvstored_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """#66 item 5: a client that lived through a kill -9 and restart of its daemon
    named, in its first put, the staging lease (and staged slots) the dead daemon had
    given it: the new daemon answered `LeaseError: unknown lease` (3 of 3). The put is
    made again under new leases, and no error reaches the caller; the same for a
    tenant with an arena region of its own (a) and one that maps the common arena (b)."""
    config, tokens, _ = write_tenants(tmp_path)
    daemon = kvstored_factory(extra_args=("--config", str(config)))
    with KVClient(daemon.addr, token=tokens["a"], use_arena=True) as a, KVClient(
        daemon.addr, token=tokens["b"], use_arena=True
    ) as b:
        spaces = {
            who: client.namespace("restart", block_tokens=BLOCK_TOKENS, block_bytes=4096)
            for who, client in (("a", a), ("b", b))
        }
        for tag, ns in enumerate(spaces.values()):  # each holds staged slots now
            assert ns.put(tokens_of(300 + tag, 3), blocks_of(3, 4096, tag)).stored == 3
        for restart in range(2):
            daemon.kill()
            daemon.start()
            for client in (a, b):
                # (gRPC's reconnect backoff may still hold the client's channel: wait for
                # it, the condition this test is not about)
                grpc.channel_ready_future(client._conn.grpc.channel).result(timeout=30)
            for tag, (who, ns) in enumerate(spaces.items()):
                chain, blocks = tokens_of(310 + 10 * restart + tag, 3), blocks_of(3, 4096, 40 + tag)
                if restart == 0:  # sent ahead, as the vLLM connector's worker puts
                    assert ns.put_nowait(chain, blocks).result(30).stored == 3, who
                else:
                    assert ns.put(chain, blocks).stored == 3, who
                assert np.all(ns.get(chain).blocks == (40 + tag)), who


class _FakeListener:
    """A listener that took a daemon socket's path (the daemon's own socket moved
    aside, as team A did in #66): it records what each connection sends and answers
    as ``respond(conn, captured)`` says, on a thread of its own."""

    def __init__(self, path: str, respond: Callable[[socket.socket, bytearray], None]) -> None:
        self.captured: list[bytearray] = []
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(path)
        self._listener.listen(8)
        self._respond = respond
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            captured = bytearray()
            self.captured.append(captured)
            with conn:
                conn.settimeout(10)
                with contextlib.suppress(OSError, ValueError, struct.error):
                    self._respond(conn, captured)

    def close(self) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(10)


@contextlib.contextmanager
def _taken_over(path: str, respond: Callable[[socket.socket, bytearray], None]) -> Iterator[
    tuple[_FakeListener, str]
]:
    """The daemon's socket at ``path`` renamed to ``path.real`` and a fake listener at
    ``path``; put back as it was after."""
    real = path + ".real"
    os.rename(path, real)
    fake = None
    try:
        fake = _FakeListener(path, respond)
        yield fake, real
    finally:
        if fake is not None:
            fake.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.rename(real, path)


def _fake_local_calls(conn: socket.socket, captured: bytearray) -> None:
    """Answers as a daemon would, but with a forged proof (it knows no token)."""
    while True:
        header = conn.recv(frames.HEADER.size, socket.MSG_WAITALL)
        if len(header) < frames.HEADER.size:
            return
        size, name_len = frames.HEADER.unpack(header)
        rest = conn.recv(name_len + size, socket.MSG_WAITALL) if name_len + size else b""
        captured += header + rest
        name = rest[:name_len]
        body = secrets.token_bytes(32) if name in (frames.HELLO_NAME, frames.AUTH_NAME) else b""
        conn.sendall(frames.response_frame(frames.OK, body))


def _fake_handout(conn: socket.socket, captured: bytearray) -> None:
    """Answers as the hand-out would, with a memory file of its own and a forged proof."""
    import json

    for answer in ({"nonce": secrets.token_hex(32)}, {"arena": "x", "offset": 0,
                                                      "length": 4096, "proof": "00" * 32}):
        line = b""
        while not line.endswith(b"\n"):
            chunk = conn.recv(4096)
            if not chunk:
                return
            line += chunk
        captured += line
        data = json.dumps(answer).encode() + b"\n"
        if "proof" in answer:
            fd = os.memfd_create("fake-region")
            os.ftruncate(fd, 4096)
            socket.send_fds(conn, [data], [fd])
            os.close(fd)
        else:
            conn.sendall(data)


def test_a_listener_that_took_a_local_socket_learns_nothing_it_can_use(
    tenancy: Tenancy,
) -> None:
    """#66 item 4: team A replaced ``kvstored.local.sock`` with its own listener and
    received team B's token, sent in clear in the first frame. Now the client proves
    its token over the peer's nonce and wants the daemon's proof back: the listener
    captures no token, its capture replayed to the real daemon authenticates nothing,
    and the client, finding no proof, gives it no call and stays on gRPC. The same for
    the arena hand-out socket (and the client maps no memory the listener hands it)."""
    from kvclient.arena_path import map_handed_out

    token_b = tenancy.tokens["b"]
    with tenancy.client("a") as client:
        info = client.server_info()
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED.value[0]

    with _taken_over(info.local_socket, _fake_local_calls) as (fake, real):
        with tenancy.client("b", use_arena=True) as b:  # a new client: it connects anew
            ns = b.namespace("taken-over", block_tokens=BLOCK_TOKENS, block_bytes=4096)
            chain = tokens_of(400, 3)
            stored = ns.put(chain, blocks_of(3, 4096, 21)).stored
            got = ns.get(chain)
        assert fake.captured, "the client never came to the fake listener"
        everything = b"".join(fake.captured)
        assert token_b.encode() not in everything
        assert token_b.encode().hex().encode() not in everything
        # it saw only the challenge, no call
        for captured in fake.captured:
            names, at = [], 0
            while at < len(captured):
                size, name_len = frames.HEADER.unpack_from(captured, at)
                names.append(bytes(captured[at + 5 : at + 5 + name_len]))
                at += frames.HEADER.size + name_len + size
            assert set(names) <= {frames.HELLO_NAME, frames.AUTH_NAME}, names
        # the capture, replayed to the real daemon, authenticates nothing
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(20)
            sock.connect(real)
            sock.sendall(bytes(fake.captured[0]))
            answers = [_local_answer(sock) for _ in range(2)]
            assert answers[-1][0] == unauthenticated, answers
            status, _ = _local_call(sock, b"ServerInfo", b"")
            assert status == unauthenticated
        # and B was served all the same, over gRPC
        assert stored == 3 and got.n_blocks == 3 and np.all(got.blocks == 21)

    token_a = tenancy.tokens["a"]
    with _taken_over(info.arena_socket, _fake_handout) as (fake, real):
        with pytest.raises(ValueError, match="did not prove"):
            map_handed_out(info.arena_socket, token_a, 10, info.uid)
        everything = b"".join(fake.captured)
        assert everything and token_a.encode() not in everything
        lines = bytes(fake.captured[0]).splitlines(keepends=True)
        with socket.socket(socket.AF_UNIX) as sock:  # replayed: no region, an error
            sock.settimeout(20)
            sock.connect(real)
            for line in lines:
                sock.sendall(line)
                data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
                assert not fds
            assert b"not valid" in data or b"challenge" in data, data
    # the daemon's own sockets serve on: a's client maps its region
    with tenancy.client("a", use_arena=True) as a:
        ns = a.namespace("taken-over", block_tokens=BLOCK_TOKENS, block_bytes=4096)
        assert ns.put(tokens_of(401, 2), blocks_of(2, 4096, 22)).stored == 2
        assert a.arena_in_use


def _local_answer(sock: socket.socket) -> tuple[int, bytes]:
    header = sock.recv(frames.HEADER.size, socket.MSG_WAITALL)
    size, status = frames.HEADER.unpack(header)
    return status, sock.recv(size, socket.MSG_WAITALL) if size else b""


def _flood_handout(path: str, cap: int, report: int, release: int) -> None:
    """As uid 65534: hold ``cap`` hand-out connections (each answered a nonce), then
    open one more and write to ``report`` whether it was closed unanswered; hold the
    others until ``release`` is closed. Runs in a forked child (ends in os._exit)."""
    code = 1
    try:
        os.setgid(65534)
        os.setuid(65534)

        def hello(sock: socket.socket) -> bytes:
            try:
                sock.sendall(b"hello " + secrets.token_hex(32).encode() + b"\n")
                return sock.recv(4096)
            except (BrokenPipeError, ConnectionResetError):
                return b""

        held = []
        for _ in range(cap):
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(30)
            sock.connect(path)
            assert hello(sock)  # answered (a nonce): admitted
            held.append(sock)
        extra = socket.socket(socket.AF_UNIX)
        extra.settimeout(30)
        extra.connect(path)
        os.write(report, b"closed\n" if hello(extra) == b"" else b"answered\n")
        os.read(release, 1)  # b"" when the test closes its end
        code = 0
    finally:
        os._exit(code)


def test_one_user_cannot_take_the_arena_handouts_connections(
    kvstored_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """#66 item 5: one unauthenticated user filled the daemon's fds through the arena
    hand-out socket (20,000 of 20,000; a new tenant's client took 4.1 s). It is capped
    per user as the local-call socket is (max_connections_per_user): the connection
    past the cap of a user (here nobody, uid 65534) is closed at once, unanswered, and
    meanwhile a tenant of another user still gets its arena region."""
    if os.geteuid() != 0:
        pytest.skip("a connecting process of another user needs root")
    config, tokens, _ = write_tenants(tmp_path)
    config.write_text('socket_mode = "0666"\n' + config.read_text())
    daemon = kvstored_factory(
        extra_args=("--config", str(config)), max_connections_per_user=4
    )
    os.chmod(os.path.dirname(daemon.socket_path), 0o711)  # other users may reach it
    with KVClient(daemon.addr, token=tokens["a"]) as client:
        path = client.server_info().arena_socket
    assert path
    report_r, report_w = os.pipe()
    release_r, release_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        os.close(release_w)
        _flood_handout(path, 4, report_w, release_r)
    os.close(report_w)
    os.close(release_r)
    try:
        with os.fdopen(report_r) as report:
            assert report.readline().strip() == "closed"
        # while nobody holds its four, tenant a (another user) maps its region
        with KVClient(daemon.addr, token=tokens["a"], use_arena=True) as a:
            ns = a.namespace("past-the-cap", block_tokens=BLOCK_TOKENS, block_bytes=4096)
            assert ns.put(tokens_of(500, 2), blocks_of(2, 4096, 9)).stored == 2
            assert a.arena_in_use and a.server_info().arena_path.startswith("fd:")
    finally:
        os.close(release_w)
        if not wait_for(lambda: os.waitpid(pid, os.WNOHANG)[0] != 0, 30):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert "max_connections_per_user" in daemon.output()
