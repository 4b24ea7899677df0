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

Hybrid models (vLLM's hybrid KV cache manager): the layers form groups (full attention,
sliding window), each with block ids of its own, so a copy names one id list per group
(:data:`BlockIds`), and a row holds the groups' layers one group after another. A
sliding-window group names vLLM's null block (:data:`NULL_BLOCK`) for the pages it
freed or never allocated (out of its window): a load skips those, a store never has one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvstore import block_kernel

# vLLM's null block: what a sliding-window group's block table holds for a page out of
# its window (vllm.v1.core.block_pool: the pool's first block, never handed out)
NULL_BLOCK = 0

BlockIds = Sequence[Sequence[int]]  # one list of vLLM block ids per KV cache group


class PagedLayers:
    """The paged KV tensors of one worker, in layer order, seen as whole blocks."""

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        num_blocks: int,
        *,
        groups: Sequence[int] = (),
        one_launch: bool = True,
    ) -> None:
        """``groups``: how many of ``layers`` (in order) each KV cache group has (empty:
        one group of all)."""
        if not layers:
            raise ValueError("no KV cache layers to register")
        self.groups = tuple(groups) or (len(layers),)
        if sum(self.groups) != len(layers) or min(self.groups) < 1:
            raise ValueError(f"KV cache groups of {self.groups} layers, {len(layers)} given")
        # the group of each layer
        self._group_of = [g for g, n in enumerate(self.groups) for _ in range(n)]
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
        on_gpu = one_launch and self.device.type == "cuda" and len(self.groups) == 1
        self._pieces = block_kernel.page_pieces(self._pages) if on_gpu else None

    @property
    def num_layers(self) -> int:
        return len(self._pages)

    def gather(self, block_ids: BlockIds, rows: torch.Tensor) -> torch.Tensor:
        """Copy the pages of ``block_ids`` (n ids per group, none the null block) into
        ``rows`` (uint8 ``[>= n, block_bytes]``, host memory); returns ``rows[:n]``."""
        n = self._count(block_ids)
        out = self._check_rows(rows, n)
        if n == 0:
            return out
        if any(NULL_BLOCK in ids for ids in block_ids):
            raise ValueError("a block to store names vLLM's null block (a page out of its window)")
        if self._one_launch(block_ids, out, True):
            return out
        staged = self._staging(out)
        parts = self._parts(staged)
        ids = [torch.tensor(list(g), dtype=torch.long, device=self.device) for g in block_ids]
        for layer, pages in enumerate(self._pages):
            for o in range(self.outer):
                torch.index_select(pages[o], 0, ids[self._group_of[layer]], out=parts[layer][o])
        if staged is not out:
            out.copy_(staged)
        return out

    def scatter(self, block_ids: BlockIds, rows: torch.Tensor) -> None:
        """Write ``rows[i]`` (uint8 ``[n, block_bytes]``, host memory) into the pages of
        ``block_ids[g][i]`` of each group ``g``; a null block id skips that group's part."""
        n = self._count(block_ids)
        source = self._check_rows(rows, n)
        if n == 0:
            return
        if NULL_BLOCK not in block_ids[0] and self._one_launch(block_ids, source, False):
            return
        staged = self._staging(source)
        if staged is not source:
            staged.copy_(source)
        parts = self._parts(staged)
        # per group: the rows to write (None: all of them) and their page ids
        targets: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        for group in block_ids:
            kept = [i for i, block in enumerate(group) if block != NULL_BLOCK]
            picked = None if len(kept) == n else torch.tensor(kept, device=self.device)
            ids = torch.tensor([group[i] for i in kept], dtype=torch.long, device=self.device)
            targets.append((picked, ids))
        for layer, pages in enumerate(self._pages):
            picked, ids = targets[self._group_of[layer]]
            if ids.numel() == 0:
                continue
            for o in range(self.outer):
                part = parts[layer][o]
                pages[o].index_copy_(0, ids, part if picked is None else part[picked])

    def _count(self, block_ids: BlockIds) -> int:
        """The blocks a copy names: as many ids in every group."""
        if len(block_ids) != len(self.groups):
            raise ValueError(f"{len(block_ids)} block id lists for {len(self.groups)} groups")
        n = len(block_ids[0])
        if any(len(ids) != n for ids in block_ids):
            raise ValueError(f"KV cache groups name {[len(ids) for ids in block_ids]} blocks")
        return n

    def _one_launch(self, block_ids: BlockIds, rows: torch.Tensor, to_rows: bool) -> bool:
        pieces, blocks = self._pieces, self.num_blocks
        return pieces is not None and block_kernel.copy_rows(
            pieces, block_ids[0], rows, to_rows, blocks, self.device
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
