"""The one place where the HF adapter touches version-specific transformers internals.

:mod:`kvclient.hf` talks to a transformers model only through the functions here:

- :func:`check_supported` refuses configs whose cache is not one full-attention K/V
  pair per layer (sliding windows, chunked attention, linear attention, KV sharing):
  a kvstore block must hold every past token of every layer.
- :func:`new_cache` / :func:`cache_from_layers` build a ``DynamicCache``, empty or
  holding given K/V tensors (``[1, kv_heads, seq, head_dim]`` per layer) without copying
  them again; :func:`layer_kv` reads one layer back.
- :func:`forward_kwargs` says how to tell a forward where its tokens sit (position ids;
  ``cache_position`` on models whose forward still takes it) and how many logits to keep.
- :func:`reserved_cache` builds a cache whose layers write new tokens into room kept
  after the prefix (:class:`ReservedLayer`) instead of concatenating: ``DynamicLayer``
  copies the whole prefix once per layer on every forward that appends to it.
- :func:`waiting_layers` runs a callback before each decoder layer's forward (the
  layer-wise load: layer ``i`` waits only for its own copy).

Written against transformers 5.x (``Cache.layers`` of ``DynamicLayer`` with ``.keys`` /
``.values``; no ``cache_position``; ``logits_to_keep``); tested with 5.23 and 4.57
(``cache_position`` still a forward argument). Fallbacks for older 4.x (``key_cache`` /
``value_cache`` lists, ``num_logits_to_keep``) are kept but untested.
When transformers changes its Cache API again, this module is what changes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig

try:  # transformers >= 4.56: a cache is a list of layer objects
    from transformers.cache_utils import DynamicLayer
except ImportError:  # pragma: no cover - older transformers
    DynamicLayer = None  # type: ignore[assignment,misc]


class UnsupportedModelError(ValueError):
    """The model's KV cache cannot be stored as kvstore blocks (see check_supported)."""


def new_cache(config: PretrainedConfig) -> DynamicCache:
    """An empty DynamicCache for ``config`` (layer types from the config where supported)."""
    try:
        return DynamicCache(config=config)
    except TypeError:  # pragma: no cover - transformers < 4.56 takes no config
        return DynamicCache()


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config (the text part of a multimodal config)."""
    if hasattr(config, "get_text_config"):
        return config.get_text_config(decoder=True)
    return config  # pragma: no cover - older transformers


def check_supported(config: PretrainedConfig) -> None:
    """Raise UnsupportedModelError unless every layer keeps a full, unshared K/V history."""
    text = text_config(config)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        kinds = sorted(set(layer_types))
        raise UnsupportedModelError(f"only full-attention layers are supported, config has {kinds}")
    if getattr(text, "kv_sharing_modes", None) is not None:
        raise UnsupportedModelError("layers that share another layer's KV cache are not supported")
    cache = new_cache(config)
    layers = getattr(cache, "layers", None)
    if layers and DynamicLayer is not None:
        odd = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
        if odd:
            raise UnsupportedModelError(f"cache layers {odd} are not plain DynamicLayer")


def layer_kv(cache: DynamicCache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one layer: ``[batch, kv_heads, seq, head_dim]`` each."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        layer = layers[layer_idx]
        if layer.keys is None or layer.values is None:
            raise ValueError(f"cache layer {layer_idx} holds no keys/values")
        return layer.keys, layer.values
    return cache.key_cache[layer_idx], cache.value_cache[layer_idx]  # pragma: no cover


def cache_length(cache: DynamicCache) -> int:
    """Tokens held by the cache (of layer 0; every layer holds the same here)."""
    return int(cache.get_seq_length())


def _plain_layers(cache: DynamicCache, count: int) -> list[Any] | None:
    """The cache's ``count`` layer objects when all are plain ``DynamicLayer`` s (whose
    tensors may be set directly); None on other versions or layer kinds."""
    layers = getattr(cache, "layers", None)
    if DynamicLayer is None or layers is None or len(layers) != count:
        return None
    return layers if all(type(layer) is DynamicLayer for layer in layers) else None


def cache_from_layers(
    config: PretrainedConfig, layers: list[tuple[torch.Tensor, torch.Tensor]]
) -> DynamicCache:
    """A DynamicCache whose layer ``i`` holds ``layers[i]`` = (keys, values).

    On transformers 5 the tensors are adopted as they are (no copy: they were just
    gathered from kvstore blocks into fresh contiguous memory); elsewhere they go through
    ``Cache.update``, which copies once.
    """
    cache = new_cache(config)
    cache_layers = _plain_layers(cache, len(layers))
    for idx, (keys, values) in enumerate(layers):
        if cache_layers is not None:
            layer = cache_layers[idx]
            # initialise through the layer's own update (dtype, device, flags: whatever
            # this version keeps) with zero tokens, then adopt the tensors
            layer.update(keys[:, :, :0], values[:, :, :0])
            layer.keys, layer.values = keys, values
        else:
            cache.update(keys, values, idx)
    return cache


_SIGNATURES: dict[type, frozenset[str]] = {}


def _forward_params(model: torch.nn.Module) -> frozenset[str]:
    cls = type(model)
    params = _SIGNATURES.get(cls)
    if params is None:
        params = frozenset(inspect.signature(model.forward).parameters)
        _SIGNATURES[cls] = params
    return params


def forward_kwargs(
    model: torch.nn.Module, start: int, length: int, logits_to_keep: int, device: torch.device
) -> dict[str, Any]:
    """Keyword arguments placing ``length`` new tokens at positions ``start ..`` of a
    sequence whose first ``start`` tokens are in the cache; ``logits_to_keep`` (0: all)
    limits the LM head to the last tokens where the model supports it."""
    positions = torch.arange(start, start + length, device=device)
    kwargs: dict[str, Any] = {"position_ids": positions.unsqueeze(0)}
    params = _forward_params(model)
    if "cache_position" in params:  # transformers 4.x
        kwargs["cache_position"] = positions
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = logits_to_keep
    elif "num_logits_to_keep" in params:  # pragma: no cover - transformers 4.4x
        kwargs["num_logits_to_keep"] = logits_to_keep
    return kwargs


class ReservedLayer(DynamicLayer):  # type: ignore[misc,valid-type]
    """A ``DynamicLayer`` whose keys and values are the first ``length`` tokens of
    buffers with room after them: :meth:`update` writes the new tokens into the room
    (no copy of the prefix) and doubles the room, with one copy, when it runs out.
    Whatever else replaces the tensors (a crop keeps the prefix view; a reorder does
    not) turns it back into a plain ``DynamicLayer``."""

    def adopt(self, keys_room: torch.Tensor, values_room: torch.Tensor, length: int) -> None:
        # initialise through the layer's own update (dtype, device, flags: whatever this
        # version keeps) with zero tokens, then hold the room
        super().update(keys_room[:, :, :0], values_room[:, :, :0])
        self._room: tuple[torch.Tensor, torch.Tensor] | None = (keys_room, values_room)
        self.keys, self.values = keys_room[:, :, :length], values_room[:, :, :length]

    def _held(self) -> int | None:
        """Tokens held in the room, or None once the tensors are no longer its views."""
        room = getattr(self, "_room", None)
        keys, values = self.keys, self.values
        if room is None or keys is None or values is None:
            return None
        for tensor, buffer in ((keys, room[0]), (values, room[1])):
            if tensor.data_ptr() != buffer.data_ptr() or tensor.stride() != buffer.stride():
                return None
        return int(keys.shape[-2])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        held = self._held()
        if held is None:
            self._room = None
            return super().update(key_states, value_states, *args, **kwargs)  # type: ignore[no-any-return]
        assert self._room is not None
        keys_room, values_room = self._room
        end = held + key_states.shape[-2]
        if end > keys_room.shape[-2]:
            capacity = max(end, 2 * keys_room.shape[-2])
            keys_room = _grown(keys_room, held, capacity)
            values_room = _grown(values_room, held, capacity)
            self._room = (keys_room, values_room)
        keys_room[:, :, held:end].copy_(key_states)
        values_room[:, :, held:end].copy_(value_states)
        self.keys, self.values = keys_room[:, :, :end], values_room[:, :, :end]
        return self.keys, self.values


def _grown(room: torch.Tensor, held: int, capacity: int) -> torch.Tensor:
    shape = (*room.shape[:-2], capacity, room.shape[-1])
    bigger = torch.empty(shape, dtype=room.dtype, device=room.device)
    bigger[:, :, :held].copy_(room[:, :, :held])
    return bigger


def reserved_cache(
    config: PretrainedConfig, rooms: list[tuple[torch.Tensor, torch.Tensor]], length: int
) -> DynamicCache:
    """A DynamicCache whose layer ``i`` holds the first ``length`` tokens of
    ``rooms[i]`` = (keys, values), each ``[batch, kv_heads, capacity, head_dim]``, and
    appends into the rest (:class:`ReservedLayer`). Where this transformers keeps no
    plain ``DynamicLayer`` list, the views are adopted as :func:`cache_from_layers` does."""
    cache = new_cache(config)
    layers = _plain_layers(cache, len(rooms))
    if layers is None:
        return cache_from_layers(config, [(k[:, :, :length], v[:, :, :length]) for k, v in rooms])
    for idx, (keys, values) in enumerate(rooms):
        layer = ReservedLayer()
        layer.adopt(keys, values, length)
        layers[idx] = layer
    return cache


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The model's decoder layers in order: its first ModuleList of
    ``num_hidden_layers`` modules (``model.model.layers`` on Llama-like models)."""
    count = getattr(text_config(model.config), "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return list(module)
    return None


@contextmanager
def waiting_layers(model: torch.nn.Module, wait: Callable[[int], None]) -> Iterator[None]:
    """While open, ``wait(i)`` runs before decoder layer ``i``'s forward; where the
    layers cannot be found, every ``wait`` runs at once instead."""
    layers = decoder_layers(model)
    if layers is None:
        for index in range(text_config(model.config).num_hidden_layers):
            wait(index)
        yield
        return
    handles = [
        layer.register_forward_pre_hook(lambda module, args, index=index: wait(index))
        for index, layer in enumerate(layers)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
