"""GPU data paths on CPU tensors, across two processes: this test and a real kvstored.

Both copy modes, both KV layouts, byte-exact:

- client-driven (``GpuClient.offload/onboard``): this process gathers its KV blocks
  into the daemon's arena slots (Reserve -> copy -> Commit) and scatters them back
  (Acquire -> copy -> Release);
- daemon-driven (``GpuClient.register`` + ``Registration.offload/onboard``): the KV
  lives in a shared-memory file the daemon maps; the daemon gathers and scatters.

Every round trip fills the source with random bits, checks the stored blocks (read
back inline with ``Namespace.get``) against the documented slot layout
``[layers][K|V][kv_heads][tokens][head_dim]``, onboards into a POISONED cache at other
block ids, and checks those blocks byte for byte and that nothing else changed.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
import torch
from conftest import Daemon

from kvclient import InvalidArgumentError, KVClient, Namespace
from kvclient.integrations.gpu import (
    HFKV,
    GpuClient,
    KVCache,
    PagedKV,
    RegistrationError,
    SharedKV,
    layout_message,
)
from kvproto.v1 import gpu_pb2 as gpb
from kvproto.v1 import gpu_pb2_grpc as gpb_grpc

L, H, D, T = 3, 2, 16, 4  # layers, kv heads, head dim, tokens per block
NB = 16  # paged pool blocks
B, S = 2, 6 * T  # HF batch and sequence capacity: 6 blocks per sequence
DTYPE = torch.bfloat16
SENTINEL = 0xA5
LAYOUTS = ["paged", "hf"]


@pytest.fixture(scope="module")
def client(kvstored_module: Daemon) -> Iterator[KVClient]:
    with KVClient(kvstored_module.addr) as c:
        yield c


@pytest.fixture(scope="module")
def gpu(client: KVClient) -> Iterator[GpuClient]:
    with GpuClient(client) as g:
        yield g


def namespace(client: KVClient, model: str) -> Namespace:
    return client.namespace(
        model, T, num_layers=L, num_kv_heads=H, head_dim=D, dtype="bfloat16"
    )


def shared(layout: str) -> SharedKV:
    if layout == "paged":
        return SharedKV.paged(L, NB, T, H, D, DTYPE)
    return SharedKV.hf(L, B, H, S, D, T, DTYPE)


def fill_random(kv: KVCache, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in kv.tensors:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def poison(kv: KVCache) -> None:
    for t in kv.tensors:
        t.view(torch.uint8).fill_(SENTINEL)


def plain(layout: str) -> KVCache:
    """A cache in ordinary (unshared) memory: client-driven copies only."""
    if layout == "paged":
        return PagedKV([torch.empty(2, NB, T, H, D, dtype=DTYPE) for _ in range(L)])
    return HFKV([(torch.empty(B, H, S, D, dtype=DTYPE),) * 2 for _ in range(L)], T)


def block_view(kv: KVCache, block: int) -> torch.Tensor:
    """One block of the engine's tensors, in the documented slot layout [L, 2, H, T, D]."""
    if isinstance(kv, PagedKV):
        layers = kv.tensors if len(kv.tensors) == L else list(kv.tensors[0])
        return torch.stack([layer[:, block].transpose(1, 2) for layer in layers])
    assert isinstance(kv, HFKV)
    seq, j = divmod(block, kv.blocks_per_seq)
    pairs = [(kv.tensors[2 * i], kv.tensors[2 * i + 1]) for i in range(L)]
    return torch.stack(
        [torch.stack([t[seq, :, j * T : (j + 1) * T] for t in pair]) for pair in pairs]
    )


def block_bytes(kv: KVCache, block: int) -> np.ndarray:
    return block_view(kv, block).contiguous().view(torch.uint8).numpy().reshape(-1)


def ids_for(layout: str, n: int, shift: int = 0) -> list[int]:
    """n distinct block ids, out of order (HF: spread over both sequences)."""
    pool = NB if layout == "paged" else B * (S // T)
    order = [(7 * i + 3 + shift) % pool for i in range(pool)]
    return order[:n]


def assert_moved(src: KVCache, dst: KVCache, pairs: list[tuple[int, int]]) -> None:
    """dst blocks hold the src blocks byte for byte; every other dst block is poison."""
    for s, d in pairs:
        assert np.array_equal(block_bytes(dst, d), block_bytes(src, s)), (s, d)
    touched = {d for _, d in pairs}
    for other in range(dst.num_blocks):
        if other not in touched:
            assert (block_view(dst, other).view(torch.uint8) == SENTINEL).all(), other


def prompt(first: int, n_blocks: int) -> list[int]:
    return list(range(first, first + n_blocks * T + 1))  # +1: a trailing partial block


def check_stored(ns: Namespace, tokens: list[int], src: KVCache, ids: list[int]) -> None:
    got = ns.get(tokens)
    assert got.n_blocks == len(ids)
    for i, block in enumerate(ids):
        assert np.array_equal(got.blocks[i], block_bytes(src, block)), i


# -- client-driven ----------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_client_driven_round_trip(client: KVClient, gpu: GpuClient, layout: str) -> None:
    ns = namespace(client, f"client-{layout}")
    src = plain(layout)
    fill_random(src, seed=1)
    tokens = prompt(1000, 5)
    ids = ids_for(layout, 5)

    # offload 5 blocks: committed, and the daemon serves the documented bytes
    put = gpu.offload(ns, tokens, src, ids)
    assert (put.stored, put.existing, put.refused) == (5, 0, 0)
    check_stored(ns, tokens, src, ids)
    again = gpu.offload(ns, tokens, src, ids)
    assert (again.stored, again.existing) == (0, 5)  # nothing copied twice

    # onboard into a poisoned cache at other ids
    dst = plain(layout)
    poison(dst)
    targets = ids_for(layout, 5, shift=5)
    got = gpu.onboard(ns, tokens, dst, targets)
    assert (got.ready_blocks, got.onboarded, got.tokens) == (5, 5, 5 * T)
    assert got.released and got.event is None  # CPU: done when it returns
    assert_moved(src, dst, list(zip(ids, targets, strict=True)))


def test_a_gpu_client_dropped_unclosed_unpins_and_unmaps_its_arena(client: KVClient) -> None:
    # a registration must never outlive its mapping: a later mapping at the same address
    # could not be pinned again (seen on an H100 after a daemon restart)
    gpu = GpuClient(client)
    src = plain("paged")
    fill_random(src, seed=9)
    gpu.offload(namespace(client, "dropped"), prompt(3000, 2), src, ids_for("paged", 2))
    arena = gpu._arena
    assert arena is not None and not arena.mapping.closed
    del gpu
    gc.collect()
    assert arena.mapping.closed


def test_client_driven_onboard_of_a_partial_prefix(client: KVClient, gpu: GpuClient) -> None:
    ns = namespace(client, "client-partial")
    src = plain("paged")
    fill_random(src, seed=2)
    tokens = prompt(2000, 6)
    assert gpu.offload(ns, tokens, src, [4, 5, 6]).stored == 3  # blocks 0..2 of 6
    dst = plain("paged")
    poison(dst)
    # the engine holds block 0 already: ask for 1..5 -> only 1 and 2 are cached
    got = gpu.onboard(ns, tokens, dst, [10, 11, 12, 13, 14], start=1, wait=False)
    assert (got.ready_blocks, got.onboarded) == (3, 2)
    got.release()
    got.release()  # idempotent
    assert_moved(src, dst, [(5, 10), (6, 11)])
    # continue the chain from block 3: the parent blocks must exist first
    assert gpu.offload(ns, tokens, src, [7, 8], start=3).stored == 2
    assert gpu.offload(ns, prompt(2100, 3), src, [9], start=2).refused == 1  # no parent


# -- daemon-driven ----------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_daemon_driven_round_trip(client: KVClient, gpu: GpuClient, layout: str) -> None:
    ns = namespace(client, f"daemon-{layout}")
    with shared(layout) as src_kv, shared(layout) as dst_kv:
        src, dst = src_kv.kv, dst_kv.kv
        fill_random(src, seed=3)
        poison(dst)
        tokens = prompt(3000, 6)
        ids = ids_for(layout, 6)
        with gpu.register(ns, src_kv) as reg:
            assert reg.reply.num_blocks == src.num_blocks and reg.reply.stacked
            out = reg.offload(tokens, ids)
            assert (out.stored, out.existing, out.refused) == (6, 0, 0)
            assert out.bytes == 6 * ns.block_bytes and not out.out_of_space
            assert reg.offload(tokens, ids).existing == 6
        check_stored(ns, tokens, src, ids)
        targets = ids_for(layout, 6, shift=6)
        with gpu.register(ns, dst_kv) as reg:
            got = reg.onboard(tokens, targets)
            assert (got.ready_blocks, got.onboarded, got.ready_tokens) == (6, 6, 6 * T)
            assert got.bytes == 6 * ns.block_bytes
        assert_moved(src, dst, list(zip(ids, targets, strict=True)))


def test_daemon_driven_per_layer_tensors(client: KVClient, gpu: GpuClient) -> None:
    # layers stored in reverse order in the file: the daemon cannot stack them and
    # gathers layer by layer
    ns = namespace(client, "daemon-per-layer")
    with SharedKV.paged(L, NB, T, H, D, DTYPE) as base:
        whole = base.storage.view(L, 2, NB, T, H, D)
        src_kv = SharedKV(base.path, base.storage, PagedKV([whole[L - 1 - i] for i in range(L)]))
        fill_random(src_kv.kv, seed=4)
        tokens = prompt(4000, 4)
        with gpu.register(ns, src_kv) as reg:
            assert not reg.reply.stacked
            assert reg.offload(tokens, [9, 1, 14, 3]).stored == 4
            check_stored(ns, tokens, src_kv.kv, [9, 1, 14, 3])
            snapshot = base.storage.clone()
            poison(src_kv.kv)
            assert reg.onboard(tokens, [9, 1, 14, 3]).onboarded == 4
            # blocks 9, 1, 14, 3 are back; the others stay poisoned
            back = base.storage.view(L, 2, NB, T, H, D)
            want = snapshot.view(L, 2, NB, T, H, D)
            assert torch.equal(back[:, :, [9, 1, 14, 3]].view(torch.uint8),
                               want[:, :, [9, 1, 14, 3]].view(torch.uint8))
            assert (back[:, :, [0, 2, 4]].view(torch.uint8) == SENTINEL).all()


def test_daemon_driven_partial_prefix_with_start(client: KVClient, gpu: GpuClient) -> None:
    ns = namespace(client, "daemon-partial")
    with shared("hf") as src_kv, shared("hf") as dst_kv:
        fill_random(src_kv.kv, seed=5)
        poison(dst_kv.kv)
        hf = src_kv.kv
        assert isinstance(hf, HFKV)
        tokens = prompt(5000, 6)
        with gpu.register(ns, src_kv) as reg:
            assert reg.offload(tokens, hf.block_ids(0, 0, 2)).stored == 2
            # block 2 continues the stored prefix; start=3 would lack a parent
            assert reg.offload(tokens, hf.block_ids(1, 2, 1), start=2).stored == 1
            assert reg.offload(tokens, hf.block_ids(1, 4, 1), start=4).refused == 1
        with gpu.register(ns, dst_kv) as reg:
            got = reg.onboard(tokens, hf.block_ids(1, 1, 4), start=1)
            assert (got.ready_blocks, got.onboarded) == (3, 2)
        assert_moved(hf, dst_kv.kv, [(1, 7), (8, 8)])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_modes_share_one_slot_layout(client: KVClient, gpu: GpuClient, layout: str) -> None:
    ns = namespace(client, f"cross-{layout}")
    with shared(layout) as a, shared(layout) as b:
        fill_random(a.kv, seed=6)
        poison(b.kv)
        first, second = prompt(6000, 3), prompt(7000, 3)
        fill_ids, back_ids = ids_for(layout, 3), ids_for(layout, 3, shift=3)
        with gpu.register(ns, a) as reg_a, gpu.register(ns, b) as reg_b:
            # daemon-driven offload -> client-driven onboard
            assert reg_a.offload(first, fill_ids).stored == 3
            assert gpu.onboard(ns, first, b.kv, back_ids).onboarded == 3
            # client-driven offload -> daemon-driven onboard
            assert gpu.offload(ns, second, a.kv, back_ids).stored == 3
            assert reg_b.onboard(second, fill_ids).onboarded == 3
        pairs = list(zip(fill_ids, back_ids, strict=True)) + list(
            zip(back_ids, fill_ids, strict=True)
        )
        assert_moved(a.kv, b.kv, pairs)


# -- errors -------------------------------------------------------------------------------


def test_bad_registrations_and_requests(client: KVClient, gpu: GpuClient) -> None:
    ns = namespace(client, "errors")
    with pytest.raises(InvalidArgumentError, match="SharedKV"):
        gpu.register(ns, plain("paged"))  # CPU memory the daemon cannot map
    wrong = SharedKV.paged(L, NB, T, H, D // 2, DTYPE)
    try:
        with pytest.raises(InvalidArgumentError, match="namespace"):
            gpu.register(ns, wrong)  # caught client-side
        with pytest.raises(InvalidArgumentError, match="stores blocks of"):
            gpu.register(ns.ns_id, wrong)  # by id only: the daemon refuses it
    finally:
        wrong.close()
    with shared("paged") as kv:
        reg = gpu.register(ns, kv)
        with pytest.raises(InvalidArgumentError, match="must be in"):
            reg.offload(prompt(0, 2), [0, NB])
        with pytest.raises(InvalidArgumentError, match="distinct"):
            reg.onboard(prompt(0, 2), [3, 3])
        with pytest.raises(InvalidArgumentError, match="need"):
            reg.offload(prompt(0, 1), [0, 1])  # tokens cover one block, two asked
        # the daemon validates too (a raw request past the client's checks)
        stub = gpb_grpc.KVGpuStub(client.channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Offload(gpb.OffloadRequest(registration_id=reg.registration_id,
                                            tokens=prompt(0, 2), block_ids=[0, NB]), timeout=10)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        reg.close()
        with pytest.raises(RegistrationError):
            reg.offload(prompt(0, 2), [0, 1])
        reg.close()  # idempotent


def test_registration_of_a_gone_process_is_dropped(client: KVClient, gpu: GpuClient) -> None:
    ns = namespace(client, "gone")
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with shared("paged") as kv:
            stub = gpb_grpc.KVGpuStub(client.channel)
            request = gpb.RegisterKVRequest(
                ns_id=ns.ns_id, layout=layout_message(kv), client_pid=engine.pid
            )
            reply = stub.RegisterKV(request, timeout=30)
            onboard = gpb.OnboardRequest(
                registration_id=reply.registration_id, tokens=prompt(0, 1), block_ids=[0]
            )
            assert stub.Onboard(onboard, timeout=10).onboarded == 0  # alive: answered
            # the engine dies: its registration (and any IPC mapping) is dropped
            engine.kill()
            engine.wait()
            with pytest.raises(grpc.RpcError) as err:
                stub.Onboard(onboard, timeout=10)
            assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "is gone" in err.value.details()
            metadata = dict(err.value.trailing_metadata())
            assert metadata["kvstore-error"] == "UnknownRegistration"
    finally:
        engine.kill()
        engine.wait()


def test_platform_is_reported(kvstored_module: Daemon, client: KVClient, gpu: GpuClient) -> None:
    info = gpu.info()
    assert info.platform == "cpu-only" and info.devices == () and not info.arena_pinned
    assert client.stats().platform == "cpu-only"
    assert client.server_info().platform == "cpu-only"
    assert "platform cpu-only" in kvstored_module.output()


def test_daemon_stops_cleanly_with_live_registrations(
    kvstored_factory: Callable[..., Daemon],
) -> None:
    daemon = kvstored_factory(disk_bytes=0)
    with KVClient(daemon.addr) as c, GpuClient(c) as g, shared("hf") as kv:
        ns = namespace(c, "shutdown")
        fill_random(kv.kv, seed=7)
        reg = g.register(ns, kv)
        assert reg.offload(prompt(0, 2), [0, 1]).stored == 2
        assert g.info().registrations == 1
        # SIGTERM with the registration (and its mapping of our file) still open
        assert daemon.stop() == 0
    assert "stopped" in daemon.output()


def test_client_driven_layer_wise_onboard_and_its_refusals(
    client: KVClient, gpu: GpuClient
) -> None:
    """onboard_layers on CPU tensors: each layer lands when it is waited for, release
    completes the rest, and bad requests are refused before anything is acquired."""
    ns = namespace(client, "client-layers")
    src = plain("hf")
    fill_random(src, seed=4)
    tokens = prompt(2400, 3)
    assert gpu.offload(ns, tokens, src, [0, 1, 2]).stored == 3
    dst = plain("hf")
    poison(dst)
    with pytest.raises(InvalidArgumentError, match="must be in"):
        gpu.onboard_layers(ns, tokens, dst, [0, 1, dst.num_blocks])
    with pytest.raises(InvalidArgumentError, match="need"):
        gpu.onboard_layers(ns, tokens[: 2 * T], dst, [0, 1, 2])
    assert all(bool((t.view(torch.uint8) == SENTINEL).all()) for t in dst.tensors)
    got = gpu.onboard_layers(ns, tokens, dst, [3, 4, 5])
    assert (got.ready_blocks, got.onboarded) == (3, 3)
    got.wait(0)  # layer 0 only
    assert not bool((dst.tensors[0].view(torch.uint8) == SENTINEL).all())
    assert bool((dst.tensors[2].view(torch.uint8) == SENTINEL).all())  # layer 1 not yet
    got.release()
    got.release()  # idempotent
    assert_moved(src, dst, [(0, 3), (1, 4), (2, 5)])
