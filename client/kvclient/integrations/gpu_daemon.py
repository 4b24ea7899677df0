"""The daemon-driven GPU path of kvclient (:mod:`kvclient.integrations.gpu`, path 3 of
DESIGN.md): a KV cache registered with the daemon (CUDA IPC handles, or a shared-memory
file for CPU tensors: :class:`SharedKV`), then Offload / Onboard by block ids
(:class:`Registration`), the daemon copying on its own streams; and the results of
both GPU paths' calls."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvclient.errors import InvalidArgumentError, KVStoreError
from kvclient.payloads import as_tokens, check_cover, check_priority
from kvclient.wire import ExtraKeys, extra_bytes
from kvproto.v1 import gpu_pb2 as gpb
from kvstore.errors import InvalidArgument
from kvstore.kv_caches import DTYPE_NAMES, HFKV, KVCache, PagedKV

if TYPE_CHECKING:
    from kvclient.integrations.gpu import GpuClient


class RegistrationError(KVStoreError):
    """The daemon does not know this KV registration (unregistered, or it restarted)."""


# -- results ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuInfo:
    platform: str  # "cpu-only" | "pcie" | "c2c"
    devices: tuple[str, ...]  # "cuda:0 NVIDIA H100 80GB HBM3 (pcie, numa 0)"
    arena_pinned: bool
    registrations: int


@dataclass(frozen=True, slots=True)
class OffloadResult:
    stored: int  # copied and committed
    existing: int  # already stored: not copied
    refused: int  # no room, or another owner computes them
    out_of_space: bool
    bytes: int
    copy_s: float  # the daemon's gather + copy time


@dataclass(frozen=True, slots=True)
class OnboardResult:
    ready_blocks: int  # ready prefix in the store (from block 0, up to what was asked)
    onboarded: int  # block_ids[:onboarded] now hold chain blocks start .. start+onboarded
    ready_tokens: int
    bytes: int
    copy_s: float


def validated_ids(kv: KVCache, ids: list[int]) -> list[int]:
    try:
        kv.block_index(ids)
    except InvalidArgument as exc:
        raise InvalidArgumentError(str(exc)) from None
    return [int(i) for i in ids]


# -- KV caches in shared memory (CPU, daemon-driven) --------------------------------------


def _shm_dir(directory: str | None) -> str:
    if directory:
        return directory
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    import tempfile

    return tempfile.gettempdir()


class SharedKV:
    """A KV cache whose tensors live in one shared-memory file the daemon maps.

    ``storage`` is the whole file as a flat tensor of the KV dtype; ``kv.tensors`` are
    views of it. :meth:`close` unlinks the file (mappings stay valid until dropped).
    """

    def __init__(self, path: str, storage: torch.Tensor, kv: KVCache) -> None:
        ptr = storage.untyped_storage().data_ptr()
        for t in kv.tensors:
            if t.device.type != "cpu" or t.untyped_storage().data_ptr() != ptr:
                raise InvalidArgumentError("every KV tensor must be a view of the shared file")
        self.path = path
        self.storage = storage
        self.kv = kv

    @staticmethod
    def allocate(
        numel: int, dtype: torch.dtype, directory: str | None = None
    ) -> tuple[str, torch.Tensor]:
        """A new owner-only file of ``numel`` zeroed elements, mapped shared."""
        name = f"kvstore-kv-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"
        path = os.path.join(_shm_dir(directory), name)
        size = numel * torch.empty((), dtype=dtype).element_size()
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return path, torch.from_file(path, shared=True, size=numel, dtype=dtype)

    @classmethod
    def paged(
        cls,
        num_layers: int,
        num_blocks: int,
        block_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        *,
        directory: str | None = None,
    ) -> SharedKV:
        """vLLM-shaped: layer ``l`` is ``storage[l]`` of ``[L, 2, NB, T, H, D]``."""
        shape = (num_layers, 2, num_blocks, block_tokens, num_kv_heads, head_dim)
        path, storage = cls.allocate(int(np.prod(shape)), dtype, directory)
        stacked = storage.view(shape)
        return cls(path, storage, PagedKV([stacked[i] for i in range(num_layers)]))

    @classmethod
    def hf(
        cls,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        seq: int,
        head_dim: int,
        block_tokens: int,
        dtype: torch.dtype = torch.bfloat16,
        *,
        directory: str | None = None,
    ) -> SharedKV:
        """HF-shaped: layer ``l`` is ``(storage[l, 0], storage[l, 1])`` of
        ``[L, 2, B, H, S, D]``."""
        shape = (num_layers, 2, batch, num_kv_heads, seq, head_dim)
        path, storage = cls.allocate(int(np.prod(shape)), dtype, directory)
        stacked = storage.view(shape)
        pairs = [(stacked[i, 0], stacked[i, 1]) for i in range(num_layers)]
        return cls(path, storage, HFKV(pairs, block_tokens))

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> SharedKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def layout_message(kv: KVCache | SharedKV) -> gpb.KVLayout:
    """The RegisterKV layout descriptor: shapes, strides, and where the memory is."""
    shm_path = ""
    if isinstance(kv, SharedKV):
        shm_path, kv = kv.path, kv.kv
    s = kv.shape
    device = kv.device.type
    if device == "cpu" and not shm_path:
        raise InvalidArgumentError(
            "CPU tensors must live in a shared file the daemon can map: use SharedKV"
        )
    if device not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"KV tensors on {kv.device} cannot be registered")
    tensors = []
    for t in kv.tensors:
        msg = gpb.KVTensor(
            shape=list(t.shape), stride=list(t.stride()), storage_offset=t.storage_offset()
        )
        if device == "cuda":
            msg.cuda.CopyFrom(_share_cuda(t))
        tensors.append(msg)
    return gpb.KVLayout(
        kind=gpb.KV_LAYOUT_PAGED if kv.kind == "paged" else gpb.KV_LAYOUT_HF,
        num_layers=s.num_layers,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        block_tokens=s.block_tokens,
        dtype=DTYPE_NAMES[s.dtype],
        device=device,
        shm_path=shm_path,
        tensors=tensors,
    )


def _share_cuda(t: torch.Tensor) -> gpb.CudaIpcStorage:
    """IPC fields of a CUDA tensor's storage (torch's own sharing; untested here)."""
    (
        device,
        handle,
        size_bytes,
        offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = t.untyped_storage()._share_cuda_()
    msg = gpb.CudaIpcStorage(
        device=int(device),
        handle=bytes(handle),
        storage_size_bytes=int(size_bytes),
        storage_offset_bytes=int(offset_bytes),
        ref_counter_offset=int(ref_counter_offset),
        event_sync_required=bool(event_sync_required),
    )
    if ref_counter_handle is not None:
        msg.ref_counter_handle = bytes(ref_counter_handle)
    if event_handle is not None:
        msg.event_handle = bytes(event_handle)
    msg.device_uuid = str(torch.cuda.get_device_properties(int(device)).uuid)
    return msg


class Registration:
    """One KV cache registered with the daemon: Offload/Onboard by block ids."""

    def __init__(
        self,
        gpu: GpuClient,
        reply: gpb.RegisterKVResponse,
        kv: KVCache,
        owner: KVCache | SharedKV,
    ) -> None:
        self._gpu = gpu
        self.reply = reply  # the daemon's view: ns_id, block_bytes, num_blocks, stacked
        self.registration_id = reply.registration_id
        self.block_tokens = kv.shape.block_tokens
        self.kv = kv
        self._owner = owner  # keeps the tensors (and their IPC exports) alive
        self._closed = False

    def offload(
        self,
        tokens: Sequence[int] | np.ndarray,
        block_ids: Sequence[int],
        *,
        start: int = 0,
        priority: int | None = None,
        extra_keys: ExtraKeys = (),
        stream: Any = None,
        ipc_event: bool = False,
    ) -> OffloadResult:
        """The daemon copies blocks ``block_ids[i]`` to chain blocks ``start + i``."""
        arr = as_tokens(tokens)
        ids = validated_ids(self.kv, list(block_ids))
        check_cover(arr, self.block_tokens, start, len(ids))
        check_priority(priority)
        request = gpb.OffloadRequest(
            registration_id=self.registration_id,
            tokens=arr[: (start + len(ids)) * self.block_tokens].tolist(),
            extra_keys=extra_bytes(extra_keys),
            start_block=start,
            block_ids=ids,
            priority=priority,
        )
        event = None
        if self.kv.device.type == "cuda":
            with torch.cuda.device(self.kv.device):
                s = stream if stream is not None else torch.cuda.current_stream()
                if ipc_event:  # the daemon's stream waits; this thread does not
                    event = torch.cuda.Event(interprocess=True)
                    event.record(s)
                    request.wait_event = bytes(event.ipc_handle())
                else:
                    s.synchronize()
        reply = self._gpu._call(self._gpu._stub.Offload, request)
        del event  # kept alive until the daemon has waited on it
        return OffloadResult(
            reply.stored,
            reply.existing,
            reply.refused,
            reply.out_of_space,
            reply.bytes,
            reply.copy_s,
        )

    def onboard(
        self,
        tokens: Sequence[int] | np.ndarray,
        block_ids: Sequence[int],
        *,
        start: int = 0,
        extra_keys: ExtraKeys = (),
    ) -> OnboardResult:
        """The daemon copies the ready chain blocks ``start + i`` into ``block_ids[i]``;
        they are in the cache when this returns."""
        arr = as_tokens(tokens)
        ids = validated_ids(self.kv, list(block_ids))
        check_cover(arr, self.block_tokens, start, len(ids))
        request = gpb.OnboardRequest(
            registration_id=self.registration_id,
            tokens=arr[: (start + len(ids)) * self.block_tokens].tolist(),
            extra_keys=extra_bytes(extra_keys),
            start_block=start,
            block_ids=ids,
        )
        reply = self._gpu._call(self._gpu._stub.Onboard, request)
        return OnboardResult(
            reply.ready_blocks, reply.onboarded, reply.ready_tokens, reply.bytes, reply.copy_s
        )

    def close(self) -> None:
        """UnregisterKV. Idempotent; a daemon that forgot it already is fine."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RegistrationError):
            self._gpu._call(
                self._gpu._stub.UnregisterKV,
                gpb.UnregisterKVRequest(registration_id=self.registration_id),
            )

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
