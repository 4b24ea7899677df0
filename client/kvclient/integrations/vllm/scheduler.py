"""The scheduler side of the vLLM connector: lookups, claims and each step's plan
(the protocol: :mod:`kvclient.vllm`).

With several KV cache groups (a hybrid model) loads are asynchronous in vLLM's sense:
a hit is loaded in the step after its blocks are allocated (``allocated`` plans it),
and the request waits for it. vLLM can only hear of such a load failing by request, not
by block (its scheduler cannot map a block id of one group back to a request); the
request is then computed from its start, and asks kvstore no more."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvclient.claims import Claim
from kvclient.errors import KVStoreError, LayoutMismatchError, OutOfSpaceError
from kvclient.integrations.vllm.plan import (
    LoadSpec,
    RequestKeys,
    RequestState,
    SaveSpec,
    StepPlan,
    own_ids,
)
from kvclient.integrations.vllm.request_keys import Unkeyable, request_keys
from kvclient.integrations.vllm.settings import (
    POLL_PENDING_S,
    ConnectorSettings,
    EngineLayout,
    EngineNamespaces,
    log,
)
from kvclient.integrations.vllm.stats import new_counts
from kvclient.outages import Outage
from kvclient.sync_client import KVClient

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request



class SchedulerSide:
    """Lookups, claims and the per-step plans (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings, layout: EngineLayout) -> None:
        self.settings = settings
        self.layout = layout
        self.client = KVClient(
            settings.addr, timeout=settings.lookup_timeout_s, token=settings.token()
        )
        self.namespaces = EngineNamespaces(self.client, layout, 0, settings, announce=True)
        self.requests: dict[str, RequestState] = {}
        self.claims: dict[str, Claim] = {}
        self.final_saves: list[SaveSpec] = []  # of finished requests, for the next step
        self.async_loads: list[LoadSpec] = []  # hybrid models: for the next step
        self.no_reuse: set[str] = set()  # requests whose load failed: computed whole
        self.outage = Outage(log, settings.retry_after_s, f"kvstore at {self.client.addr}")
        self.counts = new_counts()  # for vLLM's connector stats (stats.py)
        self._told: set[str] = set()  # the reasons of unkeyed requests logged already
        try:  # a layout clash is a start-up error; a daemon not there yet is not
            self.namespaces.get("")
        except LayoutMismatchError:
            self.client.close()
            raise
        except KVStoreError as exc:
            self._failed(exc)

    def _failed(self, exc: KVStoreError) -> None:
        self.outage.failed(
            "daemon",
            "kvstore at %s: %s; requests compute their prefixes (no reuse) until it answers",
            self.client.addr,
            exc,
        )

    def _keys(self, request: Request) -> RequestKeys | None:
        """The request's extra keys; None (counted, logged once a reason) where it
        cannot be keyed: vLLM computes it and kvstore never stores it."""
        try:
            return request_keys(request, self.layout.block_tokens)
        except Unkeyable as exc:
            self.counts[f"unkeyed_{exc.reason}_requests"] += 1
            if exc.reason not in self._told:
                self._told.add(exc.reason)
                log.warning(
                    "kvstore connector leaves request %s to vLLM (no reuse, nothing stored): "
                    "%s; such requests are counted as unkeyed_%s_requests in vLLM's KV "
                    "connector stats, not logged again",
                    request.request_id, exc, exc.reason,
                )  # fmt: skip
            return None

    def matched(self, request: Request, local_tokens: int) -> int | None:
        state = self.requests.get(request.request_id)
        if state is None:
            state = RequestState(
                salt=request.cache_salt or "",
                # the ids vLLM hashes: embedded positions are 0s (their embeddings key them)
                prompt=list(request.all_token_ids[: request.num_prompt_tokens]),
                block_size=self.layout.block_tokens,
                tokens=request.all_token_ids if self.settings.store_replies else (),
                keys=self._keys(request),
            )
            self.requests[request.request_id] = state
        no_reuse = state.keys is None or request.request_id in self.no_reuse
        if state.full_blocks == 0 or no_reuse or self.outage.down:
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
        self.outage.answered()
        if pending_elsewhere and stored < state.loadable_blocks:
            if state.waiting_since is None or stored > state.waited_blocks:
                # the claim delivered blocks since the last look: it makes progress, so
                # the wait starts again (a slow prefill is waited for; a stalled claim
                # is given up on after early_reuse_wait_s without a block)
                state.waiting_since, state.waited_blocks = now, stored
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
        assert state.keys is not None
        extra = state.keys.wire(state.full_blocks)
        if self.settings.early_reuse and req_id not in self.claims:
            try:
                claim = ns.claim(prefix, 0, priority=self.settings.priority, extra_keys=extra)
            except OutOfSpaceError:  # no room to claim in: a plain lookup
                pass
            else:
                if claim.blocks:
                    self.claims[req_id] = claim
                    state.claim = claim.ticket()
                return claim.existing, claim.pending_elsewhere and not claim.blocks
        hit = ns.lookup(prefix, extra_keys=extra)
        # blocks pending under this request's own claim (resumed after a preemption)
        # are not worth waiting for: nobody else computes them
        waiting = self.settings.early_reuse and req_id not in self.claims
        return hit.blocks, waiting and hit.pending_blocks > 0

    def allocated(self, request: Request, blocks: KVCacheBlocks, external_tokens: int) -> None:
        state = self.requests.get(request.request_id)
        if state is not None:
            state.allocated(external_tokens)
            # once per request: what kvstore was asked for (the blocks after vLLM's own
            # prefix cache) and what it served of them: hit_rate is kvstore's (stats.py)
            if state.keys is not None:
                self.counts["lookup_tokens"] += state.asked_blocks * state.block_size
                self.counts["hit_tokens"] += external_tokens
            if self.layout.hybrid and external_tokens > 0:  # an asynchronous load
                state.block_ids = own_ids(blocks.get_block_ids())
                load = state.take_load(request.request_id)
                if load is not None:
                    self.async_loads.append(load)

    def plan(self, scheduler_output: SchedulerOutput) -> StepPlan:
        plan = StepPlan(loads=self.async_loads, saves=self.final_saves)
        self.final_saves, self.async_loads = [], []
        down = self.outage.down  # no saves for a daemon that just failed a call
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = own_ids(new.block_ids)
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
                state.block_ids = own_ids(new_ids or [[]] * max(1, len(self.layout.group_layers)))
                load = state.take_load(req_id)
                if load is not None:
                    plan.loads.append(load)
            elif new_ids is not None:
                for ids, more in zip(state.block_ids, new_ids, strict=True):
                    ids.extend(more)
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            if state is None or req_id not in computed:
                continue
            done = computed[req_id] + scheduled
            first_held = self.layout.first_held(computed[req_id])
            save = state.take_save(req_id, done, first_held=first_held)
            if save is not None and not down:
                plan.saves.append(save)
        return plan

    def failed(self, block_ids: set[int]) -> None:
        """Blocks a worker could not load (one KV cache group): vLLM recomputes them,
        and the steps that do store them again (they were missing or damaged in
        kvstore)."""
        for state in self.requests.values():
            for i, block_id in enumerate(state.block_ids[0][: state.saved]):
                if block_id in block_ids:
                    state.saved = i
                    break

    def failed_requests(self, req_ids: set[str]) -> None:
        """Requests whose asynchronous load failed (a hybrid model): vLLM computes them
        from their start; when it asks again, :meth:`matched` gives them no hit, so they
        store every block again."""
        self.no_reuse.update(req_ids)

    def finished(self, request: Request, block_ids: tuple[list[int], ...]) -> bool:
        """vLLM is done with ``request``: store what it computed and no step stored
        (the reply's last blocks under async scheduling) -> whether vLLM must keep
        its blocks until the worker reports that save done."""
        state = self.requests.get(request.request_id)
        if state is None or not self.settings.store_replies or self.outage.down:
            self._end(request.request_id)
            return False
        # tokens whose KV exists: those of steps still in flight are not counted
        computed = max(0, request.num_computed_tokens - request.num_in_flight_tokens)
        save = state.take_save(request.request_id, computed, block_ids, final=True)
        self._end(request.request_id)
        if save is None:
            return False
        self.final_saves.append(save)
        return True

    def _end(self, req_id: str) -> None:
        self.no_reuse.discard(req_id)
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
            self._end(req_id)
        self.client.close()
