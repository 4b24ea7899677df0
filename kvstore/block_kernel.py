"""One CUDA launch per batch: every layer of every block, between a KV cache and slots.

The torch path of :mod:`kvstore.mover` issues one indexed copy per layer (and K/V),
stages the batch in device memory and then issues one DMA per run of slots: 32-64
launches and two passes per call, a fixed cost that small batches cannot spread
(``docs/benchmarks/gpu.md``). This kernel does the whole batch in one launch and one
pass: each thread moves 16-byte vectors straight between the KV tensors and
the slots, whose addresses it is given. The slots are host memory that the device
addresses directly (an arena registered with ``cudaHostRegister``, read and written
over the link by the kernel itself: no staging, no DMA calls) or any device buffer.

What the kernel sees of a KV cache (:class:`KernelPieces`): ``P`` pieces, one per
(layer, part) in block byte order, each at a base address; inside a piece a block is
``heads x tokens`` rows of ``row_bytes`` contiguous bytes, at byte strides
``head_stride`` and ``token_stride``; a block starts at ``block_offsets(ids)`` bytes
from its piece's base. A slot holds the block as ``[piece][head][token][row]``,
contiguous: exactly the block byte layout of :mod:`kvstore.mover` (pieces = layers x
K|V, rows = head_dim) and of the vLLM connector's page rows (pieces = layers x outer
parts, one row per page part).

Protocol: :func:`load` compiles the kernel at first use (CuPy's NVRTC) and returns
None where CuPy or CUDA is missing or the compile fails (logged once): callers then
keep the torch path. :meth:`BlockKernel.table` copies a batch's addresses to the
device once; :meth:`BlockKernel.launch` enqueues the copy of a range of pieces on a
torch stream (the whole batch, or one layer at a time for layer-wise loading). The
caller orders it: the slots must stay leased and the tensors alive until an event
recorded after the launch has completed. Addresses, strides and sizes must all be
multiples of 16 (:meth:`KernelPieces.aligned`); callers check and fall back.

A cost to know: while it reads or writes host memory, the kernel's thread blocks wait
on the link and hold their multiprocessors, so a model's kernels do not run beside it
(the copy engines, which DMA calls use, would leave them free). Layer-wise loads
therefore do not overlap compute yet (``docs/benchmarks/ttft_gpu.md``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.host import pinning

log = logging.getLogger(__name__)

VECTOR = 16  # bytes moved per load and store
THREADS = 256
UNROLL = 4  # vectors in flight per thread: loads over the link have a long latency
BLOCKS_PER_SM = 16  # grid of a launch, at most: enough loads in flight to fill the link

SOURCE = r"""
extern "C" __global__ void kv_block_copy(
    const long long* __restrict__ table,  // piece bases [P], block offsets [n], slots [n]
    int num_pieces, int n, int first_piece, int pieces,
    int heads, int tokens, int vectors,   // per piece: heads x tokens rows of vectors
    long long head_stride, long long token_stride, int to_slots)
{
    const long long* bases = table;
    const long long* block_offsets = table + num_pieces;
    const long long* slots = table + num_pieces + n;
    const long long total = (long long)n * pieces * heads * tokens * vectors;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x; first < total;
         first += step * UNROLL) {
        uint4 values[UNROLL];
        uint4* targets[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            long long idx = first + k * step;
            targets[k] = 0;
            if (idx >= total) continue;
            long long rest = idx;
            const int v = (int)(rest % vectors); rest /= vectors;
            const int t = (int)(rest % tokens); rest /= tokens;
            const int h = (int)(rest % heads); rest /= heads;
            const int p = first_piece + (int)(rest % pieces);
            const long long i = rest / pieces;
            char* kv = (char*)bases[p] + block_offsets[i] + h * head_stride
                + t * token_stride + (long long)v * 16;
            char* slot = (char*)slots[i]
                + ((((long long)p * heads + h) * tokens + t) * vectors + v) * 16;
            const uint4* source = (const uint4*)(to_slots ? kv : slot);
            targets[k] = (uint4*)(to_slots ? slot : kv);
            values[k] = *source;
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            if (targets[k] != 0) *targets[k] = values[k];
        }
    }
}
""".replace("UNROLL", str(UNROLL))


@dataclass(frozen=True, slots=True)
class KernelPieces:
    """A KV cache as the kernel addresses it (see the module docstring).

    ``block_offsets`` maps validated block ids (int64) to byte offsets from a piece's
    base; it is the same for every piece.
    """

    bases: tuple[int, ...]
    heads: int
    tokens: int
    row_bytes: int
    head_stride: int
    token_stride: int
    block_offsets: Callable[[np.ndarray], np.ndarray]

    @property
    def block_bytes(self) -> int:
        return len(self.bases) * self.heads * self.tokens * self.row_bytes

    def aligned(self) -> bool:
        """Whether every base, stride and row is a whole number of 16-byte vectors."""
        values = (*self.bases, self.row_bytes, self.head_stride, self.token_stride)
        return all(value % VECTOR == 0 for value in values)


def strided_pieces(
    bases: list[int],
    dims: tuple[int, int, int],
    strides: tuple[int, int],
    element_bytes: int,
    block_offsets: Callable[[np.ndarray], np.ndarray],
) -> KernelPieces | None:
    """Pieces whose rows are ``dims = (heads, tokens, row_elems)`` with the given
    (head, token) strides in elements; None unless rows are contiguous and 16-aligned."""
    heads, tokens, row = dims
    pieces = KernelPieces(
        bases=tuple(bases),
        heads=heads,
        tokens=tokens,
        row_bytes=row * element_bytes,
        head_stride=strides[0] * element_bytes,
        token_stride=strides[1] * element_bytes,
        block_offsets=block_offsets,
    )
    return pieces if pieces.aligned() else None


class BlockKernel:
    """The compiled kernel (one per process; thread-safe)."""

    def __init__(self, cupy: Any) -> None:
        self._cupy = cupy
        self._kernel = cupy.RawKernel(SOURCE, "kv_block_copy", options=("-std=c++17",))
        self._sms: dict[int, int] = {}

    def table(
        self, pieces: KernelPieces, ids: np.ndarray, slots: np.ndarray, device: torch.device
    ) -> torch.Tensor:
        """The batch's addresses on ``device``: piece bases, block offsets, slot addresses
        (device-visible). Copied on the current stream (ordered before the launches)."""
        return torch.from_numpy(host_table(pieces, ids, slots)).to(device, non_blocking=True)

    def launch(
        self,
        table: torch.Tensor,
        pieces: KernelPieces,
        n: int,
        to_slots: bool,
        stream: torch.cuda.Stream,
        first_piece: int = 0,
        count: int | None = None,
        blocks_per_sm: int = BLOCKS_PER_SM,
    ) -> None:
        """Copy pieces ``[first_piece, first_piece + count)`` of ``n`` blocks, on ``stream``,
        with at most ``blocks_per_sm`` thread blocks per multiprocessor (fewer leave the
        multiprocessors to kernels running beside the copy)."""
        count = len(pieces.bases) - first_piece if count is None else count
        args = arguments(table.data_ptr(), pieces, n, to_slots, first_piece, count)
        total = vectors_to_move(pieces, n, count)
        if total == 0:
            return
        device = table.device.index or 0
        sms = self._sms.get(device)
        if sms is None:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            self._sms[device] = sms
        blocks = max(1, min(-(-total // (THREADS * UNROLL)), sms * blocks_per_sm))
        cupy = self._cupy
        with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream.cuda_stream, device):
            self._kernel((blocks,), (THREADS,), args)


def host_table(pieces: KernelPieces, ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """The kernel's table, int64: piece bases, each block's offset, each slot's address."""
    offsets = pieces.block_offsets(np.asarray(ids, dtype=np.int64))
    if (offsets % VECTOR).any() or (np.asarray(slots) % VECTOR).any():
        raise ValueError("block offsets and slot addresses must be 16-byte aligned")
    return np.concatenate(
        [np.asarray(pieces.bases, dtype=np.int64), offsets.astype(np.int64),
         np.asarray(slots, dtype=np.int64)]
    )


def vectors_to_move(pieces: KernelPieces, n: int, count: int) -> int:
    """The kernel's work items: 16-byte vectors of ``count`` pieces of ``n`` blocks."""
    return n * count * pieces.heads * pieces.tokens * (pieces.row_bytes // VECTOR)


def arguments(
    table_address: int,
    pieces: KernelPieces,
    n: int,
    to_slots: bool,
    first_piece: int,
    count: int,
) -> tuple[Any, ...]:
    """The kernel's arguments after the table's address, typed as SOURCE declares them."""
    return (
        np.uint64(table_address), np.int32(len(pieces.bases)), np.int32(n),
        np.int32(first_piece), np.int32(count), np.int32(pieces.heads),
        np.int32(pieces.tokens), np.int32(pieces.row_bytes // VECTOR),
        np.int64(pieces.head_stride), np.int64(pieces.token_stride),
        np.int32(1 if to_slots else 0),
    )


def page_pieces(pages: Sequence[torch.Tensor]) -> KernelPieces | None:
    """Pieces of CUDA tensors each ``[outer, num_blocks, inner]`` (a paged cache's
    layers, as the vLLM connector views them): one piece per tensor and outer part, a
    block one row of ``inner`` elements in each; None unless 16-byte aligned."""
    first = pages[0]
    outer, num_blocks, inner = first.shape
    part_bytes = inner * first.element_size()
    bases = [t.data_ptr() + o * num_blocks * part_bytes for t in pages for o in range(outer)]

    def offsets(ids: np.ndarray) -> np.ndarray:
        return ids * part_bytes

    return strided_pieces(bases, (1, 1, inner), (0, 0), first.element_size(), offsets)


def copy_rows(
    pieces: KernelPieces,
    block_ids: Sequence[int],
    rows: torch.Tensor,
    to_rows: bool,
    num_blocks: int,
    device: torch.device,
) -> bool:
    """Blocks ``block_ids`` between the ``pieces`` of a cache on ``device`` and pinned
    host ``rows`` (``[>= n, block_bytes]``, row ``i`` for block ``i``) in one launch on
    the device's current stream, waited for before returning (as a blocking copy would
    be). False, with nothing done, where one launch cannot do it: rows not pinned, no
    kernel here, addresses not 16-byte aligned, or a block id outside
    ``[0, num_blocks)`` (the caller's own path then copies or refuses)."""
    kernel = load() if rows.is_pinned() else None
    address = pinning.device_address(rows.data_ptr()) if kernel is not None else None
    ids = np.asarray(block_ids, dtype=np.int64)
    if kernel is None or address is None or not ids.size:
        return False
    if (address | pieces.block_bytes) % VECTOR or ids.min() < 0 or ids.max() >= num_blocks:
        return False
    slots = address + np.arange(ids.size, dtype=np.int64) * pieces.block_bytes
    stream = torch.cuda.current_stream(device)
    table = kernel.table(pieces, ids, slots, device)
    kernel.launch(table, pieces, int(ids.size), to_rows, stream)  # the rows are the slots
    stream.synchronize()
    return True


_lock = threading.Lock()
_loaded: list[BlockKernel | None] = []  # [] until the first load


def load() -> BlockKernel | None:
    """The compiled kernel, or None where it cannot run here (no CUDA, no CuPy, or the
    compile failed: logged once, and the torch path stays in use)."""
    with _lock:
        if not _loaded:
            _loaded.append(_compile())
        return _loaded[0]


def _compile() -> BlockKernel | None:
    if not torch.cuda.is_available():
        return None
    try:
        import cupy  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        log.info("no CuPy: the torch copies move KV blocks (one launch per layer)")
        return None
    try:
        kernel = BlockKernel(cupy)
        kernel._kernel.compile()
    except Exception as exc:  # a CUDA or NVRTC error of any kind
        log.warning("the one-launch block copy did not build (%s): torch copies are used", exc)
        return None
    return kernel
