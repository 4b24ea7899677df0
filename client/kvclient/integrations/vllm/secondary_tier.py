"""kvstore as a secondary tier of vLLM's native offloading (``vllm.v1.kv_offload.tiering``,
vLLM >= 0.32): vLLM moves KV between the GPU and its own CPU tier (the primary tier),
and cascades chunks from there to kvstore and promotes them back::

    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": ..., "secondary_tiers": [{"type": "kvstore",
            "module_path": "kvclient.integrations.vllm.secondary_tier"}]}

vLLM's factory imports ``module_path`` and takes the attribute named by ``type`` (the
:data:`kvstore` alias of :class:`KVStoreTier`); the tier dict's other keys are the
constructor's keyword arguments (``addr``, ``model``, ...).

Protocol. Every method runs on vLLM's scheduler thread and returns at once:

- ``lookup(key)``: vLLM's :class:`AsyncLookupManager` gathers a step's keys and hands
  them to its lookup thread once per step (``on_schedule_end``), one batch per request;
  the thread asks the daemon (:meth:`KVStoreTier.present`: one LookupBatch per
  max_blocks_per_request chunks) and ``lookup`` answers RETRY until the verdict is in.
- ``submit_store`` / ``submit_load``: queued for one I/O thread, loads before stores (a
  load holds back a request; a store only holds primary slots). A store copies each
  chunk from the primary tier's memoryview straight into a slot of the daemon's arena
  (``put_nowait``: the commit is not waited for); a load copies each chunk from the
  arena straight into its primary slot (``get`` with ``out``). Without the arena (a
  daemon on another host) the same calls carry the bytes inline.
- ``get_finished_jobs``: the jobs done since the last call; ``drain_jobs`` waits for
  the queue to empty (each call has its deadline, so the wait is bounded).

Keys. vLLM's chunk key (``OffloadKey``: the block hash and the KV cache group) already
folds in the whole prefix, the request's ``cache_salt``, LoRA adapter and multimodal
inputs. The tier sees chunks without their prefix (the primary tier may hold the start
of a prompt), so each chunk is a chain of one block of its own: placeholder tokens
(:data:`CHUNK_TOKENS`) with the key as extra key (:func:`chunk_extra`). What makes two
engines' chunks interchangeable (the model, named by its weights as the connector
names it, and vLLM's own description of a chunk's bytes: groups, layers, dtype,
parallelism, layout) is the namespace (:func:`tier_model`), so keys are the same in
every process, on every host, after every restart.

Faults. kvstore is a cache: a daemon that is down, restarted or slow makes lookups
misses and jobs failed jobs (vLLM recomputes), never an exception into the scheduler
or a wait without a deadline. After a failed call the tier answers misses for
``retry_after_s`` without asking (:class:`kvclient.outages.Outage`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvclient.errors import KVStoreError
from kvclient.integrations.vllm.settings import engine_model_id
from kvclient.integrations.weights import weights_id
from kvclient.namespace import Namespace
from kvclient.outages import Outage
from kvclient.puts_ahead import PendingPut
from kvclient.security import read_token_file
from kvclient.sync_client import KVClient
from kvstore.keys import DTYPE_BYTES, MIN_BLOCK_TOKENS, encode_extra

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

# under vLLM's own logger: the tier's lines go where vLLM's go, in its format
log = logging.getLogger("vllm.kvstore_tier")

CHUNK_TOKENS = np.zeros(MIN_BLOCK_TOKENS, dtype=np.int64)  # a chunk's one-block chain
MAX_PENDING_PUTS = 1024  # puts whose answers are not read yet, before a store waits


def chunk_extra(key: OffloadKey) -> list[bytes]:
    """The extra keys that name vLLM chunk ``key`` in the tier's namespace."""
    return [encode_extra(["vllm-offload-key", bytes(key)])]


def tier_model(spec: OffloadingSpec, model: str | None = None) -> str:
    """The namespace's model id: the model by its weights (or ``model``), and a digest
    of vLLM's own description of a chunk's bytes (the ``fs`` tier's FileMapper fields,
    parallelism collapsed where vLLM says the bytes do not depend on it, and the KV
    cache's page layout), its path aside: the same weights loaded from two paths share
    their chunks.

    A tier sees the engine through vLLM's ``OffloadingConfig``: the model's name and KV
    dtype, not its ``--revision`` or ``--hf-overrides`` (vLLM's own ``fs`` tier keys its
    files by the same fields). Where vLLM's current config is set, the model id takes
    them as the connector does; elsewhere an engine that serves one name at another
    revision or with overrides gives the tier ``model`` to keep its chunks apart."""
    fields = FileMapper.from_offloading_spec(
        root_dir="", offloading_spec=spec, blocks_per_file=spec.blocks_per_chunk,
        parallel_agnostic=True,
    ).get_run_config()  # fmt: skip
    fields.pop("model_name")
    fields["kv_cache_layout"] = spec.config.kv_cache_layout or "default"
    fields["canonical_layout"] = spec.config.canonical_layout
    layout = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(layout.encode()).hexdigest()[:16]
    return f"{model or _model_id(spec.config.model.name)}:vllm-tier-{digest}"


def _model_id(name: str) -> str:
    """``name`` by its weights, with the engine's revision and overrides where vLLM's
    current config is set and serves that model (as :mod:`.settings` names it)."""
    vllm_config = get_current_vllm_config_or_none()
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None or model_config.model != name:
        return weights_id(name)
    return engine_model_id(model_config)


class _Lookups(AsyncLookupManager):
    """vLLM's per-step lookup batching, answered by the tier."""

    def __init__(self, tier: KVStoreTier, tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.present(keys)


class KVStoreTier(SecondaryTierManager):
    """kvstore behind vLLM's CPU tier (see the module docstring)."""

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        addr: str | None = None,
        model: str | None = None,
        namespace: str = "",
        token_file: str = "",
        priority: int | None = None,
        codec: str = "exact",
        lookup_timeout_s: float = 0.5,
        io_timeout_s: float = 10.0,
        retry_after_s: float = 5.0,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        """``addr``: kvstored's address (default KVSTORE_ADDR or the default socket);
        ``model``: the model id in the namespace (default: its weights' digest);
        ``namespace``: a name to bind the namespace to; ``token_file``: this engine's
        token, where the daemon has tenants; ``priority`` (0..100) and ``codec`` of
        the stored chunks; ``lookup_timeout_s`` and ``io_timeout_s``: each lookup's
        and each copy's deadline; ``retry_after_s``: misses without asking after a
        failed call; ``locality``: LOCAL or REMOTE, as vLLM's tiers say (for its
        per-request tier filters). ValueError for a setting out of range."""
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        for name, value in (
            ("lookup_timeout_s", lookup_timeout_s), ("io_timeout_s", io_timeout_s),
            ("retry_after_s", retry_after_s),
        ):  # fmt: skip
            if not float(value) > 0:
                raise ValueError(f"kvstore tier: {name} must be > 0, got {value!r}")
        if priority is not None and not 0 <= int(priority) <= 100:
            raise ValueError(f"kvstore tier: priority must be in 0..100, got {priority!r}")
        rows = np.asarray(primary_kv_view).view(np.uint8)
        self._rows = rows.reshape(rows.shape[0], -1)  # chunk c is row c, one block
        if self._rows.shape[1] != self.block_size_bytes:
            raise ValueError("kvstore tier: the primary tier's chunks are not contiguous rows")
        token = read_token_file(token_file, "token_file") if token_file else None
        self.model = tier_model(offloading_spec, model)
        dtype = offloading_spec.config.model.dtype
        self._namespace_args: dict[str, Any] = dict(
            model=self.model, block_tokens=MIN_BLOCK_TOKENS, block_bytes=self.block_size_bytes,
            name=namespace, codec=codec, **({"dtype": dtype} if dtype in DTYPE_BYTES else {}),
        )  # fmt: skip
        self._priority = priority
        # lookups and copies have deadlines of their own: a client each
        self._lookup_client = KVClient(addr, timeout=lookup_timeout_s, token=token)
        self._io_client = KVClient(addr, timeout=io_timeout_s, token=token)
        self._open: dict[int, Namespace] = {}
        # one outage each: a lookup past its short deadline under load is no reason to
        # fail the loads and stores of the next retry_after_s, nor the reverse
        where = f"kvstore at {self._io_client.addr}"
        self._lookup_outage = Outage(log, retry_after_s, where)
        self._outage = Outage(log, retry_after_s, where)  # loads and stores
        self._pending: deque[PendingPut] = deque()  # puts sent ahead, answers unread
        # submitted jobs (loads, stores), the I/O thread's results, and how many are
        # queued or running (drain_jobs waits for 0)
        self._loads: deque[TransferJob] = deque()
        self._stores: deque[TransferJob] = deque()
        self._finished: SimpleQueue[JobResult] = SimpleQueue()
        self._load_keys: dict[int, list[OffloadKey]] = {}  # scheduler thread only
        self._in_flight = 0
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvstore-tier-io", daemon=True)
        self._thread.start()
        self._lookups = _Lookups(self, tier_type)
        log.info("kvstore tier: kvstored at %s, namespace model %s, chunks of %d bytes",
                 self._io_client.addr, self.model, self.block_size_bytes)  # fmt: skip

    # -- vLLM's scheduler thread ------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self._stores, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._load_keys[job_metadata.job_id] = list(job_metadata.keys)
        self._submit(self._loads, job_metadata)

    def _submit(self, queue: deque[TransferJob], job: TransferJob) -> None:
        with self._cond:
            queue.append(job)
            self._in_flight += 1
            self._cond.notify_all()

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The jobs done since the last call; a failed load's keys become misses (vLLM
        would otherwise promote them again and again)."""
        done: list[JobResult] = []
        while True:
            try:
                result = self._finished.get_nowait()
            except Empty:
                return done
            keys = self._load_keys.pop(result.job_id, None)
            if keys is not None and not result.success:
                kept = set(result.successful_keys or ())
                self._lookups.mark_miss([key for key in keys if key not in kept])
            done.append(result)

    def has_pending_work(self) -> bool:
        return self._in_flight > 0  # vLLM keeps stepping, so the results are collected

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def drain_jobs(self) -> None:
        """Wait until every submitted job is done (bounded: each call has a deadline)."""
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight == 0 or not self._thread.is_alive())

    def shutdown(self) -> None:
        """Stop the threads (a job being copied finishes first), fail the jobs still
        queued, close the clients and let go of the primary tier's buffer."""
        self._lookups.shutdown()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        for job in [*self._loads, *self._stores]:
            self._finished.put(JobResult(job_id=job.job_id, success=False))
        self._loads.clear()
        self._stores.clear()
        self._lookup_client.close()
        self._io_client.close()
        # our view of the primary tier's buffer, given back: vLLM closes its mmap next
        self._rows = np.empty((0, self.block_size_bytes), dtype=np.uint8)

    # -- the lookup thread ------------------------------------------------------------

    def present(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Whether the daemon holds each chunk of ``keys`` (each a chain of its own):
        one LookupBatch per max_blocks_per_request chunks; all False after a failed call."""
        if self._lookup_outage.down or not keys:
            return [False] * len(keys)
        try:
            ns = self._namespace(self._lookup_client)
            extras = [chunk_extra(key) for key in keys]
            found = ns.lookup_batch([CHUNK_TOKENS] * len(keys), extra_keys=extras)
        except KVStoreError as exc:
            self._lookup_outage.failed("lookup", "kvstore tier: lookup failed (%s); misses", exc)
            return [False] * len(keys)
        self._lookup_outage.answered()
        return [result.blocks > 0 for result in found]

    def _namespace(self, client: KVClient) -> Namespace:
        """The tier's namespace on ``client``, opened on first use (the daemon may come
        up after vLLM; a restarted one is re-opened by the client itself)."""
        ns = self._open.get(id(client))
        if ns is None:
            ns = self._open[id(client)] = client.namespace(**self._namespace_args)
        return ns

    # -- the I/O thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closing or self._loads or self._stores)
                if self._closing:
                    return
                is_load = bool(self._loads)
                job = (self._loads if is_load else self._stores).popleft()
            try:
                result = self._load(job) if is_load else self._store(job)
            except Exception:  # noqa: BLE001 - the edge: a job that broke fails, never the thread
                log.exception("kvstore tier: job %d failed", job.job_id)
                result = JobResult(job_id=job.job_id, success=False)
            self._finished.put(result)
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def _store(self, job: TransferJob) -> JobResult:
        """Copy each chunk into an arena slot and send its commit without waiting (the
        primary slot is free once copied); a failed call fails the job."""
        if self._outage.down:
            return JobResult(job_id=job.job_id, success=False)
        started = time.perf_counter()
        try:
            ns = self._namespace(self._io_client)
            self._reap()
            for key, chunk in zip(job.keys, job.chunk_ids, strict=True):
                self._pending.append(ns.put_nowait(
                    CHUNK_TOKENS, self._rows[int(chunk) : int(chunk) + 1],
                    priority=self._priority, extra_keys=chunk_extra(key),
                ))  # fmt: skip
        except KVStoreError as exc:
            self._outage.failed("store", "kvstore tier: store failed (%s); not stored", exc)
            return JobResult(job_id=job.job_id, success=False)
        self._outage.answered()
        return JobResult(
            job_id=job.job_id, success=True, transfer_time=time.perf_counter() - started,
            transfer_bytes=len(job.keys) * self.block_size_bytes,
        )  # fmt: skip

    def _reap(self) -> None:
        """Read the answers of earlier puts that came (waiting, bounded, for the oldest
        while too many are unread); warn of a refused one."""
        while self._pending and (self._pending[0].done() or len(self._pending) > MAX_PENDING_PUTS):
            try:
                self._pending.popleft().result(timeout=self._io_client.timeout)
            except KVStoreError as exc:
                self._outage.warn("put", "kvstore tier: the daemon refused a chunk: %s", exc)

    def _load(self, job: TransferJob) -> JobResult:
        """Copy each chunk from the daemon into its primary slot; the job succeeds when
        every chunk was there, else it names the chunks that were."""
        keys = list(job.keys)
        loaded: list[OffloadKey] = []
        started = time.perf_counter()
        if not self._outage.down:
            try:
                ns = self._namespace(self._io_client)
                for key, chunk in zip(keys, job.chunk_ids, strict=True):
                    out = self._rows[int(chunk) : int(chunk) + 1]
                    if ns.get(CHUNK_TOKENS, extra_keys=chunk_extra(key), out=out).n_blocks:
                        loaded.append(key)
            except KVStoreError as exc:
                self._outage.failed("load", "kvstore tier: load failed (%s); recomputed", exc)
            else:
                self._outage.answered()
        whole = len(loaded) == len(keys)
        return JobResult(
            job_id=job.job_id, success=whole,
            successful_keys=None if whole or not loaded else tuple(loaded),
            transfer_time=time.perf_counter() - started,
            transfer_bytes=len(loaded) * self.block_size_bytes,
        )  # fmt: skip


# the name vLLM's factory looks up: {"type": "kvstore", "module_path": this module}
kvstore = KVStoreTier
