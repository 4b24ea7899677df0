"""Hugging Face transformers adapter: reuse prompt prefixes through kvstore.

    from kvclient import KVClient
    from kvclient.hf import HFPrefixCache

    with KVClient() as client:
        kv = HFPrefixCache(client, model, "meta-llama/Llama-3.1-8B@main")
        out = kv.generate(input_ids, max_new_tokens=64)   # out.tokens, out.stats
        print(out.stats.reused_tokens, out.stats.computed_tokens, out.stats.ttft_s)

Protocol of one prefill (:meth:`HFPrefixCache.prefill`):

1. Cap reuse at ``(len(prompt) - 1) // block_tokens`` blocks: the model must compute at
   least the last prompt token to produce the next-token logits.
2. ``lookup`` (for the host/disk split) and ``get`` the longest cached prefix of those
   blocks; turn the bytes into a ``DynamicCache`` (:func:`cache_from_blocks`). This step
   alone is :meth:`HFPrefixCache.load`. With layer-wise loading (``stream_layers``, the
   default wherever the daemon's arena maps here) the blocks are acquired instead and
   every layer's copy is enqueued (CUDA: on a side stream, one event per layer) or
   left until the model reaches the layer (CPU), and the cache's layers keep room after
   the prefix for the tokens still to come (``cache.ReservedLayer``: no copy of the
   prefix per forward).
3. Run the model on the remaining tokens only, at positions ``reused ..`` (so RoPE and
   the causal mask see the true offsets); with layer-wise loading, decoder layer ``i``
   first waits for layer ``i``'s copy (a forward pre-hook), so copies of later layers
   overlap the compute of earlier ones, and the lease ends after the forward. TTFT is
   measured here: from the call until the logits exist (on CUDA, after a synchronize).
4. ``put`` the prompt's new full blocks with ``start`` = reused blocks
   (:func:`blocks_from_cache`). Only full blocks are stored.

:meth:`HFPrefixCache.generate` does this, greedy-decodes on the same cache and then
stores the full blocks of prompt + reply, so the next chat turn (whose prompt contains
this one and its reply) reuses both.

Namespace: one per (model id, config fingerprint, KV layout, tenant salt). The layout
fields (layers, KV heads, head dim, dtype, tokens per block) are sent to the daemon,
which checks block_bytes against them. The model id names the weights (a repo and
revision); a fingerprint of the config is appended to it, so two different configs
never share blocks even under one id. A different tenant salt never shares either.

Block byte layout, for one block of T tokens::

    [layer][K|V][kv_head][token][head_dim]   (dtype of the model, native byte order)

i.e. a C-contiguous ``[num_layers, 2, num_kv_heads, T, head_dim]`` array. Why: a
``DynamicCache`` layer holds ``[batch, kv_heads, seq, head_dim]``, so inside a block
every (layer, K/V, head) is one contiguous run of ``T * head_dim`` elements cut from
that tensor; storing n blocks is one strided gather per layer and K/V into one
``[n, layers, 2, heads, T, head_dim]`` buffer, and loading is the inverse gather
straight into per-layer ``[1, heads, n*T, head_dim]`` tensors that the cache adopts
without another copy. Every block holds all layers, so a block is usable on its own
(the prefix tree's unit) and all of a prefix moves in one get.

Errors: when the daemon is unreachable, times out or has no room, the adapter logs a
warning and recomputes (a cache must never make an answer fail); malformed requests and
layout mismatches raise. Batch size 1; full-attention decoder models only
(:func:`kvclient.integrations.hf.cache.check_supported`).

Devices: where the daemon shares its arena with this process, blocks move straight
between the cache's tensors and the arena slots (:class:`kvclient.integrations.gpu.
GpuClient`, an ``HFKV`` over the tensors; on CUDA the arena is pinned and a batch is one
kernel launch or one DMA per run of slots, no host copy). Otherwise (a remote daemon,
``direct_copies=False``, or a CPU model with ``stream_layers=False``) block bytes
arrive in host memory (a numpy array filled from the shared arena or the gRPC stream)
and move with ``.to(device)``; stored blocks are gathered on the model's device and
copied back with ``.cpu()``. Both use the same byte
layout (``kvstore.kv_caches``), so blocks stored by either path are interchangeable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvclient.claims import Claim
from kvclient.errors import (
    ArenaUnavailableError,
    DaemonUnavailableError,
    OutOfSpaceError,
    RequestTimeoutError,
)
from kvclient.integrations.gpu import GpuClient, LayerOnboarding
from kvclient.integrations.hf import cache as hf_cache
from kvclient.integrations.hf.cache import UnsupportedModelError
from kvclient.integrations.hf.layout import (
    DEFAULT_BLOCK_TOKENS,
    KVLayout,
    blocks_from_cache,
    cache_from_blocks,
    config_fingerprint,
    model_device,
    text_config,
)
from kvclient.namespace import Namespace
from kvclient.sync_client import KVClient
from kvstore.kv_caches import HFKV

log = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 512  # early reuse: tokens per forward pass, blocks delivered after each
DEFAULT_WAIT_S = 10.0  # early reuse: wait for pending blocks before any prefill was timed
MAX_WAIT_S = 60.0
CLAIM_ATTEMPTS = 3  # early reuse: wait-load-claim rounds before computing regardless

# Failures a cache may have without the answer failing: recompute instead.
_RECOVERABLE = (DaemonUnavailableError, RequestTimeoutError, OutOfSpaceError)

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "GenerateOutput",
    "HFPrefixCache",
    "KVLayout",
    "LoadedPrefix",
    "PrefillOutput",
    "ReuseStats",
    "UnsupportedModelError",
    "blocks_from_cache",
    "cache_from_blocks",
    "config_fingerprint",
]


# -- the adapter ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReuseStats:
    """What one prefill did. ``reused_tokens + computed_tokens == prompt_tokens``."""

    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    host_blocks: int  # reused blocks served from the host tier
    disk_blocks: int  # reused blocks the daemon read from its disk tier
    stored_blocks: int  # new blocks the put stored (after the first token)
    load_s: float  # lookup + get + building the cache
    ttft_s: float  # call -> logits of the last prompt token
    store_s: float  # gathering and putting the new blocks (not part of TTFT)
    waited_s: float = 0.0  # early reuse: waiting for blocks another session computed

    @property
    def reused_blocks(self) -> int:
        return self.host_blocks + self.disk_blocks


@dataclass(frozen=True, slots=True, eq=False)
class LoadedPrefix:
    """A reusable prefix from kvstore: ``cache`` holds its first ``tokens`` tokens
    (None when nothing was cached)."""

    cache: Any
    tokens: int
    host_blocks: int
    disk_blocks: int
    load_s: float
    # layer-wise loading: copies still in flight (the prefill waits per layer, then
    # releases it); None once the cache is complete
    loading: LayerOnboarding | None = None

    def stats(
        self, prompt_tokens: int, stored: int, ttft_s: float, store_s: float, waited_s: float = 0.0
    ) -> ReuseStats:
        """The stats of a prefill of ``prompt_tokens`` that reused this prefix."""
        return ReuseStats(
            prompt_tokens=prompt_tokens,
            reused_tokens=self.tokens,
            computed_tokens=prompt_tokens - self.tokens,
            host_blocks=self.host_blocks,
            disk_blocks=self.disk_blocks,
            stored_blocks=stored,
            load_s=self.load_s,
            ttft_s=ttft_s,
            store_s=store_s,
            waited_s=waited_s,
        )


@dataclass(frozen=True, slots=True, eq=False)
class PrefillOutput:
    """Logits of the computed tokens (the last ``logits_to_keep`` of them, all for 0),
    the cache holding the whole prompt, and the stats."""

    logits: torch.Tensor
    cache: Any
    stats: ReuseStats


@dataclass(frozen=True, slots=True, eq=False)
class GenerateOutput:
    tokens: list[int]  # generated token ids (the first comes from the prefill)
    sequence: list[int]  # prompt + generated
    stats: ReuseStats
    decode_s: float  # after the first token, until the last
    stored_blocks: int  # blocks stored after decoding (prompt + reply)


class HFPrefixCache:
    """Reuse a transformers causal LM's prompt prefixes through one kvstore namespace.

    ``model_id`` should name the weights (repo and revision): two models with one config
    but different weights must not share an id. On a daemon with tenants the token
    of ``client`` (``KVClient(token=...)`` or ``KVSTORE_TOKEN``) decides whose
    namespace this is; ``tenant_salt`` further separates users of one tenant.
    ``codec``: how the daemon's disk and shared tiers keep the blocks (kvstore.codecs:
    "exact", "fp8", "int8", "int4"); the cache always gets the model's own dtype.
    ``stream_layers``: load a hit layer by layer while the model runs (module
    docstring, step 2), straight from the daemon's arena mapped here; None means on
    (CUDA: copies overlap earlier layers' compute; CPU: each layer is copied just
    before the model reads it, which skips the bytes path's copy out of the arena and
    the cache's copies of the prefix). False: the whole prefix first (CUDA: straight
    from the arena; CPU: through host memory, the bytes path).
    The namespace is opened at construction (the daemon must be reachable then).
    """

    def __init__(
        self,
        client: KVClient,
        model: torch.nn.Module,
        model_id: str,
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        tenant_salt: str = "",
        priority: int | None = None,
        fingerprint_config: bool = True,
        codec: str = "exact",
        direct_copies: bool = True,
        stream_layers: bool | None = None,
    ) -> None:
        hf_cache.check_supported(model.config)
        self.client = client
        # CUDA: copies between the cache and the pinned arena (None until first needed;
        # False once the arena proved not mappable here, or when turned off)
        self._gpu: GpuClient | None | bool = None if direct_copies else False
        self._stream_layers = stream_layers
        self._side_stream: torch.cuda.Stream | None = None
        self.model = model
        self.config = model.config
        self.layout = KVLayout.from_model(model, block_tokens)
        self.priority = priority
        self._tokens_per_s = 0.0  # measured prefill rate (early reuse weighs waiting by it)
        ns_model = model_id
        if fingerprint_config:
            ns_model = f"{model_id}#{config_fingerprint(model.config)[:16]}"
        vocab = getattr(text_config(model.config), "vocab_size", 0) or 0
        self.namespace: Namespace = client.namespace(
            ns_model,
            block_tokens,
            self.layout.block_bytes,
            tenant_salt=tenant_salt,
            vocab_size=vocab,
            codec=codec,
            tokenizer=str(getattr(model.config, "name_or_path", "") or ""),  # kvctl --text
            **self.layout.namespace_fields(),
        )

    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    def close(self) -> None:
        """Unpin and unmap the direct copy path's view of the arena (the client stays
        open: it is the caller's). Idempotent; a later call maps it again."""
        if isinstance(self._gpu, GpuClient):
            self._gpu.close()
            self._gpu = None

    def __enter__(self) -> HFPrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    # -- prefill ----------------------------------------------------------------------

    def prefill(
        self,
        input_ids: torch.Tensor | Sequence[int],
        *,
        store: bool = True,
        logits_to_keep: int = 1,
        early_reuse: bool = False,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        wait_s: float | None = None,
        reserve_tokens: int = 0,
    ) -> PrefillOutput:
        """Load the longest cached prefix, compute the rest, store the new full blocks.

        ``reserve_tokens``: room kept in a layer-wise loaded cache for that many tokens
        after the prompt (``generate`` passes ``max_new_tokens``), so decoding appends
        without copying the prefix.

        ``early_reuse``: for bursts of requests sharing a prompt (see
        :meth:`_prefill_early`): wait for blocks other sessions are computing, claim the
        rest, and deliver them chunk by chunk (``chunk_tokens`` per forward pass) so that
        concurrent sessions can start before this prefill ends.
        """
        start_time = time.perf_counter()
        if reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be >= 0, got {reserve_tokens}")
        ids = _as_ids(input_ids)
        tokens = ids.tolist()
        if early_reuse and store:
            return self._prefill_early(ids, start_time, logits_to_keep, chunk_tokens, wait_s)
        n_tokens = len(tokens)
        T = self.block_tokens
        loaded = self._load(ids, n_tokens + reserve_tokens)
        cache = loaded.cache if loaded.cache is not None else hf_cache.new_cache(self.config)
        reused = loaded.tokens
        reused_blocks = reused // T

        loading = loaded.loading
        try:
            with hf_cache.waiting_layers(self.model, loading.wait) if loading else nullcontext():
                cache, logits = self._forward(ids, reused, n_tokens, cache, logits_to_keep)
            _synchronize(self.device)
            ttft_s = time.perf_counter() - start_time
        finally:
            if loading is not None:
                loading.release()
        self._learn_rate(n_tokens - reused, ttft_s - loaded.load_s)

        stored, store_s = 0, 0.0
        if store:
            t0 = time.perf_counter()
            stored = self.store(tokens, cache, reused_blocks, n_tokens // T)
            store_s = time.perf_counter() - t0
        stats = loaded.stats(n_tokens, stored, ttft_s, store_s)
        return PrefillOutput(logits=logits, cache=cache, stats=stats)

    def _forward(
        self, ids: torch.Tensor, start: int, end: int, cache: Any, logits_to_keep: int
    ) -> tuple[Any, torch.Tensor]:
        """Run the model on tokens ``[start, end)`` at their true positions after the
        ``start`` tokens in ``cache``; returns the grown cache and the kept logits."""
        device = self.device
        kwargs = hf_cache.forward_kwargs(self.model, start, end - start, logits_to_keep, device)
        with torch.no_grad():
            out = self.model(
                input_ids=ids[start:end].to(device).unsqueeze(0),
                past_key_values=cache,
                use_cache=True,
                **kwargs,
            )
        logits = out.logits
        if logits_to_keep and logits.shape[1] > logits_to_keep:  # models without the argument
            logits = logits[:, -logits_to_keep:]
        return out.past_key_values, logits

    def _prefill_early(
        self,
        ids: torch.Tensor,
        start_time: float,
        logits_to_keep: int,
        chunk_tokens: int,
        wait_s: float | None,
    ) -> PrefillOutput:
        """Prefill with early reuse (DESIGN.md, "Early reuse"):

        1. If blocks of the reusable prefix are pending (another session is computing
           them), wait for them when that is expected to be faster than computing them
           here: at most as long as this session would take (``wait_s`` overrides).
        2. Load the ready prefix; claim the prompt's full blocks after it that nobody
           has (they turn pending for everyone else).
        3. Run the model chunk by chunk; after each chunk, deliver the claimed blocks it
           completed, so they are ready for waiters before this prefill ends.
        4. Abandon what was not delivered (a failure, or blocks someone else owns).
        """
        tokens = ids.tolist()
        n_tokens = len(tokens)
        T = self.block_tokens
        device = self.device
        reusable = ((n_tokens - 1) // T) * T
        waited_s = 0.0
        for _ in range(CLAIM_ATTEMPTS):
            if reusable:
                waited_s += self._wait_for_pending(tokens[:reusable], wait_s)
            loaded = self.load(ids)
            claim = self._claim(tokens, loaded.tokens // T)
            # lost the race for the next block to a session that claimed it just now:
            # wait for it (step 1) instead of computing it twice
            if claim is None or claim.blocks or not claim.pending_elsewhere:
                break
        cache = loaded.cache if loaded.cache is not None else hf_cache.new_cache(self.config)
        reused = loaded.tokens
        step = max(T, chunk_tokens // T * T) if chunk_tokens else n_tokens
        stored = 0
        try:
            pos = reused
            while True:
                end = min(n_tokens, pos + step)
                last = end == n_tokens
                cache, logits = self._forward(ids, pos, end, cache, logits_to_keep if last else 1)
                pos = end
                if last:
                    break
                stored += self._deliver(claim, cache, pos // T)
            _synchronize(device)
            ttft_s = time.perf_counter() - start_time
            self._learn_rate(n_tokens - reused, ttft_s - loaded.load_s - waited_s)
            t0 = time.perf_counter()
            stored += self._deliver(claim, cache, n_tokens // T)
            store_s = time.perf_counter() - t0
        finally:
            if claim is not None:
                claim.abandon()
        stats = loaded.stats(n_tokens, stored, ttft_s, store_s, waited_s)
        return PrefillOutput(logits=logits, cache=cache, stats=stats)

    def _wait_for_pending(self, prefix: list[int], wait_s: float | None) -> float:
        """Wait while another session computes blocks of ``prefix``, if it pays."""
        try:
            hit = self.namespace.lookup(prefix)
            if hit.pending_blocks == 0:
                return 0.0
            if wait_s is None:  # no longer than computing them here would take
                pending_tokens = (hit.blocks + hit.pending_blocks) * self.block_tokens
                rate = self._tokens_per_s
                wait_s = pending_tokens / rate if rate else DEFAULT_WAIT_S
            t0 = time.perf_counter()
            self.namespace.lookup(prefix, wait_pending_s=min(wait_s, MAX_WAIT_S))
            return time.perf_counter() - t0
        except _RECOVERABLE as exc:
            log.warning("kvstore lookup failed, computing the prompt: %s", exc)
            return 0.0

    def _claim(self, tokens: list[int], start_block: int) -> Claim | None:
        if len(tokens) // self.block_tokens <= start_block:
            return None
        try:
            return self.namespace.claim(tokens, start_block, priority=self.priority)
        except _RECOVERABLE as exc:  # no room: compute without storing
            log.info("kvstore claim refused, blocks not cached: %s", exc)
            return None

    def _deliver(self, claim: Claim | None, cache: Any, complete_blocks: int) -> int:
        """Hand the claimed blocks that ``cache`` now holds in full to the store."""
        if claim is None or not claim.blocks:
            return 0
        begin = claim.first + claim.delivered
        end = min(complete_blocks, claim.first + claim.blocks)
        if end <= begin:
            return 0
        rows = blocks_from_cache(cache, self.layout, begin, end).cpu().numpy()
        try:
            return claim.fill(rows)
        except _RECOVERABLE as exc:
            log.warning("kvstore could not take claimed blocks: %s", exc)
            claim.abandon()
            return 0

    def _learn_rate(self, tokens: int, seconds: float) -> None:
        """Prefill tokens per second, smoothed: what waiting is weighed against."""
        if tokens < self.block_tokens or seconds <= 0:
            return
        rate = tokens / seconds
        self._tokens_per_s = (
            rate if not self._tokens_per_s else 0.7 * self._tokens_per_s + 0.3 * rate
        )

    def load(self, input_ids: torch.Tensor | Sequence[int]) -> LoadedPrefix:
        """The longest cached prefix of the prompt that may be reused (at most
        ``(len - 1) // block_tokens`` blocks) as a ``DynamicCache`` on the model's device.

        The cache may also go to transformers' own ``model.generate(input_ids,
        past_key_values=loaded.cache)``, which then runs only the uncached tokens.
        """
        start_time = time.perf_counter()
        loaded = self._load(_as_ids(input_ids), 0)
        if loaded.loading is None:
            return loaded
        loaded.loading.release()  # every layer copied: the cache is complete
        return replace(loaded, loading=None, load_s=time.perf_counter() - start_time)

    def _load(self, ids: torch.Tensor, room: int) -> LoadedPrefix:
        """:meth:`load`, whose copies may still be in flight (``loading``); a layer-wise
        loaded cache keeps room for ``room`` tokens in all."""
        start_time = time.perf_counter()
        tokens = ids.tolist()
        T = self.block_tokens
        prefix = tokens[: ((len(tokens) - 1) // T) * T]
        gpu = self._gpu_client()
        if gpu is not None and prefix:
            try:
                return self._load_direct(gpu, prefix, room, start_time)
            except ArenaUnavailableError as exc:
                self._no_direct_copies(exc)
        blocks, host_blocks = self._fetch(prefix)
        if blocks is None or blocks.shape[0] == 0:
            return LoadedPrefix(None, 0, 0, 0, time.perf_counter() - start_time)
        n = int(blocks.shape[0])
        cache = cache_from_blocks(blocks, self.layout, self.config, self.device)
        host = min(host_blocks, n)  # tiers are prefix-closed: host holds the first blocks
        return LoadedPrefix(cache, n * T, host, n - host, time.perf_counter() - start_time)

    def _gpu_client(self) -> GpuClient | None:
        """The direct copy path: on a CUDA model, or with layer-wise loading (None:
        through host memory; also once the arena proved not mappable here)."""
        if self._gpu is None:
            direct = self.device.type == "cuda" or self._streams_layers()
            self._gpu = GpuClient(self.client) if direct else False
        return self._gpu if isinstance(self._gpu, GpuClient) else None

    def _streams_layers(self) -> bool:
        return True if self._stream_layers is None else self._stream_layers

    def _copy_stream(self) -> torch.cuda.Stream | None:
        """The side stream layer copies run on (CUDA), so they overlap the model's."""
        if self.device.type != "cuda":
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        return self._side_stream

    def _no_direct_copies(self, why: Exception) -> None:
        log.info("kvstore blocks go through host memory: %s", why)
        if isinstance(self._gpu, GpuClient):
            self._gpu.close()
        self._gpu = False

    def _load_direct(
        self, gpu: GpuClient, prefix: list[int], room: int, start_time: float
    ) -> LoadedPrefix:
        """``load`` on the direct path: one ``[layers, 2, 1, heads, capacity, head_dim]``
        tensor on the device, filled from the leased arena slots.

        Layer-wise (:meth:`_streams_layers`): the layers' copies are enqueued on the side
        stream (``loading``) and the cache is :class:`~kvclient.integrations.hf.cache.
        ReservedLayer` s over the tensor, with room for ``room`` tokens. Otherwise the
        whole prefix is copied before this returns and a ``DynamicCache`` adopts it."""
        T, layout = self.block_tokens, self.layout
        layered = self._streams_layers()
        loading: LayerOnboarding | None = None
        try:
            hit = self.namespace.lookup(prefix)
            n = hit.blocks
            if n == 0:
                return LoadedPrefix(None, 0, 0, 0, time.perf_counter() - start_time)
            capacity = max(n * T, room) if layered else n * T
            shape = (layout.num_layers, 2, 1, layout.num_kv_heads, capacity, layout.head_dim)
            kv = torch.empty(shape, dtype=layout.dtype, device=self.device)
            blocks = (self.namespace, prefix[: n * T], HFKV(kv[..., : n * T, :], T), list(range(n)))
            if layered:
                stream = self._copy_stream()
                if stream is not None:
                    kv.record_stream(stream)  # written there: not reused before it is done
                loading = gpu.onboard_layers(*blocks, stream=stream)
                m = loading.onboarded
            else:
                m = gpu.onboard(*blocks).onboarded
            # a prefix longer than the daemon's host tier: the rest window by window
            while 0 < m < n:
                more = gpu.onboard(*blocks[:3], list(range(m, n)), start=m).onboarded
                if more == 0:
                    break
                m += more
        except _RECOVERABLE as exc:
            log.warning("kvstore load failed, recomputing the prompt: %s", exc)
            return LoadedPrefix(None, 0, 0, 0, time.perf_counter() - start_time)
        # m: the ready prefix (all n blocks, or those still ready at the acquire)
        if m == 0:
            if loading is not None:
                loading.release()
            return LoadedPrefix(None, 0, 0, 0, time.perf_counter() - start_time)
        rooms = [(kv[i, 0], kv[i, 1]) for i in range(layout.num_layers)]
        if layered:
            cache = hf_cache.reserved_cache(self.config, rooms, m * T)
        else:
            cache = hf_cache.cache_from_layers(
                self.config, [(k[:, :, : m * T], v[:, :, : m * T]) for k, v in rooms]
            )
        host = min(hit.host_blocks, m)
        elapsed = time.perf_counter() - start_time
        return LoadedPrefix(cache, m * T, host, m - host, elapsed, loading)

    def _fetch(self, prefix: list[int]) -> tuple[np.ndarray | None, int]:
        """Bytes of the longest cached prefix of ``prefix`` and how many of its blocks
        the lookup saw in the host tier (None: nothing cached or the daemon failed)."""
        if not prefix:
            return None, 0
        try:
            hit = self.namespace.lookup(prefix)
            if hit.blocks == 0:
                return None, 0
            got = self.namespace.get(prefix)
        except _RECOVERABLE as exc:
            log.warning("kvstore lookup failed, recomputing the prompt: %s", exc)
            return None, 0
        return got.blocks, hit.host_blocks

    def store(self, tokens: Sequence[int], cache: Any, start_block: int, end_block: int) -> int:
        """Put blocks ``[start_block, end_block)`` of ``tokens`` from ``cache``; returns
        the blocks newly stored. Blocks before ``start_block`` must be stored already."""
        if end_block <= start_block:
            return 0
        chain = list(tokens[: end_block * self.block_tokens])
        ids = list(range(start_block, end_block))
        gpu = self._gpu_client()
        try:
            if gpu is not None:  # gathered from the cache's tensors straight into slots
                layers = [hf_cache.layer_kv(cache, i) for i in range(self.layout.num_layers)]
                try:
                    kv = HFKV(layers, self.block_tokens)
                    return gpu.offload(
                        self.namespace, chain, kv, ids, start=start_block, priority=self.priority
                    ).stored
                except ArenaUnavailableError as exc:
                    self._no_direct_copies(exc)
            rows = blocks_from_cache(cache, self.layout, start_block, end_block).cpu().numpy()
            return self.namespace.put(chain, rows, start=start_block, priority=self.priority).stored
        except _RECOVERABLE as exc:
            log.warning("kvstore put failed, blocks not cached: %s", exc)
            return 0

    # -- generation -------------------------------------------------------------------

    def generate(
        self,
        input_ids: torch.Tensor | Sequence[int],
        max_new_tokens: int,
        *,
        eos_token_id: int | None = None,
        store: bool = True,
    ) -> GenerateOutput:
        """Prefill with reuse, greedy-decode up to ``max_new_tokens`` on the same cache,
        then store the full blocks of prompt + reply whose K/V the cache holds."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        ids = _as_ids(input_ids)
        prompt = ids.tolist()
        pre = self.prefill(ids, store=store, logits_to_keep=1, reserve_tokens=max_new_tokens)
        cache = pre.cache
        device = self.device
        next_token = pre.logits[0, -1].argmax()
        generated = [int(next_token)]
        t0 = time.perf_counter()
        with torch.no_grad():
            while len(generated) < max_new_tokens and generated[-1] != eos_token_id:
                position = len(prompt) + len(generated) - 1
                kwargs = hf_cache.forward_kwargs(self.model, position, 1, 1, device)
                out = self.model(
                    input_ids=next_token.view(1, 1).to(device),
                    past_key_values=cache,
                    use_cache=True,
                    **kwargs,
                )
                cache = out.past_key_values
                next_token = out.logits[0, -1].argmax()
                generated.append(int(next_token))
        _synchronize(device)
        decode_s = time.perf_counter() - t0
        sequence = prompt + generated
        stored = 0
        if store:  # the last generated token has no K/V in the cache yet
            held = hf_cache.cache_length(cache)
            stored = self.store(
                sequence, cache, len(prompt) // self.block_tokens, held // self.block_tokens
            )
        return GenerateOutput(
            tokens=generated,
            sequence=sequence,
            stats=pre.stats,
            decode_s=decode_s,
            stored_blocks=stored,
        )


def _as_ids(input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """A 1-D int64 CPU tensor of the prompt (batch size 1)."""
    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(list(input_ids))
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"batch size 1 only, got input_ids of shape {tuple(ids.shape)}")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"input_ids must hold at least one token, got shape {tuple(ids.shape)}")
    return ids.to(device="cpu", dtype=torch.long)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
