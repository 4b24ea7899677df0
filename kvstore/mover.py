"""Gather/scatter of KV blocks between an engine's KV cache and host-arena slots.

A slot holds one block in the byte layout :mod:`kvstore.kv_caches` gives (every layer,
K and V, of ``block_tokens`` tokens), the same for every path of one namespace. KV
caches (:class:`~kvstore.kv_caches.KVCache`: vLLM's paged one, transformers'
per-sequence one) name blocks by integer block ids (:mod:`kvstore.kv_caches`).

Batching. A cache is seen as a few strided "pieces" whose leading dims are the block
index: one piece when all layers live in one tensor at a uniform stride (stacked, or
per-layer views of one allocation: detected), else one per layer (paged) or per layer
and K/V (HF). Moving n blocks is one indexed copy per piece (``index_select`` /
``index_copy_``, all n blocks at once, the T/H transpose folded in) into or out of a
staging tensor ``[n, L, 2, H, T, D]`` -- never one copy per layer per block -- then
one copy per run of adjacent slots (on CUDA: one ``cudaMemcpyAsync`` per run), or a
single indexed copy over slot rows when the slots are scattered. When the arena is
addressable from the KV's device (CPU tensors; CUDA on a c2c machine) and the slots
form one run, the gather writes straight into the arena and the scatter reads
straight from it. Copies move raw bits (integer views of the same width), so every
dtype, float8 included, round-trips exactly. On CPU the fancy-indexed copies run in
numpy, whose strided subspace copies are several times faster than torch's CPU
index kernels.

:class:`Mover` protocol: ``offload(kv, block_ids, offsets, stream=None)`` /
``onboard(...)`` enqueue the copies on ``stream`` (CUDA: the given stream or the
current one; CPU: run now) and return a ``torch.cuda.Event`` recorded after them, or
None on CPU. The caller owns ordering: wait on the event before committing slots
(offload) or before the engine reads the blocks (onboard), and keep the slots leased
until then. On CUDA the copy stream first waits for the current stream when
``wait_current`` is set, so blocks the model just wrote are complete.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from kvstore import block_kernel
from kvstore.block_kernel import KernelPieces
from kvstore.errors import InvalidArgument
from kvstore.host import pinning
from kvstore.host.slot_runs import Run, slot_runs
from kvstore.kv_caches import KVCache

log = logging.getLogger(__name__)

MAX_RUN_COPIES = 8  # more runs than this: one indexed copy over rows (same-device arenas)
MAX_STAGING_BYTES = 1 << 30  # CPU staging kept for reuse, per mover


class _CudaArrayInterface:
    """A raw device pointer as ``__cuda_array_interface__`` (for torch.as_tensor)."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def device_alias(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CUDA uint8 tensor over registered host memory whose host pointer kernels may use
    as is (c2c: ``canUseHostPointerForRegisteredMem``). The host tensor must stay alive
    and registered while the alias is used. Untested without a GPU."""
    if host.dtype != torch.uint8 or host.dim() != 1 or host.device.type != "cpu":
        raise ValueError("device_alias needs a flat uint8 CPU tensor")
    return torch.as_tensor(_CudaArrayInterface(host.data_ptr(), host.numel()), device=device)


@contextmanager
def _on_stream(device: torch.device, stream: Any, wait_current: bool) -> Iterator[Any]:
    if device.type != "cuda":
        yield None
        return
    with torch.cuda.device(device):
        current = torch.cuda.current_stream(device)
        s = stream if stream is not None else current
        if wait_current and s != current:
            s.wait_stream(current)
        with torch.cuda.stream(s):
            yield s


class Mover:
    """Copies blocks between KV caches and the slots of one arena region.

    ``arena`` is the whole region as a flat uint8 CPU tensor (pinned when CUDA copies
    should be asynchronous). ``device_address``: the address at which CUDA kernels
    reach the arena's first byte (registered memory, mapped: over the link on PCIe,
    coherently on c2c; None: not reachable). With it, and where
    :mod:`kvstore.block_kernel` runs, a CUDA batch is one kernel launch between the KV
    tensors and the slots. Otherwise ``device_arenas`` (c2c: an alias of the same bytes
    for torch's kernels) or, by default, a staging tensor in device memory and one DMA
    per slot run.

    Thread-safe. CUDA staging comes from torch's caching allocator (stream-ordered);
    CPU staging buffers are kept for reuse, up to ``max_staging_bytes`` in all,
    because a fresh multi-MiB CPU buffer costs a page fault per 4 KiB on every call.
    """

    def __init__(
        self,
        arena: torch.Tensor,
        *,
        device_arenas: dict[torch.device, torch.Tensor] | None = None,
        device_address: int | None = None,
        max_run_copies: int = MAX_RUN_COPIES,
        max_staging_bytes: int = MAX_STAGING_BYTES,
    ) -> None:
        if arena.dtype != torch.uint8 or arena.dim() != 1 or arena.device.type != "cpu":
            raise ValueError("arena must be a flat uint8 CPU tensor")
        self.arena = arena
        self.size = arena.numel()
        self.device_arenas = dict(device_arenas or {})
        self.device_address = device_address
        self.max_run_copies = max_run_copies
        self.max_staging_bytes = min(max_staging_bytes, self.size)  # a transfer fits the arena
        self._spare: list[torch.Tensor] = []  # idle CPU staging buffers (uint8)
        self._spare_lock = threading.Lock()

    @classmethod
    def for_array(cls, array: np.ndarray, **kwargs: Any) -> Mover:
        """A mover over an arena's numpy view (``HostArena.array()``, ``ArenaMapping.array()``)."""
        return cls(torch.from_numpy(array), **kwargs)

    def reach_pinned(self, start: int, alias_devices: Sequence[torch.device]) -> None:
        """The arena, from byte ``start`` on, was just registered (mapped) in this
        process: kernels reach it at its device address (the one-launch copy), and
        torch's kernels on ``alias_devices`` (c2c) through aliases of its host pointer."""
        first = pinning.device_address(self.arena.data_ptr() + start)
        self.device_address = None if first is None else first - start
        for device in alias_devices:
            try:
                self.device_arenas[device] = device_alias(self.arena, device)
            except Exception as exc:  # noqa: BLE001 - DMA copies serve instead
                log.warning("no direct arena access from %s: %s", device, exc)

    def _arena_on(self, device: torch.device) -> torch.Tensor | None:
        if device.type == "cpu":
            return self.arena
        return self.device_arenas.get(device)

    def _check(
        self, kv: KVCache, block_ids: Any, offsets: Sequence[int]
    ) -> tuple[torch.Tensor, int]:
        ids = kv.block_index(block_ids)
        if ids.numel() != len(offsets):
            raise InvalidArgument(f"{ids.numel()} block ids for {len(offsets)} slots")
        bb = kv.shape.block_bytes
        for off in offsets:
            if off < 0 or off + bb > self.size:
                raise InvalidArgument(
                    f"slot [{off}, {off + bb}) is outside the arena of {self.size} bytes"
                )
            if off % kv.tensors[0].element_size():
                raise InvalidArgument(f"slot offset {off} is not aligned to the KV dtype")
        return ids, bb

    def offload(
        self,
        kv: KVCache,
        block_ids: Any,
        offsets: Sequence[int],
        *,
        stream: Any = None,
        wait_current: bool = True,
    ) -> torch.cuda.Event | None:
        """Blocks ``block_ids[i]`` of ``kv`` -> the slot at ``offsets[i]``."""
        return self._move(kv, block_ids, offsets, True, stream, wait_current)

    def onboard(
        self,
        kv: KVCache,
        block_ids: Any,
        offsets: Sequence[int],
        *,
        stream: Any = None,
        wait_current: bool = True,
    ) -> torch.cuda.Event | None:
        """The slot at ``offsets[i]`` -> block ``block_ids[i]`` of ``kv``."""
        return self._move(kv, block_ids, offsets, False, stream, wait_current)

    def _move(
        self,
        kv: KVCache,
        block_ids: Any,
        offsets: Sequence[int],
        to_slots: bool,
        stream: Any,
        wait_current: bool,
    ) -> torch.cuda.Event | None:
        """Offload (``to_slots``) or onboard: straight between the blocks and the arena
        when it is mapped on the device and the slots are one run, else through a
        staging buffer on the device and one copy per run of slots."""
        ids, bb = self._check(kv, block_ids, offsets)
        n = len(offsets)
        if n == 0:
            return None
        one_launch = self._one_launch(kv, offsets)
        if one_launch is not None:
            kernel, pieces = one_launch
            with _on_stream(kv.device, stream, wait_current) as s:
                table = kernel.table(pieces, ids.numpy(), self._addresses(offsets), kv.device)
                kernel.launch(table, pieces, n, to_slots, s)
                return _record(s)
        runs = slot_runs(offsets, bb)
        with _on_stream(kv.device, stream, wait_current) as s:
            ids = ids.to(kv.device, non_blocking=True)
            near = self._arena_on(kv.device)
            if near is not None and len(runs) == 1:
                off = offsets[0]
                arena_run = near[off : off + n * bb].view(kv.shape.dtype)
                kv.gather(ids, arena_run) if to_slots else kv.scatter(ids, arena_run)
            else:
                with self._staging(n * bb, kv.device) as staging:
                    if to_slots:
                        kv.gather(ids, staging.view(kv.shape.dtype))
                        self._to_slots(staging.view(n, bb), offsets, runs, near)
                    else:
                        self._from_slots(staging.view(n, bb), offsets, runs, near)
                        kv.scatter(ids, staging.view(kv.shape.dtype))
            return _record(s)

    def onboard_layers(
        self,
        kv: KVCache,
        block_ids: Any,
        offsets: Sequence[int],
        *,
        stream: Any = None,
        wait_current: bool = True,
        blocks_per_sm: int = block_kernel.BLOCKS_PER_SM,
    ) -> list[torch.cuda.Event] | None:
        """Onboard layer after layer: one launch per layer on ``stream`` and an event
        recorded after each, so a model's layer ``i`` waits only for ``events[i]``
        (layer-wise loading: copies overlap the compute of earlier layers).

        None, with nothing done, where the one-launch kernel cannot run here (CPU, no
        CuPy, an arena kernels cannot reach): then :meth:`onboard_layer` moves one
        layer at a time through the torch path."""
        ids, _ = self._check(kv, block_ids, offsets)
        n = len(offsets)
        one_launch = self._one_launch(kv, offsets) if n else None
        if one_launch is None:
            return None
        kernel, pieces = one_launch
        per_layer = len(pieces.bases) // kv.shape.num_layers
        events: list[torch.cuda.Event] = []
        with _on_stream(kv.device, stream, wait_current) as s:
            table = kernel.table(pieces, ids.numpy(), self._addresses(offsets), kv.device)
            for layer in range(kv.shape.num_layers):
                kernel.launch(
                    table, pieces, n, False, s, layer * per_layer, per_layer, blocks_per_sm
                )
                event = _record(s)
                assert event is not None
                events.append(event)
        return events

    def onboard_layer(
        self,
        kv: KVCache,
        block_ids: Any,
        offsets: Sequence[int],
        layer: int,
        *,
        stream: Any = None,
        wait_current: bool = True,
    ) -> torch.cuda.Event | None:
        """The slots' layer ``layer`` -> that layer of blocks ``block_ids`` (the other
        layers are not touched): a one-layer cache over the layer's share of each slot."""
        if not 0 <= layer < kv.shape.num_layers:
            raise InvalidArgument(
                f"layer {layer} is outside the cache's layers 0..{kv.shape.num_layers - 1}"
            )
        share = kv.shape.block_bytes // kv.shape.num_layers
        shifted = [off + layer * share for off in offsets]
        return self._move(kv.layer(layer), block_ids, shifted, False, stream, wait_current)

    def _one_launch(
        self, kv: KVCache, offsets: Sequence[int]
    ) -> tuple[block_kernel.BlockKernel, KernelPieces] | None:
        """The kernel and the cache's pieces, where one launch can move this batch."""
        if kv.device.type != "cuda" or self.device_address is None:
            return None
        if any((self.device_address + off) % block_kernel.VECTOR for off in offsets):
            return None
        kernel = block_kernel.load()
        if kernel is None:
            return None
        pieces = kv.kernel_pieces()
        return None if pieces is None else (kernel, pieces)

    def _addresses(self, offsets: Sequence[int]) -> np.ndarray:
        assert self.device_address is not None
        return np.asarray(offsets, dtype=np.int64) + self.device_address

    @contextmanager
    def _staging(self, nbytes: int, device: torch.device) -> Iterator[torch.Tensor]:
        """A uint8 buffer of ``nbytes`` on ``device`` for the length of one transfer."""
        if device.type != "cpu":
            yield torch.empty(nbytes, dtype=torch.uint8, device=device)
            return
        with self._spare_lock:
            fits = [b for b in self._spare if b.numel() >= nbytes]
            buf = min(fits, key=lambda b: b.numel()) if fits else None
            if buf is not None:
                self._spare.remove(buf)
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        try:
            yield buf[:nbytes]
        finally:
            with self._spare_lock:
                self._spare.append(buf)
                self._spare.sort(key=lambda b: b.numel(), reverse=True)
                while sum(b.numel() for b in self._spare) > self.max_staging_bytes:
                    self._spare.pop(0)  # the largest goes first

    # staging <-> slots: per run (DMA, or few runs), else one indexed copy over rows

    def _to_slots(
        self,
        staging: torch.Tensor,
        offsets: Sequence[int],
        runs: list[Run],
        near: torch.Tensor | None,
    ) -> None:
        bb = staging.shape[1]
        if near is not None and len(runs) > self.max_run_copies:
            rows, index, unit = self._rows(near, offsets, bb, staging.device)
            if rows.device.type == "cpu":  # numpy: torch's CPU index_copy_ is elementwise
                rows.numpy()[index.numpy()] = staging.view(-1, unit).numpy()
            else:
                rows.index_copy_(0, index, staging.view(-1, unit))
            return
        arena = near if near is not None else self.arena
        async_copy = staging.device.type == "cuda"
        for run in runs:
            pos, count, off = run.pos, run.count, run.offset
            arena[off : off + count * bb].view(count, bb).copy_(
                staging[pos : pos + count], non_blocking=async_copy
            )

    def _from_slots(
        self,
        staging: torch.Tensor,
        offsets: Sequence[int],
        runs: list[Run],
        near: torch.Tensor | None,
    ) -> None:
        bb = staging.shape[1]
        if near is not None and len(runs) > self.max_run_copies:
            rows, index, unit = self._rows(near, offsets, bb, staging.device)
            torch.index_select(rows, 0, index, out=staging.view(-1, unit))
            return
        arena = near if near is not None else self.arena
        async_copy = staging.device.type == "cuda"
        for run in runs:
            pos, count, off = run.pos, run.count, run.offset
            staging[pos : pos + count].copy_(
                arena[off : off + count * bb].view(count, bb), non_blocking=async_copy
            )

    def _rows(
        self, arena: torch.Tensor, offsets: Sequence[int], bb: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The arena as rows of ``unit`` bytes (unit divides block_bytes and every offset)
        and the row numbers of the slots, in block order."""
        unit = math.gcd(bb, *offsets)
        per_block = bb // unit
        rows = arena[: (self.size // unit) * unit].view(-1, unit)
        starts = torch.as_tensor(offsets, dtype=torch.int64) // unit
        index = (starts[:, None] + torch.arange(per_block, dtype=torch.int64)[None, :]).reshape(-1)
        return rows, index.to(device, non_blocking=True), unit


def _record(stream: Any) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event
