"""kvstore as a secondary tier of vLLM's native offloading, driven as vLLM drives it.

vLLM refuses to start its offloading on CPU, so these tests do what vLLM's own tier
tests do (``tests/v1/kv_offload/tiering/test_fs_tier.py``): they build vLLM's
``TieringOffloadingSpec`` from an ``OffloadingConfig`` whose ``secondary_tiers`` name
kvstore's tier by ``module_path``, let vLLM make its CPU primary tier and, through its
``SecondaryTierFactory``, our tier; then they write chunks into the primary tier's
memoryview and call the tier's interface step by step, against a real kvstored.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import Daemon, wait_for
from test_metrics import metrics_url, rpc_count, scrape

pytest.importorskip("vllm.v1.kv_offload.tiering.factory")

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.base import JobResult  # noqa: E402

from kvbench.tiering import (  # noqa: E402
    KVSTORE_TIER,
    TierEngine,
    finish_jobs,
    lookup_all,
    offloading_spec,
    transfer_job,
)
from kvclient.integrations.vllm.secondary_tier import KVStoreTier, tier_model  # noqa: E402

CHUNK_BYTES = 64 << 10  # one chunk: 2 layers x 16 tokens of a small model, say
PRIMARY_CHUNKS = 16


class Engine(TierEngine):
    """An engine whose one secondary tier is kvstore's, at ``daemon``."""

    def __init__(self, daemon: Daemon | str, **tier: object) -> None:
        addr = daemon if isinstance(daemon, str) else daemon.addr
        config = {"type": "kvstore", "module_path": KVSTORE_TIER, "addr": addr,
                  "retry_after_s": 0.2, **tier}  # fmt: skip
        super().__init__(config, CHUNK_BYTES, PRIMARY_CHUNKS)
        assert isinstance(self.tier, KVStoreTier)


BATCH_BOUND = 8  # the module daemon's max_blocks_per_request: lookups split by it


@pytest.fixture(scope="module")
def daemon(kvstored_module_factory: Callable[..., Daemon]) -> Daemon:
    return kvstored_module_factory(
        max_blocks_per_request=BATCH_BOUND, metrics_listen="127.0.0.1:0"
    )


@pytest.fixture
def engine(daemon: Daemon) -> Iterator[Engine]:
    made = Engine(daemon)
    yield made
    made.close()


def chunk_key(name: str, i: int) -> OffloadKey:
    """vLLM's key of chunk ``i`` of a prompt called ``name`` (a 32-byte block hash)."""
    return make_offload_key(f"{name}/{i}".encode().ljust(32, b"."), 0)


def content(key: OffloadKey) -> np.ndarray:
    """A chunk's bytes, a function of its key: any process can check any other's."""
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, CHUNK_BYTES, dtype=np.uint8)


def store(engine: Engine, keys: list[OffloadKey]) -> JobResult:
    """Write the chunks into the primary tier's first rows and cascade them to kvstore."""
    for row, key in enumerate(keys):
        engine.rows[row] = content(key)
    submitted = transfer_job(keys, list(range(len(keys))), promotion=False)
    engine.tier.submit_store(submitted)
    return finish_jobs(engine.tier, [submitted.job_id])[submitted.job_id]


def load(engine: Engine, keys: list[OffloadKey], first_row: int = 8) -> JobResult:
    """Promote the chunks into zeroed primary rows from ``first_row`` on."""
    rows = list(range(first_row, first_row + len(keys)))
    engine.rows[rows] = 0
    submitted = transfer_job(keys, rows, promotion=True)
    engine.tier.submit_load(submitted)
    return finish_jobs(engine.tier, [submitted.job_id])[submitted.job_id]


def lookup(tier: object, keys: list[OffloadKey]) -> list[LookupResult]:
    assert isinstance(tier, KVStoreTier)
    return lookup_all(tier, keys)


def test_vllm_loads_the_tier_from_its_config_and_a_store_is_loaded_back(engine: Engine) -> None:
    keys = [chunk_key("store-load", i) for i in range(4)]
    # nothing stored yet: every chunk a miss
    assert lookup(engine.tier, keys) == [LookupResult.MISS] * 4
    # cascade 4 chunks from the primary tier to kvstore
    stored = store(engine, keys)
    assert stored.success and stored.transfer_bytes == 4 * CHUNK_BYTES
    assert lookup(engine.tier, keys) == [LookupResult.HIT] * 4
    # promote them into other primary rows: the bytes that were stored
    loaded = load(engine, keys)
    assert loaded.success
    for row, key in enumerate(keys, start=8):
        assert np.array_equal(engine.rows[row], content(key))
    engine.tier.drain_jobs()  # nothing in flight: returns at once
    assert not engine.tier.has_pending_work()


def test_a_steps_lookups_are_one_call_per_batch(daemon: Daemon, engine: Engine) -> None:
    """vLLM hands the tier a request's keys once a step; the tier asks the daemon in
    one LookupBatch per max_blocks_per_request chunks (here 8), never a Lookup each,
    and the answers are each chunk's own."""
    keys = [chunk_key("batched", i) for i in range(12)]
    assert store(engine, keys[::2]).success  # every other chunk
    url = metrics_url(daemon)
    before = scrape(url)
    wanted = [LookupResult.HIT, LookupResult.MISS] * 6 + [LookupResult.MISS] * 3
    assert lookup(engine.tier, keys + [chunk_key("batched", i) for i in range(12, 15)]) == wanted
    after = scrape(url)
    assert rpc_count(after, "Lookup") == rpc_count(before, "Lookup")
    assert rpc_count(after, "LookupBatch") - rpc_count(before, "LookupBatch") == 2  # 8 + 7


def test_a_second_engine_in_another_process_loads_what_the_first_stored(
    daemon: Daemon, engine: Engine
) -> None:
    assert store(engine, [chunk_key("shared", i) for i in range(3)]).success
    # a process of its own, started afresh (not forked from this one, whose gRPC and
    # vLLM threads a fork would copy mid-flight): its own vLLM manager and tier
    here = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(here)!r}); import {Path(__file__).stem} as t; "
            f"sys.exit(t.other_engine_loads_shared({daemon.addr!r}))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def other_engine_loads_shared(addr: str) -> int:
    """In another process: 0 when its engine finds and loads the 3 "shared" chunks."""
    keys = [chunk_key("shared", i) for i in range(3)]
    second = Engine(addr)
    try:
        if lookup(second.tier, keys) != [LookupResult.HIT] * 3:
            return 2
        if not load(second, keys, first_row=0).success:
            return 3
        same = all(np.array_equal(second.rows[i], content(k)) for i, k in enumerate(keys))
        return 0 if same else 4
    finally:
        second.close()


def test_a_chunk_never_stored_is_a_miss_and_its_load_fails(engine: Engine) -> None:
    there, absent = chunk_key("miss", 0), chunk_key("miss", 1)
    assert store(engine, [there]).success
    assert lookup(engine.tier, [there, absent]) == [LookupResult.HIT, LookupResult.MISS]
    # a load of both (the absent one evicted since its lookup, say): the job fails
    # and names the chunk it did load
    result = load(engine, [there, absent])
    assert not result.success and list(result.successful_keys or ()) == [there]
    assert np.array_equal(engine.rows[8], content(there))


def test_the_tier_outlives_a_daemon_killed_and_restarted(
    kvstored_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = kvstored_factory()
    engine = Engine(daemon)
    try:
        keys = [chunk_key("restart", i) for i in range(2)]
        assert store(engine, keys).success
        daemon.kill()  # kill -9: no drain, no goodbye
        # the daemon is gone: misses and failed jobs, nothing raised into vLLM
        assert lookup(engine.tier, keys) == [LookupResult.MISS] * 2
        assert not load(engine, keys).success
        assert not store(engine, [chunk_key("restart", 9)]).success
        # a new daemon with empty tiers (its arena and disk elsewhere): the old chunks
        # are gone, and the tier stores and loads again
        os.makedirs(tmp_path / "arena2")
        daemon.restart(arena_dir=str(tmp_path / "arena2"), disk_dir=str(tmp_path / "disk2"))
        fresh = [chunk_key("restart", 10)]

        def stores_again() -> bool:  # (misses for retry_after_s after the last failure)
            return store(engine, fresh).success and lookup(engine.tier, fresh) == [
                LookupResult.HIT
            ]

        assert wait_for(stores_again, 30)
        assert lookup(engine.tier, keys) == [LookupResult.MISS] * 2
        assert load(engine, fresh).success
        assert np.array_equal(engine.rows[8], content(fresh[0]))
    finally:
        engine.close()


def test_a_setting_out_of_range_is_refused_when_vllm_builds_the_tier(daemon: Daemon) -> None:
    with pytest.raises(ValueError, match="priority must be in 0..100"):
        Engine(daemon, priority=101)
    with pytest.raises(ValueError, match="Locality"):
        Engine(daemon, locality="nearby")  # vLLM's tiers take LOCAL or REMOTE
    with pytest.raises(TypeError, match="unknown_key"):
        Engine(daemon, unknown_key=1)


def test_chunks_of_another_page_layout_are_another_namespace() -> None:
    """vLLM's chunk key hashes tokens only: what makes two engines' chunk bytes differ
    must be in the namespace. The page layout (NHD or HND) was not: an HND engine
    loaded an NHD engine's chunks as hits (review of #69)."""
    from dataclasses import replace
    from types import SimpleNamespace

    spec = offloading_spec({"type": "kvstore", "module_path": KVSTORE_TIER}, CHUNK_BYTES, 4)
    ids = {
        tier_model(SimpleNamespace(config=replace(spec.config, kv_cache_layout=layout),
                                   blocks_per_chunk=1), "m")  # fmt: skip
        for layout in ("NHD", "HND", None)
    }
    assert len(ids) == 3, ids
    assert tier_model(spec, "m") == tier_model(spec, "m")  # the same engine: the same


def test_the_quickstarts_tier_config_is_what_vllm_builds_the_tier_from(daemon: Daemon) -> None:
    """The GPU line of docs/quickstart/vllm-server.md and the README, the same in both
    (not run here: vLLM refuses this offloading on CPU): its spec is one vLLM registers,
    and its tier entry, the address aside, makes a tier through vLLM's factory that
    stores and looks up."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    repo = Path(__file__).parents[1]
    lines = [
        block
        for page in (repo / "docs" / "quickstart" / "vllm-server.md", repo / "README.md")
        for block in re.findall(r"```console\n(.*?)```", page.read_text(), re.S)
        if "secondary_tiers" in block
    ]
    assert len(lines) == 2 and lines[0] == lines[1], lines
    args = shlex.split(lines[0])
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    extra = config["kv_connector_extra_config"]
    assert config["kv_connector"] == "OffloadingConnector"
    assert extra["spec_name"] in OffloadingSpecFactory._registry
    (tier,) = extra["secondary_tiers"]
    engine = Engine(daemon, **{k: v for k, v in tier.items() if k not in ("type", "addr")})
    try:
        keys = [chunk_key("quickstart", 0)]
        assert store(engine, keys).success
        assert lookup(engine.tier, keys) == [LookupResult.HIT]
    finally:
        engine.close()
