"""GPU data paths of kvclient: copy KV blocks between an engine's cache and kvstored.

Two ways, one block byte layout (``[layers][K|V][kv_heads][tokens][head_dim]``, see
:mod:`kvstore.kv_caches`), so blocks written one way are read back the other:

Client-driven (DESIGN.md, path 2 with GPU tensors)::

    gpu = GpuClient(client)                      # maps (and CUDA-pins) the daemon's arena
    kv = PagedKV(vllm_layers)                    # or HFKV([(k, v), ...], block_tokens)
    gpu.offload(ns, tokens, kv, block_ids)       # Reserve -> gather + DMA -> Commit
    got = gpu.onboard(ns, tokens, kv, block_ids, stream=s, wait=False)
    torch.cuda.current_stream().wait_event(got.event)   # before attention reads them
    got.release()                                # after the event: ends the read lease

  The copies run on the caller's stream (default: the current stream); the copy
  stream first waits for the current stream, so blocks the model just wrote are
  complete. Offload waits for its event before Commit (a block becomes visible only
  once its bytes are in the arena). Onboard returns the event; the slots stay leased
  until :meth:`Onboarding.release` (``wait=True``, the default, does it at once).
  On CPU tensors every copy is done when the call returns and the event is None.

Daemon-driven (DESIGN.md, path 3)::

    reg = gpu.register(ns, kv)                   # CUDA: IPC handles; CPU: a SharedKV file
    reg.offload(tokens, block_ids)               # the daemon gathers on its own streams
    reg.onboard(tokens, block_ids)               # returns once the blocks are in kv
    reg.close()

  CUDA tensors are shared with ``storage._share_cuda_()`` (keep them alive while
  registered); CPU tensors must live in a shared file the daemon can map: allocate
  them with :meth:`SharedKV.paged` / :meth:`SharedKV.hf`. Before an offload the
  engine's writes must be complete: by default the client synchronizes the stream;
  ``ipc_event=True`` records an interprocess event the daemon's stream waits on.

Errors are :class:`kvclient.errors.KVStoreError` subclasses;
:class:`RegistrationError` when the daemon no longer knows a registration.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np
import torch

from kvclient.arena_path import ClientArena, SlotTable
from kvclient.errors import (
    ArenaUnavailableError,
    InvalidArgumentError,
    _error_kind,
    error_from_rpc,
)
from kvclient.integrations.gpu_daemon import (
    GpuInfo,
    OffloadResult,
    OnboardResult,
    Registration,
    RegistrationError,
    SharedKV,
    layout_message,
    validated_ids,
)
from kvclient.namespace import BlockLease, Namespace
from kvclient.payloads import as_tokens, check_cover
from kvclient.sync_client import KVClient
from kvclient.wire import ExtraKeys
from kvproto.v1 import gpu_pb2 as gpb
from kvproto.v1 import gpu_pb2_grpc as gpb_grpc
from kvproto.v1.results import PutResult
from kvstore import platform as kv_platform
from kvstore.errors import InvalidArgument
from kvstore.host import pinning
from kvstore.host.mapping import ArenaMapping
from kvstore.kv_caches import HFKV, KVCache, PagedKV
from kvstore.mover import Mover

log = logging.getLogger(__name__)

_R = TypeVar("_R")

__all__ = [
    "HFKV",
    "GpuClient",
    "GpuInfo",
    "KVCache",
    "LayerOnboarding",
    "OffloadResult",
    "OnboardResult",
    "Onboarding",
    "PagedKV",
    "Registration",
    "RegistrationError",
    "SharedKV",
    "layout_message",
]


class Onboarding:
    """A client-driven onboard in flight: ``event`` (CUDA) marks the end of the copies.

    The read lease on the slots is held until :meth:`release` (which first waits for
    the event). ``onboarded`` blocks were asked for: ``block_ids[:onboarded]``.
    """

    def __init__(
        self,
        release: Callable[[], None] | None,
        ready_blocks: int,
        onboarded: int,
        block_tokens: int,
        event: torch.cuda.Event | None,
    ) -> None:
        self._release = release
        self.ready_blocks = ready_blocks
        self.onboarded = onboarded
        self.tokens = onboarded * block_tokens
        self.event = event

    @property
    def released(self) -> bool:
        return self._release is None

    def release(self) -> None:
        """Wait for the copies, then end the lease. Idempotent."""
        release, self._release = self._release, None
        if self.event is not None:
            self.event.synchronize()
        if release is not None:
            release()

    def __enter__(self) -> Onboarding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LayerOnboarding:
    """A layer-wise onboard in flight (:meth:`GpuClient.onboard_layers`).

    ``wait(layer)`` before the model reads ``layer``: on CUDA the current stream waits
    for that layer's event (the host does not block); on CPU the layer is copied then.
    ``release()`` after the forward: loads what was never waited for, waits for the
    last copy and ends the read lease. ``onboarded`` blocks were asked for.
    """

    def __init__(
        self,
        release: Callable[[], None] | None,
        mover: Mover | None,
        kv: KVCache,
        block_ids: list[int],
        offsets: list[int],
        events: list[torch.cuda.Event] | None,
        ready_blocks: int,
        block_tokens: int,
    ) -> None:
        self._release = release
        self._mover = mover
        self._kv = kv
        self._block_ids = block_ids
        self._offsets = offsets
        self._events = events
        self._loaded: set[int] = set()
        self.ready_blocks = ready_blocks
        self.onboarded = len(offsets)
        self.tokens = self.onboarded * block_tokens

    def wait(self, layer: int) -> None:
        if self._events is not None:
            torch.cuda.current_stream(self._kv.device).wait_event(self._events[layer])
        else:
            self._load(layer)

    def _load(self, layer: int) -> None:
        if layer not in self._loaded and self._mover is not None and self._offsets:
            try:
                self._mover.onboard_layer(self._kv, self._block_ids, self._offsets, layer)
            except InvalidArgument as exc:
                raise InvalidArgumentError(str(exc)) from None
            self._loaded.add(layer)

    def release(self) -> None:
        """Complete every layer, then end the lease. Idempotent."""
        release, self._release = self._release, None
        if release is None:
            return
        try:
            if self._events is not None:
                self._events[-1].synchronize()  # the last launch: every copy before it
            else:
                for layer in range(self._kv.shape.num_layers):
                    self._load(layer)
        finally:
            release()

    def __enter__(self) -> LayerOnboarding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# -- the client -------------------------------------------------------------------------


def _check_kv(ns: Namespace, kv: KVCache) -> None:
    if kv.shape.block_bytes != ns.block_bytes or kv.shape.block_tokens != ns.block_tokens:
        raise InvalidArgumentError(
            f"KV blocks are {kv.shape.block_bytes} bytes of {kv.shape.block_tokens} tokens "
            f"({kv.shape.describe()}); namespace {ns.ns_id} stores {ns.block_bytes} bytes "
            f"of {ns.block_tokens} tokens"
        )


class GpuClient:
    """GPU data paths on top of one :class:`KVClient` (which it does not own)."""

    def __init__(self, client: KVClient, *, pin_arena: bool = True) -> None:
        self.client = client
        self.pin_arena = pin_arena
        self._stub = gpb_grpc.KVGpuStub(client.channel)
        self._lock = threading.Lock()
        self._arena: ClientArena | None = None
        self._mover: Mover | None = None
        # unpins, then unmaps: run by close, or when this client is collected unclosed, so
        # a registration never outlives its mapping (a later mapping at the same address
        # could not be pinned: cudaErrorHostMemoryAlreadyRegistered)
        self._release: weakref.finalize | None = None

    def close(self) -> None:
        """Unpin and unmap this client's arena mapping. Idempotent."""
        with self._lock:
            self._drop_arena()

    def __enter__(self) -> GpuClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drop_arena(self) -> None:
        release, self._release = self._release, None
        self._arena, self._mover = None, None
        if release is not None:
            release()

    def _call(self, method: Callable[..., _R], request: Any) -> _R:
        try:
            return method(request, timeout=self.client.timeout)
        except grpc.RpcError as exc:
            if _error_kind(exc) == "UnknownRegistration":
                details = exc.details() if callable(getattr(exc, "details", None)) else ""
                raise RegistrationError(
                    details or "unknown KV registration",
                    code=grpc.StatusCode.FAILED_PRECONDITION,
                    details=details,
                    addr=self.client.addr,
                ) from None
            raise error_from_rpc(exc, self.client.addr) from None

    # -- the arena, mapped and pinned in this process

    def _mover_for(self, kv: KVCache) -> Mover:
        with self._lock:
            if self._arena is not None and self._arena.is_current() and self._mover is not None:
                return self._mover
            self._drop_arena()
            info = self.client.server_info()
            arena = self.client.open_arena(info)
            if arena is None:
                raise ArenaUnavailableError(
                    f"the shared arena of kvstored at {self.client.addr} cannot be mapped "
                    f"here (arena {info.arena_path or 'not shared'})",
                    addr=self.client.addr,
                )
            mover = Mover.for_array(arena.mapping.array())
            unpin = None
            if self.pin_arena and torch.cuda.is_available():
                local = kv_platform.detect()
                pin = pinning.cuda_pin_hook(local.host_register_flags)
                start = arena.mapping.start  # a region handed out by fd starts there
                unpin = pin(arena.mapping.view(start, arena.mapping.size - start))
                if pin.pinned_bytes:
                    aliased = local.devices if local.direct_host_access else ()
                    mover.reach_pinned(start, [torch.device("cuda", d.index) for d in aliased])
            self._arena, self._mover = arena, mover
            self._release = weakref.finalize(self, _unpin_and_unmap, unpin, arena)
            return mover

    # -- client-driven copies

    def offload(
        self,
        ns: Namespace,
        tokens: Sequence[int] | np.ndarray,
        kv: KVCache,
        block_ids: Sequence[int],
        *,
        start: int = 0,
        priority: int | None = None,
        extra_keys: ExtraKeys = (),
        stream: Any = None,
    ) -> PutResult:
        """Store ``kv``'s blocks ``block_ids[i]`` as chain blocks ``start + i`` of ``tokens``:
        the namespace's one put path (kvclient.writes) with the blocks gathered and
        copied into the slots on ``stream``, waited for before the commit.
        """
        _check_kv(ns, kv)
        ids = validated_ids(kv, list(block_ids))
        blocks = _GpuBlocks(self._mover_for(kv), kv, ids, stream)
        result: PutResult = ns.put(tokens, blocks, start, priority, extra_keys=extra_keys)
        return result

    def onboard(
        self,
        ns: Namespace,
        tokens: Sequence[int] | np.ndarray,
        kv: KVCache,
        block_ids: Sequence[int],
        *,
        start: int = 0,
        extra_keys: ExtraKeys = (),
        stream: Any = None,
        wait: bool = True,
    ) -> Onboarding:
        """Copy the cached chain blocks ``start + i`` of ``tokens`` into ``block_ids[i]``.

        Acquire (``Namespace.acquire``) -> copy from the slots and scatter on ``stream``
        -> (``wait``: wait, Release). Only the ready prefix is copied:
        ``result.onboarded`` blocks.
        """
        got = self._acquire(ns, tokens, kv, block_ids, start, extra_keys)
        if got is None:
            return Onboarding(None, 0, 0, ns.block_tokens, None)
        mover, lease, ready, block_ids, offsets = got
        try:
            event = _moved(mover.onboard, kv, block_ids, offsets, stream) if offsets else None
        except BaseException:
            lease.release()
            raise
        result = Onboarding(lease.release, ready, len(offsets), ns.block_tokens, event)
        if wait or event is None:
            result.release()
        return result

    def onboard_layers(
        self,
        ns: Namespace,
        tokens: Sequence[int] | np.ndarray,
        kv: KVCache,
        block_ids: Sequence[int],
        *,
        start: int = 0,
        extra_keys: ExtraKeys = (),
        stream: Any = None,
    ) -> LayerOnboarding:
        """:meth:`onboard`, layer by layer: the model waits for each layer's copy just
        before it reads that layer (:meth:`LayerOnboarding.wait`), so copies of later
        layers overlap the compute of earlier ones.

        CUDA: every layer's copy is enqueued now on ``stream`` (give a side stream for
        overlap), one launch and one event per layer; without the one-launch kernel the
        whole batch is one onboard and every layer waits for its event. CPU: a layer is
        copied when it is first waited for. Call :meth:`LayerOnboarding.release` after
        the forward (it completes any layer not yet loaded, then ends the lease)."""
        got = self._acquire(ns, tokens, kv, block_ids, start, extra_keys)
        if got is None:
            return LayerOnboarding(None, None, kv, [], [], None, 0, ns.block_tokens)
        mover, lease, ready, block_ids, offsets = got
        events: list[torch.cuda.Event] | None = None
        try:
            if offsets and kv.device.type == "cuda":
                events = mover.onboard_layers(kv, block_ids, offsets, stream=stream)
                if events is None:  # no one-launch kernel here: the whole batch at once
                    event = _moved(mover.onboard, kv, block_ids, offsets, stream)
                    assert event is not None
                    events = [event] * kv.shape.num_layers
        except BaseException:
            lease.release()
            raise
        return LayerOnboarding(
            lease.release, mover, kv, block_ids, offsets, events, ready, ns.block_tokens
        )

    def _acquire(
        self,
        ns: Namespace,
        tokens: Sequence[int] | np.ndarray,
        kv: KVCache,
        block_ids: Sequence[int],
        start: int,
        extra_keys: ExtraKeys,
    ) -> tuple[Mover, BlockLease, int, list[int], list[int]] | None:
        """Acquire the ready prefix of chain blocks ``start ..``: (mover, lease, ready
        blocks, the cache's block ids and the slot offsets to copy); None: none asked."""
        arr = as_tokens(tokens)
        ids = list(block_ids)
        check_cover(arr, ns.block_tokens, start, len(ids))
        _check_kv(ns, kv)
        validated_ids(kv, ids)
        if not ids:
            return None
        mover = self._mover_for(kv)
        n = start + len(ids)
        lease = ns.acquire(
            arr[: n * ns.block_tokens], extra_keys=extra_keys, max_blocks=len(ids), start=start
        )
        table = lease.slots  # (blocks start .. of the chain: the lease's window)
        return mover, lease, start + len(table), ids[: len(table)], table.offsets.tolist()

    # -- daemon-driven copies

    def info(self) -> GpuInfo:
        reply = self._call(self._stub.GpuInfo, gpb.GpuInfoRequest())
        devices = tuple(
            f"cuda:{d.index} {d.name} ({d.profile}, numa "
            f"{d.numa_node if d.numa_node >= 0 else '?'})"
            for d in reply.devices
        )
        return GpuInfo(reply.platform, devices, reply.arena_pinned, reply.registrations)

    def register(self, ns: Namespace | str, kv: KVCache | SharedKV) -> Registration:
        """Hand ``kv`` to the daemon; keep its tensors alive until ``close()``."""
        cache = kv.kv if isinstance(kv, SharedKV) else kv
        if isinstance(ns, Namespace):
            _check_kv(ns, cache)
        ns_id = ns.ns_id if isinstance(ns, Namespace) else ns
        request = gpb.RegisterKVRequest(
            ns_id=ns_id, layout=layout_message(kv), client_pid=os.getpid()
        )
        reply = self._call(self._stub.RegisterKV, request)
        return Registration(self, reply, cache, kv)


class _GpuBlocks:
    """KV blocks of a GPU (or CPU) cache as a put's SlotWriter (kvclient.writes)."""

    def __init__(self, mover: Mover, kv: KVCache, ids: list[int], stream: Any) -> None:
        self._mover = mover
        self._kv = kv
        self._ids = ids
        self._stream = stream

    def __len__(self) -> int:
        return len(self._ids)

    def write(self, mapping: ArenaMapping, slots: SlotTable, first_index: int) -> None:
        """Gather and copy the blocks into the slots (through this process's pinned
        mapping of the same arena: the offsets are the same), then wait for the copy."""
        ids = [self._ids[int(i) - first_index] for i in slots.indices]
        event = _moved(self._mover.offload, self._kv, ids, slots.offsets.tolist(), self._stream)
        if event is not None:
            event.synchronize()


def _unpin_and_unmap(unpin: Callable[[], None] | None, arena: ClientArena) -> None:
    if unpin is not None:
        unpin()
    arena.close()


def _moved(
    move: Callable[..., torch.cuda.Event | None],
    kv: KVCache,
    block_ids: list[int],
    offsets: list[int],
    stream: Any,
) -> torch.cuda.Event | None:
    try:
        return move(kv, block_ids, offsets, stream=stream)
    except InvalidArgument as exc:
        raise InvalidArgumentError(str(exc)) from None
