"""The arena PinHook (kvstore.host.pinning) against a fake CUDA runtime.

The fake records what ``cudaHostRegister``/``cudaHostUnregister`` were called with, so
the hook's contract is checked on CPU: the whole region, at its real address, with the
profile's flags, unregistered on close, and never fatal when registration fails.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from test_platform import GH200, H100_PCIE

from kvstore.host.arena import HostArena
from kvstore.host.mapping import map_arena
from kvstore.host.pinning import CudaPin, arena_pin_hook, buffer_address, cuda_pin_hook, pin_mapping
from kvstore.platform import HOST_REGISTER_MAPPED, HOST_REGISTER_PORTABLE, PlatformInfo, Profile
from kvstore.store import Store, StoreConfig


class FakeCudart:
    def __init__(self, register_result: int = 0) -> None:
        self.register_result = register_result
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.registered.append((ptr, size, flags))
        return self.register_result

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_hook_registers_the_whole_region_and_unregisters_on_close(tmp_path) -> None:
    fake = FakeCudart()
    hook = cuda_pin_hook(HOST_REGISTER_PORTABLE, lambda: fake)
    arena = HostArena(1 << 20, directory=str(tmp_path), pin=hook)
    address = arena.array().ctypes.data
    assert fake.registered == [(address, 1 << 20, HOST_REGISTER_PORTABLE)]
    assert hook.pinned_bytes == 1 << 20
    offset = arena.alloc(8192)  # the arena works as before
    assert offset is not None
    arena.view(offset, 4)[:] = b"abcd"
    arena.close()
    assert fake.unregistered == [address]
    assert hook.pinned_bytes == 0


def test_failed_registration_leaves_the_arena_pageable(tmp_path, caplog) -> None:
    fake = FakeCudart(register_result=2)  # cudaErrorMemoryAllocation
    hook = cuda_pin_hook(HOST_REGISTER_PORTABLE, lambda: fake)
    with caplog.at_level(logging.WARNING, logger="kvstore.host.pinning"):
        arena = HostArena(1 << 20, directory=str(tmp_path), pin=hook)
    assert "cudaError 2" in caplog.text and hook.pinned_bytes == 0
    assert arena.alloc(4096) is not None
    arena.close()
    assert fake.unregistered == []  # nothing to undo


def test_runtime_that_cannot_start_is_not_fatal(tmp_path) -> None:
    def no_cuda() -> FakeCudart:
        raise AssertionError("Torch not compiled with CUDA enabled")

    arena = HostArena(1 << 20, directory=str(tmp_path), pin=cuda_pin_hook(cudart=no_cuda))
    arena.close()
    strict = CudaPin(cudart=no_cuda, strict=True)
    with pytest.raises(AssertionError):
        HostArena(1 << 20, directory=str(tmp_path), pin=strict)
    with pytest.raises(RuntimeError, match="cudaError 2"):
        HostArena(1 << 20, directory=str(tmp_path),
                  pin=CudaPin(cudart=lambda: FakeCudart(2), strict=True))


def test_profile_picks_the_flags() -> None:
    assert arena_pin_hook(PlatformInfo(Profile.CPU_ONLY)) is None
    pcie = arena_pin_hook(PlatformInfo(Profile.PCIE, (H100_PCIE,)))
    c2c = arena_pin_hook(PlatformInfo(Profile.C2C, (GH200,)))
    assert pcie is not None and pcie.flags == HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED
    assert c2c is not None and c2c.flags == HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED


def test_store_passes_the_hook_and_a_client_pins_its_own_mapping(tmp_path) -> None:
    fake = FakeCudart()
    store = Store(
        StoreConfig(host_bytes=1 << 20, arena_dir=str(tmp_path)),
        pin=cuda_pin_hook(HOST_REGISTER_PORTABLE, lambda: fake),
    )
    try:
        assert fake.registered[0][1] == 1 << 20
        # a client maps the same file at another address and registers that mapping
        assert store.arena_path is not None
        mapping = map_arena(store.arena_path)
        unpin = pin_mapping(mapping, HOST_REGISTER_PORTABLE, lambda: fake)
        client_address = mapping.array().ctypes.data
        # the whole mapped file: the slots and the epoch table after them
        assert fake.registered[1] == (client_address, mapping.size, HOST_REGISTER_PORTABLE)
        unpin()
        assert fake.unregistered == [client_address]
        mapping.close()
    finally:
        store.close()
    assert len(fake.unregistered) == 2


def test_buffer_address_keeps_no_export() -> None:
    buf = bytearray(64)
    view = memoryview(buf)
    assert buffer_address(view) == np.frombuffer(buf, dtype=np.uint8).ctypes.data
    view.release()  # would raise BufferError if the address lookup kept an export
