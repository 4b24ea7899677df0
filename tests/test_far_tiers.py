"""A new far tier is one class and one line (kvstore.far_tier, kvstore.tier_stack).

The tier here is a folder: one file per block, written behind the puts by its own
thread, read back by key and checked (the shared tier's value format). Two stores share
it as two nodes would: what one stores, the other's reads pull through host and disk
into its host tier; a damaged file is a miss, and the chain stops before it; two far
tiers are asked in order, each for what the ones before it did not have.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from conftest import wait_for

from kvstore.far_tier import BlockSource, FarTierEntry
from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.shared.format import pack_value, unpack_value
from kvstore.store import Store, StoreConfig

MiB = 1 << 20
SPEC = NamespaceSpec(model="folder-test", block_tokens=4, block_bytes=4096)


class FolderTier:
    """A far tier in a folder (see the module docstring): :class:`FarTier`."""

    def __init__(self, root: Path, source: BlockSource) -> None:
        self.root = root
        self._source = source
        self._stop = threading.Event()
        self.written = 0
        self._thread = threading.Thread(target=self._run, name="folder-tier", daemon=True)
        self._thread.start()

    def _path(self, key: BlockKey) -> Path:
        return self.root / key.hex()

    def _known(self, key: BlockKey) -> bool:
        return self._path(key).exists()

    def usable(self) -> bool:
        return True

    def fetch(self, spec: NamespaceSpec, keys: Sequence[BlockKey]) -> list[memoryview]:
        found: list[memoryview] = []
        for key in keys:
            path = self._path(key)
            payload = unpack_value(spec, key, path.read_bytes()) if path.exists() else None
            if payload is None:
                break
            found.append(payload)
        return found

    def stats(self, queue_bytes: int, queue_dropped: int) -> dict[str, int]:
        return {"written": self.written, "queue_bytes": queue_bytes}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                lent = self._source.lend_queued(16, self._known, 0.1, False)
            except Exception:  # noqa: BLE001 - the store closed under us
                return
            sent = set()
            for block in lent.blocks:
                part = self._path(block.key).with_suffix(".part")
                part.write_bytes(pack_value(block.spec, block.key, block.payload))
                part.rename(self._path(block.key))  # whole or absent
                sent.add(block.key)
                self.written += 1
            lent.release(sent)


def folder(root: Path) -> FarTierEntry:
    """The one line a store needs to have the folder tier behind its own."""
    return FarTierEntry("folder", "FOLDER", lambda source: FolderTier(root, source), 64 * MiB)


@pytest.fixture
def node() -> Iterator[Callable[..., Store]]:
    stores: list[Store] = []

    def make(*roots: Path) -> Store:
        config = StoreConfig(host_bytes=8 * MiB, disk_bytes=0, shared_arena=False)
        store = Store(config, more_tiers=[folder(root) for root in roots])
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def blocks(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, SPEC.block_bytes, dtype=np.uint8).tobytes() for _ in range(n)]


def test_what_one_node_stores_another_pulls_from_the_folder_tier(
    node: Callable[..., Store], tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    a, b = node(shared), node(shared)
    spec_a, spec_b = a.open_namespace(SPEC), b.open_namespace(SPEC)
    chain = a.keys_for(spec_a.ns_id, list(range(24)))
    payloads = blocks(6, 1)
    assert a.put(spec_a.ns_id, chain, payloads).stored == 6
    assert wait_for(lambda: all((shared / key.hex()).exists() for key in chain))  # behind
    assert b.lookup(spec_b.ns_id, chain).ready_blocks == 0
    assert b.far_gap(spec_b.ns_id, chain)
    assert b.pull(spec_b.ns_id, chain) == 6
    assert not b.far_gap(spec_b.ns_id, chain)  # all ready now: nothing to pull
    copied, data = b.read(spec_b.ns_id, chain)
    assert copied == 6 and bytes(data) == b"".join(payloads)


def test_a_damaged_block_in_a_far_tier_is_a_miss_and_the_chain_stops_there(
    node: Callable[..., Store], tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    a = node(shared)
    spec = a.open_namespace(SPEC)
    chain = a.keys_for(spec.ns_id, list(range(16)))
    assert a.put(spec.ns_id, chain, blocks(4, 2)).stored == 4
    assert wait_for(lambda: all((shared / key.hex()).exists() for key in chain))
    damaged = shared / chain[2].hex()
    value = bytearray(damaged.read_bytes())
    value[-1] ^= 0xFF
    damaged.write_bytes(bytes(value))
    b = node(shared)
    spec_b = b.open_namespace(SPEC)
    assert b.pull(spec_b.ns_id, chain) == 2  # the two before it; never the bad one
    assert b.lookup(spec_b.ns_id, chain).ready_blocks == 2


def test_far_tiers_are_asked_in_order_each_for_what_the_ones_before_lacked(
    node: Callable[..., Store], tmp_path: Path
) -> None:
    near, far = tmp_path / "near", tmp_path / "far"
    near.mkdir()
    far.mkdir()
    writer = node(far)
    spec = writer.open_namespace(SPEC)
    chain = writer.keys_for(spec.ns_id, list(range(20)))
    payloads = blocks(5, 3)
    assert writer.put(spec.ns_id, chain, payloads).stored == 5
    assert wait_for(lambda: all((far / key.hex()).exists() for key in chain))
    for key in chain[:2]:  # the near tier holds the first two blocks only
        (near / key.hex()).write_bytes((far / key.hex()).read_bytes())
    reader = node(near, far)
    spec_r = reader.open_namespace(SPEC)
    assert reader.pull(spec_r.ns_id, chain) == 5
    copied, data = reader.read(spec_r.ns_id, chain)
    assert copied == 5 and bytes(data) == b"".join(payloads)
