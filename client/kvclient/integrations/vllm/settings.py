"""What both sides of the vLLM connector share: its settings, the vLLM versions it
supports, the engine's KV layout as a kvstore block and the namespaces of one engine
(the protocol: :mod:`kvclient.vllm`)."""

from __future__ import annotations

import json
import logging
import math
import os
import reprlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args, get_type_hints

import vllm

from kvclient.errors import InvalidArgumentError, LayoutMismatchError
from kvclient.integrations.weights import weights_id
from kvclient.namespace import Namespace
from kvclient.security import read_token_file
from kvclient.sync_client import KVClient
from kvproto.v1.tls import read_file
from kvstore.keys import MAX_BLOCK_TOKENS, MIN_BLOCK_TOKENS, layout_fields

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# under vLLM's own logger: the connector's lines go where vLLM's go, in its format
log = logging.getLogger("vllm.kvstore_connector")

# vLLM releases this connector is tested with: [first, end)
SUPPORTED_VLLM = ((0, 32), (0, 33))
POLL_PENDING_S = 0.02  # early reuse: least time between two lookups of a waiting request


ENV_PREFIX = "KVSTORE_"  # a setting's environment variable: KVSTORE_<SETTING>
EXTRA = "kv_connector_extra_config"
CONFIG_SUFFIXES = (".yaml", ".yml", ".toml", ".json")


def _setting(default: Any, help: str, check: Callable[[Any], str | None] | None = None) -> Any:
    """A row of the settings table: its default, what it does (the docs' reference)
    and a check of its value (-> the problem, or None)."""
    return field(default=default, metadata={"help": help, "check": check})


def _positive(value: float) -> str | None:
    return None if value > 0 else "must be > 0"


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's settings: one table (these fields: name, type, default, help,
    check) read from three sources, a later one over an earlier one::

        defaults < a config file < environment variables < kv_connector_extra_config

    - ``kv_connector_extra_config``: the JSON of vLLM's ``--kv-transfer-config``, the
      most specific (one engine's command line), so it wins.
    - ``KVSTORE_<SETTING>`` (``KVSTORE_PRIORITY=70``, ``KVSTORE_EARLY_REUSE=false``):
      a deployment's, for every engine started in it. An empty variable is not set;
      other ``KVSTORE_*`` variables (the client's ``KVSTORE_TOKEN``, ``KVSTORE_TLS_*``)
      are not settings and are left alone.
    - a file, named by ``config_file`` (in the JSON config, or ``KVSTORE_CONFIG_FILE``):
      ``.yaml``/``.yml``, ``.toml`` or ``.json``, one flat table of settings, shared by
      the engines that name it.

    An unknown key (in the JSON config or the file) or a bad value is one ValueError
    naming the key and its source; the engine does not start."""

    addr: str | None = _setting(
        None, "kvstored address (KVSTORE_ADDR is this setting); default: the default socket"
    )
    priority: int | None = _setting(
        None, "of stored blocks (0..100); default: the daemon's",
        lambda v: None if v is None or 0 <= v <= 100 else "must be in 0..100",
    )  # fmt: skip
    early_reuse: bool = _setting(True, "wait for blocks another engine is computing; claim ours")
    early_reuse_wait_s: float = _setting(
        10.0, "longest a request waits for another engine's claim to deliver its next block",
        _positive,
    )  # fmt: skip
    store_replies: bool = _setting(True, "store the reply's full blocks too (false: the prompt's)")
    lookup_timeout_s: float = _setting(
        0.5, "the scheduler's calls (lookup, claim): deadline each", _positive
    )
    io_timeout_s: float = _setting(
        10.0, "the worker's calls (loads, saves): deadline each", _positive
    )
    retry_after_s: float = _setting(5.0, "after a failed call, answer misses this long")
    model: str | None = _setting(None, "model id in the namespace; default: its weights' digest")
    namespace: str = _setting("", "a name to bind the (unsalted) namespace to, checked at start")
    load_failure_policy: str = _setting(
        "recompute", "vLLM's kv_load_failure_policy: recompute or fail",
        lambda v: None if v in ("recompute", "fail") else "is 'recompute' or 'fail'",
    )  # fmt: skip
    # No key takes the token itself: vLLM logs its configuration, kv_connector_extra_config
    # included.
    token_file: str = _setting(
        "", "a daemon with tenants: the file holding this engine's token (unset: the "
        "client's KVSTORE_TOKEN); KVSTORE_TOKEN_FILE is this setting",
    )  # fmt: skip
    codec: str = _setting("exact", "of the disk and shared tiers (kvstore.codecs: fp8, int8, int4)")
    window_bytes: int = _setting(
        64 << 20, "a load pins this many bytes of blocks at a time (a prefix longer than the "
        "daemon's host tier is loaded window by window: kvclient.Namespace.windows)", _positive,
    )  # fmt: skip
    config_file: str = _setting(
        "", "a .yaml/.yml, .toml or .json file of these settings (below the environment and "
        "the JSON config)",
    )  # fmt: skip

    def token(self) -> str | None:
        """The token from ``token_file``; None: the client's default (environment)."""
        if not self.token_file:
            return None
        try:
            return read_token_file(self.token_file, "token_file")
        except InvalidArgumentError as exc:
            raise ValueError(f"KVStoreConnector: {exc}") from None

    @classmethod
    def from_extra(
        cls, extra: Mapping[str, Any], env: Mapping[str, str] | None = None
    ) -> ConnectorSettings:
        """The settings of ``kv_connector_extra_config`` over ``env`` (None: no
        environment; the connector passes ``os.environ``) over the config file either
        names, over the defaults; ValueError naming the key and source of a bad one."""
        env = {} if env is None else env
        table = {f.name: f for f in fields(cls)}
        types = get_type_hints(cls)

        def problem(name: str, reason: str, source: str) -> ValueError:
            return ValueError(f"KVStoreConnector: {name} {reason} ({source})")

        def known(layer: Mapping[str, object], source: str) -> None:
            unknown = sorted(set(layer) - set(table), key=str)
            if unknown:
                raise ValueError(
                    f"KVStoreConnector: unknown key(s) {unknown} in {source}; "
                    f"known: {sorted(table)}"
                )

        known(extra, EXTRA)
        from_env = {name: value for name in table if (value := env.get(ENV_PREFIX + name.upper()))}
        layers: list[tuple[str, Mapping[str, object], bool]] = [  # (source, values, text)
            (EXTRA, extra, False),
            (f"env {ENV_PREFIX}{{}}", from_env, True),
        ]

        def value_of(name: str) -> tuple[Any, str] | None:
            """The setting from the first layer that has it, parsed and checked."""
            for label, layer, text in layers:
                if name in layer:
                    source = label.format(name.upper())
                    try:
                        value = _parse(types[name], layer[name], text)
                    except ValueError as exc:
                        raise problem(name, str(exc), source) from None
                    check = table[name].metadata["check"]
                    if check is not None and (why := check(value)):
                        raise problem(name, why, source)
                    return value, source
            return None

        named = value_of("config_file")
        if named is not None and named[0]:
            path, source = named
            data = _read_config_file(path, source)
            known(data, f"file {path}")
            if "config_file" in data:
                raise problem("config_file", "cannot be set in the file itself", f"file {path}")
            layers.append((f"file {path}", data, False))
        values = {name: found[0] for name in table if (found := value_of(name)) is not None}
        return cls(**values)


def _parse(kind: Any, raw: object, text: bool) -> Any:
    """A setting's value of type ``kind`` (``bool``, ``int``, ``float``, ``str``, or
    one of them ``| None``) from ``raw``; ``text``: an environment variable's string,
    read as that type. ValueError saying what was expected otherwise: a JSON, YAML or
    TOML value must have the type itself (``"50"`` is not a priority)."""
    args = get_args(kind)
    optional = type(None) in args
    base = next(a for a in args if a is not type(None)) if args else kind
    if raw is None and optional:
        return None
    if text and isinstance(raw, str):
        if base is bool:
            word = raw.strip().lower()
            if word in ("1", "true", "yes", "on"):
                return True
            if word in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"must be true or false, not {_shown(raw)}")
        if base is int:
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"must be an integer, not {_shown(raw)}") from None
        if base is float:
            try:
                raw = float(raw)
            except ValueError:
                raise ValueError(f"must be a number, not {_shown(raw)}") from None
    if base is bool and isinstance(raw, bool):
        return raw
    if base is int and isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if base is float and isinstance(raw, int | float) and not isinstance(raw, bool):
        if not math.isfinite(raw):
            raise ValueError(f"must be a finite number, not {_shown(raw)}")
        return float(raw)
    if base is str and isinstance(raw, str):
        return raw
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    raise ValueError(f"must be {names[base]}, not {_shown(raw)}")


def _shown(raw: object) -> str:
    """``raw`` for an error message, bounded: a value made of nested YAML aliases may
    expand to millions of elements, whose whole repr would be hundreds of MB."""
    shown = reprlib.Repr()
    shown.maxlevel, shown.maxlist, shown.maxdict, shown.maxstring = 2, 4, 4, 60
    return shown.repr(raw)


def _read_config_file(path: str, source: str) -> dict[str, object]:
    """The table of settings in the file at ``path`` (named by ``source``): YAML, TOML
    or JSON by its suffix, at most MAX_SETTINGS_FILE_BYTES; ValueError naming the file
    otherwise."""
    suffix = Path(path).suffix.lower()
    if suffix not in CONFIG_SUFFIXES:
        raise ValueError(
            f"KVStoreConnector: config_file must end in .yaml, .yml, .toml or .json, "
            f"not {path!r} ({source})"
        )
    try:
        text = read_file(path, "the connector's config file").decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"KVStoreConnector: {path} is not UTF-8 text (byte {exc.start})") from None
    except ValueError as exc:
        raise ValueError(f"KVStoreConnector: {exc} ({source})") from None
    kind = {".toml": "TOML", ".json": "JSON"}.get(suffix, "YAML")
    data: object
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            data = _load_yaml(text)
    except RecursionError:
        raise ValueError(f"KVStoreConnector: {path} is nested too deeply to be read") from None
    except ValueError as exc:  # the parser's error (TOML, JSON, YAML), in one line
        reason = " ".join(str(exc).split())
        raise ValueError(f"KVStoreConnector: {path} is not valid {kind}: {reason}") from None
    if data is None:  # an empty YAML file
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"KVStoreConnector: {path} holds a {type(data).__name__}, not a table of settings"
        )
    return data


def _load_yaml(text: str) -> object:
    """YAML's ``safe_load`` (PyYAML: a dependency of vLLM), its errors as ValueError."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(str(exc)) from None


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


# fields of an EngineLayout that describe() leaves out: not what a mismatch is about
UNSHOWN_FIELDS = ("layer_names", "served_model", "tokenizer")


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
    # labels of its namespaces, not layout: the name vLLM serves the model under and
    # where its tokenizer is (kvctl lookup/why --text tokenize a prompt with it)
    served_model: str = ""
    tokenizer: str = ""

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
        model = settings.model or engine_model_id(model_config)
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
            **served_labels(model_config),
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
            served_model=self.served_model,
            tokenizer=self.tokenizer,
            **layout,
        )

    def describe(self) -> str:
        shown = (f.name for f in fields(self) if f.name not in UNSHOWN_FIELDS)
        return " ".join(f"{name}={getattr(self, name)}" for name in shown)


def served_labels(model_config: Any) -> dict[str, str]:
    """The labels of the engine's namespaces: the name vLLM serves the model under (its
    first, where it was given several) and its tokenizer (a directory made absolute: a
    kvctl started elsewhere finds it too)."""
    served = getattr(model_config, "served_model_name", None) or getattr(model_config, "model", "")
    if isinstance(served, list | tuple):
        served = served[0] if served else ""
    tokenizer = str(getattr(model_config, "tokenizer", "") or "")
    if tokenizer and os.path.isdir(tokenizer):
        tokenizer = os.path.abspath(tokenizer)
    return {"served_model": str(served or ""), "tokenizer": tokenizer}


def engine_model_id(model_config: Any) -> str:
    """The model an engine serves, by its weights at its revision and the overrides
    that change its KV (:func:`config_overrides`): the connector's and the tier's id."""
    return weights_id(model_config.model, model_config.revision, config_overrides(model_config))


def config_overrides(model_config: Any) -> dict[str, Any]:
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
