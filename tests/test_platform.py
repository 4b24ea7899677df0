"""Platform profile detection (kvstore.platform) with FAKED device attributes.

No GPU is needed: ``detect`` takes the device query as a parameter, so each test hands
it the facts a real driver would report for one machine.
"""

from __future__ import annotations

import ctypes.util
import logging
from pathlib import Path

import pytest

from kvstore.platform import (
    HOST_REGISTER_MAPPED,
    HOST_REGISTER_PORTABLE,
    DeviceFacts,
    PlatformInfo,
    Profile,
    classify,
    detect,
    numa_node_of,
    query_cuda_devices,
)

# What the driver reports on the machines we care about (cuDeviceGetAttribute values).
H100_PCIE = DeviceFacts(
    0, "NVIDIA H100 PCIe", (9, 0), 80 << 30, "0000:17:00.0", 0,
    integrated=False, pageable_memory_access=False, uses_host_page_tables=False,
    host_native_atomics=False, host_pointer_for_registered_mem=False,
)
H100_SXM_HMM = DeviceFacts(  # x86 + open kernel modules: HMM = pageable access, software tables
    0, "NVIDIA H100 80GB HBM3", (9, 0), 80 << 30, "0000:18:00.0", 1,
    integrated=False, pageable_memory_access=True, uses_host_page_tables=False,
    host_native_atomics=False, host_pointer_for_registered_mem=False,
)
GH200 = DeviceFacts(
    0, "NVIDIA GH200 480GB", (9, 0), 96 << 30, "0009:01:00.0", 0,
    integrated=False, pageable_memory_access=True, uses_host_page_tables=True,
    host_native_atomics=True, host_pointer_for_registered_mem=True,
)


def query_of(*devices: DeviceFacts):  # noqa: ANN201 - a DeviceQuery
    return lambda: list(devices)


@pytest.mark.parametrize(
    "device,profile",
    [
        (H100_PCIE, Profile.PCIE),
        (H100_SXM_HMM, Profile.PCIE),  # pageable access alone is not C2C
        (GH200, Profile.C2C),
    ],
)
def test_profile_from_device_attributes(device: DeviceFacts, profile: Profile) -> None:
    info = detect(query_of(device), env={})
    assert info.profile is profile
    assert info.devices == (device,)
    assert info.has_cuda


def test_only_both_coherence_attributes_make_c2c() -> None:
    # host page tables without native host atomics (or the reverse) stays pcie
    half = DeviceFacts(0, "X", uses_host_page_tables=True, host_native_atomics=False)
    other = DeviceFacts(0, "X", uses_host_page_tables=False, host_native_atomics=True)
    assert half.profile() is Profile.PCIE
    assert other.profile() is Profile.PCIE


def test_unreadable_attributes_fall_back_to_the_device_name() -> None:
    # an old driver without the attributes: the name decides, compute capability does not
    assert DeviceFacts(0, "NVIDIA GH200 480GB", (9, 0)).profile() is Profile.C2C
    assert DeviceFacts(0, "NVIDIA GB200", (10, 0)).profile() is Profile.C2C
    assert DeviceFacts(0, "NVIDIA H100 PCIe", (9, 0)).profile() is Profile.PCIE
    # attributes, when readable, win over the name
    renamed = DeviceFacts(0, "NVIDIA GH200 480GB", uses_host_page_tables=False,
                          host_native_atomics=False)
    assert renamed.profile() is Profile.PCIE


def test_machine_is_c2c_only_if_every_device_is() -> None:
    assert classify([]) is Profile.CPU_ONLY
    assert classify([GH200, GH200]) is Profile.C2C
    assert classify([GH200, H100_PCIE]) is Profile.PCIE
    assert classify([H100_PCIE, H100_PCIE]) is Profile.PCIE


def test_no_device_or_a_failing_driver_means_cpu_only() -> None:
    assert detect(query_of(), env={}).profile is Profile.CPU_ONLY

    def broken() -> list[DeviceFacts]:
        raise OSError("no CUDA driver (libcuda.so.1: cannot open shared object file)")

    info = detect(broken, env={})
    assert info.profile is Profile.CPU_ONLY
    assert not info.has_cuda
    assert "libcuda" in info.reason and "libcuda" in info.describe()

    def cu_error() -> list[DeviceFacts]:
        raise RuntimeError("cuInit failed with CUresult 100")

    assert detect(cu_error, env={}).profile is Profile.CPU_ONLY


def test_env_can_turn_the_gpu_path_off(caplog: pytest.LogCaptureFixture) -> None:
    called = []

    def query() -> list[DeviceFacts]:
        called.append(True)
        return [GH200]

    info = detect(query, env={"KVSTORE_PLATFORM": "cpu-only"})
    assert info.profile is Profile.CPU_ONLY and not called  # no CUDA context is created
    assert detect(query, env={"KVSTORE_PLATFORM": "auto"}).profile is Profile.C2C
    with caplog.at_level(logging.WARNING, logger="kvstore.platform"):
        assert detect(query, env={"KVSTORE_PLATFORM": "c2c"}).profile is Profile.C2C
    assert "ignored" in caplog.text  # only cpu-only can be forced


def test_register_flags_and_direct_access_follow_the_profile() -> None:
    pcie = detect(query_of(H100_PCIE), env={})
    c2c = detect(query_of(GH200), env={})
    assert pcie.host_register_flags == HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED
    assert c2c.host_register_flags == HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED
    assert not pcie.direct_host_access
    assert c2c.direct_host_access
    assert not PlatformInfo(Profile.CPU_ONLY).direct_host_access


def test_describe_names_devices_and_numa_nodes() -> None:
    text = detect(query_of(H100_PCIE), env={}).describe()
    assert text.startswith("pcie: cuda:0 NVIDIA H100 PCIe (sm_90, 80 GiB")
    assert "pci 0000:17:00.0" in text and "numa 0" in text


def test_numa_node_comes_from_sysfs(tmp_path: Path) -> None:
    for bus, value in (("0000:17:00.0", "1\n"), ("0000:18:00.0", "-1\n"), ("0000:19:00.0", "x")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "numa_node").write_text(value)
    assert numa_node_of("0000:17:00.0", str(tmp_path)) == 1
    assert numa_node_of("0000:18:00.0", str(tmp_path)) is None  # -1: no NUMA affinity
    assert numa_node_of("0000:19:00.0", str(tmp_path)) is None
    assert numa_node_of("0000:99:00.0", str(tmp_path)) is None
    assert numa_node_of("", str(tmp_path)) is None


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is here")
def test_real_query_without_a_driver_is_cpu_only() -> None:
    with pytest.raises(OSError, match="libcuda"):
        query_cuda_devices()
    assert detect(env={}).profile is Profile.CPU_ONLY
