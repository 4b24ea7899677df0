"""kvstore.mover on CPU tensors: gather/scatter between KV layouts and arena slots.

Every round trip fills the KV cache with random bit patterns (NaN payloads included),
offloads some blocks into arena slots, checks each slot against an independent
reference of the documented byte layout ``[layers][K|V][kv_heads][tokens][head_dim]``,
then onboards the slots into a POISONED cache (every element a sentinel) at other
block ids and compares bytes: the target blocks must equal the source blocks and
every other block must still hold the sentinel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.errors import InvalidArgument
from kvstore.keys import NamespaceSpec
from kvstore.kv_caches import HFKV, BlockShape, KVCache, PagedKV, stack_uniform
from kvstore.mover import Mover

L, H, T, D = 3, 2, 4, 8  # layers, kv heads, tokens per block, head dim
NB = 12  # paged: blocks in the pool
B, S = 2, 4 * T + 3  # HF: batch, sequence capacity (3 tokens past the last full block)
SENTINEL = 0x5A


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (any bytes are valid, NaNs included)."""
    size = torch.empty((), dtype=dtype).element_size()
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * size, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape).clone()


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t)
    out.view(torch.uint8).fill_(SENTINEL)
    return out


def bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


# -- the cache layouts under test ---------------------------------------------------------
# Each builder returns (kv, per-layer K/V tensors as [(k_view, v_view)] in the engine's own
# shape, how to address block (seq, j) -> id) so the reference can be computed by hand.


def paged_layers(dtype: torch.dtype, seed: int, how: str) -> list[torch.Tensor]:
    if how == "stacked-views":  # per-layer views of one allocation: detected as stacked
        whole = random_bits((L, 2, NB, T, H, D), dtype, seed)
        return [whole[i] for i in range(L)]
    if how == "reversed-views":  # one allocation, layers in reverse order: not uniform
        whole = random_bits((L, 2, NB, T, H, D), dtype, seed)
        return [whole[L - 1 - i] for i in range(L)]
    return [random_bits((2, NB, T, H, D), dtype, seed + i) for i in range(L)]


def make_paged(layers: list[torch.Tensor], stacked_tensor: bool) -> PagedKV:
    if stacked_tensor:
        return PagedKV(torch.stack(layers))
    return PagedKV(layers)


def paged_reference(layers: list[torch.Tensor], block: int) -> np.ndarray:
    """One block in the slot layout, built element by element from the engine's tensors."""
    ref = torch.empty((L, 2, H, T, D), dtype=layers[0].dtype)
    for layer in range(L):
        for kv in range(2):
            for head in range(H):
                for tok in range(T):
                    ref[layer, kv, head, tok] = layers[layer][kv, block, tok, head]
    return bytes_of(ref)


def hf_pairs(
    dtype: torch.dtype, seed: int, stacked: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if stacked:
        whole = random_bits((L, 2, B, H, S, D), dtype, seed)
        return [(whole[i, 0], whole[i, 1]) for i in range(L)]
    return [
        (
            random_bits((B, H, S, D), dtype, seed + 2 * i),
            random_bits((B, H, S, D), dtype, seed + 2 * i + 1),
        )
        for i in range(L)
    ]


def hf_reference(pairs: list[tuple[torch.Tensor, torch.Tensor]], seq: int, j: int) -> np.ndarray:
    ref = torch.empty((L, 2, H, T, D), dtype=pairs[0][0].dtype)
    for layer, (k, v) in enumerate(pairs):
        for kv, t in enumerate((k, v)):
            for head in range(H):
                for tok in range(T):
                    ref[layer, kv, head, tok] = t[seq, head, j * T + tok]
    return bytes_of(ref)


def arena(size: int = 1 << 20) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.uint8)


def slot_offsets(placement: str, n: int, bb: int) -> list[int]:
    """Where the n slots go: one run of adjacent slots, or scattered out of order."""
    if placement == "one-run":
        return [8192 + i * bb for i in range(n)]
    # scattered and out of order, page-aligned, never adjacent
    pages = (bb + 4095) // 4096 + 1
    order = [3, 0, 5, 1, 4, 2, 6, 7][:n]
    return [(1 + k * pages) * 4096 for k in order]


# -- round trips ---------------------------------------------------------------------------

PAGED_CASES = [
    ("per-layer", False),
    ("stacked-views", False),
    ("reversed-views", False),
    ("per-layer", True),  # one [L, 2, NB, ...] tensor
]


@pytest.mark.parametrize("placement", ["one-run", "scattered"])
@pytest.mark.parametrize("max_runs", [0, 8])  # 0: one index_copy_ over rows; 8: per run
@pytest.mark.parametrize("how,stacked_tensor", PAGED_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_paged_round_trip_is_byte_exact(
    dtype: torch.dtype, how: str, stacked_tensor: bool, max_runs: int, placement: str
) -> None:
    layers = paged_layers(dtype, seed=1, how=how)
    kv = make_paged(layers, stacked_tensor)
    assert kv.stacked == (how == "stacked-views" or stacked_tensor)
    bb = kv.shape.block_bytes
    assert bb == 2 * L * H * D * T * layers[0].element_size()
    mover = Mover(arena(), max_run_copies=max_runs)
    blocks = [7, 2, 11, 0, 5]
    offsets = slot_offsets(placement, len(blocks), bb)

    # offload 5 blocks: each slot holds exactly the reference bytes of its block
    assert mover.offload(kv, blocks, offsets) is None  # CPU: done, no event
    region = mover.arena.numpy()
    for block, off in zip(blocks, offsets, strict=True):
        assert np.array_equal(region[off : off + bb], paged_reference(layers, block)), block

    # onboard into a poisoned cache at other ids: those blocks match, the rest is poison
    target_layers = [poisoned_like(t) for t in layers]
    if how == "stacked-views":
        whole = poisoned_like(torch.stack(layers))
        target_layers = [whole[i] for i in range(L)]
    target = make_paged(target_layers, stacked_tensor)
    dst = [1, 3, 4, 9, 10]
    assert mover.onboard(target, dst, offsets) is None
    final = target.tensors if not stacked_tensor else list(target.tensors[0])
    for layer in range(L):
        for src_block, dst_block in zip(blocks, dst, strict=True):
            assert torch.equal(
                final[layer][:, dst_block].view(torch.uint8),
                layers[layer][:, src_block].view(torch.uint8),
            )
        untouched = [b for b in range(NB) if b not in dst]
        assert (final[layer][:, untouched].view(torch.uint8) == SENTINEL).all()


@pytest.mark.parametrize("placement", ["one-run", "scattered"])
@pytest.mark.parametrize("max_runs", [0, 8])
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hf_round_trip_is_byte_exact(
    dtype: torch.dtype, stacked: bool, max_runs: int, placement: str
) -> None:
    pairs = hf_pairs(dtype, seed=2, stacked=stacked)
    kv = HFKV(pairs, T)
    assert kv.stacked == stacked
    assert (kv.batch, kv.blocks_per_seq, kv.num_blocks) == (B, 4, 8)
    bb = kv.shape.block_bytes
    mover = Mover(arena(), max_run_copies=max_runs)
    where = [(1, 3), (0, 0), (1, 0), (0, 2)]
    blocks = [kv.block_id(seq, j) for seq, j in where]
    offsets = slot_offsets(placement, len(blocks), bb)

    mover.offload(kv, blocks, offsets)
    region = mover.arena.numpy()
    for (seq, j), off in zip(where, offsets, strict=True):
        assert np.array_equal(region[off : off + bb], hf_reference(pairs, seq, j))

    # onboard into a poisoned cache: sequence 1's blocks land in sequence 0 and back
    target_pairs = [(poisoned_like(k), poisoned_like(v)) for k, v in pairs]
    target = HFKV(target_pairs, T)
    moved_to = [(0, 1), (1, 2), (0, 3), (1, 1)]
    mover.onboard(target, [target.block_id(s, j) for s, j in moved_to], offsets)
    for layer in range(L):
        for x in range(2):
            got, want = target_pairs[layer][x], pairs[layer][x]
            filled = torch.zeros(B, S, dtype=torch.bool)
            for (ss, sj), (ds, dj) in zip(where, moved_to, strict=True):
                assert torch.equal(
                    got[ds, :, dj * T : (dj + 1) * T].view(torch.uint8),
                    want[ss, :, sj * T : (sj + 1) * T].view(torch.uint8),
                )
                filled[ds, dj * T : (dj + 1) * T] = True
            # everything else, the 3 tokens past the last full block included, is poison
            rest = got.view(torch.uint8).permute(0, 2, 1, 3)[~filled]
            assert (rest == SENTINEL).all()


def test_paged_and_hf_blocks_are_interchangeable() -> None:
    # the same K/V content in both layouts makes the same slot bytes
    pairs = hf_pairs(torch.bfloat16, seed=3, stacked=False)
    hf = HFKV(pairs, T)
    # paged pool whose block b is sequence 0's block b (kv-first, token-major inside)
    layers = [
        torch.stack([t[0, :, : 4 * T].unflatten(1, (4, T)).permute(1, 2, 0, 3) for t in pair])
        for pair in pairs
    ]
    paged = PagedKV(layers)
    mover = Mover(arena())
    bb = hf.shape.block_bytes
    mover.offload(hf, [0, 1, 2, 3], [0, bb, 2 * bb, 3 * bb])
    mover.offload(paged, [0, 1, 2, 3], [4 * bb, 5 * bb, 6 * bb, 7 * bb])
    region = mover.arena.numpy()
    assert np.array_equal(region[: 4 * bb], region[4 * bb : 8 * bb])


# -- the pieces ---------------------------------------------------------------------------


def test_stack_uniform_detects_layers_of_one_allocation() -> None:
    whole = torch.zeros(4, 2, 3)
    assert stack_uniform([whole[i] for i in range(4)]) is not None
    assert stack_uniform([whole[i] for i in (0, 2)]) is not None  # constant step of 2
    assert stack_uniform([whole[i] for i in (0, 1, 3)]) is None  # step changes
    assert stack_uniform([whole[i] for i in (3, 2, 1)]) is None  # backwards
    assert stack_uniform([whole[0], whole[0]]) is None  # the same layer twice
    assert stack_uniform([torch.zeros(2, 3), torch.zeros(2, 3)]) is None  # two allocations
    view = stack_uniform([whole[1], whole[2]])
    assert view is not None and view.data_ptr() == whole[1].data_ptr()
    assert torch.equal(view, whole[1:3])


def test_hf_block_ids_address_sequences() -> None:
    kv = HFKV([(torch.zeros(B, H, S, D), torch.zeros(B, H, S, D))], T)
    assert kv.block_id(1, 2) == 6
    assert kv.block_ids(1, 1, 3) == [5, 6, 7]
    with pytest.raises(InvalidArgument):
        kv.block_id(0, 4)  # the partial block past 4 full ones is not addressable
    with pytest.raises(InvalidArgument):
        kv.block_ids(1, 2, 3)
    with pytest.raises(InvalidArgument, match="no full block"):
        HFKV([(torch.zeros(1, H, T - 1, D),) * 2], T)


def test_block_shape_matches_namespace_spec() -> None:
    spec = NamespaceSpec("m", block_tokens=T, num_layers=L, num_kv_heads=H, head_dim=D)
    shape = BlockShape.from_spec(spec)
    assert shape.block_bytes == spec.block_bytes == spec.layout_bytes()
    shape.check_spec(spec)
    other = NamespaceSpec("m", block_tokens=T, num_layers=L, num_kv_heads=H, head_dim=D,
                          dtype="float16")
    with pytest.raises(InvalidArgument, match="differs"):
        shape.check_spec(other)  # same size, other dtype
    with pytest.raises(InvalidArgument, match="stores blocks of"):
        shape.check_spec(NamespaceSpec("m", block_tokens=T, block_bytes=4096))
    with pytest.raises(InvalidArgument, match="no KV layout"):
        BlockShape.from_spec(NamespaceSpec("m", block_tokens=T, block_bytes=4096))


def _small_paged() -> KVCache:
    return PagedKV([torch.zeros(2, NB, T, H, D, dtype=torch.bfloat16) for _ in range(L)])


@pytest.mark.parametrize(
    "ids,offsets,message",
    [
        ([NB], [0], "must be in"),
        ([-1], [0], "must be in"),
        ([1, 1], [0, 4096], "distinct"),
        ([1, 2], [0], "2 block ids for 1 slots"),
        ([1], [(1 << 20) - 64], "outside the arena"),
        ([1], [-4096], "outside the arena"),
        ([1], [4097], "aligned"),
        ([[1, 2]], [0], "flat"),
    ],
)
def test_bad_requests_raise_and_copy_nothing(ids: list, offsets: list[int], message: str) -> None:
    mover = Mover(arena())
    kv = _small_paged()
    with pytest.raises(InvalidArgument, match=message):
        mover.offload(kv, ids, offsets)
    with pytest.raises(InvalidArgument, match=message):
        mover.onboard(kv, ids, offsets)
    with pytest.raises(InvalidArgument, match=message):
        mover.onboard_layers(kv, ids, offsets)
    with pytest.raises(InvalidArgument, match=message):
        mover.onboard_layer(kv, ids, offsets, 0)
    assert not mover.arena.any()


@pytest.mark.parametrize("layer", [-1, L])
def test_a_layer_outside_the_cache_is_refused_and_nothing_moves(layer: int) -> None:
    mover = Mover(arena())
    mover.arena.fill_(7)
    kv = _small_paged()
    with pytest.raises(InvalidArgument, match=f"layer {layer} is outside"):
        mover.onboard_layer(kv, [1], [0], layer)
    assert all(not t.any() for t in kv.tensors)


def test_mismatched_layers_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="layer 1"):
        PagedKV([torch.zeros(2, NB, T, H, D), torch.zeros(2, NB, T, H, D + 1)])
    with pytest.raises(InvalidArgument, match="paged KV layers"):
        PagedKV([torch.zeros(NB, T, H, D)])
    with pytest.raises(InvalidArgument, match="K/V tensor 1"):
        HFKV([(torch.zeros(B, H, S, D), torch.zeros(B, H, S, D, dtype=torch.float16))], T)
    with pytest.raises(ValueError, match="uint8"):
        Mover(torch.zeros(16, dtype=torch.float32))


def test_empty_request_moves_nothing() -> None:
    mover = Mover(arena())
    assert mover.offload(_small_paged(), [], []) is None
    assert mover.onboard(_small_paged(), [], []) is None
