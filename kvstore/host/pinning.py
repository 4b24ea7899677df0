"""Page-locking the host arena for CUDA: the :data:`kvstore.host.arena.PinHook` of the GPU path.

Why: a ``cudaMemcpyAsync`` from or to pageable memory is staged through a driver
bounce buffer and is neither asynchronous nor full speed. Registered (pinned) memory
is reached by the copy engines directly (~50 GB/s per direction on PCIe Gen5) and,
with ``cudaHostRegisterMapped`` on a coherent C2C link, by kernels too.

Protocol:

- The daemon passes :func:`arena_pin_hook` ``(platform)`` to ``Store(config, pin=...)``;
  :class:`kvstore.host.arena.HostArena` calls it once with the whole region right after
  mapping and calls the returned unpin on close. On ``cpu-only`` there is no hook.
- Registration is per process (it pins *virtual* pages of one address space), so a
  client that maps the arena registers its own mapping: :func:`pin_mapping`.
- Flags: ``Portable`` (the registration is valid in every CUDA context of the
  process, whatever device is current) and ``Mapped``, so kernels can address the
  arena (:func:`device_address`; on GH200 and on most x86 hosts the device pointer
  equals the host pointer): the one-launch block copy reads and writes slots itself.
- Pinning is an optimisation, never a requirement: a failed registration (too little
  ``RLIMIT_MEMLOCK``, an old driver, a region too large, or an arena file outside
  tmpfs/hugetlbfs: Linux refuses long-term pins of writable shared file pages there,
  cudaError 1 on a disk-backed ``arena_dir``) is logged and the arena stays pageable;
  copies are then slower but correct. The runtime keeps that error as the thread's
  last error, which the next framework call would raise as its own failure, so it is
  cleared (:func:`clear_last_error`). The hook keeps no export of the region after it
  returns, so closing the arena never trips over it.

Cost: ``cudaHostRegister`` faults in and locks every page of the region at start-up
(about 1-3 s per 10 GiB), where the arena would otherwise fault pages lazily.

NUMA placement: the pages are placed on the NUMA node of the thread that first
touches them, which, once pinned, is the daemon's thread calling ``cudaHostRegister``.
On a two-socket PCIe host put the daemon on the GPU's node so DMA does not cross the
socket link (``numactl --cpunodebind=N --membind=N kvstored``, N from
``/sys/bus/pci/devices/<bus id>/numa_node``, printed in the start-up log per device).
On GH200 the Grace memory is the CPU's only node and is local to its Hopper anyway.
Several GPUs on different nodes sharing one daemon cannot all be local: run one
daemon per node in that case.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Callable
from typing import Any, Protocol

from kvstore.host.mapping import ArenaMapping
from kvstore.platform import HOST_REGISTER_MAPPED, HOST_REGISTER_PORTABLE, PlatformInfo

log = logging.getLogger(__name__)


class CudaRuntime(Protocol):
    """The two calls this module needs, as ``torch.cuda.cudart()`` exposes them."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> Any: ...  # noqa: N802

    def cudaHostUnregister(self, ptr: int) -> Any: ...  # noqa: N802


def torch_cudart() -> CudaRuntime:
    """``torch.cuda.cudart()`` (initialises CUDA in this process)."""
    import torch

    return torch.cuda.cudart()  # type: ignore[no-any-return]


def buffer_address(view: memoryview) -> int:
    """Address of a writable buffer's first byte, without keeping an export of it."""
    holder = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder  # releases the export taken by from_buffer


def clear_last_error() -> None:
    """Reset the CUDA runtime's last error on this thread (``cudaGetLastError``), through
    the libcudart this process loaded (torch's binding of the runtime lacks the call)."""
    for get_last_error in _cudart_functions("cudaGetLastError"):
        get_last_error()


_FOUND: dict[str, list[Any]] = {}


def _cudart_functions(name: str) -> list[Any]:
    """``name`` in every libcudart this process has loaded (torch's binding of the
    runtime lacks the calls that take pointers out). Kept once found, or once CUDA is
    initialised without one (a runtime linked statically): reading the process's
    mappings costs a millisecond. Before that an empty answer is not kept, since the
    runtime may simply not be loaded yet."""
    found = _FOUND.get(name)
    if found is not None:
        return found
    found = _cudart_lookup(name)
    torch = sys.modules.get("torch")
    if found or (torch is not None and torch.cuda.is_initialized()):
        _FOUND[name] = found
    return found


def _cudart_lookup(name: str) -> list[Any]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libcudart.so" in line}
    except OSError:
        return []
    found = []
    for path in sorted(paths):
        try:
            found.append(getattr(ctypes.CDLL(path), name))
        except (OSError, AttributeError) as exc:
            log.debug("no %s in %s: %s", name, path, exc)
    return found


def device_address(host_address: int) -> int | None:
    """The address at which CUDA kernels reach registered, mapped host memory at
    ``host_address`` (``cudaHostGetDevicePointer``); None where it is not mapped or the
    runtime refuses (the error is cleared)."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.set_device(torch.cuda.current_device())  # a current context on this thread
    for get in _cudart_functions("cudaHostGetDevicePointer"):
        pointer = ctypes.c_void_p(0)
        result = get(ctypes.byref(pointer), ctypes.c_void_p(host_address), ctypes.c_uint(0))
        if result == 0 and pointer.value:
            return int(pointer.value)
        clear_last_error()
        log.debug("cudaHostGetDevicePointer(%#x) failed: cudaError %d", host_address, result)
    # a runtime linked statically (not in /proc/self/maps): the driver API, in the
    # context the runtime made current on this thread
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device_pointer = ctypes.c_uint64(0)
    result = driver.cuMemHostGetDevicePointer_v2(
        ctypes.byref(device_pointer), ctypes.c_void_p(host_address), ctypes.c_uint(0)
    )
    if result != 0 or not device_pointer.value:
        log.debug("cuMemHostGetDevicePointer(%#x) failed: CUresult %d", host_address, result)
        return None
    return int(device_pointer.value)


class CudaPin:
    """A PinHook registering the region with ``cudaHostRegister(ptr, size, flags)``.

    ``cudart`` returns the runtime (tests inject a fake). ``strict`` raises on failure
    instead of logging and leaving the region pageable. ``pinned_bytes`` says what the
    last call registered (0: nothing, the region is pageable).
    """

    def __init__(
        self,
        flags: int = HOST_REGISTER_PORTABLE,
        cudart: Callable[[], CudaRuntime] = torch_cudart,
        *,
        strict: bool = False,
    ) -> None:
        self.flags = flags
        self.strict = strict
        self.pinned_bytes = 0
        self._cudart = cudart

    def __call__(self, view: memoryview) -> Callable[[], None]:
        size = view.nbytes
        self.pinned_bytes = 0
        if size == 0:
            return _nothing
        flags = self.flags
        try:
            runtime = self._cudart()
            address = buffer_address(view)
            result = int(runtime.cudaHostRegister(address, size, flags))
        except Exception as exc:
            if self.strict:
                raise
            log.warning("cannot pin the arena with CUDA (%s); it stays pageable", exc)
            return _nothing
        if result != 0:
            clear_last_error()
            message = (
                f"cudaHostRegister({size} bytes, flags={flags:#x}) failed: cudaError {result} "
                "(CUDA pins shared files only on tmpfs or hugetlbfs, e.g. arena_dir=/dev/shm, "
                "and within ulimit -l)"
            )
            if self.strict:
                raise RuntimeError(message)
            log.warning("%s; the arena stays pageable", message)
            return _nothing
        log.info("pinned %d bytes at %#x with cudaHostRegister(flags=%#x)", size, address, flags)
        self.pinned_bytes = size

        def unpin() -> None:
            self.pinned_bytes = 0
            code = int(runtime.cudaHostUnregister(address))
            if code != 0:
                log.warning("cudaHostUnregister(%#x) failed: cudaError %d", address, code)

        return unpin


def cuda_pin_hook(
    flags: int = HOST_REGISTER_PORTABLE,
    cudart: Callable[[], CudaRuntime] = torch_cudart,
    *,
    strict: bool = False,
) -> CudaPin:
    """A :class:`CudaPin` hook (see there)."""
    return CudaPin(flags, cudart, strict=strict)


def arena_pin_hook(platform: PlatformInfo) -> CudaPin | None:
    """The daemon's hook for its platform: None on cpu-only."""
    if not platform.has_cuda:
        return None
    return cuda_pin_hook(platform.host_register_flags)


def pin_mapping(
    mapping: ArenaMapping,
    flags: int = HOST_REGISTER_PORTABLE,
    cudart: Callable[[], CudaRuntime] = torch_cudart,
) -> Callable[[], None]:
    """Register a client's mapping of the arena; returns the unpin (call before unmapping).

    Never raises: an unpinned mapping still works, only slower.
    """
    if not mapping.writable:
        log.warning("arena mapping is read-only: not pinned")
        return _nothing
    return cuda_pin_hook(flags, cudart)(mapping.view(0, mapping.size))


def _nothing() -> None:
    return None


__all__ = [
    "HOST_REGISTER_MAPPED",
    "HOST_REGISTER_PORTABLE",
    "CudaPin",
    "CudaRuntime",
    "arena_pin_hook",
    "buffer_address",
    "cuda_pin_hook",
    "device_address",
    "pin_mapping",
]
