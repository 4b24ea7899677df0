"""What both sides of the vLLM connector share: its settings, the vLLM versions it
supports, the engine's KV layout as a kvstore block and the namespaces of one engine
(the protocol: :mod:`kvclient.vllm`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import vllm

from kvclient.errors import InvalidArgumentError, LayoutMismatchError
from kvclient.integrations.weights import weights_id
from kvclient.namespace import Namespace
from kvclient.security import read_token_file
from kvclient.sync_client import KVClient
from kvstore.keys import MAX_BLOCK_TOKENS, MIN_BLOCK_TOKENS, layout_fields

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# under vLLM's own logger: the connector's lines go where vLLM's go, in its format
log = logging.getLogger("vllm.kvstore_connector")

# vLLM releases this connector is tested with: [first, end)
SUPPORTED_VLLM = ((0, 32), (0, 33))
POLL_PENDING_S = 0.02  # early reuse: least time between two lookups of a waiting request


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` keys (all optional)."""

    addr: str | None = None  # kvstored address; default: KVSTORE_ADDR or the default socket
    priority: int | None = None  # of stored blocks (0..100); default: the daemon's
    early_reuse: bool = True  # wait for blocks another engine is computing; claim ours
    # longest a request waits for another engine's claim to deliver its next block
    early_reuse_wait_s: float = 10.0
    store_replies: bool = True  # store the reply's full blocks too (False: the prompt's)
    lookup_timeout_s: float = 0.5  # scheduler's calls (lookup, claim): deadline each
    io_timeout_s: float = 10.0  # worker's calls (loads, saves): deadline each
    retry_after_s: float = 5.0  # after a failed call, answer misses this long
    model: str | None = None  # model id in the namespace; default: its weights' digest
    namespace: str = ""  # a name to bind the (unsalted) namespace to, checked at start
    load_failure_policy: str = "recompute"  # vLLM's kv_load_failure_policy
    # a daemon with tenants: the file holding this engine's token (default
    # KVSTORE_TOKEN / KVSTORE_TOKEN_FILE). No key takes the token itself: vLLM logs
    # its configuration, kv_connector_extra_config included.
    token_file: str = ""
    codec: str = "exact"  # of the disk and shared tiers (kvstore.codecs: fp8, int8, int4)
    # a load pins this many bytes of blocks at a time (a prefix longer than the daemon's
    # host tier is loaded window by window: kvclient.Namespace.windows)
    window_bytes: int = 64 << 20

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
        if not int(settings.window_bytes) > 0:
            raise ValueError("KVStoreConnector: window_bytes must be > 0")
        if settings.priority is not None and not 0 <= int(settings.priority) <= 100:
            raise ValueError("KVStoreConnector: priority must be in 0..100")
        if settings.load_failure_policy not in ("recompute", "fail"):
            raise ValueError("KVStoreConnector: load_failure_policy is 'recompute' or 'fail'")
        return settings


def check_vllm_version(version: str = vllm.__version__) -> None:
    """One clear error at start-up for a vLLM this connector was not tested with."""
    parts = version.split(".")[:2]
    major_minor = tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else (-1, -1)
    first, end = SUPPORTED_VLLM
    if not first <= major_minor < end:
        raise RuntimeError(
            f"KVStoreConnector supports vLLM >= {first[0]}.{first[1]}, < {end[0]}.{end[1]}; "
            f"this is vLLM {version}"
        )


class UnstorableModel(Exception):
    """This model's KV cache has layers kvstore cannot store (the connector stands aside:
    vLLM computes every prompt)."""


# the KV cache kinds whose pages hold a block's KV and nothing else (vllm.v1.kv_cache_interface)
STORABLE_KINDS = ("FullAttentionSpec", "SlidingWindowSpec")


@dataclass(frozen=True)
class EngineLayout:
    """What makes this engine's blocks interchangeable with another's (the namespace).

    One KV cache group, or several (vLLM's hybrid KV cache manager: full attention and
    sliding window): a block's row holds the layers of ``layer_names``, group after
    group (``group_layers`` of them each), and ``windows`` says each group's sliding
    window in tokens (0: full attention)."""

    model: str
    block_tokens: int
    block_bytes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    world_size: int
    layer_names: tuple[str, ...]
    group_layers: tuple[int, ...] = ()
    windows: tuple[int, ...] = ()

    @property
    def hybrid(self) -> bool:
        """Several KV cache groups: block ids per group, and loads that vLLM runs
        asynchronously (a failed one is reported by request: vllm's scheduler cannot map
        a block id of one group back to its request)."""
        return len(self.group_layers) > 1

    def first_held(self, computed_tokens: int) -> int:
        """The first block whose pages every group still holds once ``computed_tokens``
        are computed: a sliding-window group frees the blocks wholly before its window
        (vLLM's ``remove_skipped_blocks``)."""
        skipped = (max(0, computed_tokens - w + 1) for w in self.windows if w)
        return max(skipped, default=0) // self.block_tokens

    @classmethod
    def of(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings
    ) -> EngineLayout:
        """The layout of this engine; :class:`UnstorableModel` where a kind of its layers
        cannot be stored, ValueError for a block size kvstore does not take."""
        groups = kv_cache_config.kv_cache_groups
        specs = [group.kv_cache_spec for group in groups]
        _check_storable(specs)
        spec = specs[0]
        block_tokens = int(spec.block_size)
        if not MIN_BLOCK_TOKENS <= block_tokens <= MAX_BLOCK_TOKENS:
            raise ValueError(
                f"KVStoreConnector: vLLM's block_size {block_tokens} is outside kvstore's "
                f"{MIN_BLOCK_TOKENS}..{MAX_BLOCK_TOKENS} tokens per block"
            )
        layer_names = tuple(name for group in groups for name in group.layer_names)
        group_layers = tuple(len(group.layer_names) for group in groups)
        windows = tuple(int(getattr(s, "sliding_window", 0) or 0) for s in specs)
        dtype = str(spec.dtype).removeprefix("torch.")
        device = vllm_config.device_config.device_type
        page_layout = kv_cache_config.kv_cache_layout or "default"
        if len(groups) > 1:  # rows hold the layers group by group: a layout of its own
            page_layout += "-hma" + "+".join(
                f"{n}{f'w{w}' if w else 'f'}" for n, w in zip(group_layers, windows, strict=True)
            )
        model_config = vllm_config.model_config
        model = settings.model or weights_id(
            model_config.model, model_config.revision, _config_overrides(model_config)
        )
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
            group_layers=group_layers,
            windows=windows,
        )

    def namespace_fields(self, rank: int, salt: str) -> dict[str, Any]:
        """Arguments of ``KVClient.namespace`` for the engine's ``rank`` and a
        request's ``cache_salt``."""
        layout = layout_fields(
            self.block_tokens, self.block_bytes, self.num_layers, self.num_kv_heads,
            self.head_dim, self.dtype,
        )  # fmt: skip
        return dict(
            model=self.model,
            block_tokens=self.block_tokens,
            block_bytes=self.block_bytes,
            rank=rank,
            world_size=self.world_size,
            tenant_salt=salt,
            **layout,
        )

    def describe(self) -> str:
        shown = (f.name for f in fields(self) if f.name != "layer_names")
        return " ".join(f"{name}={getattr(self, name)}" for name in shown)


def _config_overrides(model_config: Any) -> dict[str, Any]:
    """What the engine changes beside the model's files, part of the model id as the
    config is: vLLM's ``hf_overrides`` (a function by the config it made, overrides
    applied: its name says nothing of what it does), the compute dtype and the
    quantization (either changes the KV while the cache's layout may stay the same)."""
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):
        made: dict[str, Any] = {"hf_config": model_config.hf_config.to_dict()}
    else:
        made = dict(overrides or {})
    dtype = getattr(model_config, "dtype", None)
    if dtype is not None:
        made["engine_dtype"] = str(dtype).removeprefix("torch.")
    quantization = getattr(model_config, "quantization", None)
    if quantization:
        made["engine_quantization"] = str(quantization)
    return made


def _check_storable(specs: list[Any]) -> None:
    """Raise :class:`UnstorableModel` unless every KV cache group is attention whose
    pages kvstore can store, all of one block size, page size, dtype and head shape."""
    kinds = [type(spec).__name__ for spec in specs]
    other = sorted({kind for kind in kinds if kind not in STORABLE_KINDS})
    if not specs or other:
        raise UnstorableModel(
            f"this model's {', '.join(other) or 'missing'} KV cache layers (state-space or "
            f"other kinds) cannot be stored; kvstore stores {' and '.join(STORABLE_KINDS)}"
        )
    shapes = {
        (s.block_size, s.page_size_bytes, str(s.dtype), s.num_kv_heads, s.head_size)
        for s in specs
    }
    if len(shapes) > 1:
        raise UnstorableModel(
            f"this model's KV cache groups {kinds} differ in block size, page size, dtype "
            "or head shape; kvstore stores groups of one shape"
        )


class EngineNamespaces:
    """The namespaces of one connector side, by ``cache_salt``, opened on first use.

    ``announce``: the first namespace opened is logged at INFO (the daemon's address and
    how it is reached, the namespace, its block and codec): the scheduler's side does,
    so that vLLM's log says once which kvstored the engine uses."""

    def __init__(
        self,
        client: KVClient,
        layout: EngineLayout,
        rank: int,
        settings: ConnectorSettings,
        announce: bool = False,
    ) -> None:
        self.client = client
        self.layout = layout
        self.rank = rank
        self.name, self.codec = settings.namespace, settings.codec
        self._announce = announce
        self._open: dict[str, Namespace] = {}

    def get(self, salt: str) -> Namespace:
        ns = self._open.get(salt)
        if ns is None:
            try:
                ns = self.client.namespace(
                    name=self.name if not salt else "",
                    codec=self.codec,
                    **self.layout.namespace_fields(self.rank, salt),
                )
            except LayoutMismatchError as exc:
                raise LayoutMismatchError(
                    f"kvstore namespace {self.name!r} is bound to another layout than "
                    f"this engine's ({self.layout.describe()}): {exc}",
                    addr=self.client.addr,
                ) from None
            if self._announce and not self._open:
                log.info(
                    "kvstore connector: reached kvstored at %s (%s); namespace %s: %d tokens "
                    "and %d bytes a block, codec %s",
                    self.client.addr,
                    "shared arena" if self.client.arena_in_use else "inline over gRPC",
                    ns.ns_id, ns.block_tokens, ns.block_bytes, self.codec or "none",
                )  # fmt: skip
            self._open[salt] = ns
        return ns
