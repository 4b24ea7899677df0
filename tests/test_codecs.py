"""KV codecs (kvstore.codecs): round trips with error bounds, the C decoder against the
numpy reference, and a coded namespace through the store's disk tier (restart,
damage, an unknown codec version, no sharing with the exact namespace)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import ml_dtypes
import numpy as np
import pytest
from conftest import Daemon

from kvclient import KVClient
from kvstore.codecs import CODECS, VERSION, Codec
from kvstore.disk.format import META_DB, pack_record, unpack_record
from kvstore.errors import InvalidArgument
from kvstore.keys import NamespaceSpec
from kvstore.store import Store, StoreConfig

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
# the largest error of a decoded element, relative to its group's largest magnitude:
# half a step of the code (int: 1/127 and 1/7; fp8 e4m3: 3 mantissa bits, 2**-4 at the
# top), plus the output dtype's own rounding
BOUNDS = {"int8": 0.5 / 127 + 2**-8, "int4": 0.5 / 7 + 2**-8, "fp8": 2**-4 + 2**-8}
HEAD_DIM = 64
MiB = 1 << 20


def kv_block(dtype: str, elements: int, seed: int = 0) -> np.ndarray:
    """Values shaped like keys and values: groups of very different magnitudes, a few
    outliers, and an all-zero group."""
    rng = np.random.default_rng(seed)
    groups = elements // HEAD_DIM
    x = rng.standard_normal((groups, HEAD_DIM)) * np.exp(rng.uniform(-6, 5, (groups, 1)))
    x[0] = 0.0
    x[1, 3] = 300.0
    return x.ravel().astype(DTYPES[dtype])


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", [c for c in CODECS if c != "exact"])
def test_round_trips_stay_within_their_bounds_and_c_agrees_with_numpy(
    name: str, dtype: str
) -> None:
    x = kv_block(dtype, 64 * HEAD_DIM)
    raw = x.tobytes()
    codec = Codec(name, dtype, HEAD_DIM, len(raw))
    encoded = bytes(codec.encode(raw, memoryview(bytearray(codec.encoded_bytes))))
    assert len(encoded) == codec.encoded_bytes
    fast, reference = bytearray(len(raw)), bytearray(len(raw))
    codec.decode(encoded, memoryview(fast))
    codec.decode(encoded, memoryview(reference), fast=False)
    assert fast == reference  # the compiled decoder is the numpy one, bit for bit
    got = np.frombuffer(fast, DTYPES[dtype]).astype(np.float64).reshape(-1, HEAD_DIM)
    want = x.astype(np.float64).reshape(-1, HEAD_DIM)
    scale = np.abs(want).max(axis=1, keepdims=True)
    error = np.abs(got - want) / np.where(scale == 0, 1, scale)
    assert error.max() <= BOUNDS[name], (name, dtype, error.max())
    assert np.all(got[0] == 0)  # the zero group decodes to zeros
    bits = 4 if name == "int4" else 8
    ratio = codec.encoded_bytes / len(raw)
    assert ratio <= bits / (8 * x.itemsize) + 2 / (HEAD_DIM * x.itemsize) + 1e-9


def test_exact_is_bit_for_bit_and_codecs_refuse_what_they_cannot_encode() -> None:
    raw = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    codec = Codec("exact", "bfloat16", HEAD_DIM, len(raw))
    out = bytearray(len(raw))
    codec.decode(codec.encode(raw, memoryview(bytearray(len(raw)))), memoryview(out))
    assert out == raw and codec.encoded_bytes == len(raw)
    with pytest.raises(InvalidArgument, match="head_dim"):
        NamespaceSpec("m", 16, 4096, codec="int8")
    with pytest.raises(InvalidArgument, match="use exact"):
        NamespaceSpec("m", 16, 0, 2, 2, 64, dtype="float8_e4m3fn", codec="fp8")
    with pytest.raises(InvalidArgument, match="codec must be one of"):
        NamespaceSpec("m", 16, 0, 2, 2, 64, codec="zstd")
    # exact keeps the digest namespaces had before codecs; a codec makes another one
    exact = NamespaceSpec("m", 16, 0, 2, 2, 64)
    assert exact.digest == NamespaceSpec("m", 16, 0, 2, 2, 64, codec="exact").digest
    assert exact.digest != NamespaceSpec("m", 16, 0, 2, 2, 64, codec="int8").digest


def coded_store(tmp_path: Path, host_bytes: int = 2 * MiB) -> Store:
    return Store(
        StoreConfig(
            host_bytes=host_bytes, disk_bytes=64 * MiB, disk_dir=str(tmp_path / "disk"),
            shared_arena=False,
        )  # fmt: skip
    )


SPEC = dict(model="coded", block_tokens=16, num_layers=8, num_kv_heads=8, head_dim=HEAD_DIM)


def fill(store: Store, codec: str, chains: int, seed: int = 0) -> tuple[str, list, list]:
    """Put ``chains`` one-block chains into a namespace with ``codec`` (the host tier
    holds 8: the others go to disk as they are evicted, the rest at close)."""
    spec = store.open_namespace(NamespaceSpec(**SPEC, codec=codec))  # type: ignore[arg-type]
    keys, blocks = [], []
    for i in range(chains):
        block = kv_block("bfloat16", spec.block_bytes // 2, seed + i).tobytes()
        chain = store.keys_for(spec.ns_id, [seed * 1000 + i] * 16)
        assert store.put(spec.ns_id, chain, [block]).stored == 1
        keys.append(chain)
        blocks.append(block)
    store.flush()
    return spec.ns_id, keys, blocks


def read_back(store: Store, ns_id: str, chain: list) -> bytes | None:
    copied, data = store.read(ns_id, chain)
    return bytes(data) if copied else None


def test_a_coded_namespace_keeps_half_the_bytes_on_disk_and_reads_back_after_restart(
    tmp_path: Path,
) -> None:
    store = coded_store(tmp_path)
    try:
        ns_id, chains, blocks = fill(store, "int8", 24)
        block_bytes = len(blocks[0])
        disk = next(t for t in store.stats().tiers if t.name == "disk")
        assert disk.used_bytes < 0.6 * disk.blocks * block_bytes  # (pages included)
        exact_ns, exact_chains, _ = fill(store, "exact", 1, seed=1)
        # the same tokens in the exact namespace: other keys, nothing shared
        assert store.lookup(exact_ns, store.keys_for(exact_ns, [0] * 16)).ready_blocks == 0
        assert store.lookup(ns_id, store.keys_for(ns_id, [1000] * 16)).ready_blocks == 0
    finally:
        store.close()
    with lmdb.open(str(tmp_path / "disk"), max_dbs=8, readonly=True, lock=False) as env:
        meta = env.open_db(META_DB, create=False)
        with env.begin() as txn:
            records = [unpack_record(k, v) for k, v in txn.cursor(db=meta)]
    coded = [r for r in records if r.codec]
    assert len(coded) == 24 and all(r.codec_version == VERSION for r in coded)
    assert all(r.size <= 0.53 * block_bytes for r in coded)
    store = coded_store(tmp_path)
    try:
        for chain, block in zip(chains, blocks, strict=True):
            got = read_back(store, ns_id, chain)
            assert got is not None and len(got) == block_bytes
            want = np.frombuffer(block, ml_dtypes.bfloat16).astype(np.float32)
            have = np.frombuffer(got, ml_dtypes.bfloat16).astype(np.float32)
            scale = np.abs(want).reshape(-1, HEAD_DIM).max(axis=1, keepdims=True)
            error = np.abs(have - want).reshape(-1, HEAD_DIM) / np.where(scale == 0, 1, scale)
            assert error.max() <= BOUNDS["int8"]
        got = read_back(store, exact_ns, exact_chains[0])
        assert got is not None  # the exact namespace, bit for bit, beside it
    finally:
        store.close()


def test_a_damaged_or_foreign_encoded_record_is_a_miss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = coded_store(tmp_path)
    try:
        ns_id, chains, blocks = fill(store, "fp8", 12)
    finally:
        store.close()
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=8, map_size=1 << 30)
    meta = env.open_db(META_DB, create=False)
    payload = env.open_db(b"payload", create=False)
    damaged, foreign = bytes(chains[0][0]), bytes(chains[1][0])
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(damaged, db=payload))
        value[-1] ^= 0xFF  # a flipped bit in the codes
        txn.put(damaged, bytes(value), db=payload)
        record = unpack_record(foreign, txn.get(foreign, db=meta))
        txn.put(foreign, pack_record(record.__class__(
            record.key, record.ns_digest, record.parent, record.size, record.checksum,
            record.priority, record.last_access, record.offset, record.tokens, record.codec,
            VERSION + 1,
        )), db=meta)  # fmt: skip
    env.close()
    store = coded_store(tmp_path)
    try:
        with caplog.at_level(logging.WARNING):
            store.wait_loaded(30)
            assert read_back(store, ns_id, chains[0]) is None
            assert store.stats().corrupt_reads == 1
            assert read_back(store, ns_id, chains[1]) is None
            assert read_back(store, ns_id, chains[2]) is not None
        lines = [r.getMessage() for r in caplog.records if "codec version" in r.getMessage()]
        assert len(lines) == 1, lines
    finally:
        store.close()


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_crafted_scales_are_a_miss_counted_as_damage(tmp_path: Path, name: str) -> None:
    """A record whose checksum holds but whose scales no encoder makes (NaN, infinite,
    3.4e38: past the dtype's range over the codes' limit) is a miss and counted as
    damage, as is such a shared-tier value; the intact record next to them is served."""
    import xxhash

    from kvstore.codecs import DamagedBlock
    from kvstore.shared import format as shared_format

    store = coded_store(tmp_path)
    try:
        ns_id, chains, blocks = fill(store, name, 12)
        spec = store.namespace(ns_id)
    finally:
        store.close()
    crafted = {0: np.nan, 1: np.inf, 2: 3.4e38}
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=8, map_size=1 << 30)
    meta = env.open_db(META_DB, create=False)
    payload = env.open_db(b"payload", create=False)
    with env.begin(write=True) as txn:
        for i, scale in crafted.items():
            key = bytes(chains[i][0])
            value = bytearray(txn.get(key, db=payload))
            value[2:4] = np.array([scale], dtype=ml_dtypes.bfloat16).tobytes()  # group 1
            txn.put(key, bytes(value), db=payload)
            record = unpack_record(key, txn.get(key, db=meta))
            txn.put(key, pack_record(record.__class__(
                record.key, record.ns_digest, record.parent, record.size,
                xxhash.xxh3_64_intdigest(bytes(value)), record.priority, record.last_access,
                record.offset, record.tokens, record.codec, record.codec_version,
            )), db=meta)  # fmt: skip
            codec = Codec(name, spec.dtype, spec.head_dim, spec.block_bytes)
            with pytest.raises(DamagedBlock):
                codec.decode(bytes(value), memoryview(bytearray(spec.block_bytes)))
            # the same payload as a shared-tier value: its checksum holds, it is a miss
            shared_value = shared_format.pack_value(
                spec, chains[i][0], bytes(value), codec, encoded=True
            )
            unpacked = shared_format.unpack_value(spec, chains[i][0], bytes(shared_value), codec)
            assert unpacked is None
    env.close()
    store = coded_store(tmp_path)
    try:
        store.wait_loaded(30)
        for i in crafted:
            assert read_back(store, ns_id, chains[i]) is None, i
        assert store.stats().corrupt_reads == len(crafted)
        assert read_back(store, ns_id, chains[3]) is not None
    finally:
        store.close()


def test_a_name_bound_before_codecs_still_opens_its_namespace(tmp_path: Path) -> None:
    """A namespace-names.json written before the codec field (and before the log):
    re-opening the name with the same layout (codec exact, the default) is no layout
    change, and the binding moves into the log."""
    import json

    from kvstored.names import FILE_NAME, OLD_FILE_NAME, NamespaceNames

    spec = NamespaceSpec("old-model", 16, 4096)
    declared = spec.to_dict()
    del declared["codec"]  # as an older daemon saved it
    old = tmp_path / OLD_FILE_NAME
    old.write_text(json.dumps({"prod": {"ns_id": spec.ns_id, "spec": declared}}))
    names = NamespaceNames(tmp_path)
    assert not old.exists() and (tmp_path / FILE_NAME).stat().st_mode & 0o777 == 0o600
    assert names.bind("prod", spec, lambda s: s).ns_id == spec.ns_id
    with pytest.raises(Exception, match="codec='exact'->'int8'"):
        coded = NamespaceSpec("old-model", 16, 0, 1, 1, 64, codec="int8")
        names.bind("prod", coded, lambda s: s)


def within_bound(got: bytes, want: bytes, name: str) -> bool:
    have = np.frombuffer(got, ml_dtypes.bfloat16).astype(np.float32).reshape(-1, HEAD_DIM)
    ref = np.frombuffer(want, ml_dtypes.bfloat16).astype(np.float32).reshape(-1, HEAD_DIM)
    scale = np.abs(ref).max(axis=1, keepdims=True)
    return bool((np.abs(have - ref) / np.where(scale == 0, 1, scale)).max() <= BOUNDS[name])


def test_host_coding_holds_about_twice_the_blocks_and_every_read_decodes(
    tmp_path: Path,
) -> None:
    """codec_tiers with host: the same arena holds near twice the int8 blocks; a read,
    an acquire (slots of its lease, freed with it) and a restart from the blocks the
    host tier handed to disk as they were all give the block within int8's bound."""
    held = {}
    for tiers in (("disk", "shared"), ("host", "disk", "shared")):
        store = Store(
            StoreConfig(
                host_bytes=4 * MiB, disk_bytes=64 * MiB,
                disk_dir=str(tmp_path / "-".join(tiers) / "disk"),
                shared_arena=False, codec_tiers=tiers,
            )  # fmt: skip
        )
        try:
            spec = store.open_namespace(NamespaceSpec(**SPEC, codec="int8"))  # type: ignore[arg-type]
            chains, blocks = [], []
            for i in range(40):
                blocks.append(kv_block("bfloat16", spec.block_bytes // 2, i).tobytes())
                chains.append(store.keys_for(spec.ns_id, [i] * 16))
                assert store.put(spec.ns_id, chains[-1], [blocks[-1]]).stored == 1
                assert store.wait_host_coded(30)
            held[tiers] = next(t for t in store.stats().tiers if t.name == "host").blocks
            store.verify_invariants()
            if "host" not in tiers:
                continue
            last = chains[-1]
            assert store.locate(spec.ns_id, last) is None  # encoded: no unpinned read
            copied, data = store.read(spec.ns_id, last)
            assert copied == 1 and within_bound(bytes(data), blocks[-1], "int8")
            used = store.arena.used_bytes
            got = store.acquire(spec.ns_id, last)
            assert bytes(store.arena.view(got.offsets[0], spec.block_bytes)) == bytes(data)
            store.verify_invariants()
            store.release(got.lease_id)
            assert store.arena.used_bytes == used  # the decoded copy went with the lease
            saved = next(n for n in store.stats().namespaces if n.ns_id == spec.ns_id)
            assert saved.saved_bytes > held[tiers] * spec.block_bytes // 3
        finally:
            store.close()
    assert held[("host", "disk", "shared")] >= 1.7 * held[("disk", "shared")], held
    store = coded_store(tmp_path / "host-disk-shared")  # (its dir) host exact this time
    try:
        store.open_namespace(spec)
        for chain, block in zip(chains, blocks, strict=True):
            copied, data = store.read(spec.ns_id, chain)
            assert copied == 1 and within_bound(bytes(data), block, "int8")
    finally:
        store.close()


def test_a_daemon_with_host_coding_serves_arena_and_inline_gets_decoded(
    kvstored_factory: Callable[..., Daemon],
) -> None:
    """A real kvstored with codec_tiers host,disk,shared: once its host tier encoded the
    blocks (the bytes it saves say so), an arena get and an inline get give the same
    bfloat16 blocks, within int8's bound, and `kvctl status` counts the host's saving."""
    daemon = kvstored_factory(codec_tiers="host,disk,shared")
    layout = {"num_layers": 2, "num_kv_heads": 4, "head_dim": HEAD_DIM, "codec": "int8"}
    block_bytes = 2 * 2 * 4 * HEAD_DIM * 2 * 16
    values = np.stack([kv_block("bfloat16", block_bytes // 2, i) for i in range(4)])
    tokens = list(range(4 * 16 + 1))
    encoded = Codec("int8", "bfloat16", HEAD_DIM, block_bytes).encoded_bytes
    with KVClient(daemon.addr) as client:
        ns = client.namespace("host-coded", 16, block_bytes, **layout)
        assert ns.put(tokens, values.view(np.uint8)).stored == 4
        deadline = time.monotonic() + 30

        def saved() -> int:
            stats = client.stats().namespaces
            return next(n.saved_bytes for n in stats if n.ns_id == ns.ns_id)

        while saved() < 4 * (block_bytes - encoded):
            assert time.monotonic() < deadline, f"host tier saved {saved()} bytes"
            time.sleep(0.05)
        by_arena = ns.get(tokens)
    with KVClient(daemon.addr, use_arena=False) as client:
        by_wire = client.namespace("host-coded", 16, block_bytes, **layout).get(tokens)
    assert by_arena.n_blocks == by_wire.n_blocks == 4
    assert np.array_equal(by_arena.blocks, by_wire.blocks)
    for i in range(4):
        got = by_arena.blocks[i].tobytes()
        assert got != values[i].tobytes() and within_bound(got, values[i].tobytes(), "int8")


def test_a_block_encoded_in_host_goes_to_the_shared_tier_as_it_is(tmp_path: Path) -> None:
    """The shared tier's writer is lent a block encoded in host as its encoded bytes;
    the value it packs is the one it would pack from the exact block, and decodes
    within int8's bound. (The tier's own writer is stopped: this test lends.)"""
    from kvstore.far_tier import BlockSource, FarTierEntry
    from kvstore.shared.format import pack_value, unpack_value
    from kvstore.shared.tier import SharedConfig

    sources: list[BlockSource] = []  # a second far tier's: lent what the shared tier is

    class Probe:  # a far tier that only keeps its source
        def usable(self) -> bool:
            return False

        def fetch(self, spec: Any, keys: Any) -> list[memoryview]:
            return []

        def stats(self, queue_bytes: int, queue_dropped: int) -> None:
            return None

        def close(self) -> None:
            return None

    def probe(source: BlockSource) -> Probe:
        sources.append(source)
        return Probe()

    store = Store(
        StoreConfig(
            host_bytes=4 * MiB, disk_bytes=64 * MiB, disk_dir=str(tmp_path / "disk"),
            shared_arena=False, codec_tiers=("host", "disk", "shared"),
            shared=SharedConfig("redis://127.0.0.1:1"),
        ),
        more_tiers=[FarTierEntry("probe", "PROBE", probe, queue_bytes=MiB)],
    )  # fmt: skip
    try:
        assert store.shared is not None
        store.shared.close()
        spec = store.open_namespace(NamespaceSpec(**SPEC, codec="int8"))  # type: ignore[arg-type]
        block = kv_block("bfloat16", spec.block_bytes // 2, 7).tobytes()
        chain = store.keys_for(spec.ns_id, list(range(16)))
        assert store.put(spec.ns_id, chain, [block]).stored == 1
        assert store.wait_host_coded(30)
        lent = sources[0].lend_queued(8, lambda key: False, 0.0, False)
        (out,) = lent.blocks
        codec = Codec("int8", "bfloat16", HEAD_DIM, spec.block_bytes)
        assert out.encoded and out.payload.nbytes == codec.encoded_bytes
        value = pack_value(spec, out.key, out.payload, codec, encoded=True)
        assert value == pack_value(spec, out.key, block, codec)
        got = unpack_value(spec, out.key, bytes(value), codec)
        assert got is not None and within_bound(bytes(got), block, "int8")
        lent.release({out.key})
    finally:
        store.close()


def test_a_block_queued_for_disk_encoded_reads_back_decoded(tmp_path: Path) -> None:
    """A block the host tier kept encoded goes to the disk writer as it is (its record
    says which codec): read while still queued, and once committed, it decodes."""
    import threading

    import xxhash

    from kvstore.codecs import VERSION
    from kvstore.disk import DiskRecord, DiskTier

    raw = kv_block("bfloat16", 64 * HEAD_DIM, 3).tobytes()
    codec = Codec("int8", "bfloat16", HEAD_DIM, len(raw))
    encoded = bytes(codec.encode(raw, memoryview(bytearray(codec.encoded_bytes))))
    key = b"q" * 32
    record = DiskRecord(
        key, b"d" * 32, b"", len(encoded), xxhash.xxh3_64_intdigest(encoded), 35, 0.0,
        codec=codec.code_id, codec_version=VERSION,
    )  # fmt: skip
    with DiskTier(str(tmp_path / "lmdb"), 64 * MiB) as tier:
        gate = threading.Event()
        commit = tier._writer._commit_early  # held until the queued read is done

        def held(ops: object) -> None:
            gate.wait(30)
            commit(ops)  # type: ignore[arg-type]

        tier._writer._commit_early = held  # type: ignore[method-assign]
        assert tier.write(record, encoded)
        queued = tier.read(key, codec=codec)
        gate.set()
        tier.flush(30)
        committed = tier.read(key, codec=codec)
    assert queued is not None and committed is not None
    assert bytes(queued) == bytes(committed) and within_bound(bytes(queued), raw, "int8")


def test_a_raw_record_in_a_coded_namespace_is_a_miss_after_a_restart(tmp_path: Path) -> None:
    """int8 keeps its disk blocks encoded: a record rewritten as raw (codec 0, one
    block's size, a checksum that holds) is not of its namespace's codec. After a
    restart it is a miss, counted, never served as the block; its neighbours are."""
    import xxhash

    store = coded_store(tmp_path)
    try:
        ns_id, chains, blocks = fill(store, "int8", 12)
    finally:
        store.close()
    forged = b"\x3c" * len(blocks[0])  # reads as bfloat16 0.0114..., whole
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=8, map_size=1 << 30)
    meta = env.open_db(META_DB, create=False)
    payload = env.open_db(b"payload", create=False)
    key = bytes(chains[0][0])
    with env.begin(write=True) as txn:
        record = unpack_record(key, txn.get(key, db=meta))
        assert record.codec  # stored encoded
        txn.put(key, forged, db=payload)
        txn.put(key, pack_record(record.__class__(
            record.key, record.ns_digest, record.parent, len(forged),
            xxhash.xxh3_64_intdigest(forged), record.priority, record.last_access,
            record.offset, record.tokens, 0, 0,
        )), db=meta)  # fmt: skip
    env.close()
    store = coded_store(tmp_path)
    try:
        store.wait_loaded(30)
        assert read_back(store, ns_id, chains[0]) is None
        assert store.stats().counters["disk_codec_mismatches"] == 1
        got = read_back(store, ns_id, chains[1])
        assert got is not None and within_bound(got, blocks[1], "int8")
    finally:
        store.close()


def test_a_record_of_another_codec_than_asked_is_a_miss_when_read(tmp_path: Path) -> None:
    """The disk storage's own read: a raw record asked for with a codec (the namespace
    keeps its blocks encoded there), or an encoded one asked for as it is, is a miss
    and counted; asked for as it was written, it is served."""
    import xxhash

    from kvstore.disk import DiskRecord, DiskTier

    raw = kv_block("bfloat16", 64 * HEAD_DIM, 4).tobytes()
    codec = Codec("int8", "bfloat16", HEAD_DIM, len(raw))
    encoded = bytes(codec.encode(raw, memoryview(bytearray(codec.encoded_bytes))))
    plain = DiskRecord(b"r" * 32, b"d" * 32, b"", len(raw), xxhash.xxh3_64_intdigest(raw), 35, 0.0)
    coded = DiskRecord(
        b"e" * 32, b"d" * 32, b"", len(encoded), xxhash.xxh3_64_intdigest(encoded), 35, 0.0,
        codec=codec.code_id, codec_version=VERSION,
    )  # fmt: skip
    with DiskTier(str(tmp_path / "lmdb"), 64 * MiB) as tier:
        assert tier.write(plain, raw) and tier.write(coded, encoded)
        tier.flush(30)
        assert tier.read(plain.key, codec=codec) is None
        assert tier.read(coded.key) is None
        out = [memoryview(bytearray(len(raw)))]
        assert tier.read_all([plain.key], out, codec=codec) == 0
        assert tier.stats().codec_mismatches == 3
        assert bytes(tier.read(plain.key) or b"") == raw
        assert within_bound(bytes(tier.read(coded.key, codec=codec) or b""), raw, "int8")
