"""The HF adapter's block layout: which bytes of a ``DynamicCache`` one kvstore block
holds (``[layer][K|V][kv_head][token][head_dim]``, see :mod:`kvclient.hf`), the
namespace fields that describe it, and the gathers between the two."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig

from kvclient.integrations.hf import cache as hf_cache
from kvclient.integrations.hf.cache import UnsupportedModelError, text_config
from kvstore.keys import DTYPE_BYTES

DEFAULT_BLOCK_TOKENS = 16

# Config entries that do not change what K/V a model computes (runtime switches,
# bookkeeping); the dtype is part of the layout already.
_FINGERPRINT_SKIP = frozenset(
    {
        "transformers_version",
        "name_or_path",
        "use_cache",
        "torch_dtype",
        "dtype",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "tie_word_embeddings",
    }
)


# -- layout ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of a model's KV cache as kvstore blocks (see the module docstring)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, block_tokens: int = DEFAULT_BLOCK_TOKENS
    ) -> KVLayout:
        config = text_config(model.config)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=model_dtype(model),
            block_tokens=block_tokens,
        )

    @property
    def dtype_name(self) -> str:
        """The dtype as kvstore's NamespaceSpec names it."""
        name = str(self.dtype).removeprefix("torch.")
        if name not in DTYPE_BYTES:
            raise UnsupportedModelError(f"KV dtype {self.dtype} has no kvstore name")
        return name

    @property
    def dtype_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``[layers, K|V, kv_heads, tokens, head_dim]``: one block, C order."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """2 * layers * kv_heads * head_dim * dtype bytes * tokens per block."""
        return math.prod(self.block_shape) * self.dtype_bytes

    def namespace_fields(self) -> dict[str, Any]:
        """The layout fields of ``KVClient.namespace`` (the daemon checks block_bytes)."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype_name,
        }


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next(model.parameters()).dtype  # pragma: no cover


def model_device(model: torch.nn.Module) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device  # pragma: no cover


def config_fingerprint(config: PretrainedConfig) -> str:
    """Hex SHA-256 of the config entries that shape the K/V (stable across processes)."""
    entries = {
        k: v
        for k, v in config.to_dict().items()
        if k not in _FINGERPRINT_SKIP and not k.startswith("_")
    }
    text = json.dumps(entries, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# -- cache <-> blocks -----------------------------------------------------------------


def blocks_from_cache(
    cache: Any, layout: KVLayout, start_block: int, end_block: int
) -> torch.Tensor:
    """Blocks ``[start_block, end_block)`` of ``cache`` as ``uint8[n, block_bytes]``, on
    the cache's device (one gather per layer and K/V into one buffer)."""
    n = end_block - start_block
    L, H, T, D = layout.num_layers, layout.num_kv_heads, layout.block_tokens, layout.head_dim
    lo, hi = start_block * T, end_block * T
    first, _ = hf_cache.layer_kv(cache, 0)
    out = torch.empty((n, L, 2, H, T, D), dtype=layout.dtype, device=first.device)
    for layer in range(L):
        for kv, tensor in enumerate(hf_cache.layer_kv(cache, layer)):
            if tensor.dim() != 4 or tensor.shape[0] != 1 or tensor.shape[1] != H:
                raise ValueError(
                    f"layer {layer}: expected [1, {H}, seq, {D}] K/V, got {tuple(tensor.shape)}"
                )
            if tensor.shape[2] < hi or tensor.dtype != layout.dtype:
                raise ValueError(
                    f"layer {layer}: cache holds {tensor.shape[2]} tokens of {tensor.dtype}, "
                    f"need {hi} of {layout.dtype}"
                )
            # [H, n*T, D] -> [H, n, T, D] -> [n, H, T, D]
            out[:, layer, kv].copy_(tensor[0, :, lo:hi].unflatten(1, (n, T)).transpose(0, 1))
    return out.view(torch.uint8).reshape(n, layout.block_bytes)


def cache_from_blocks(
    blocks: np.ndarray | torch.Tensor,
    layout: KVLayout,
    config: PretrainedConfig,
    device: torch.device | str = "cpu",
) -> Any:
    """A ``DynamicCache`` holding the ``n * block_tokens`` tokens of ``blocks``
    (``uint8[n, block_bytes]``), on ``device``: the bytes path (a CUDA model next to its
    daemon takes the adapter's direct path instead)."""
    data = torch.from_numpy(blocks) if isinstance(blocks, np.ndarray) else blocks
    if data.dim() != 2 or data.shape[1] != layout.block_bytes or data.dtype != torch.uint8:
        raise ValueError(
            f"blocks must be uint8[n, {layout.block_bytes}], got {data.dtype} {tuple(data.shape)}"
        )
    n = data.shape[0]
    L, H, T, D = layout.num_layers, layout.num_kv_heads, layout.block_tokens, layout.head_dim
    data = data.to(device)
    kv = data.view(layout.dtype).view(n, *layout.block_shape)  # [n, L, 2, H, T, D]
    # One gather: [n, L, 2, H, T, D] -> [L, 2, H, n, T, D] contiguous -> [L, 2, 1, H, n*T, D]
    per_layer = kv.permute(1, 2, 3, 0, 4, 5).contiguous().view(L, 2, 1, H, n * T, D)
    return hf_cache.cache_from_layers(
        config, [(per_layer[layer, 0], per_layer[layer, 1]) for layer in range(L)]
    )
