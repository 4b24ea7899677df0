"""Which GPU data path this machine has: the platform profile chosen at start-up.

Three profiles (DESIGN.md, "Tiers"), shown in ``Stats.platform`` and the daemon's
start-up line:

``cpu-only``
    No usable CUDA device (no driver, no device, or ``KVSTORE_PLATFORM=cpu-only``).
    Every GPU interface still works on CPU tensors; nothing is pinned.
``pcie``
    Discrete GPUs behind PCIe (H100 PCIe/SXM on x86 hosts): host memory is reached by
    the DMA copy engines only, about 50 GB/s per direction on Gen5, and only from
    page-locked memory at full speed. The arena is registered with
    ``cudaHostRegister(Portable)`` and copies are ``cudaMemcpyAsync`` per slot run.
``c2c``
    Hardware-coherent CPU-GPU link (GH200 / GB200 NVLink-C2C, ~340+ GB/s measured
    host->device): GPU kernels read and write host memory through the host's own page
    tables. The arena is registered ``Portable | Mapped`` and the mover may gather
    straight into arena slots from a kernel instead of staging in HBM.

The rule (:func:`classify`), per device, from CUDA device attributes:

1. ``pageableMemoryAccessUsesHostPageTables == 1`` and ``hostNativeAtomicSupported
   == 1`` -> ``c2c``. Both together mean the GPU walks the CPU's page tables (ATS) and
   does native atomics on host memory: a coherent link, not PCIe. HMM on x86 reports
   pageable access through *software* page tables (the first attribute is 0), and
   PCIe has no native host atomics, so neither is mistaken for C2C.
2. When the attributes cannot be read (old driver), the device name decides: a name
   containing ``GH200`` or ``GB200`` -> ``c2c``. Compute capability alone is not
   enough: H100 PCIe and H100 SXM are 9.0 as well.
3. Any other CUDA device -> ``pcie``.

With several devices the machine is ``c2c`` only if every visible device is, else
``pcie``. ``KVSTORE_PLATFORM=cpu-only`` turns the GPU paths off on a GPU host (the
daemon then never creates a CUDA context); other values are refused.

Detection talks to the driver API (``libcuda.so.1``) through ctypes: it is fast,
needs no torch import (the daemon starts in well under a second on a CPU host) and
fails closed: any error means ``cpu-only``. :func:`detect` takes the query as a
parameter so tests fake devices on machines without CUDA.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

log = logging.getLogger(__name__)

PLATFORM_ENV = "KVSTORE_PLATFORM"


class Profile(str, Enum):
    CPU_ONLY = "cpu-only"
    PCIE = "pcie"
    C2C = "c2c"


# CUdevice_attribute values (cuda.h; the runtime's cudaDevAttr* use the same numbers).
ATTR_INTEGRATED = 18
ATTR_COMPUTE_CAPABILITY_MAJOR = 75
ATTR_COMPUTE_CAPABILITY_MINOR = 76
ATTR_HOST_NATIVE_ATOMIC_SUPPORTED = 86
ATTR_PAGEABLE_MEMORY_ACCESS = 88
ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
ATTR_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES = 100

C2C_NAME_MARKERS = ("GH200", "GB200")

# cudaHostRegister flags
HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_MAPPED = 0x02


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    """What detection learned about one CUDA device. None: the attribute was unreadable."""

    index: int
    name: str
    compute_capability: tuple[int, int] = (0, 0)
    total_memory: int = 0
    pci_bus_id: str = ""
    numa_node: int | None = None
    integrated: bool | None = None
    pageable_memory_access: bool | None = None
    uses_host_page_tables: bool | None = None
    host_native_atomics: bool | None = None
    host_pointer_for_registered_mem: bool | None = None

    def profile(self) -> Profile:
        """``c2c`` or ``pcie`` for this device (rule in the module docstring)."""
        if self.uses_host_page_tables is not None and self.host_native_atomics is not None:
            if self.uses_host_page_tables and self.host_native_atomics:
                return Profile.C2C
            return Profile.PCIE
        if any(marker in self.name.upper() for marker in C2C_NAME_MARKERS):
            return Profile.C2C
        return Profile.PCIE

    def describe(self) -> str:
        major, minor = self.compute_capability
        numa = "?" if self.numa_node is None else str(self.numa_node)
        return (
            f"cuda:{self.index} {self.name} (sm_{major}{minor}, "
            f"{self.total_memory / (1 << 30):.0f} GiB, pci {self.pci_bus_id or '?'}, "
            f"numa {numa}, {self.profile().value})"
        )


@dataclass(frozen=True, slots=True)
class PlatformInfo:
    """The machine's profile and the devices it was derived from."""

    profile: Profile
    devices: tuple[DeviceFacts, ...] = ()
    reason: str = ""  # why cpu-only, when it is

    @property
    def has_cuda(self) -> bool:
        return self.profile is not Profile.CPU_ONLY

    @property
    def host_register_flags(self) -> int:
        """cudaHostRegister flags for the arena: Portable and Mapped (kernels reach it:
        coherently on c2c, over the link on PCIe, where the one-launch block copy of
        :mod:`kvstore.block_kernel` reads and writes the slots itself)."""
        return HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED

    @property
    def direct_host_access(self) -> bool:
        """Whether kernels may use host pointers of registered memory as they are (c2c)."""
        return self.profile is Profile.C2C and all(
            d.host_pointer_for_registered_mem for d in self.devices
        )

    def describe(self) -> str:
        if not self.devices:
            return f"{self.profile.value} ({self.reason or 'no CUDA device'})"
        return f"{self.profile.value}: " + "; ".join(d.describe() for d in self.devices)


DeviceQuery = Callable[[], Sequence[DeviceFacts]]
"""Returns the visible CUDA devices (empty: none); raises OSError/RuntimeError on failure."""


def classify(devices: Sequence[DeviceFacts]) -> Profile:
    """The machine's profile: cpu-only without devices, c2c if every device is c2c."""
    if not devices:
        return Profile.CPU_ONLY
    if all(d.profile() is Profile.C2C for d in devices):
        return Profile.C2C
    return Profile.PCIE


def detect(
    query: DeviceQuery | None = None, env: dict[str, str] | None = None
) -> PlatformInfo:
    """Detect the profile; never raises (a failing query means cpu-only, logged)."""
    env = dict(os.environ) if env is None else env
    forced = env.get(PLATFORM_ENV, "").strip().lower()
    if forced and forced not in ("auto", Profile.CPU_ONLY.value):
        log.warning("%s=%r ignored: only 'cpu-only' or 'auto' may be set", PLATFORM_ENV, forced)
    elif forced == Profile.CPU_ONLY.value:
        return PlatformInfo(Profile.CPU_ONLY, reason=f"{PLATFORM_ENV}=cpu-only")
    try:
        devices = tuple((query or query_cuda_devices)())
    except (OSError, RuntimeError, AttributeError) as exc:
        log.debug("CUDA detection failed: %s", exc)
        return PlatformInfo(Profile.CPU_ONLY, reason=str(exc))
    if not devices:
        return PlatformInfo(Profile.CPU_ONLY, reason="no CUDA device visible")
    return PlatformInfo(classify(devices), devices)


# -- the real query: CUDA driver API through ctypes -------------------------------------


def _load_libcuda() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise OSError(f"no CUDA driver (libcuda.so.1: {exc})") from None


def query_cuda_devices() -> list[DeviceFacts]:
    """Facts of every visible CUDA device, read with the driver API (cuInit, cuDevice*).

    Honours CUDA_VISIBLE_DEVICES like every CUDA program. Raises OSError when there is
    no driver, RuntimeError when the driver reports an error (no device, bad install).
    """
    cuda = _load_libcuda()

    def check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed with CUresult {result}")

    check(cuda.cuInit(0), "cuInit")
    count = ctypes.c_int(0)
    check(cuda.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    devices = []
    for index in range(count.value):
        dev = ctypes.c_int(0)
        check(cuda.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")

        def attr(number: int, dev: ctypes.c_int = dev) -> int | None:
            value = ctypes.c_int(0)
            if cuda.cuDeviceGetAttribute(ctypes.byref(value), number, dev) != 0:
                return None
            return value.value

        def flag(number: int) -> bool | None:
            value = attr(number)
            return None if value is None else bool(value)

        name = ctypes.create_string_buffer(256)
        check(cuda.cuDeviceGetName(name, 256, dev), "cuDeviceGetName")
        total = ctypes.c_size_t(0)
        cuda.cuDeviceTotalMem_v2(ctypes.byref(total), dev)
        bus = ctypes.create_string_buffer(64)
        bus_id = ""
        if cuda.cuDeviceGetPCIBusId(bus, 64, dev) == 0:
            bus_id = bus.value.decode(errors="replace")
        devices.append(
            DeviceFacts(
                index=index,
                name=name.value.decode(errors="replace"),
                compute_capability=(
                    attr(ATTR_COMPUTE_CAPABILITY_MAJOR) or 0,
                    attr(ATTR_COMPUTE_CAPABILITY_MINOR) or 0,
                ),
                total_memory=total.value,
                pci_bus_id=bus_id,
                numa_node=numa_node_of(bus_id),
                integrated=flag(ATTR_INTEGRATED),
                pageable_memory_access=flag(ATTR_PAGEABLE_MEMORY_ACCESS),
                uses_host_page_tables=flag(ATTR_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES),
                host_native_atomics=flag(ATTR_HOST_NATIVE_ATOMIC_SUPPORTED),
                host_pointer_for_registered_mem=flag(
                    ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
                ),
            )
        )
    return devices


def numa_node_of(pci_bus_id: str, sysfs: str = "/sys/bus/pci/devices") -> int | None:
    """The NUMA node of a PCI device (``0000:17:00.0``), None when unknown or -1."""
    if not pci_bus_id:
        return None
    try:
        text = (Path(sysfs) / pci_bus_id.lower() / "numa_node").read_text().strip()
        node = int(text)
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None
