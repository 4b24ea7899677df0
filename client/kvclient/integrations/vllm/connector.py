"""kvstore's KV connector for vLLM v1: reuse prompt prefixes across requests, engines
and restarts.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvclient.vllm", "kv_role": "kv_both"}'

or ``LLM(model, kv_transfer_config={...the same keys...})``. Settings go in
``kv_connector_extra_config``, in ``KVSTORE_<SETTING>`` environment variables or in a
YAML, TOML or JSON file (``config_file`` / ``KVSTORE_CONFIG_FILE``), the JSON over the
environment over the file (:class:`ConnectorSettings`); none is needed next to a
kvstored on its default socket.

Who calls what (vLLM's ``KVConnectorBase_V1``), and what this connector does then:

Scheduler side (one per engine, in the scheduler's process):

- ``get_num_new_matched_tokens``: one kvstore call on the prompt's full blocks
  (short deadline) -> tokens to load beyond vLLM's own prefix cache, always leaving
  the last prompt token to compute. With early reuse, blocks another engine is
  computing right now (pending) answer "ask again later" (None) until they are ready;
  the wait starts again whenever the other engine delivers a block (a long prefill
  is waited for as long as it makes progress) and ends after ``early_reuse_wait_s``
  without one.
- With early reuse that Lookup is a claim (a Reserve): the prompt blocks nobody holds
  become this request's to compute, and another engine asking at the same moment sees
  them pending and waits instead of computing them too.
- ``update_state_after_alloc``: what vLLM decided to load.
- ``build_connector_meta``: the step's plan (:mod:`kvclient.integrations.vllm.plan`): loads for the
  requests scheduled for the first time, saves of the full blocks each step completes
  (the prompt's and, with ``store_replies`` on, the default, the reply's as it is
  generated: a chat's next turn loads the history and the last reply).
- ``update_connector_output``: blocks a worker could not load are stored again once
  vLLM has recomputed them.
- ``request_finished``: drop what a claim did not deliver (preempted, aborted or
  finished early). Computed full blocks no step stored yet (the reply's last ones
  under async scheduling) become a *final* save in the next step's plan, and vLLM
  keeps the request's blocks until then (True); otherwise they are freed at once.
  Every other save finishes within its step.

Worker side (one per GPU / CPU worker):

- ``register_kv_caches``: the paged tensors (:mod:`kvclient.integrations.vllm.blocks`).
- ``start_load_kv``: before the forward pass, for each load, pin the blocks in the
  shared arena (``acquire``: zero-copy views) and copy them straight into vLLM's
  blocks, one ``index_copy_`` per layer; on another host, ``get`` inline.
- ``wait_for_layer_load`` / ``save_kv_layer``: nothing (loads are done before the
  forward; saves wait for all layers).
- ``wait_for_save``: gather the step's completed blocks into a reused buffer and put
  them sent ahead (``put_nowait``: the call returns once the bytes are in the arena,
  the daemon commits them behind the step), or fill the scheduler's claim.
- ``get_finished``: the finished requests whose final save is done (vLLM then frees
  their blocks), whether the save worked or not: a failed save is a later miss.
- ``get_block_ids_with_load_errors``: blocks that did not load (evicted meanwhile, a
  failed check, a daemon gone): vLLM recomputes them; nothing wrong is ever served.

Failures: kvstore is a cache. A daemon that is down, slow or refusing is a miss (0
matched tokens) with one warning per minute, never a failed request; after a failure
the scheduler does not ask again for ``retry_after_s``. Start-up errors (a bad
setting, an unsupported vLLM, a namespace name bound to another layout) are raised.

Hybrid models (vLLM's hybrid KV cache manager, kept on: :class:`SupportsHMA`): full
attention and sliding-window layers form KV cache groups with block ids of their own. A
kvstore block holds every group's page of its tokens; a load writes a sliding-window
group's pages only inside its window, and is asynchronous (vLLM hears of a failed one
by request, then computes it whole); a block whose window pages vLLM already freed is
not stored (:mod:`kvclient.integrations.vllm.plan`, rule 6). A model with layers that
cannot be stored (state-space) gets one warning at start, and the connector stands
aside: every prompt is computed, nothing fails.

Namespaces: one per (model, vLLM's KV page layout, tokens per block, layers, KV heads,
head dim, dtype, tensor-parallel rank and size, ``cache_salt``): a request's
``cache_salt`` is the namespace's tenant salt, so different models, layouts or tenants
never share a block. The page layout is part of the model id because a block is stored
as the backend's raw page bytes (:mod:`kvclient.integrations.vllm.blocks`).

Keys: within a namespace a block is keyed by its tokens and whatever else vLLM's own
block hashes fold in: the multimodal items it overlaps, the LoRA adapter (by its
weights), its prompt embeddings (:mod:`kvclient.integrations.vllm.request_keys`). A
request the connector cannot key is left to vLLM: neither loaded nor stored, logged
once per reason and counted in the stats (``unkeyed_*_requests``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvclient.integrations.vllm.plan import StepPlan
from kvclient.integrations.vllm.scheduler import SchedulerSide
from kvclient.integrations.vllm.settings import (
    ConnectorSettings,
    EngineLayout,
    UnstorableModel,
    check_vllm_version,
    log,
)
from kvclient.integrations.vllm.stats import KVStorePromMetrics, KVStoreStats
from kvclient.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """The scheduler's plan for one step, sent to every worker."""

    plan: StepPlan


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector of kvstore; see the module docstring. Without a side (a
    model it cannot store) it answers as a connector with an empty cache."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        check_vllm_version()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra(
            dict(transfer.kv_connector_extra_config), os.environ
        )
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        try:
            self.layout = EngineLayout.of(vllm_config, kv_cache_config, self.settings)
        except UnstorableModel as exc:
            if role == KVConnectorRole.SCHEDULER:  # one line, not one per worker
                log.warning("kvstore connector stands aside: %s; vLLM computes every prompt", exc)
            return
        if role == KVConnectorRole.SCHEDULER:
            # a block that fails to load is recomputed, never a failed request
            transfer.kv_load_failure_policy = self.settings.load_failure_policy
            self._scheduler = SchedulerSide(self.settings, self.layout)
        else:
            self._worker = WorkerSide(self.settings, self.layout, _worker_rank())

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    # -- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.register(kv_caches, self._num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVStoreConnectorMetadata)
        if metadata.plan.loads and self._worker is not None:
            self._worker.load(metadata.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load is complete before the forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks are stored in wait_for_save, once every layer is written

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVStoreConnectorMetadata)
        if metadata.plan.saves and self._worker is not None:
            self._worker.save(metadata.plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished requests whose final save is done; with several KV cache groups, the
        asynchronous loads done, and those that failed (vLLM computes them whole)."""
        if self._worker is None:
            return KVConnectorTransferResults()
        if finished_req_ids:
            self._worker.finished(finished_req_ids)
        loaded, failed = self._worker.take_loaded()
        return KVConnectorTransferResults(self._worker.take_sent(), loaded, failed)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._worker if self._worker is not None else self._scheduler
        return None if side is None else KVStoreStats.take(side.counts)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVStoreStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self._worker is None else self._worker.take_failed_blocks()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        tokens = self._scheduler.matched(request, num_computed_tokens)
        # several KV cache groups: an asynchronous load (see the module docstring)
        return tokens, bool(tokens) and self._scheduler.layout.hybrid

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._scheduler is not None:
            self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._scheduler is None:
            return KVStoreConnectorMetadata(StepPlan())
        return KVStoreConnectorMetadata(self._scheduler.plan(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is None:
            return
        if connector_output.invalid_block_ids:
            self._scheduler.failed(set(connector_output.invalid_block_ids))
        if connector_output.failed_recving:
            self._scheduler.failed_requests(set(connector_output.failed_recving))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        return self._scheduler.finished(request, block_ids), None


def _worker_rank() -> int:
    """This worker's rank among the engine's tensor- and pipeline-parallel workers."""
    from vllm.distributed import parallel_state

    try:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        pp_rank = parallel_state.get_pp_group().rank_in_group
    except AssertionError:  # parallel state not initialised (a bare test engine)
        return 0
    return pp_rank * tp_size + tp_rank


__all__ = ["ConnectorSettings", "KVStoreConnector", "KVStoreConnectorMetadata"]
