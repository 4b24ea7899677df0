"""KV caches as the store sees them: the layout of a block in a slot, and the
engines' caches that blocks are copied out of and into (:mod:`kvstore.mover` moves
them).

One slot holds one block: every layer, K and V, of ``block_tokens`` tokens. Its bytes
are the C-contiguous array (dtype of the namespace, native little-endian)::

    [num_layers][2: K, V][num_kv_heads][block_tokens][head_dim]

the same layout as the HF adapter (``kvclient.hf.blocks_from_cache``), so blocks
stored by any path of one namespace are interchangeable. Layer-major keeps one
layer's K and V together (a later layer-wise onboarding can start attention on layer
0 while layer 1 is still in flight); head-major inside a layer makes each
(layer, K/V, head) one contiguous ``block_tokens * head_dim`` run of an HF
``[batch, heads, seq, dim]`` tensor. ``block_bytes`` is
``2 * L * H * D * dtype_bytes * T``, exactly ``NamespaceSpec.layout_bytes()``.

KV caches (:class:`KVCache`) name blocks by integer block ids:

- :class:`PagedKV` (vLLM): per layer ``[2, num_blocks, block_tokens, kv_heads,
  head_dim]``, or one stacked ``[layers, 2, num_blocks, ...]`` tensor; block id = the
  engine's physical block number.
- :class:`HFKV` (transformers, contiguous per sequence): per layer K and V, each
  ``[batch, kv_heads, seq, head_dim]``, or one stacked ``[layers, 2, batch, ...]``;
  block id ``b * blocks_per_seq + j`` = tokens ``[j*T, (j+1)*T)`` of sequence ``b``.

A cache is seen as a few strided "pieces" whose leading dims are the block index (see
:mod:`kvstore.mover`, "Batching"); :meth:`KVCache.kernel_pieces` describes them for
the one-launch kernel (:mod:`kvstore.block_kernel`).
"""

from __future__ import annotations

import itertools
import math
from abc import ABC
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvstore.block_kernel import KernelPieces, strided_pieces
from kvstore.errors import InvalidArgument
from kvstore.keys import NamespaceSpec

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

# Blocks are moved as bytes: every gather/scatter runs on an integer view of the same
# width, so dtypes without CPU indexing kernels (float8) move too and bits stay exact.
_SAME_WIDTH_INT: dict[int, torch.dtype] = {
    1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64
}


def dtype_of(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise InvalidArgument(
            f"dtype must be one of {sorted(TORCH_DTYPES)}, got {name!r}"
        ) from None


@dataclass(frozen=True, slots=True)
class BlockShape:
    """The shape of one block: ``[num_layers, 2, num_kv_heads, block_tokens, head_dim]``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def block_elems(self) -> int:
        return math.prod(self.dims)

    @property
    def block_bytes(self) -> int:
        return self.block_elems * torch.empty((), dtype=self.dtype).element_size()

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    @classmethod
    def from_spec(cls, spec: NamespaceSpec) -> BlockShape:
        if not spec.layout_bytes():
            raise InvalidArgument(
                f"namespace {spec.ns_id} has no KV layout (num_layers, num_kv_heads, "
                "head_dim): GPU copies need one"
            )
        return cls(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_tokens,
            dtype_of(spec.dtype),
        )

    def check_spec(self, spec: NamespaceSpec) -> None:
        """Raise InvalidArgument unless blocks of this shape are the namespace's blocks."""
        if spec.block_bytes != self.block_bytes:
            raise InvalidArgument(
                f"KV blocks are {self.block_bytes} bytes ({self.describe()}); namespace "
                f"{spec.ns_id} stores blocks of {spec.block_bytes}"
            )
        if spec.layout_bytes() and BlockShape.from_spec(spec) != self:
            raise InvalidArgument(
                f"KV layout {self.describe()} differs from namespace {spec.ns_id} "
                f"(layers={spec.num_layers}, kv_heads={spec.num_kv_heads}, "
                f"head_dim={spec.head_dim}, block_tokens={spec.block_tokens}, {spec.dtype})"
            )

    def describe(self) -> str:
        return (
            f"layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"block_tokens={self.block_tokens}, {DTYPE_NAMES.get(self.dtype, self.dtype)}"
        )


# -- KV caches ------------------------------------------------------------------------


def stack_uniform(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One ``[len(tensors), *shape]`` view when the tensors are equally shaped views of one
    storage at a constant, non-overlapping distance (e.g. layers of one allocation)."""
    first = tensors[0]
    if len(tensors) == 1:
        return first.unsqueeze(0)
    if first.numel() == 0:
        return None
    ptr = first.untyped_storage().data_ptr()
    for t in tensors[1:]:
        if (
            t.shape != first.shape
            or t.stride() != first.stride()
            or t.dtype != first.dtype
            or t.device != first.device
            or t.untyped_storage().data_ptr() != ptr
        ):
            return None
    offsets = [t.storage_offset() for t in tensors]
    step = offsets[1] - offsets[0]
    dims = zip(first.shape, first.stride(), strict=True)
    extent = 1 + sum((size - 1) * stride for size, stride in dims)
    if step < extent or any(b - a != step for a, b in zip(offsets, offsets[1:], strict=False)):
        return None
    return first.as_strided((len(tensors), *first.shape), (step, *first.stride()), offsets[0])


class KVCache(ABC):
    """An engine's KV tensors seen as numbered blocks. Subclasses set the pieces."""

    kind: ClassVar[str]

    def __init__(
        self,
        shape: BlockShape,
        tensors: Sequence[torch.Tensor],
        pieces: Sequence[torch.Tensor],
        index_dims: int,
        num_blocks: int,
    ) -> None:
        self.shape = shape
        self.tensors = tuple(tensors)  # as given (what a registration shares)
        self.device = self.tensors[0].device
        self.num_blocks = num_blocks
        self._bits = _SAME_WIDTH_INT[self.tensors[0].element_size()]
        self._pieces = [p.view(self._bits) for p in pieces]  # each [*index dims, *piece dims]
        self._index_dims = index_dims
        piece_dims = tuple(self._pieces[0].shape[index_dims:])
        if len(self._pieces) * math.prod(piece_dims) != shape.block_elems:
            raise AssertionError("pieces do not tile a block")  # a bug in a subclass
        self._piece_dims = piece_dims

    @property
    def stacked(self) -> bool:
        """Whether one indexed gather moves every layer (one piece)."""
        return len(self._pieces) == 1

    def block_index(self, block_ids: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
        """Validated int64 block ids (distinct, in range), on the CPU.

        The mover moves them to the device inside its stream context: a pageable
        host-to-device copy may still be in flight when the call returns, so it must
        be ordered on the stream that uses the ids."""
        ids = torch.as_tensor(block_ids, dtype=torch.int64).cpu()
        if ids.dim() != 1:
            raise InvalidArgument(
                f"block ids must be a flat sequence, got shape {tuple(ids.shape)}"
            )
        if ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.num_blocks:
                raise InvalidArgument(
                    f"block ids must be in [0, {self.num_blocks}), got {low if low < 0 else high}"
                )
            if torch.unique(ids).numel() != ids.numel():
                raise InvalidArgument("block ids must be distinct")
        return ids

    def _index(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (ids,)

    def kernel_pieces(self) -> KernelPieces | None:
        """The cache as :mod:`kvstore.block_kernel` addresses it (pieces = layers x K|V,
        in block byte order); None where its rows are not contiguous 16-byte vectors."""
        # leading dims that index (layer, K|V): 2 when stacked; a paged layer's 1 (its
        # K|V), an HF tensor's 0 (it is one K or V)
        lead = 2 if len(self.tensors) == 1 else 1 if self.kind == "paged" else 0
        found = self._piece_addresses(lead)
        if found is None or found[1][-1] != 1:  # head_dim must be contiguous
            return None
        bases, strides = found
        head, token, block_offset = self._kernel_strides(strides[:-1])
        es, s = self.tensors[0].element_size(), self.shape

        def offsets(ids: np.ndarray) -> np.ndarray:
            return block_offset(ids) * es

        dims = (s.num_kv_heads, s.block_tokens, s.head_dim)
        return strided_pieces(bases, dims, (head, token), es, offsets)

    def _kernel_strides(
        self, strides: tuple[int, ...]
    ) -> tuple[int, int, Callable[[np.ndarray], np.ndarray]]:
        """(head stride, token stride, block ids -> offsets), in elements, from the
        strides of the dimensions between (layer, K|V) and head_dim."""
        raise NotImplementedError

    def _piece_addresses(self, lead: int) -> tuple[list[int], tuple[int, ...]] | None:
        """The byte address of every (layer, K|V) in block byte order, and the element
        strides of the dimensions after them; None unless every tensor has the same
        strides. ``lead``: how many leading dimensions of each given tensor index
        (layer, K|V): 2 when stacked, 1 for a paged layer, 0 for an HF K or V."""
        first = self.tensors[0]
        if any(t.stride() != first.stride() for t in self.tensors):
            return None
        es, lead_strides = first.element_size(), first.stride()[:lead]
        bases = [
            t.data_ptr() + sum(i * step for i, step in zip(index, lead_strides, strict=True)) * es
            for t in self.tensors
            for index in itertools.product(*(range(n) for n in t.shape[:lead]))
        ]
        return bases, tuple(first.stride()[lead:])

    def layer(self, index: int) -> KVCache:
        """Layer ``index`` alone, as a one-layer cache of the same block ids: its block
        bytes are bytes ``[index * block_bytes / L, (index + 1) * block_bytes / L)`` of
        the whole block's (layer-major layout)."""
        raise NotImplementedError

    def _parts(self, ids: torch.Tensor, staged: torch.Tensor) -> list[torch.Tensor]:
        """Each piece's share of a staging tensor ``[n, L, 2, H, T, D]`` (views)."""
        n = ids.numel()
        flat = staged.view(self._bits)
        if self.stacked:
            return [flat.view(n, *self._piece_dims)]
        whole = flat.view(n, len(self._pieces), *self._piece_dims)
        return [whole[:, k] for k in range(len(self._pieces))]

    def gather(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy blocks ``ids`` into ``out`` (``[n, L, 2, H, T, D]``, contiguous, same device).

        One indexed copy per piece, written straight into its share of ``out``: an
        ``index_select`` for one index dim; for two (HF) a fancy index, done by numpy
        on CPU (torch's CPU advanced indexing is several times slower)."""
        idx = self._index(ids)
        for piece, part in zip(self._pieces, self._parts(ids, out), strict=True):
            if len(idx) == 1:
                torch.index_select(piece, 0, idx[0], out=part)
            elif piece.device.type == "cpu":
                part.numpy()[...] = piece.numpy()[tuple(i.numpy() for i in idx)]
            else:
                part.copy_(piece[idx])

    def scatter(self, ids: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (``[n, L, 2, H, T, D]``) into blocks ``ids``.

        On CPU a numpy fancy assignment per piece (torch's CPU index_copy_/index_put_
        run element by element, ~5x slower); on CUDA ``index_copy_``/``index_put_``."""
        idx = self._index(ids)
        for piece, part in zip(self._pieces, self._parts(ids, src), strict=True):
            if piece.device.type == "cpu":
                piece.numpy()[tuple(i.numpy() for i in idx)] = part.numpy()
            elif len(idx) == 1:
                piece.index_copy_(0, idx[0], part)
            else:
                piece.index_put_(idx, part)


def _check_same(tensors: Sequence[torch.Tensor], what: str) -> None:
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise InvalidArgument(
                f"{what} {i} is {t.dtype} {tuple(t.shape)} on {t.device}; expected "
                f"{first.dtype} {tuple(first.shape)} on {first.device} like {what} 0"
            )
    if first.dtype not in DTYPE_NAMES:
        raise InvalidArgument(f"KV dtype {first.dtype} is not supported")


class PagedKV(KVCache):
    """vLLM's paged KV cache: per layer ``[2, num_blocks, block_tokens, kv_heads, head_dim]``
    (a list), or all layers stacked as ``[layers, 2, num_blocks, block_tokens, ...]``."""

    kind = "paged"

    def __init__(self, layers: torch.Tensor | Sequence[torch.Tensor]) -> None:
        if isinstance(layers, torch.Tensor):
            if layers.dim() != 6 or layers.shape[1] != 2:
                raise InvalidArgument(
                    "stacked paged KV must be [layers, 2, num_blocks, block_tokens, kv_heads, "
                    f"head_dim], got {tuple(layers.shape)}"
                )
            tensors: list[torch.Tensor] = [layers]
            stacked: torch.Tensor | None = layers
        else:
            tensors = list(layers)
            if not tensors:
                raise InvalidArgument("paged KV needs at least one layer")
            _check_same(tensors, "layer")
            if tensors[0].dim() != 5 or tensors[0].shape[0] != 2:
                raise InvalidArgument(
                    "paged KV layers must be [2, num_blocks, block_tokens, kv_heads, head_dim], "
                    f"got {tuple(tensors[0].shape)}"
                )
            stacked = stack_uniform(tensors)
        if stacked is not None:
            L, _, nb, T, H, D = stacked.shape
            pieces = [stacked.permute(2, 0, 1, 4, 3, 5)]  # [NB, L, 2, H, T, D]
            dtype = stacked.dtype
        else:
            L = len(tensors)
            _, nb, T, H, D = tensors[0].shape
            pieces = [t.permute(1, 0, 3, 2, 4) for t in tensors]  # [NB, 2, H, T, D]
            dtype = tensors[0].dtype
        super().__init__(BlockShape(L, H, D, T, dtype), tensors, pieces, 1, nb)

    def layer(self, index: int) -> PagedKV:
        if len(self.tensors) == 1:
            return PagedKV(self.tensors[0][index : index + 1])
        return PagedKV([self.tensors[index]])

    def _kernel_strides(
        self, strides: tuple[int, ...]
    ) -> tuple[int, int, Callable[[np.ndarray], np.ndarray]]:
        # after (layer, K|V): [NB, T, H] (then D), stacked or per layer
        sb, st, sh = strides
        return sh, st, lambda ids: ids * sb


class HFKV(KVCache):
    """transformers' contiguous KV: per layer (K, V), each ``[batch, kv_heads, seq,
    head_dim]``, or stacked ``[layers, 2, batch, kv_heads, seq, head_dim]``. Block id
    ``b * blocks_per_seq + j`` is tokens ``[j*T, (j+1)*T)`` of sequence ``b``; tokens
    past the last full block of ``seq`` are not addressable."""

    kind = "hf"

    def __init__(
        self,
        layers: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_tokens: int,
    ) -> None:
        T = int(block_tokens)
        if T < 1:
            raise InvalidArgument(f"block_tokens must be >= 1, got {block_tokens}")
        if isinstance(layers, torch.Tensor):
            if layers.dim() != 6 or layers.shape[1] != 2:
                raise InvalidArgument(
                    "stacked HF KV must be [layers, 2, batch, kv_heads, seq, head_dim], "
                    f"got {tuple(layers.shape)}"
                )
            tensors: list[torch.Tensor] = [layers]
            L, _, B, H, S, D = layers.shape
            stacked: torch.Tensor | None = layers
        else:
            pairs = list(layers)
            if not pairs:
                raise InvalidArgument("HF KV needs at least one layer")
            tensors = [t for pair in pairs for t in pair]
            if len(tensors) != 2 * len(pairs):
                raise InvalidArgument("HF KV layers must be (keys, values) pairs")
            _check_same(tensors, "K/V tensor")
            if tensors[0].dim() != 4:
                raise InvalidArgument(
                    "HF KV tensors must be [batch, kv_heads, seq, head_dim], got "
                    f"{tuple(tensors[0].shape)}"
                )
            L = len(pairs)
            B, H, S, D = tensors[0].shape
            stacked = stack_uniform(tensors)
            if stacked is not None:
                stacked = stacked.unflatten(0, (L, 2))
        nb = S // T
        if nb == 0:
            raise InvalidArgument(f"sequence capacity {S} holds no full block of {T} tokens")
        self.batch, self.blocks_per_seq = B, nb
        if stacked is not None:
            view = stacked[..., : nb * T, :].unflatten(4, (nb, T))  # [L, 2, B, H, nb, T, D]
            pieces = [view.permute(2, 4, 0, 1, 3, 5, 6)]  # [B, nb, L, 2, H, T, D]
        else:
            pieces = [
                t[:, :, : nb * T].unflatten(2, (nb, T)).permute(0, 2, 1, 3, 4)  # [B, nb, H, T, D]
                for t in tensors
            ]
        super().__init__(BlockShape(L, H, D, T, tensors[0].dtype), tensors, pieces, 2, B * nb)

    def layer(self, index: int) -> HFKV:
        T = self.shape.block_tokens
        if len(self.tensors) == 1:
            return HFKV(self.tensors[0][index : index + 1], T)
        return HFKV([(self.tensors[2 * index], self.tensors[2 * index + 1])], T)

    def _kernel_strides(
        self, strides: tuple[int, ...]
    ) -> tuple[int, int, Callable[[np.ndarray], np.ndarray]]:
        # after (layer, K|V): [B, H, S] (then D), stacked or K0, V0, K1, ...
        sbatch, sh, ss = strides
        nb, T = self.blocks_per_seq, self.shape.block_tokens
        return sh, ss, lambda ids: (ids // nb) * sbatch + (ids % nb) * T * ss

    def block_id(self, batch_index: int, block: int) -> int:
        if not (0 <= batch_index < self.batch and 0 <= block < self.blocks_per_seq):
            raise InvalidArgument(
                f"(batch {batch_index}, block {block}) is outside {self.batch} sequences of "
                f"{self.blocks_per_seq} blocks"
            )
        return batch_index * self.blocks_per_seq + block

    def block_ids(self, batch_index: int, first: int, count: int) -> list[int]:
        """Ids of blocks ``[first, first + count)`` of sequence ``batch_index``."""
        if count <= 0:
            return []
        self.block_id(batch_index, first)
        self.block_id(batch_index, first + count - 1)
        base = batch_index * self.blocks_per_seq
        return list(range(base + first, base + first + count))

    def _index(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        nb = self.blocks_per_seq
        return (torch.div(ids, nb, rounding_mode="floor"), ids % nb)


# -- slots ----------------------------------------------------------------------------
