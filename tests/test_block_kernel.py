"""The one-launch block copy's CUDA source, run on the CPU.

The host C++ compiler builds ``kvstore.block_kernel.SOURCE`` with CUDA's few names
stubbed, and a launch runs every (block, thread) in turn over CPU tensors (each thread's
work is independent, so a serial run is the launch's result). The index math, the
pieces of each cache kind, layer ranges and the grid-stride loop are checked byte for
byte against the torch path of :class:`kvstore.mover.Mover`; the ``gpu`` tests check
the same on CUDA.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kvclient.integrations.vllm.blocks import PagedLayers
from kvstore import block_kernel
from kvstore.block_kernel import KernelPieces
from kvstore.kv_caches import HFKV, KVCache, PagedKV
from kvstore.mover import Mover

COMPILER = shutil.which("c++") or shutil.which("g++")
pytestmark = pytest.mark.skipif(COMPILER is None, reason="needs a C++ compiler")

HARNESS = r"""
struct uint4 { unsigned x, y, z, w; };
struct dim3_ { unsigned x, y, z; };
static dim3_ gridDim, blockDim, blockIdx, threadIdx;
#define __global__
#define __restrict__
SOURCE
extern "C" void launch(int grid, int block, const long long* table, int num_pieces, int n,
                       int first_piece, int pieces, int heads, int tokens, int vectors,
                       long long head_stride, long long token_stride, int to_slots) {
    gridDim.x = grid; blockDim.x = block;
    for (int b = 0; b < grid; ++b)
        for (int t = 0; t < block; ++t) {
            blockIdx.x = b; threadIdx.x = t;
            kv_block_copy(table, num_pieces, n, first_piece, pieces, heads, tokens, vectors,
                          head_stride, token_stride, to_slots);
        }
}
"""

L, H, D, T = 3, 2, 16, 4  # bf16 rows of 32 bytes: two vectors each
NB, B, S = 12, 2, 6 * T


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    folder = tmp_path_factory.mktemp("kernel")
    source = folder / "kernel.cpp"
    source.write_text(HARNESS.replace("SOURCE", block_kernel.SOURCE))
    library = folder / "kernel.so"
    assert COMPILER is not None
    subprocess.run(
        [COMPILER, "-O1", "-shared", "-fPIC", "-x", "c++", str(source), "-o", str(library)],
        check=True,
        capture_output=True,
    )
    return ctypes.CDLL(str(library))


def run(
    emulator: ctypes.CDLL,
    pieces: KernelPieces,
    ids: list[int],
    slots: np.ndarray,
    to_slots: bool,
    first_piece: int = 0,
    count: int | None = None,
    grid: tuple[int, int] = (3, 32),  # small: the grid-stride loop takes several turns
) -> None:
    count = len(pieces.bases) - first_piece if count is None else count
    table = block_kernel.host_table(pieces, np.asarray(ids), slots)
    args = block_kernel.arguments(table.ctypes.data, pieces, len(ids), to_slots,
                                  first_piece, count)
    types = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong,
             ctypes.c_int]
    values = [kind(int(value)) for kind, value in zip(types, args, strict=True)]
    emulator.launch(ctypes.c_int(grid[0]), ctypes.c_int(grid[1]), *values)


def caches(layout: str) -> tuple[KVCache, KVCache]:
    def make() -> KVCache:
        if layout == "paged":
            return PagedKV([torch.empty(2, NB, T, H, D, dtype=torch.bfloat16) for _ in range(L)])
        if layout == "paged-stacked":
            return PagedKV(torch.empty(L, 2, NB, T, H, D, dtype=torch.bfloat16))
        if layout == "hf":
            return HFKV([(torch.empty(B, H, S, D, dtype=torch.bfloat16),
                          torch.empty(B, H, S, D, dtype=torch.bfloat16)) for _ in range(L)], T)
        # a stacked HF buffer with room to grow: strided views, as the adapter's
        # layer-wise load allocates them
        room = torch.empty(L, 2, B, H, S + 3 * T, D, dtype=torch.bfloat16)
        return HFKV(room[..., :S, :], T)

    src, dst = make(), make()
    gen = torch.Generator().manual_seed(7)
    for t in src.tensors:
        t.view(torch.int16).copy_(torch.randint(-30000, 30000, t.shape, generator=gen))
    for t in dst.tensors:
        t.view(torch.uint8).fill_(0x5A)
    return src, dst


def arena_bytes(size: int) -> torch.Tensor:
    # 16-byte aligned start: the kernel moves 16-byte vectors
    raw = torch.zeros(size + 16, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % 16
    return raw[skip : skip + size]


@pytest.mark.parametrize("layout", ["paged", "paged-stacked", "hf", "hf-strided"])
def test_the_kernel_moves_the_bytes_the_torch_path_moves(
    emulator: ctypes.CDLL, layout: str
) -> None:
    src, dst = caches(layout)
    pieces = src.kernel_pieces()
    assert pieces is not None and pieces.block_bytes == src.shape.block_bytes
    bb = src.shape.block_bytes
    ids = [5, 0, 9, 3]
    offsets = [3 * bb, 0, 7 * bb, 1 * bb]  # out of order, with gaps
    expected = arena_bytes(8 * bb)
    Mover(expected).offload(src, ids, offsets)
    got = arena_bytes(8 * bb)
    slots = np.asarray(offsets, dtype=np.int64) + got.data_ptr()
    run(emulator, pieces, ids, slots, to_slots=True)
    assert torch.equal(got, expected)

    back = dst.kernel_pieces()
    assert back is not None
    run(emulator, back, ids, slots, to_slots=False)
    reference = caches(layout)[1]
    Mover(expected).onboard(reference, ids, offsets)
    for mine, theirs in zip(dst.tensors, reference.tensors, strict=True):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))


@pytest.mark.parametrize("layout", ["paged", "hf-strided"])
def test_a_launch_per_layer_fills_only_its_layer(emulator: ctypes.CDLL, layout: str) -> None:
    src, dst = caches(layout)
    bb = src.shape.block_bytes
    ids = [1, 4]
    offsets = [2 * bb, 0]
    arena = arena_bytes(3 * bb)
    Mover(arena).offload(src, ids, offsets)
    pieces = dst.kernel_pieces()
    assert pieces is not None
    slots = np.asarray(offsets, dtype=np.int64) + arena.data_ptr()
    reference = caches(layout)[1]
    for layer in (2, 0):  # any order: each launch touches its own layer only
        run(emulator, pieces, ids, slots, to_slots=False, first_piece=2 * layer, count=2)
        Mover(arena).onboard_layer(reference, ids, offsets, layer)
        for mine, theirs in zip(dst.tensors, reference.tensors, strict=True):
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    untouched = dst.layer(1).tensors[0].view(torch.uint8)
    assert bool((untouched == 0x5A).all())


def test_the_connector_pages_move_as_one_launch_would(emulator: ctypes.CDLL) -> None:
    layers = [torch.randn(2, NB, T, H, D).to(torch.bfloat16) for _ in range(L)]
    paged = PagedLayers(layers, NB)
    ids = [7, 2, 11]
    expected = torch.zeros(len(ids), paged.block_bytes, dtype=torch.uint8)
    paged.gather((ids,), expected)
    # the pieces the CUDA path would use, built over these CPU pages
    pieces = block_kernel.page_pieces(paged._pages)
    assert pieces is not None and pieces.block_bytes == paged.block_bytes
    rows = arena_bytes(len(ids) * paged.block_bytes)
    slots = rows.data_ptr() + np.arange(len(ids), dtype=np.int64) * paged.block_bytes
    run(emulator, pieces, ids, slots, to_slots=True)
    assert torch.equal(rows.view(len(ids), -1), expected)


def test_unaligned_rows_have_no_pieces() -> None:
    odd = PagedKV([torch.empty(2, NB, T, H, 3, dtype=torch.bfloat16) for _ in range(L)])
    assert odd.kernel_pieces() is None  # rows of 6 bytes: the torch path moves them


def test_without_cuda_there_is_no_kernel() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the gpu tests cover the kernel there")
    assert block_kernel.load() is None
    assert Path(block_kernel.__file__).exists()
