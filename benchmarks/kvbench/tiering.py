"""vLLM's tiering offloading without an engine, as vLLM's own tier tests build it: its
``TieringOffloadingSpec`` from an ``OffloadingConfig``, its CPU primary tier, and the
secondary tiers its ``SecondaryTierFactory`` makes from the config's ``secondary_tiers``
(kvstore's, by ``module_path``; vLLM's ``fs``). vLLM refuses to start its offloading
on CPU; this is how the tier tests (tests/test_vllm_secondary_tier.py) and
benchmarks/secondary_tier.py drive a tier through vLLM's interface step by step: write
chunks into the primary tier's memoryview, submit jobs, poll as the scheduler does."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

KVSTORE_TIER = "kvclient.integrations.vllm.secondary_tier"  # the tier's module_path
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
_job_ids = itertools.count(1)


def offloading_spec(
    tier: dict[str, Any], chunk_bytes: int, primary_chunks: int, model: str = "tier-test-model"
) -> TieringOffloadingSpec:
    """vLLM's spec of an engine whose chunks are ``chunk_bytes`` (one 16-token block of
    two layers), with room for ``primary_chunks`` in its CPU tier and ``tier`` (a
    ``secondary_tiers`` entry) behind it."""
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": primary_chunks * chunk_bytes, "secondary_tiers": [tier]},
        engine_id=f"engine-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),  # fmt: skip
    )
    return TieringOffloadingSpec(config)


class TierEngine:
    """One engine's scheduler side: vLLM's tiering manager, its primary tier's chunks as
    ``rows`` (``uint8[chunks, chunk_bytes]``) and the secondary tier vLLM made."""

    def __init__(self, tier: dict[str, Any], chunk_bytes: int, primary_chunks: int) -> None:
        self.manager = offloading_spec(tier, chunk_bytes, primary_chunks).get_manager()
        assert isinstance(self.manager, TieringOffloadingManager)
        self.tier: SecondaryTierManager = self.manager.secondary_tiers[0]
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)

    def close(self) -> None:
        del self.rows  # (a view of vLLM's mmap: it is closed next)
        self.manager.shutdown()


def transfer_job(
    keys: Sequence[OffloadKey], chunk_ids: Sequence[int], promotion: bool
) -> TransferJob:
    """A job as vLLM's tiering manager submits it: a store (cascade) or a load (promotion)."""
    return TransferJob(
        job_id=next(_job_ids), keys=list(keys), chunk_ids=np.array(chunk_ids, dtype=np.int64),
        is_promotion=promotion, req_context=ReqContext(req_id="r"),
    )  # fmt: skip


def finish_jobs(
    tier: SecondaryTierManager, job_ids: Collection[int], timeout: float = 30.0,
    poll_s: float = 0.001,
) -> dict[int, JobResult]:  # fmt: skip
    """Poll ``get_finished_jobs`` (vLLM does once a step) until every job of ``job_ids``
    is done -> their results; TimeoutError after ``timeout``."""
    done: dict[int, JobResult] = {}
    deadline = time.monotonic() + timeout
    while True:
        done.update((r.job_id, r) for r in tier.get_finished_jobs() if r.job_id in job_ids)
        if len(done) == len(job_ids):
            return done
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs {sorted(set(job_ids) - set(done))} never finished")
        time.sleep(poll_s)


def lookup_all(
    tier: SecondaryTierManager, keys: Sequence[OffloadKey], timeout: float = 30.0,
    poll_s: float = 0.001,
) -> list[LookupResult]:  # fmt: skip
    """One request's lookups of ``keys``, step after step (each step ends with
    ``on_schedule_end``, which hands the tier its batch) until none is RETRY;
    TimeoutError after ``timeout``."""
    ctx = ReqContext(req_id=uuid.uuid4().hex)
    deadline = time.monotonic() + timeout
    try:
        while True:
            results = [tier.lookup(key, ctx) for key in keys]
            if LookupResult.RETRY not in results:
                return results
            if time.monotonic() > deadline:
                raise TimeoutError("lookups still RETRY")
            tier.on_schedule_end(STEP)
            time.sleep(poll_s)
    finally:
        tier.on_request_finished(ctx)
