"""Bad input gets its exact status code and changes nothing in the store.

Each test stores a known chain first, takes a snapshot of Stats, sends the bad request,
checks the code (and that the message names the field), then checks the snapshot and
the stored chain are unchanged.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from conftest import (
    Daemon,
    get_chain,
    kv_stub,
    open_ns,
    put_chain,
    put_requests,
    store_snapshot,
)

from kvproto.v1 import kvstore_pb2 as pb

TOKENS = list(range(100, 132))  # 8 blocks of 4 tokens
UNKNOWN = "no-such-model@000000000000"


@pytest.fixture
def loaded(
    kvstored_module: Daemon, request: pytest.FixtureRequest
) -> Iterator[tuple[Any, Any, bytes]]:
    """A daemon holding one 8-block chain -> (stub, NamespaceInfo, the chain's bytes);
    at teardown the store must be exactly as it was before the test's bad requests.
    The daemon is shared by the module; each test gets its own namespace."""
    stub = kv_stub(kvstored_module)
    model = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name.removeprefix("test_"))[:60]
    info = open_ns(stub, model=model, name=f"errors-{model}")
    _, data = put_chain(stub, info, TOKENS)
    before = store_snapshot(stub)
    yield stub, info, data
    assert store_snapshot(stub) == before
    header, got = get_chain(stub, info.ns_id, TOKENS)
    assert header.ready_blocks == 8 and got == data


def expect(code: grpc.StatusCode, call: Callable[[], Any], *words: str) -> str:
    """Run ``call``; it must fail with ``code`` and a message containing ``words``."""
    with pytest.raises(grpc.RpcError) as caught:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            list(result)  # server streams fail when read
    err = caught.value
    assert err.code() == code, f"{err.code()}: {err.details()}"
    for word in words:
        assert word in (err.details() or ""), err.details()
    return err.details() or ""


def _unknown_ns_calls(stub: Any) -> dict[str, Callable[[], Any]]:
    t = TOKENS
    return {
        "Lookup": lambda: stub.Lookup(pb.LookupRequest(ns_id=UNKNOWN, tokens=t), timeout=5),
        "LookupBatch": lambda: stub.LookupBatch(
            pb.LookupBatchRequest(ns_id=UNKNOWN, chains=[pb.LookupBatchRequest.Chain(tokens=t)]),
            timeout=5,
        ),
        "Get": lambda: stub.Get(pb.GetRequest(ns_id=UNKNOWN, tokens=t), timeout=5),
        "Put": lambda: stub.Put(put_requests(UNKNOWN, t, b"x" * 4096, 1), timeout=5),
        "Reserve": lambda: stub.Reserve(pb.ReserveRequest(ns_id=UNKNOWN, tokens=t), timeout=5),
        "Acquire": lambda: stub.Acquire(pb.AcquireRequest(ns_id=UNKNOWN, tokens=t), timeout=5),
        "Delete": lambda: stub.Delete(pb.DeleteRequest(ns_id=UNKNOWN, tokens=t), timeout=5),
        "SetPriority": lambda: stub.SetPriority(
            pb.SetPriorityRequest(ns_id=UNKNOWN, tokens=t, priority=50), timeout=5
        ),
        "Clear": lambda: stub.Clear(pb.ClearRequest(ns_id=UNKNOWN), timeout=5),
        "DescribeNamespace": lambda: stub.DescribeNamespace(
            pb.DescribeNamespaceRequest(ns_id=UNKNOWN), timeout=5
        ),
    }


def test_unknown_namespace_is_not_found_on_every_rpc(loaded: tuple[Any, Any, bytes]) -> None:
    stub, _, _ = loaded
    for rpc, call in _unknown_ns_calls(stub).items():
        details = expect(grpc.StatusCode.NOT_FOUND, call)
        assert UNKNOWN in details, f"{rpc}: {details}"


def test_put_with_wrong_byte_count_is_invalid(loaded: tuple[Any, Any, bytes]) -> None:
    stub, info, _ = loaded
    other = list(range(500, 516))  # 4 new blocks
    for size in (4 * 4096 - 1, 4 * 4096 + 1, 0):
        expect(
            grpc.StatusCode.INVALID_ARGUMENT,
            lambda size=size: stub.Put(put_requests(info.ns_id, other, b"x" * size, 4), timeout=5),
            "block_bytes",
        )


def test_put_of_more_blocks_than_the_tokens_make_is_invalid(
    loaded: tuple[Any, Any, bytes],
) -> None:
    stub, info, _ = loaded
    tokens = list(range(500, 510))  # 10 tokens: 2 full blocks
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: stub.Put(put_requests(info.ns_id, tokens, b"x" * 3 * 4096, 3), timeout=5),
        "n_blocks=3",
        "2 full blocks",
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: stub.Reserve(
            pb.ReserveRequest(ns_id=info.ns_id, tokens=tokens, n_blocks=3), timeout=5
        ),
        "n_blocks=3",
    )


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_token_ids_out_of_range_are_invalid(loaded: tuple[Any, Any, bytes], bad: int) -> None:
    stub, info, _ = loaded
    tokens = TOKENS[:4] + [bad] + TOKENS[5:]
    calls = {
        "Lookup": lambda: stub.Lookup(pb.LookupRequest(ns_id=info.ns_id, tokens=tokens), timeout=5),
        "Get": lambda: stub.Get(pb.GetRequest(ns_id=info.ns_id, tokens=tokens), timeout=5),
        "Put": lambda: stub.Put(
            put_requests(info.ns_id, tokens, b"x" * 8 * 4096, 8), timeout=5
        ),
        "Reserve": lambda: stub.Reserve(
            pb.ReserveRequest(ns_id=info.ns_id, tokens=tokens), timeout=5
        ),
    }
    for rpc, call in calls.items():
        details = expect(grpc.StatusCode.INVALID_ARGUMENT, call, "token")
        assert str(bad) in details, f"{rpc}: {details}"


def test_malformed_block_extra_keys_are_invalid(loaded: tuple[Any, Any, bytes]) -> None:
    """A block's own extra keys travel as tagged entries of extra_keys
    (kvstore.keys.block_extra_key): one cut short, or two for one block, is refused."""
    from kvstore.keys import block_extra_key

    stub, info, _ = loaded
    good = block_extra_key(1, [b"image"])
    for extra, words in [
        ([good[:-1]], ("cut short",)),
        ([good, block_extra_key(1, [b"other"])], ("two block extra keys for block 1",)),
    ]:
        for rpc, call in {
            "Lookup": lambda e=extra: stub.Lookup(
                pb.LookupRequest(ns_id=info.ns_id, tokens=TOKENS, extra_keys=e), timeout=5
            ),
            "Reserve": lambda e=extra: stub.Reserve(
                pb.ReserveRequest(ns_id=info.ns_id, tokens=TOKENS, extra_keys=e), timeout=5
            ),
        }.items():
            details = expect(grpc.StatusCode.INVALID_ARGUMENT, call, *words)
            assert details, rpc


def test_out_of_range_fields_are_invalid(loaded: tuple[Any, Any, bytes]) -> None:
    stub, info, _ = loaded
    other = list(range(700, 716))
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: stub.Put(
            put_requests(info.ns_id, other, b"x" * 4 * 4096, 4, priority=101), timeout=5
        ),
        "priority",
        "101",
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: stub.SetPriority(
            pb.SetPriorityRequest(ns_id=info.ns_id, tokens=TOKENS, priority=200), timeout=5
        ),
        "priority",
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: stub.Reserve(
            pb.ReserveRequest(ns_id=info.ns_id, tokens=other, ttl_s=-1), timeout=5
        ),
        "ttl_s",
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: stub.Commit(pb.CommitRequest(lease_id=0), timeout=5),
        "lease_id",
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: stub.Delete(
            pb.DeleteRequest(ns_id=info.ns_id, tokens=TOKENS, start_block=8), timeout=5
        ),
        "start_block=8",
    )
    # a Put stream must start with its header
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: stub.Put(iter([pb.PutRequest(data=b"x")]), timeout=5),
        "header",
    )


def test_bad_namespace_specs_are_invalid(loaded: tuple[Any, Any, bytes]) -> None:
    stub, _, _ = loaded
    expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: open_ns(stub, model=""), "model")
    expect(
        grpc.StatusCode.INVALID_ARGUMENT, lambda: open_ns(stub, block_tokens=1), "block_tokens"
    )
    expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: open_ns(stub, dtype="int4"), "dtype")
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: open_ns(stub, block_bytes=12345, num_layers=2, num_kv_heads=2, head_dim=8),
        "block_bytes=12345",
    )


def test_reopening_a_name_with_another_layout_fails_precondition(
    loaded: tuple[Any, Any, bytes],
) -> None:
    stub, info, _ = loaded
    model = info.spec.model
    # same name, same spec: fine (idempotent)
    assert open_ns(stub, model=model, name=info.name).ns_id == info.ns_id
    # same name, another layout: refused, nothing opened
    expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: open_ns(stub, model=model, name=info.name, block_tokens=8),
        info.name,
        "block_tokens",
    )
    expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: open_ns(stub, model=model, name=info.name, block_bytes=8192),
        "block_bytes",
    )


def test_released_or_expired_leases_fail_precondition(loaded: tuple[Any, Any, bytes]) -> None:
    stub, info, _ = loaded
    # a read lease released twice
    got = stub.Acquire(pb.AcquireRequest(ns_id=info.ns_id, tokens=TOKENS), timeout=5)
    stub.Release(pb.ReleaseRequest(lease_id=got.lease_id), timeout=5)
    expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: stub.Release(pb.ReleaseRequest(lease_id=got.lease_id), timeout=5),
    )
    # a write lease committed after it ran out: its pending blocks are gone
    other = list(range(900, 916))
    res = stub.Reserve(pb.ReserveRequest(ns_id=info.ns_id, tokens=other, ttl_s=0.2), timeout=5)
    assert len(res.slots) == 4
    time.sleep(0.5)
    for call in (
        lambda: stub.Commit(pb.CommitRequest(lease_id=res.lease_id), timeout=5),
        lambda: stub.Release(pb.ReleaseRequest(lease_id=res.lease_id), timeout=5),
        lambda: stub.Abandon(pb.AbandonRequest(lease_id=res.lease_id), timeout=5),
    ):
        expect(grpc.StatusCode.FAILED_PRECONDITION, call)
    # a lease id that never existed
    expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: stub.Commit(pb.CommitRequest(lease_id=123456789), timeout=5),
    )


@pytest.fixture(scope="module")
def small(kvstored_module_factory: Callable[..., Daemon]) -> Daemon:
    """host 1 MiB, no disk tier, the smallest message limit allowed (4 MiB + 64 KiB)."""
    return kvstored_module_factory(
        host_bytes="1MiB", disk_bytes=0, max_message_bytes=(4 << 20) + (64 << 10)
    )


def test_message_over_the_size_limit_is_resource_exhausted(small: Daemon) -> None:
    stub = kv_stub(small)
    info = open_ns(stub, model="oversized", block_bytes=1 << 20)
    before = store_snapshot(stub)
    tokens = list(range(4 * 8))
    # one 8 MiB data message: refused by grpc before the servicer sees it
    expect(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        lambda: stub.Put(put_requests(info.ns_id, tokens, b"x" * (8 << 20), 8, chunk=8 << 20)),
    )
    expect(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        # 1M tokens of 5 varint bytes each
        lambda: stub.Lookup(pb.LookupRequest(ns_id=info.ns_id, tokens=[2**31] * (1 << 20))),
    )
    assert store_snapshot(stub) == before


def test_full_store_refuses_puts_and_still_serves_gets(small: Daemon) -> None:
    # host 1 MiB, no disk tier, 64 KiB blocks: at most 16 blocks fit
    stub = kv_stub(small)
    info = open_ns(stub, model="full", block_bytes=64 << 10)
    kept = list(range(16))  # 4 blocks
    _, kept_data = put_chain(stub, info, kept)
    # pin them under a read lease, then fill every other slot with pending blocks
    lease = stub.Acquire(pb.AcquireRequest(ns_id=info.ns_id, tokens=kept), timeout=5)
    assert len(lease.slots) == 4
    filler = list(range(10_000, 10_000 + 4 * 64))
    res = stub.Reserve(pb.ReserveRequest(ns_id=info.ns_id, tokens=filler), timeout=5)
    assert res.refused > 0, "the reservation should have filled the arena"

    before = store_snapshot(stub)
    expect(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        lambda: put_chain(stub, info, list(range(50_000, 50_008))),
        "no room",
    )
    assert store_snapshot(stub) == before
    header, got = get_chain(stub, info.ns_id, kept)
    assert header.n_blocks == 4 and got == kept_data

    # once the pending blocks go, puts are admitted again
    stub.Abandon(pb.AbandonRequest(lease_id=res.lease_id), timeout=5)
    reply, _ = put_chain(stub, info, list(range(50_000, 50_008)))
    assert reply.stored == 2
