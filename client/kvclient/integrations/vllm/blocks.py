"""Whole blocks between vLLM's paged KV tensors and kvstore's block rows (torch only).

vLLM keeps, per attention layer, one tensor of pages: ``num_blocks`` pages of
``block_size`` tokens, laid out as its attention backend wants (the CPU backend
``[num_blocks, kv_heads, block_size, 2 * head_dim]``, FlashAttention
``[2, num_blocks, block_size, kv_heads, head_dim]``). What a page's bytes mean is the
backend's business, so this module never looks inside one: a kvstore block of the
paged cache is, layer after layer, the bytes of that layer's page, read as
``[outer, num_blocks, inner]`` (``outer`` = the dimensions before the block dimension,
2 for FlashAttention's K|V, 1 on CPU)::

    block row = [layer 0: outer 0 page | outer 1 page ...][layer 1: ...] ...

Blocks written by one backend are therefore only meaningful to the same backend and
layout; the connector puts the layout into the namespace, so they never meet.

Moving n blocks is one ``index_select`` (store) or ``index_copy_`` (load) per layer and
outer part, between the paged tensor and a ``[n, block_bytes]`` uint8 view: no
per-block Python, no temporary tensors. On a GPU the rows pass through one device
staging buffer, or (pinned rows, :mod:`kvstore.block_kernel`) one kernel launch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvstore import block_kernel


class PagedLayers:
    """The paged KV tensors of one worker, in layer order, seen as whole blocks."""

    def __init__(
        self, layers: Sequence[torch.Tensor], num_blocks: int, *, one_launch: bool = True
    ) -> None:
        if not layers:
            raise ValueError("no KV cache layers to register")
        first = layers[0]
        for layer in layers:
            if layer.shape != first.shape or layer.dtype != first.dtype:
                raise ValueError(
                    f"KV cache layers differ: {tuple(layer.shape)} {layer.dtype} against "
                    f"{tuple(first.shape)} {first.dtype}; one layout for all layers is needed"
                )
            if not layer.is_contiguous():
                raise ValueError("KV cache layers must be contiguous tensors")
        block_dim = _block_dim(first.shape, num_blocks)
        self.device = first.device
        self.dtype = first.dtype
        self.num_blocks = num_blocks
        self.outer = math.prod(first.shape[:block_dim])
        self.inner = math.prod(first.shape[block_dim + 1 :])  # elements per page part
        # [outer, num_blocks, inner] views, one per layer
        self._pages = [layer.view(self.outer, num_blocks, self.inner) for layer in layers]
        self.page_bytes = self.outer * self.inner * first.element_size()
        self.block_bytes = self.page_bytes * len(layers)
        self._device_rows: torch.Tensor | None = None  # GPU: staging of whole blocks
        # the one-launch kernel's view of the pages (None: the torch path, always)
        on_gpu = one_launch and self.device.type == "cuda"
        self._pieces = block_kernel.page_pieces(self._pages) if on_gpu else None

    @property
    def num_layers(self) -> int:
        return len(self._pages)

    def gather(self, block_ids: Sequence[int], rows: torch.Tensor) -> torch.Tensor:
        """Copy the pages of ``block_ids`` into ``rows`` (uint8 ``[>= n, block_bytes]``,
        host memory); returns ``rows[:n]``."""
        n = len(block_ids)
        out = self._check_rows(rows, n)
        if n == 0:
            return out
        if self._one_launch(block_ids, out, True):
            return out
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        staged = self._staging(out)
        parts = self._parts(staged)
        for layer, pages in enumerate(self._pages):
            for o in range(self.outer):
                torch.index_select(pages[o], 0, ids, out=parts[layer][o])
        if staged is not out:
            out.copy_(staged)
        return out

    def scatter(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Write ``rows[i]`` (uint8 ``[n, block_bytes]``, host memory) into the pages of
        ``block_ids[i]``."""
        n = len(block_ids)
        source = self._check_rows(rows, n)
        if n == 0:
            return
        if self._one_launch(block_ids, source, False):
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        staged = self._staging(source)
        if staged is not source:
            staged.copy_(source)
        parts = self._parts(staged)
        for layer, pages in enumerate(self._pages):
            for o in range(self.outer):
                pages[o].index_copy_(0, ids, parts[layer][o])

    def _one_launch(self, block_ids: Sequence[int], rows: torch.Tensor, to_rows: bool) -> bool:
        pieces, blocks = self._pieces, self.num_blocks
        return pieces is not None and block_kernel.copy_rows(
            pieces, block_ids, rows, to_rows, blocks, self.device
        )

    def _check_rows(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != self.block_bytes:
            raise ValueError(f"rows must be uint8 [n, {self.block_bytes}], got {rows.shape}")
        if rows.shape[0] < n:
            raise ValueError(f"rows hold {rows.shape[0]} blocks, {n} needed")
        if not rows.is_contiguous():
            raise ValueError("rows must be C-contiguous")
        if n > self.num_blocks:
            raise ValueError(f"{n} blocks named, the cache has {self.num_blocks}")
        return rows[:n]

    def _staging(self, host_rows: torch.Tensor) -> torch.Tensor:
        """``host_rows`` itself on CPU; on a GPU, a device buffer of the same shape."""
        if self.device.type == "cpu":
            return host_rows
        n = host_rows.shape[0]
        if self._device_rows is None or self._device_rows.shape[0] < n:
            self._device_rows = torch.empty(
                (n, self.block_bytes), dtype=torch.uint8, device=self.device
            )
        return self._device_rows[:n]

    def _parts(self, rows: torch.Tensor) -> list[list[torch.Tensor]]:
        """``rows`` cut into one ``[n, inner]`` view (in the pages' dtype) per layer and
        outer part: where each page part of each block lands in its row."""
        typed = rows.view(self.dtype).view(rows.shape[0], self.num_layers, self.outer, self.inner)
        return [[typed[:, layer, o] for o in range(self.outer)] for layer in range(self.num_layers)]


def _block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """The dimension that indexes pages: the first whose size is ``num_blocks``."""
    for dim, size in enumerate(shape):
        if size == num_blocks:
            return dim
    raise ValueError(f"no dimension of the KV cache {tuple(shape)} has {num_blocks} blocks")
