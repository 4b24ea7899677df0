"""kvstore's KV connector for vLLM v1: reuse prompt prefixes across requests, engines
and restarts.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvclient.vllm", "kv_role": "kv_both"}'

or ``LLM(model, kv_transfer_config={...the same keys...})``. Settings go in
``kv_connector_extra_config`` (:class:`ConnectorSettings`); none is needed next to a
kvstored on its default socket.

Who calls what (vLLM's ``KVConnectorBase_V1``), and what this connector does then:

Scheduler side (one per engine, in the scheduler's process):

- ``get_num_new_matched_tokens``: one kvstore call on the prompt's full blocks
  (short deadline) -> tokens to load beyond vLLM's own prefix cache, always leaving
  the last prompt token to compute. With early reuse, blocks another engine is
  computing right now (pending) answer "ask again later" (None) until they are ready
  or ``early_reuse_wait_s`` has passed.
- With early reuse that Lookup is a claim (a Reserve): the prompt blocks nobody holds
  become this request's to compute, and another engine asking at the same moment sees
  them pending and waits instead of computing them too.
- ``update_state_after_alloc``: what vLLM decided to load.
- ``build_connector_meta``: the step's plan (:mod:`kvclient.vllm_plan`): loads for the
  requests scheduled for the first time, saves of the full blocks each step completes.
- ``update_connector_output``: blocks a worker could not load are stored again once
  vLLM has recomputed them.
- ``request_finished``: drop what a claim did not deliver (preempted, aborted or
  finished early); blocks are never held for a save: saves finish within the step.

Worker side (one per GPU / CPU worker):

- ``register_kv_caches``: the paged tensors (:mod:`kvclient.vllm_blocks`).
- ``start_load_kv``: before the forward pass, for each load, pin the blocks in the
  shared arena (``acquire``: zero-copy views) and copy them straight into vLLM's
  blocks, one ``index_copy_`` per layer; on another host, ``get`` inline.
- ``wait_for_layer_load`` / ``save_kv_layer``: nothing (loads are done before the
  forward; saves wait for all layers).
- ``wait_for_save``: gather the step's completed blocks into a reused buffer and put
  them sent ahead (``put_nowait``: the call returns once the bytes are in the arena,
  the daemon commits them behind the step), or fill the scheduler's claim.
- ``get_block_ids_with_load_errors``: blocks that did not load (evicted meanwhile, a
  failed check, a daemon gone): vLLM recomputes them; nothing wrong is ever served.

Failures: kvstore is a cache. A daemon that is down, slow or refusing is a miss (0
matched tokens) with one warning per minute, never a failed request; after a failure
the scheduler does not ask again for ``retry_after_s``. Start-up errors (a bad
setting, an unsupported vLLM, a namespace name bound to another layout) are raised.

Namespaces: one per (model, vLLM's KV page layout, tokens per block, layers, KV heads,
head dim, dtype, tensor-parallel rank and size, ``cache_salt``): a request's
``cache_salt`` is the namespace's tenant salt, so different models, layouts or tenants
never share a block. The page layout is part of the model id because a block is stored
as the backend's raw page bytes (:mod:`kvclient.vllm_blocks`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections import deque
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvclient.claims import Claim
from kvclient.errors import (
    ArenaUnavailableError,
    InvalidArgumentError,
    KVStoreError,
    LayoutMismatchError,
    LeaseError,
    OutOfSpaceError,
)
from kvclient.namespace import Namespace
from kvclient.puts_ahead import PendingPut
from kvclient.security import read_token_file
from kvclient.sync_client import KVClient
from kvclient.vllm_blocks import PagedLayers
from kvclient.vllm_plan import LoadSpec, RequestState, SaveSpec, StepPlan
from kvstore.keys import DTYPE_BYTES, MAX_BLOCK_TOKENS, MIN_BLOCK_TOKENS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# vLLM releases this connector is tested with: [first, end)
SUPPORTED_VLLM = ((0, 32), (0, 33))
WARN_EVERY_S = 60.0  # one warning of a kind per this many seconds
POLL_PENDING_S = 0.02  # early reuse: least time between two lookups of a waiting request


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` keys (all optional)."""

    addr: str | None = None  # kvstored address; default: KVSTORE_ADDR or the default socket
    priority: int | None = None  # of stored blocks (0..100); default: the daemon's
    early_reuse: bool = True  # wait for blocks another engine is computing; claim ours
    early_reuse_wait_s: float = 10.0  # longest a request waits for another engine
    lookup_timeout_s: float = 0.5  # scheduler's calls (lookup, claim): deadline each
    io_timeout_s: float = 10.0  # worker's calls (loads, saves): deadline each
    retry_after_s: float = 5.0  # after a failed call, answer misses this long
    model: str | None = None  # model id in the namespace; default: vLLM's model name
    namespace: str = ""  # a name to bind the (unsalted) namespace to, checked at start
    load_failure_policy: str = "recompute"  # vLLM's kv_load_failure_policy
    # a daemon with tenants: the file holding this engine's token (default
    # KVSTORE_TOKEN / KVSTORE_TOKEN_FILE). No key takes the token itself: vLLM logs
    # its configuration, kv_connector_extra_config included.
    token_file: str = ""

    def token(self) -> str | None:
        """The token from ``token_file``; None: the client's default (environment)."""
        if not self.token_file:
            return None
        try:
            return read_token_file(self.token_file, "token_file")
        except InvalidArgumentError as exc:
            raise ValueError(f"KVStoreConnector: {exc}") from None

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"KVStoreConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                f"known: {sorted(known)}"
            )
        settings = cls(**extra)
        for name in ("early_reuse_wait_s", "lookup_timeout_s", "io_timeout_s"):
            if not float(getattr(settings, name)) > 0:
                raise ValueError(f"KVStoreConnector: {name} must be > 0")
        if settings.priority is not None and not 0 <= int(settings.priority) <= 100:
            raise ValueError("KVStoreConnector: priority must be in 0..100")
        if settings.load_failure_policy not in ("recompute", "fail"):
            raise ValueError("KVStoreConnector: load_failure_policy is 'recompute' or 'fail'")
        return settings


def check_vllm_version(version: str = vllm.__version__) -> None:
    """One clear error at start-up for a vLLM this connector was not tested with."""
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        major_minor = (-1, -1)
    first, end = SUPPORTED_VLLM
    if not first <= major_minor < end:
        raise RuntimeError(
            f"KVStoreConnector supports vLLM >= {first[0]}.{first[1]}, < {end[0]}.{end[1]}; "
            f"this is vLLM {version}"
        )


@dataclass(frozen=True)
class EngineLayout:
    """What makes this engine's blocks interchangeable with another's (the namespace)."""

    model: str
    block_tokens: int
    block_bytes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    world_size: int
    layer_names: tuple[str, ...]

    @classmethod
    def of(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings
    ) -> EngineLayout:
        groups = kv_cache_config.kv_cache_groups
        spec = groups[0].kv_cache_spec if len(groups) == 1 else None
        if spec is None or type(spec).__name__ != "FullAttentionSpec":
            kinds = [type(group.kv_cache_spec).__name__ for group in groups]
            raise ValueError(
                f"KVStoreConnector supports models with one full-attention KV cache group; "
                f"this model has {kinds}"
            )
        block_tokens = int(spec.block_size)
        if not MIN_BLOCK_TOKENS <= block_tokens <= MAX_BLOCK_TOKENS:
            raise ValueError(
                f"KVStoreConnector: vLLM's block_size {block_tokens} is outside kvstore's "
                f"{MIN_BLOCK_TOKENS}..{MAX_BLOCK_TOKENS} tokens per block"
            )
        layer_names = tuple(groups[0].layer_names)
        dtype = str(spec.dtype).removeprefix("torch.")
        device = vllm_config.device_config.device_type
        page_layout = kv_cache_config.kv_cache_layout or "default"
        model = settings.model or vllm_config.model_config.model
        parallel = vllm_config.parallel_config
        return cls(
            model=f"{model}:vllm-{device}-{page_layout}",
            block_tokens=block_tokens,
            block_bytes=int(spec.page_size_bytes) * len(layer_names),
            num_layers=len(layer_names),
            num_kv_heads=int(spec.num_kv_heads),
            head_dim=int(spec.head_size),
            dtype=dtype,
            world_size=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
            layer_names=layer_names,
        )

    def namespace_fields(self, rank: int, salt: str) -> dict[str, Any]:
        """Arguments of ``KVClient.namespace``; the layout fields only when they account
        for every byte of a page (a padded page is described by ``block_bytes``)."""
        layout: dict[str, Any] = {
            "model": self.model,
            "block_tokens": self.block_tokens,
            "block_bytes": self.block_bytes,
            "rank": rank,
            "world_size": self.world_size,
            "tenant_salt": salt,
        }
        dtype_bytes = DTYPE_BYTES.get(self.dtype)
        implied = 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.block_tokens
        if dtype_bytes is not None and implied * dtype_bytes == self.block_bytes:
            layout.update(
                num_layers=self.num_layers,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                dtype=self.dtype,
            )
        return layout

    def describe(self) -> str:
        return (
            f"model={self.model} block_tokens={self.block_tokens} "
            f"block_bytes={self.block_bytes} num_layers={self.num_layers} "
            f"num_kv_heads={self.num_kv_heads} head_dim={self.head_dim} dtype={self.dtype} "
            f"world_size={self.world_size}"
        )


class _Warnings:
    """At most one warning of each kind per WARN_EVERY_S (a broken daemon is seen by
    every request; the log should say so once, not thousands of times)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._last[kind] = now
            log.warning(message, *args)


class _Namespaces:
    """The namespaces of one connector side, by ``cache_salt``, opened on first use."""

    def __init__(self, client: KVClient, layout: EngineLayout, rank: int, name: str = "") -> None:
        self.client = client
        self.layout = layout
        self.rank = rank
        self.name = name
        self._open: dict[str, Namespace] = {}

    def get(self, salt: str) -> Namespace:
        ns = self._open.get(salt)
        if ns is None:
            try:
                ns = self.client.namespace(
                    name=self.name if not salt else "",
                    **self.layout.namespace_fields(self.rank, salt),
                )
            except LayoutMismatchError as exc:
                raise LayoutMismatchError(
                    f"kvstore namespace {self.name!r} is bound to another layout than "
                    f"this engine's ({self.layout.describe()}): {exc}",
                    addr=self.client.addr,
                ) from None
            self._open[salt] = ns
        return ns


class _SchedulerSide:
    """Lookups, claims and the per-step plans (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings, layout: EngineLayout) -> None:
        self.settings = settings
        self.layout = layout
        self.client = KVClient(
            settings.addr, timeout=settings.lookup_timeout_s, token=settings.token()
        )
        self.namespaces = _Namespaces(self.client, layout, rank=0, name=settings.namespace)
        self.requests: dict[str, RequestState] = {}
        self.claims: dict[str, Claim] = {}
        self.warnings = _Warnings()
        self._down_until = 0.0
        try:  # a layout clash is a start-up error; a daemon not there yet is not
            self.namespaces.get("")
        except LayoutMismatchError:
            self.client.close()
            raise
        except KVStoreError as exc:
            self._failed(exc)

    def _failed(self, exc: KVStoreError) -> None:
        self._down_until = time.monotonic() + self.settings.retry_after_s
        self.warnings.warn(
            "daemon",
            "kvstore at %s: %s; requests compute their prefixes (no reuse) until it answers",
            self.client.addr,
            exc,
        )

    def _usable(self) -> bool:
        return time.monotonic() >= self._down_until

    def matched(self, request: Request, local_tokens: int) -> int | None:
        state = self.requests.get(request.request_id)
        if state is None:
            state = RequestState(
                salt=request.cache_salt or "",
                prompt=list(request.prompt_token_ids or ()),
                block_size=self.layout.block_tokens,
            )
            self.requests[request.request_id] = state
        if state.full_blocks == 0 or not self._usable():
            return state.matched(local_tokens, 0)
        now = time.monotonic()
        if state.waiting_since is not None and now - state.last_lookup < POLL_PENDING_S:
            return None  # waiting for another engine: do not ask the daemon every step
        state.last_lookup = now
        try:
            stored, pending_elsewhere = self._stored_blocks(request.request_id, state)
        except KVStoreError as exc:
            self._failed(exc)
            return state.matched(local_tokens, 0)
        if pending_elsewhere and stored < state.loadable_blocks:
            if state.waiting_since is None:
                state.waiting_since = now
            if now - state.waiting_since < self.settings.early_reuse_wait_s:
                return None  # ask again later: another engine computes these blocks
        return state.matched(local_tokens, stored)

    def _stored_blocks(self, req_id: str, state: RequestState) -> tuple[int, bool]:
        """Blocks of the prompt kvstore holds, and whether the next ones are being
        computed by another engine. With early reuse this is a claim (one Reserve):
        the blocks nobody holds become this request's to compute, so that two engines
        asking at once never both compute them."""
        ns = self.namespaces.get(state.salt)
        prefix = state.prompt[: state.full_blocks * state.block_size]
        if self.settings.early_reuse and req_id not in self.claims:
            try:
                claim = ns.claim(prefix, 0, priority=self.settings.priority)
            except OutOfSpaceError:  # no room to claim in: a plain lookup
                pass
            else:
                if claim.blocks:
                    self.claims[req_id] = claim
                    state.claim = claim.ticket()
                return claim.existing, claim.pending_elsewhere and not claim.blocks
        hit = ns.lookup(prefix)
        # blocks pending under this request's own claim (resumed after a preemption)
        # are not worth waiting for: nobody else computes them
        waiting = self.settings.early_reuse and req_id not in self.claims
        return hit.blocks, waiting and hit.pending_blocks > 0

    def allocated(self, request: Request, external_tokens: int) -> None:
        state = self.requests.get(request.request_id)
        if state is not None:
            state.allocated(external_tokens)

    def plan(self, scheduler_output: SchedulerOutput) -> StepPlan:
        plan = StepPlan()
        down = not self._usable()  # no saves for a daemon that just failed a call
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            computed[new.req_id] = new.num_computed_tokens
            load = state.take_load(new.req_id)
            if load is not None:
                plan.loads.append(load)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
                load = state.take_load(req_id)
                if load is not None:
                    plan.loads.append(load)
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            if state is None or req_id not in computed:
                continue
            save = state.take_save(req_id, computed[req_id] + scheduled)
            if save is not None and not down:
                plan.saves.append(save)
        return plan

    def failed(self, block_ids: set[int]) -> None:
        """Blocks a worker could not load: vLLM recomputes them, and the steps that do
        store them again (they were missing or damaged in kvstore)."""
        for state in self.requests.values():
            for i, block_id in enumerate(state.block_ids[: state.saved]):
                if block_id in block_ids:
                    state.saved = i
                    break

    def finished(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        claim = self.claims.pop(req_id, None)
        if state is not None and claim is not None and state.saved >= claim.first + claim.blocks:
            return  # the worker was told to deliver all of it: nothing left to drop
        if claim is not None:
            try:
                claim.abandon()  # what the worker did not deliver: waiters compute it
            except KVStoreError as exc:
                log.debug("abandon of request %s's claim failed: %s", req_id, exc)

    def close(self) -> None:
        for req_id in list(self.claims):
            self.finished(req_id)
        self.client.close()


class _WorkerSide:
    """Copies between vLLM's paged cache and kvstore (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings, layout: EngineLayout, rank: int) -> None:
        self.settings = settings
        self.layout = layout
        self.client = KVClient(settings.addr, timeout=settings.io_timeout_s, token=settings.token())
        self.namespaces = _Namespaces(self.client, layout, rank, name=settings.namespace)
        self.layers: PagedLayers | None = None
        self.warnings = _Warnings()
        self.failed_blocks: set[int] = set()
        self.claims: dict[str, Claim | None] = {}  # None: the claim was lost, plain puts
        self._down_until = 0.0  # after a failed call, no saves until then
        self.pending: deque[PendingPut] = deque()
        self._rows = torch.empty((0, layout.block_bytes), dtype=torch.uint8)

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        missing = [name for name in self.layout.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"KVStoreConnector: no KV cache for layers {missing}")
        layers = [kv_caches[name] for name in self.layout.layer_names]
        self.layers = PagedLayers(layers, num_blocks)
        if self.layers.block_bytes != self.layout.block_bytes:
            raise ValueError(
                f"KVStoreConnector: the KV cache tensors hold {self.layers.block_bytes} bytes "
                f"per block, the KV cache spec says {self.layout.block_bytes}"
            )
        self._warm_up()

    def _warm_up(self) -> None:
        """Connect, map the arena and open the namespace now, at start-up: else the
        first request to load pays for them (a cost of the process, not of the load)."""
        try:
            if self.client.arena_in_use:
                self.namespaces.get("")
        except KVStoreError as exc:  # the daemon is not there yet: first use connects
            log.debug("kvstore not reachable at start-up: %s", exc)

    def _rows_for(self, n: int) -> torch.Tensor:
        """A reused host buffer of at least n block rows (pinned where CUDA runs)."""
        if self._rows.shape[0] < n:
            size = max(n, 2 * self._rows.shape[0])
            pin = self.layers is not None and self.layers.device.type == "cuda"
            self._rows = torch.empty(
                (size, self.layout.block_bytes), dtype=torch.uint8, pin_memory=pin
            )
        return self._rows

    # -- loads ----------------------------------------------------------------------

    def load(self, plan: StepPlan) -> None:
        for spec in plan.loads:
            started = time.perf_counter()
            loaded = self._load(spec)
            if loaded < len(spec.block_ids):
                self.failed_blocks.update(spec.block_ids[loaded:])
            log.debug(
                "request %s: loaded %d of %d blocks in %.2f ms",
                spec.req_id, loaded, len(spec.block_ids), (time.perf_counter() - started) * 1e3,
            )  # fmt: skip

    def _load(self, spec: LoadSpec) -> int:
        """Load one request's blocks -> how many of ``spec.block_ids`` were loaded."""
        assert self.layers is not None
        end = spec.start + len(spec.block_ids)
        try:
            ns = self.namespaces.get(spec.salt)
            try:
                with ns.acquire(spec.tokens, max_blocks=end) as lease:
                    got = max(min(lease.n_blocks, end) - spec.start, 0)
                    if got:
                        self.layers.scatter(
                            spec.block_ids[:got], self._leased_rows(lease, spec.start, got)
                        )
                    return got
            except ArenaUnavailableError:  # another host: the bytes come inline
                rows = self._rows_for(end)
                result = ns.get(spec.tokens, out=rows.numpy()[:end])
                got = max(result.n_blocks - spec.start, 0)
                if got:
                    self.layers.scatter(spec.block_ids[:got], rows[spec.start : spec.start + got])
                return got
        except KVStoreError as exc:
            self.warnings.warn("load", "kvstore load failed (%s); vLLM recomputes the blocks", exc)
            return 0

    def _leased_rows(self, lease: Any, first: int, n: int) -> torch.Tensor:
        """Blocks ``first .. first + n`` of a lease as one uint8 tensor: the arena's own
        bytes when the slots form one run, else copied into the reused buffer."""
        run = lease.blocks
        with warnings.catch_warnings():  # the arena's views are read-only; only read here
            warnings.simplefilter("ignore", UserWarning)
            if run is not None:
                return torch.from_numpy(run[first : first + n])
            rows = self._rows_for(n)
            lease.copy_to(rows.numpy(), first, n)
            return rows[:n]

    def take_failed_blocks(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed

    # -- saves ----------------------------------------------------------------------

    def save(self, plan: StepPlan) -> None:
        self._reap()
        for spec in plan.saves:
            if time.monotonic() < self._down_until:
                return  # a daemon that just failed: do not stall steps on it
            started = time.perf_counter()
            try:
                self._save(spec)
            except KVStoreError as exc:
                self._drop_claim(spec.req_id)
                self._down_until = time.monotonic() + self.settings.retry_after_s
                self.warnings.warn("save", "kvstore did not take blocks (%s)", exc)
            log.debug(
                "request %s: stored blocks %d..%d in %.2f ms",
                spec.req_id, spec.start, spec.start + len(spec.block_ids),
                (time.perf_counter() - started) * 1e3,
            )  # fmt: skip

    def _save(self, spec: SaveSpec) -> None:
        assert self.layers is not None
        n = len(spec.block_ids)
        rows = self.layers.gather(spec.block_ids, self._rows_for(n)).numpy()
        ns = self.namespaces.get(spec.salt)
        start, end = spec.start, spec.start + n
        claim = self._claim(spec, ns)
        if claim is not None:
            first = claim.first + claim.delivered
            last = claim.first + claim.blocks
            if first < start:  # a gap the claim can never fill: give the rest back
                self._drop_claim(spec.req_id)
            elif first < end:
                upto = min(end, last)
                try:
                    claim.fill(rows[first - start : upto - start])
                except LeaseError:  # its lease ran out (a long prefill): plain puts now
                    self.claims[spec.req_id] = None
                    upto = first
                if upto >= end:
                    return
                rows, start = rows[upto - start :], upto
            else:
                return  # delivered already, or ready before the claim was made
        pending = ns.put_nowait(spec.tokens, rows, start, priority=self.settings.priority)
        self.pending.append(pending)

    def _claim(self, spec: SaveSpec, ns: Namespace) -> Claim | None:
        if spec.claim is None:
            return None
        if spec.req_id not in self.claims:
            self.claims[spec.req_id] = ns.resume_claim(spec.claim)
        claim = self.claims[spec.req_id]
        return claim if claim is not None and (claim.remaining or claim.delivered) else None

    def _drop_claim(self, req_id: str) -> None:
        claim = self.claims.get(req_id)
        self.claims[req_id] = None  # this request stores with plain puts from now on
        if claim is not None:
            with contextlib.suppress(KVStoreError):  # else its lease runs out on its own
                claim.abandon()

    def _reap(self) -> None:
        """Read the answers of earlier puts that came; warn of a refused one."""
        while self.pending and self.pending[0].done():
            try:
                self.pending.popleft().result(timeout=0)
            except KVStoreError as exc:
                self.warnings.warn("put", "kvstore refused a put sent ahead: %s", exc)

    def finished(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.claims.pop(req_id, None)

    def close(self) -> None:
        self.claims.clear()
        self.client.close()


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """The scheduler's plan for one step, sent to every worker."""

    plan: StepPlan


class KVStoreConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector of kvstore; see the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        check_vllm_version()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra(dict(transfer.kv_connector_extra_config))
        self.layout = EngineLayout.of(vllm_config, kv_cache_config, self.settings)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # a block that fails to load is recomputed, never a failed request
            transfer.kv_load_failure_policy = self.settings.load_failure_policy
            self._scheduler = _SchedulerSide(self.settings, self.layout)
        else:
            self._worker = _WorkerSide(self.settings, self.layout, _worker_rank())

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    # -- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches, self._num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVStoreConnectorMetadata)
        if metadata.plan.loads:
            self._worker.load(metadata.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load is complete before the forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks are stored in wait_for_save, once every layer is written

    def wait_for_save(self) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVStoreConnectorMetadata)
        if metadata.plan.saves:
            self._worker.save(metadata.plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is not None and finished_req_ids:
            self._worker.finished(finished_req_ids)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_failed_blocks()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return KVStoreConnectorMetadata(self._scheduler.plan(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        if connector_output.invalid_block_ids:
            self._scheduler.failed(set(connector_output.invalid_block_ids))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.finished(request.request_id)
        return False, None


def _worker_rank() -> int:
    """This worker's rank among the engine's tensor- and pipeline-parallel workers."""
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    try:
        tp_rank = get_tensor_model_parallel_rank()
        tp_size = get_tensor_model_parallel_world_size()
        pp_rank = get_pp_group().rank_in_group
    except AssertionError:  # parallel state not initialised (a bare test engine)
        return 0
    return pp_rank * tp_size + tp_rank


__all__ = ["ConnectorSettings", "KVStoreConnector", "KVStoreConnectorMetadata"]
