"""kvstored over its real unix socket, spoken to with the raw generated stubs.

Happy paths of every RPC, health and reflection. Bad input is in
test_daemon_errors.py, start/stop/restart in test_daemon_lifecycle.py.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from conftest import (
    Daemon,
    get_chain,
    kv_stub,
    open_ns,
    put_chain,
)
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvproto.v1 import kvstore_pb2 as pb
from kvstored import hostinfo

TOKENS = list(range(1000, 1000 + 4 * 8))  # 8 blocks of 4 tokens


@pytest.fixture
def kvstored(kvstored_module: Daemon) -> Daemon:
    """One daemon for the whole module: each test opens its own namespace (model)."""
    return kvstored_module


def test_health_serving_overall_and_for_the_service(kvstored: Daemon) -> None:
    stub = health_pb2_grpc.HealthStub(kvstored.channel())
    for service in ("", "kvstore.v1.KVStore"):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service_and_a_generic_client_can_call_stats(
    kvstored: Daemon,
) -> None:
    channel = kvstored.channel()
    db = ProtoReflectionDescriptorDatabase(channel)
    services = db.get_services()
    assert "kvstore.v1.KVStore" in services
    assert "grpc.health.v1.Health" in services

    # Build the Stats request/response types from reflection alone (not kvstore_pb2).
    pool = descriptor_pool.DescriptorPool(db)
    method = pool.FindServiceByName("kvstore.v1.KVStore").methods_by_name["Stats"]
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    call = channel.unary_unary(
        "/kvstore.v1.KVStore/Stats",
        request_serializer=request_cls.SerializeToString,
        response_deserializer=response_cls.FromString,
    )
    reply = call(request_cls(), timeout=5)
    assert {t.name for t in reply.tiers} == {"host", "disk"}
    assert reply.platform


def test_server_info_describes_limits_and_host(kvstored: Daemon) -> None:
    info = kv_stub(kvstored).ServerInfo(pb.ServerInfoRequest(), timeout=5)
    assert info.version
    assert info.host_id == hostinfo.host_id()  # same host: the arena is shareable
    assert info.arena_bytes > 0
    assert info.max_message_bytes == 64 << 20
    assert info.max_chunk_bytes == 4 << 20
    assert info.max_blocks_per_request == 8192
    assert info.default_lease_ttl_s == 30
    assert info.pid == kvstored.pid


def test_open_namespace_is_idempotent_and_listed(kvstored: Daemon) -> None:
    stub = kv_stub(kvstored)
    # layout fields given, block_bytes derived: 2 x 2 layers x 2 heads x 8 dim x 2 B x 4 tok
    first = open_ns(stub, block_bytes=0, num_layers=2, num_kv_heads=2, head_dim=8)
    assert first.block_bytes == first.spec.block_bytes == 2 * 2 * 2 * 8 * 2 * 4
    assert first.ns_id.startswith("test-model@")
    assert first.spec.dtype == "bfloat16" and first.spec.world_size == 1
    again = open_ns(stub, block_bytes=0, num_layers=2, num_kv_heads=2, head_dim=8)
    assert again.ns_id == first.ns_id

    named = open_ns(stub, model="other", name="other-tp0")
    assert named.name == "other-tp0"
    described = stub.DescribeNamespace(pb.DescribeNamespaceRequest(ns_id="other-tp0"), timeout=5)
    assert described.ns_id == named.ns_id  # a bound name works where an ns_id goes

    listed = stub.ListNamespaces(pb.ListNamespacesRequest(), timeout=5).namespaces
    assert {first.ns_id, named.ns_id} <= {n.ns_id for n in listed}


def test_put_lookup_get_round_trip_is_byte_exact(kvstored: Daemon) -> None:
    stub = kv_stub(kvstored)
    info = open_ns(stub, model="round-trip")
    tokens = TOKENS + [7, 7]  # a trailing partial block is ignored

    reply, data = put_chain(stub, info, tokens)
    assert (reply.stored, reply.existing, reply.refused) == (8, 0, 0)

    found = stub.Lookup(pb.LookupRequest(ns_id=info.ns_id, tokens=tokens), timeout=5)
    assert found.ready_blocks == 8 and found.ready_tokens == 32 and found.total_blocks == 8
    assert found.host_blocks + found.disk_blocks == 8

    header, got = get_chain(stub, info.ns_id, tokens)
    assert (header.ready_blocks, header.n_blocks, header.start_block) == (8, 8, 0)
    assert not header.truncated and got == data

    # the client already holds 3 blocks: ask for the other 5
    header, tail = get_chain(stub, info.ns_id, tokens, start_block=3)
    assert header.n_blocks == 5 and tail == data[3 * 4096 :]

    # at most 2 blocks per call: truncated says to come back for more
    header, part = get_chain(stub, info.ns_id, tokens, max_blocks=2)
    assert header.n_blocks == 2 and header.truncated and part == data[: 2 * 4096]

    # putting the same blocks again writes nothing
    reply, _ = put_chain(stub, info, tokens)
    assert (reply.stored, reply.existing) == (0, 8)


def test_put_continues_a_stored_prefix_and_get_streams_many_chunks(kvstored: Daemon) -> None:
    stub = kv_stub(kvstored)
    info = open_ns(stub, model="big-blocks", block_bytes=1 << 20)  # Get needs several chunks
    tokens = list(range(4 * 6))
    first, head = put_chain(stub, info, tokens, n_blocks=2)
    assert first.stored == 2
    second, rest = put_chain(stub, info, tokens, start_block=2)
    assert second.stored == 4
    header, got = get_chain(stub, info.ns_id, tokens)
    assert header.n_blocks == 6 and got == head + rest


def test_get_of_unknown_prefix_is_an_empty_answer(kvstored: Daemon) -> None:
    stub = kv_stub(kvstored)
    info = open_ns(stub, model="empty")
    header, data = get_chain(stub, info.ns_id, [9] * 16)
    assert (header.ready_blocks, header.n_blocks, data) == (0, 0, b"")


def test_reserve_commit_then_acquire_release(kvstored: Daemon) -> None:
    stub = kv_stub(kvstored)
    info = open_ns(stub, model="reserve-commit")
    res = stub.Reserve(pb.ReserveRequest(ns_id=info.ns_id, tokens=TOKENS, n_blocks=4), timeout=5)
    assert res.lease_id > 0 and 0 < res.expires_in_s <= 30
    assert [s.index for s in res.slots] == [0, 1, 2, 3]
    assert all(s.size == info.block_bytes for s in res.slots)
    assert len({s.offset for s in res.slots}) == 4

    # reserved blocks are pending: visible to lookups, not ready
    found = stub.Lookup(pb.LookupRequest(ns_id=info.ns_id, tokens=TOKENS), timeout=5)
    assert (found.ready_blocks, found.pending_blocks) == (0, 4)

    assert stub.Commit(pb.CommitRequest(lease_id=res.lease_id, count=1), timeout=5).committed == 1
    assert stub.Commit(pb.CommitRequest(lease_id=res.lease_id), timeout=5).committed == 3
    found = stub.Lookup(pb.LookupRequest(ns_id=info.ns_id, tokens=TOKENS), timeout=5)
    assert (found.ready_blocks, found.pending_blocks) == (4, 0)

    got = stub.Acquire(pb.AcquireRequest(ns_id=info.ns_id, tokens=TOKENS), timeout=5)
    assert got.lease_id > 0 and len(got.slots) == 4 and got.ready_tokens == 16
    assert stub.Stats(pb.StatsRequest(), timeout=5).leases == 1
    stub.Release(pb.ReleaseRequest(lease_id=got.lease_id), timeout=5)
    assert stub.Stats(pb.StatsRequest(), timeout=5).leases == 0


def test_abandon_drops_pending_blocks(kvstored: Daemon) -> None:
    stub = kv_stub(kvstored)
    info = open_ns(stub, model="abandon")
    res = stub.Reserve(pb.ReserveRequest(ns_id=info.ns_id, tokens=TOKENS), timeout=5)
    assert len(res.slots) == 8
    assert stub.Abandon(pb.AbandonRequest(lease_id=res.lease_id), timeout=5).dropped == 8
    found = stub.Lookup(pb.LookupRequest(ns_id=info.ns_id, tokens=TOKENS), timeout=5)
    assert (found.ready_blocks, found.pending_blocks) == (0, 0)


def test_delete_clear_and_set_priority(kvstored: Daemon) -> None:
    stub = kv_stub(kvstored)
    info = open_ns(stub, model="delete-clear")
    put_chain(stub, info, TOKENS)
    changed = stub.SetPriority(
        pb.SetPriorityRequest(ns_id=info.ns_id, tokens=TOKENS, priority=90, duration_s=60),
        timeout=5,
    ).changed
    assert changed == 8

    # delete block 5 and below: 5 blocks stay
    removed = stub.Delete(
        pb.DeleteRequest(ns_id=info.ns_id, tokens=TOKENS, start_block=5), timeout=5
    ).removed
    assert removed == 3
    found = stub.Lookup(pb.LookupRequest(ns_id=info.ns_id, tokens=TOKENS), timeout=5)
    assert found.ready_blocks == 5

    assert stub.Clear(pb.ClearRequest(ns_id=info.ns_id), timeout=5).removed == 5
    found = stub.Lookup(pb.LookupRequest(ns_id=info.ns_id, tokens=TOKENS), timeout=5)
    assert found.ready_blocks == 0


def test_stats_count_blocks_per_tier_and_namespace(kvstored: Daemon) -> None:
    stub = kv_stub(kvstored)
    info = open_ns(stub, model="stats", name="stats-ns")
    put_chain(stub, info, TOKENS)
    stats = stub.Stats(pb.StatsRequest(), timeout=5)
    host = next(t for t in stats.tiers if t.name == "host")
    assert host.capacity_bytes > 0 and host.blocks >= 8 and host.used_bytes >= 8 * 4096
    (ns,) = [n for n in stats.namespaces if n.ns_id == info.ns_id]
    assert (ns.ns_id, ns.name, ns.blocks, ns.bytes) == (info.ns_id, "stats-ns", 8, 8 * 4096)
    assert stats.uptime_s > 0 and stats.platform


def test_watch_events_streams_stored_blocks(kvstored: Daemon) -> None:
    stub = kv_stub(kvstored)
    info = open_ns(stub, model="watch")
    call = stub.WatchEvents(
        pb.WatchEventsRequest(ns_id=info.ns_id, kinds=[pb.EVENT_KIND_STORED]), timeout=20
    )
    seen: list[pb.Event] = []

    def collect() -> None:
        try:
            for batch in call:
                seen.extend(batch.events)
                if len(seen) >= 3:
                    call.cancel()
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.CANCELLED

    reader = threading.Thread(target=collect)
    reader.start()
    put_chain(stub, info, TOKENS[:12])  # 3 blocks
    reader.join(20)
    assert not reader.is_alive()
    assert [e.kind for e in seen] == [pb.EVENT_KIND_STORED] * 3
    assert all(e.ns_id == info.ns_id and len(e.key) == 32 for e in seen)
    assert [e.seq for e in seen] == sorted(e.seq for e in seen)


def test_refused_puts_are_answers_not_errors(kvstored: Daemon) -> None:
    stub = kv_stub(kvstored)
    info = open_ns(stub, model="refusals")
    # blocks 4.. of a chain whose first 4 blocks were never stored: refused, not an error
    reply, _ = put_chain(stub, info, TOKENS, start_block=4)
    assert (reply.stored, reply.existing, reply.refused) == (0, 0, 4)
    # another client is computing blocks 0..7 (reserved): a put of them is refused
    res = stub.Reserve(pb.ReserveRequest(ns_id=info.ns_id, tokens=TOKENS), timeout=5)
    reply, _ = put_chain(stub, info, TOKENS)
    assert (reply.stored, reply.refused) == (0, 8)
    stub.Abandon(pb.AbandonRequest(lease_id=res.lease_id), timeout=5)


def test_lookup_waits_for_pending_blocks(kvstored: Daemon) -> None:
    stub = kv_stub(kvstored)
    info = open_ns(stub, model="early-reuse")
    res = stub.Reserve(pb.ReserveRequest(ns_id=info.ns_id, tokens=TOKENS), timeout=5)
    # the owner commits while a second client waits in Lookup
    timer = threading.Timer(
        0.2, lambda: stub.Commit(pb.CommitRequest(lease_id=res.lease_id), timeout=5)
    )
    timer.start()
    found = stub.Lookup(
        pb.LookupRequest(ns_id=info.ns_id, tokens=TOKENS, wait_pending_s=10), timeout=15
    )
    timer.join()
    assert (found.ready_blocks, found.pending_blocks) == (8, 0)


def test_extra_keys_make_separate_chains(kvstored: Daemon) -> None:
    stub = kv_stub(kvstored)
    info = open_ns(stub, model="lora")
    put_chain(stub, info, TOKENS)
    plain = stub.Lookup(pb.LookupRequest(ns_id=info.ns_id, tokens=TOKENS), timeout=5)
    lora = stub.Lookup(
        pb.LookupRequest(ns_id=info.ns_id, tokens=TOKENS, extra_keys=[b"lora-7"]), timeout=5
    )
    assert (plain.ready_blocks, lora.ready_blocks) == (8, 0)
