"""The kvstore.v1.KVGpu servicer: daemon-driven copies between an engine's KV cache and
the host arena (DESIGN.md, data path 3; wire contract in proto/kvproto/v1/gpu.proto).

Life of a registration::

    RegisterKV(ns_id, layout)     map the engine's tensors into this process:
                                    CUDA: open each storage's IPC handle (torch's
                                          rebuild_cuda_tensor, the inverse of
                                          storage._share_cuda_());
                                    CPU:  mmap the layout's shm file MAP_SHARED;
                                  check the layout against the namespace -> an id
    Offload(id, tokens, ids)      keys -> Store.reserve -> Mover.offload on the
                                  device's offload stream -> event.synchronize()
                                  -> Store.commit (Store.abandon if anything fails)
    Onboard(id, tokens, ids)      keys -> Store.acquire -> Mover.onboard on the
                                  onboard stream -> event.synchronize() -> release
    UnregisterKV(id) / the engine process exits / the daemon stops: the mapping goes

Each transfer runs on a pool thread of this service (not the KVStore pool), so slow
copies never hold up control calls. Offload and onboard have a CUDA stream each per
device, so a prefetch never waits behind a large offload; every transfer records its
own event and the answer is sent when that event has completed. torch is imported on
the first call that needs it, not at start-up: a daemon that never sees a GPU client
never pays for it.

Registrations whose ``client_pid`` is gone are dropped on the next call and by a sweep
every few seconds: an IPC mapping held here would otherwise keep a dead engine's GPU
memory allocated. A pid this process cannot see at RegisterKV (the engine runs in
another PID namespace) is not watched: that registration lives until UnregisterKV.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import mmap
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kvproto.v1 import gpu_pb2 as gpb
from kvproto.v1 import gpu_pb2_grpc as gpb_grpc
from kvstore.errors import InvalidArgument, LeaseError
from kvstore.host.pinning import CudaPin
from kvstore.keys import NamespaceSpec
from kvstore.platform import PlatformInfo
from kvstore.store import Store
from kvstored import convert
from kvstored.auth import Access, Caller
from kvstored.config import DaemonConfig
from kvstored.errors import grpc_errors
from kvstored.log_limits import LIMITED
from kvstored.names import NamespaceNames

if TYPE_CHECKING:
    import torch

    from kvstore.kv_caches import KVCache
    from kvstore.mover import Mover

log = logging.getLogger("kvstored.gpu")

T = TypeVar("T")

MAX_REGISTRATIONS = 256
SWEEP_INTERVAL_S = 5.0


class UnknownRegistration(LeaseError):
    """The registration id is unknown, unregistered, or its engine process is gone
    (FAILED_PRECONDITION, kvstore-error = UnknownRegistration)."""


@dataclass(eq=False)
class Registration:
    registration_id: int
    spec: NamespaceSpec
    kv: KVCache
    client_pid: int
    device: str  # "cpu" | "cuda:N"
    _closers: list[Callable[[], None]] = field(default_factory=list)
    busy: int = 0

    def alive(self) -> bool:
        return self.client_pid <= 0 or pid_exists(self.client_pid)

    def close(self) -> None:
        self.kv = None  # type: ignore[assignment]  # drop the tensors before unmapping
        for closer in reversed(self._closers):
            try:
                closer()
            except Exception:  # noqa: BLE001 - best effort at teardown
                log.debug("closing registration %d", self.registration_id, exc_info=True)
        self._closers.clear()


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


# -- building the KV view from the wire --------------------------------------------------


def _extent(shape: list[int], stride: list[int]) -> int:
    """Elements spanned by a strided tensor (0 when it is empty)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))


def _tensor_fields(i: int, msg: gpb.KVTensor) -> tuple[list[int], list[int], int]:
    shape, stride = list(msg.shape), list(msg.stride)
    if not shape or len(shape) != len(stride):
        raise InvalidArgument(
            f"tensors[{i}]: shape {shape} and stride {stride} must be non-empty and of one length"
        )
    if any(s < 0 for s in shape) or any(st < 0 for st in stride):
        raise InvalidArgument(f"tensors[{i}]: negative shape or stride")
    return shape, stride, int(msg.storage_offset)


def _map_file(path: str, closers: list[Callable[[], None]]) -> torch.Tensor:
    """The whole file as a uint8 tensor over a MAP_SHARED mapping."""
    import torch

    if not path:
        raise InvalidArgument("layout.shm_path is required for CPU tensors")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidArgument(f"cannot open layout.shm_path {path!r}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            raise InvalidArgument(f"layout.shm_path {path!r} is not a non-empty regular file")
        region = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)

    def unmap() -> None:
        try:
            region.close()
        except BufferError:  # a tensor still exports it: unmapped when that is collected
            log.debug("mapping of %s still in use; unmapped later", path)

    closers.append(unmap)
    return torch.frombuffer(region, dtype=torch.uint8)


def _cpu_tensors(
    layout: gpb.KVLayout, dtype: torch.dtype, closers: list[Callable[[], None]]
) -> list[torch.Tensor]:
    raw = _map_file(layout.shm_path, closers)
    size = torch_element_size(dtype)
    base = raw[: (raw.numel() // size) * size].view(dtype)
    out = []
    for i, msg in enumerate(layout.tensors):
        shape, stride, offset = _tensor_fields(i, msg)
        end = offset + _extent(shape, stride)
        if end > base.numel():
            raise InvalidArgument(
                f"tensors[{i}] spans elements [{offset}, {end}) but {layout.shm_path} holds "
                f"{base.numel()} elements of {layout.dtype}"
            )
        out.append(base.as_strided(shape, stride, offset))
    return out


def torch_element_size(dtype: torch.dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _cuda_tensors(layout: gpb.KVLayout, dtype: torch.dtype) -> list[torch.Tensor]:
    """Open each tensor's storage from its IPC handle (written for CUDA; untested here)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    out = []
    esize = torch_element_size(dtype)
    for i, msg in enumerate(layout.tensors):
        shape, stride, offset = _tensor_fields(i, msg)
        ipc = msg.cuda
        if not ipc.handle:
            raise InvalidArgument(f"tensors[{i}].cuda.handle is required for CUDA tensors")
        device = _local_device(ipc.device, ipc.device_uuid)
        end = offset + _extent(shape, stride)
        if end * esize > ipc.storage_size_bytes:
            raise InvalidArgument(
                f"tensors[{i}] spans {end * esize} bytes of a {ipc.storage_size_bytes}-byte storage"
            )
        tensor = rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(shape),
            tuple(stride),
            offset,
            torch.storage.TypedStorage,
            dtype,
            device,
            ipc.handle,
            ipc.storage_size_bytes,
            ipc.storage_offset_bytes,
            False,
            ipc.ref_counter_handle if ipc.HasField("ref_counter_handle") else None,
            ipc.ref_counter_offset,
            ipc.event_handle if ipc.HasField("event_handle") else None,
            ipc.event_sync_required,
        )
        out.append(tensor)
    return out


def _local_device(index: int, uuid: str) -> int:
    """This process's index of the engine's device (by UUID when the engine sent one)."""
    import torch

    if not uuid:
        return index
    for local in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(local).uuid) == uuid:
            return local
    raise InvalidArgument(
        f"CUDA device {uuid} (the engine's cuda:{index}) is not visible to the daemon: "
        "give it the same GPUs (CUDA_VISIBLE_DEVICES)"
    )


def build_kv(layout: gpb.KVLayout, closers: list[Callable[[], None]]) -> KVCache:
    """The engine's KV cache, mapped into this process, as a mover KVCache."""
    from kvstore.kv_caches import HFKV, PagedKV, dtype_of

    dtype = dtype_of(layout.dtype)
    if layout.device == "cpu":
        tensors = _cpu_tensors(layout, dtype, closers)
    elif layout.device == "cuda":
        tensors = _cuda_tensors(layout, dtype)
    else:
        raise InvalidArgument(f"layout.device must be 'cpu' or 'cuda', got {layout.device!r}")
    L = layout.num_layers
    if layout.kind == gpb.KV_LAYOUT_PAGED:
        if len(tensors) == 1 and tensors[0].dim() == 6:
            kv: KVCache = PagedKV(tensors[0])
        elif len(tensors) == L:
            kv = PagedKV(tensors)
        else:
            raise InvalidArgument(
                f"paged layout: expected {L} layer tensors or one stacked tensor, "
                f"got {len(tensors)}"
            )
    elif layout.kind == gpb.KV_LAYOUT_HF:
        if len(tensors) == 1 and tensors[0].dim() == 6:
            kv = HFKV(tensors[0], layout.block_tokens)
        elif len(tensors) == 2 * L:
            pairs = [(tensors[2 * i], tensors[2 * i + 1]) for i in range(L)]
            kv = HFKV(pairs, layout.block_tokens)
        else:
            raise InvalidArgument(
                f"HF layout: expected {2 * L} K/V tensors or one stacked tensor, "
                f"got {len(tensors)}"
            )
    else:
        raise InvalidArgument(f"layout.kind must be PAGED or HF, got {layout.kind}")
    declared = (L, layout.num_kv_heads, layout.head_dim, layout.block_tokens, dtype)
    s = kv.shape
    if (s.num_layers, s.num_kv_heads, s.head_dim, s.block_tokens, s.dtype) != declared:
        raise InvalidArgument(
            f"tensors make blocks of {s.describe()}, but the layout declares layers={L}, "
            f"kv_heads={layout.num_kv_heads}, head_dim={layout.head_dim}, "
            f"block_tokens={layout.block_tokens}, {layout.dtype}"
        )
    return kv


# -- the servicer --------------------------------------------------------------------------


class KVGpuService(gpb_grpc.KVGpuServicer):
    """Servicer for ``kvstore.v1.KVGpu``; owns its registrations, pool and streams."""

    def __init__(
        self,
        store: Store,
        config: DaemonConfig,
        names: NamespaceNames,
        platform: PlatformInfo,
        pin: CudaPin | None,
        access: Access,
    ) -> None:
        self._store = store
        self._names = names
        self._access = access
        self._platform = platform
        self._pin = pin
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="kv-gpu")
        self._lock = threading.Lock()
        self._registrations: dict[int, Registration] = {}
        self._mover: Mover | None = None
        self._streams: dict[str, tuple[Any, Any]] = {}  # device -> (offload, onboard)
        self._sweeper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def close(self) -> None:
        """Drop every registration and the arena view; waits for running transfers.
        May run on any thread (the server calls it through ``asyncio.to_thread``)."""
        if self._sweeper is not None and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed already
                self._loop.call_soon_threadsafe(self._sweeper.cancel)
        self._pool.shutdown(wait=True)
        with self._lock:
            self._closed = True
            regs = list(self._registrations.values())
            self._registrations.clear()
            self._mover = None
            self._streams.clear()
        for reg in regs:
            reg.close()

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    # --- helpers (pool threads) -------------------------------------------------------

    def _mover_for(self) -> Mover:
        with self._lock:
            if self._mover is None:
                from kvstore.mover import Mover

                mover = Mover.for_array(self._store.arena.array())
                if self._pin and self._pin.pinned_bytes:
                    aliased = self._platform.devices if self._platform.direct_host_access else ()
                    mover.reach_pinned(0, [_torch_device(f"cuda:{d.index}") for d in aliased])
                self._mover = mover
            return self._mover

    def _streams_for(self, device: str) -> tuple[Any, Any]:
        """(offload stream, onboard stream) of a CUDA device; (None, None) on CPU."""
        if device == "cpu":
            return None, None
        with self._lock:
            pair = self._streams.get(device)
            if pair is None:
                import torch

                dev = torch.device(device)
                pair = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))
                self._streams[device] = pair
            return pair

    def _registration(self, registration_id: int, caller: Caller) -> Registration:
        with self._lock:
            reg = self._registrations.get(registration_id)
            if reg is None or self._closed or not caller.owns(reg.spec):
                raise UnknownRegistration(f"unknown KV registration {registration_id}")
            if not reg.alive():
                del self._registrations[registration_id]
            else:
                reg.busy += 1
                return reg
        self._close_later(reg)
        raise UnknownRegistration(
            f"KV registration {registration_id}: its process {reg.client_pid} is gone"
        )

    def _done(self, reg: Registration) -> None:
        with self._lock:
            reg.busy -= 1

    def _close_later(self, reg: Registration) -> None:
        """Close a removed registration once no transfer uses it."""
        def close_when_idle() -> None:
            while True:
                with self._lock:
                    if reg.busy == 0:
                        break
                time.sleep(0.01)
            reg.close()
            LIMITED.info(log, "gpu_registration_closed", "KV registration %d closed",
                         reg.registration_id)

        threading.Thread(target=close_when_idle, name="kv-gpu-close", daemon=True).start()

    def sweep(self) -> int:
        """Drop registrations whose process is gone; returns how many."""
        with self._lock:
            dead = [r for r in self._registrations.values() if not r.alive()]
            for reg in dead:
                del self._registrations[reg.registration_id]
        for reg in dead:
            LIMITED.info(
                log, "gpu_registration_gone", "KV registration %d: process %d is gone, "
                "dropping it", reg.registration_id, reg.client_pid,
            )  # fmt: skip
            self._close_later(reg)
        return len(dead)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            await self._run(self.sweep)

    # --- RPCs ---------------------------------------------------------------------------

    @grpc_errors
    async def GpuInfo(
        self, request: gpb.GpuInfoRequest, context: grpc.aio.ServicerContext
    ) -> gpb.GpuInfoResponse:
        self._access.caller(context)
        devices = [
            gpb.GpuDevice(
                index=d.index,
                name=d.name,
                compute_capability_major=d.compute_capability[0],
                compute_capability_minor=d.compute_capability[1],
                total_memory=d.total_memory,
                pci_bus_id=d.pci_bus_id,
                numa_node=-1 if d.numa_node is None else d.numa_node,
                profile=d.profile().value,
            )
            for d in self._platform.devices
        ]
        with self._lock:
            count = len(self._registrations)
        return gpb.GpuInfoResponse(
            platform=self._platform.profile.value,
            devices=devices,
            arena_pinned=bool(self._pin and self._pin.pinned_bytes),
            registrations=count,
        )

    @grpc_errors
    async def RegisterKV(
        self, request: gpb.RegisterKVRequest, context: grpc.aio.ServicerContext
    ) -> gpb.RegisterKVResponse:
        caller = self._access.caller(context)
        layout = request.layout
        if layout.device == "cuda" and not self._platform.has_cuda:
            raise InvalidArgument(
                f"this daemon runs cpu-only ({self._platform.reason or 'no CUDA'}): "
                "register CPU tensors in a shared file, or copy client-side"
            )
        if self._sweeper is None:
            self._loop = asyncio.get_running_loop()
            self._sweeper = self._loop.create_task(self._sweep_forever())

        def register() -> gpb.RegisterKVResponse:
            spec = self._access.spec(request.ns_id, caller)
            try:
                import torch  # noqa: F401
            except ImportError:
                raise InvalidArgument(
                    "this kvstored has no torch: daemon-driven copies need it (copy "
                    "client-side with kvclient.integrations.gpu, or install torch for the daemon)"
                ) from None
            with self._lock:
                if len(self._registrations) >= MAX_REGISTRATIONS:
                    raise InvalidArgument(
                        f"{MAX_REGISTRATIONS} KV registrations exist: unregister unused ones"
                    )
            closers: list[Callable[[], None]] = []
            try:
                kv = build_kv(layout, closers)
                kv.shape.check_spec(spec)
            except BaseException:
                for closer in closers:
                    closer()
                raise
            pid = request.client_pid
            if pid and not pid_exists(pid):
                # another PID namespace (a sidecar without a shared process namespace):
                # the daemon cannot watch it; the registration lives until UnregisterKV
                LIMITED.info(log, "gpu_pid_unseen", "pid %d is not visible here: its "
                             "registration is not tracked", pid)
                pid = 0
            with self._lock:
                rid = secrets.randbits(62) + 1
                while rid in self._registrations:
                    rid = secrets.randbits(62) + 1
                reg = Registration(rid, spec, kv, pid, str(kv.device), closers)
                self._registrations[rid] = reg
            LIMITED.info(
                log, "gpu_registration",
                "KV registration %d: %s %s on %s, %d blocks, namespace %s, pid %d",
                rid, kv.kind, kv.shape.describe(), kv.device, kv.num_blocks, spec.ns_id,
                request.client_pid,
            )  # fmt: skip
            return gpb.RegisterKVResponse(
                registration_id=rid,
                ns_id=spec.ns_id,
                block_bytes=spec.block_bytes,
                num_blocks=kv.num_blocks,
                stacked=kv.stacked,
                platform=self._platform.profile.value,
            )

        return await self._run(register)

    @grpc_errors
    async def UnregisterKV(
        self, request: gpb.UnregisterKVRequest, context: grpc.aio.ServicerContext
    ) -> gpb.UnregisterKVResponse:
        caller = self._access.caller(context)
        with self._lock:
            reg = self._registrations.get(request.registration_id)
            if reg is not None and caller.owns(reg.spec):
                del self._registrations[request.registration_id]
            else:
                reg = None
        if reg is None:
            raise UnknownRegistration(f"unknown KV registration {request.registration_id}")
        self._close_later(reg)
        return gpb.UnregisterKVResponse()

    @grpc_errors
    async def Offload(
        self, request: gpb.OffloadRequest, context: grpc.aio.ServicerContext
    ) -> gpb.OffloadResponse:
        caller = self._access.caller(context)
        prio = convert.priority(request.priority) if request.HasField("priority") else None
        return await self._run(self._offload, request, prio, caller)

    def _offload(
        self, request: gpb.OffloadRequest, prio: int | None, caller: Caller
    ) -> gpb.OffloadResponse:
        reg = self._registration(request.registration_id, caller)
        try:
            ns_id = reg.spec.ns_id
            start, n = request.start_block, len(request.block_ids)
            keys = self._chain(reg, request.tokens, request.extra_keys, start, n)
            reg.kv.block_index(request.block_ids)  # refuse bad ids before reserving
            res = self._store.reserve(ns_id, keys, start, priority=prio)
            stored, copy_s = 0, 0.0
            if res.slots:
                try:
                    block_ids = [request.block_ids[s.index - start] for s in res.slots]
                    offsets = [s.offset for s in res.slots]
                    stream, _ = self._streams_for(reg.device)
                    began = time.perf_counter()
                    if request.wait_event and stream is not None:
                        _wait_ipc_event(stream, reg.device, request.wait_event)
                    event = self._mover_for().offload(
                        reg.kv, block_ids, offsets, stream=stream, wait_current=False
                    )
                    if event is not None:
                        event.synchronize()
                    copy_s = time.perf_counter() - began
                    stored = self._store.commit(res.lease_id)
                except BaseException:
                    with contextlib.suppress(LeaseError):
                        self._store.abandon(res.lease_id)
                    raise
            return gpb.OffloadResponse(
                stored=stored,
                existing=res.existing,
                refused=res.refused + len(res.slots) - stored,
                out_of_space=res.out_of_space,
                bytes=stored * reg.spec.block_bytes,
                copy_s=copy_s,
            )
        finally:
            self._done(reg)

    @grpc_errors
    async def Onboard(
        self, request: gpb.OnboardRequest, context: grpc.aio.ServicerContext
    ) -> gpb.OnboardResponse:
        caller = self._access.caller(context)
        return await self._run(self._onboard, request, caller)

    def _onboard(self, request: gpb.OnboardRequest, caller: Caller) -> gpb.OnboardResponse:
        reg = self._registration(request.registration_id, caller)
        try:
            start, n = request.start_block, len(request.block_ids)
            keys = self._chain(reg, request.tokens, request.extra_keys, start, n)
            reg.kv.block_index(request.block_ids)
            self._store.pull(reg.spec.ns_id, keys)  # far tiers first: may wait (a pool thread)
            got = self._store.acquire(reg.spec.ns_id, keys)
            copy_s = 0.0
            try:
                slots = [s for s in got.slots if s.index >= start]
                if slots:
                    _, stream = self._streams_for(reg.device)
                    began = time.perf_counter()
                    event = self._mover_for().onboard(
                        reg.kv,
                        [request.block_ids[s.index - start] for s in slots],
                        [s.offset for s in slots],
                        stream=stream,
                        wait_current=False,
                    )
                    if event is not None:
                        event.synchronize()
                    copy_s = time.perf_counter() - began
            finally:
                if got.lease_id:
                    with contextlib.suppress(LeaseError):
                        self._store.release(got.lease_id)
            ready = len(got.slots)
            return gpb.OnboardResponse(
                ready_blocks=ready,
                onboarded=len(slots),
                ready_tokens=ready * reg.spec.block_tokens,
                bytes=len(slots) * reg.spec.block_bytes,
                copy_s=copy_s,
            )
        finally:
            self._done(reg)

    def _chain(
        self, reg: Registration, tokens: Any, extra: Any, start: int, n: int
    ) -> list[Any]:
        """Keys of chain blocks [0, start + n) (the tokens must cover them)."""
        if n == 0:
            raise InvalidArgument("block_ids is empty")
        keys = self._store.keys_for(
            reg.spec.ns_id, convert.tokens(tokens), convert.extra_keys(extra)
        )
        end = convert.block_range(start, n, len(keys), what="block_ids")
        return keys[:end]


def _torch_device(name: str) -> torch.device:
    import torch

    return torch.device(name)


def _wait_ipc_event(stream: Any, device: str, handle: bytes) -> None:
    """Make ``stream`` wait for an engine's interprocess event (untested without a GPU)."""
    import torch

    event = torch.cuda.Event.from_ipc_handle(torch.device(device), handle)
    stream.wait_event(event)
