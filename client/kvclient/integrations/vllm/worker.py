"""The worker side of the vLLM connector: the copies between vLLM's paged cache and
kvstore that a step's plan asks for (the protocol: :mod:`kvclient.vllm`)."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import deque
from typing import Any

import torch

from kvclient.claims import Claim
from kvclient.errors import ArenaUnavailableError, KVStoreError, LeaseError
from kvclient.integrations.vllm.blocks import NULL_BLOCK, PagedLayers
from kvclient.integrations.vllm.plan import LoadSpec, SaveSpec, StepPlan
from kvclient.integrations.vllm.settings import (
    ConnectorSettings,
    EngineLayout,
    EngineNamespaces,
    log,
)
from kvclient.integrations.vllm.stats import new_counts
from kvclient.namespace import Namespace
from kvclient.outages import Outage
from kvclient.puts_ahead import PendingPut
from kvclient.sync_client import KVClient


class WorkerSide:
    """Copies between vLLM's paged cache and kvstore (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings, layout: EngineLayout, rank: int) -> None:
        self.settings = settings
        self.layout = layout
        self.client = KVClient(settings.addr, timeout=settings.io_timeout_s, token=settings.token())
        self.namespaces = EngineNamespaces(self.client, layout, rank, settings)
        self.layers: PagedLayers | None = None
        self.outage = Outage(log, settings.retry_after_s)  # after a failed call: no saves
        self.counts = new_counts()  # for vLLM's connector stats (stats.py)
        self.failed_blocks: set[int] = set()  # loads that failed (one KV cache group)
        # hybrid models: asynchronous loads done this step, and those that failed
        self.loaded: set[str] = set()
        self.failed_loads: set[str] = set()
        self.claims: dict[str, Claim | None] = {}  # None: the claim was lost, plain puts
        self.pending: deque[PendingPut] = deque()
        self.sent: set[str] = set()  # finished requests whose final save is done
        self._rows = torch.empty((0, layout.block_bytes), dtype=torch.uint8)

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        missing = [name for name in self.layout.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"KVStoreConnector: no KV cache for layers {missing}")
        layers = [kv_caches[name] for name in self.layout.layer_names]
        self.layers = PagedLayers(layers, num_blocks, groups=self.layout.group_layers)
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
            wanted = len(spec.block_ids[0])
            if self.layout.hybrid:  # an asynchronous load: done, whole or failed
                self.loaded.add(spec.req_id)
                if loaded < wanted:
                    self.failed_loads.add(spec.req_id)
            elif loaded < wanted:  # (a window's null block is no block of the request)
                self.failed_blocks.update(set(spec.block_ids[0][loaded:]) - {NULL_BLOCK})
            took_ms = (time.perf_counter() - started) * 1e3
            self.counts["loaded_blocks"] += loaded
            self.counts["load_ms"] += took_ms
            log.debug(
                "request %s: loaded %d of %d blocks in %.2f ms",
                spec.req_id, loaded, wanted, took_ms,
            )  # fmt: skip

    def _load(self, spec: LoadSpec) -> int:
        """Load one request's blocks -> how many of ``spec.block_ids`` were loaded (0
        after any failure: an asynchronous load must be reported, whatever failed, or
        its request waits for ever)."""
        assert self.layers is not None
        end = spec.start + len(spec.block_ids[0])
        try:
            ns = self.namespaces.get(spec.salt)
            window = max(1, self.settings.window_bytes // self.layout.block_bytes)
            got = 0
            try:
                # window by window: a prefix longer than the daemon's host tier too
                for lease in ns.windows(
                    spec.tokens, extra_keys=spec.extra_keys, start=spec.start, stop=end,
                    window_blocks=window,
                ):  # fmt: skip
                    n = lease.n_blocks
                    ids = [group[got : got + n] for group in spec.block_ids]
                    self.layers.scatter(ids, self._leased_rows(lease, 0, n))
                    got += n
                return got
            except ArenaUnavailableError:  # another host: the bytes come inline
                rows = self._rows_for(end)
                result = ns.get(spec.tokens, extra_keys=spec.extra_keys, out=rows.numpy()[:end])
                got = max(result.n_blocks - spec.start, 0)
                if got:
                    ids = [group[:got] for group in spec.block_ids]
                    self.layers.scatter(ids, rows[spec.start : spec.start + got])
                return got
        except Exception as exc:  # noqa: BLE001 - a cache: a failed load is recomputed
            self.outage.warn("load", "kvstore load failed (%s); vLLM recomputes the blocks", exc)
            return 0

    def _leased_rows(self, lease: Any, first: int, n: int) -> torch.Tensor:
        """Blocks ``first .. first + n`` of a lease as one uint8 tensor: the arena's own
        bytes when the slots form one run, else copied into the reused buffer."""
        run = lease.blocks
        with warnings.catch_warnings():  # the arena's views are read-only; only read here
            warnings.simplefilter("ignore", UserWarning)
            if run is not None and run.strides[0] > 0:  # (torch takes no downward run)
                return torch.from_numpy(run[first : first + n])
            rows = self._rows_for(n)
            lease.copy_to(rows.numpy(), first, n)
            return rows[:n]

    def take_failed_blocks(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed

    def take_loaded(self) -> tuple[set[str], set[str]]:
        """The asynchronous loads done since the last call, and those of them that
        failed (vLLM's finished_recving and failed_recving)."""
        done, failed = self.loaded, self.failed_loads
        self.loaded, self.failed_loads = set(), set()
        return done, failed

    # -- saves ----------------------------------------------------------------------

    def save(self, plan: StepPlan) -> None:
        self._reap()
        # vLLM frees a finished request's blocks once told, stored or not
        self.sent.update(spec.req_id for spec in plan.saves if spec.final)
        for spec in plan.saves:
            if self.outage.down:
                return  # a daemon that just failed: do not stall steps on it
            started = time.perf_counter()
            try:
                self._save(spec)
            except KVStoreError as exc:
                self._drop_claim(spec.req_id)
                self.outage.failed("save", "kvstore did not take blocks (%s)", exc)
            else:
                self.counts["saved_blocks"] += len(spec.block_ids[0])
            took_ms = (time.perf_counter() - started) * 1e3
            self.counts["save_ms"] += took_ms
            log.debug(
                "request %s: stored blocks %d..%d in %.2f ms",
                spec.req_id, spec.start, spec.start + len(spec.block_ids[0]), took_ms,
            )  # fmt: skip

    def _save(self, spec: SaveSpec) -> None:
        assert self.layers is not None
        n = len(spec.block_ids[0])
        rows = self.layers.gather(spec.block_ids, self._rows_for(n)).numpy()
        ns = self.namespaces.get(spec.salt)
        start, end = spec.start, spec.start + n
        claim = self._claim(spec, ns)
        # the claim covers prompt blocks; saves after its last one (a reply's) are puts
        if claim is not None and start < claim.first + claim.blocks:
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
        pending = ns.put_nowait(
            spec.tokens, rows, start, priority=self.settings.priority, extra_keys=spec.extra_keys
        )
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
                self.outage.warn("put", "kvstore refused a put sent ahead: %s", exc)

    def finished(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.claims.pop(req_id, None)

    def take_sent(self) -> set[str]:
        sent, self.sent = self.sent, set()
        return sent

    def close(self) -> None:
        self.claims.clear()
        self.client.close()
