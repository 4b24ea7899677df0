"""kvclient.hf without a daemon: block layout, cache <-> bytes conversion, namespaces.

Models are tiny random-weight Llamas built from a config (seeded; nothing downloaded).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LlamaConfig, MistralConfig  # noqa: E402

from kvbench.models import random_llama  # noqa: E402
from kvclient.hf import (  # noqa: E402
    KVLayout,
    UnsupportedModelError,
    blocks_from_cache,
    cache_from_blocks,
    config_fingerprint,
)
from kvclient.integrations.hf import cache as hf_cache  # noqa: E402
from kvstore.keys import NamespaceSpec  # noqa: E402

T = 4  # tokens per block in these tests


def prefill(model, ids: torch.Tensor, cache=None, start: int = 0):
    kwargs = hf_cache.forward_kwargs(model, start, ids.numel(), 0, torch.device("cpu"))
    if cache is None:
        cache = hf_cache.new_cache(model.config)
    with torch.no_grad():
        out = model(input_ids=ids.view(1, -1), past_key_values=cache, use_cache=True, **kwargs)
    return out.logits, out.past_key_values


@pytest.mark.parametrize(
    ("dtype", "overrides"),
    [
        (torch.float32, {}),
        (torch.bfloat16, {}),
        (torch.float16, {"num_key_value_heads": 4}),  # MHA
        (torch.float32, {"head_dim": 24}),  # explicit head_dim != hidden / heads
    ],
)
def test_block_bytes_match_what_the_daemon_computes(dtype, overrides) -> None:
    model = random_llama("tiny", dtype=dtype, **overrides)
    layout = KVLayout.from_model(model, block_tokens=T)
    cfg = model.config
    assert layout.num_layers == cfg.num_hidden_layers
    assert layout.num_kv_heads == cfg.num_key_value_heads
    assert layout.head_dim == overrides.get("head_dim", cfg.hidden_size // cfg.num_attention_heads)
    spec = NamespaceSpec(model="m", block_tokens=T, **layout.namespace_fields())
    assert spec.block_bytes == layout.block_bytes
    # and the cache really holds that many bytes per block
    _, cache = prefill(model, torch.arange(3 * T))
    assert blocks_from_cache(cache, layout, 0, 3).shape == (3, layout.block_bytes)


def test_block_layout_is_layer_kv_head_token_dim() -> None:
    # a cache whose every element says where it came from: value = f(layer, kv, head, pos, d)
    L, H, D, S = 2, 3, 5, 3 * T
    layout = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.float32, block_tokens=T)
    config = LlamaConfig(num_hidden_layers=L)

    def element(layer: int, kv: int, head: int, pos: int, d: int) -> float:
        return float(((layer * 2 + kv) * H + head) * 1000 + pos * 10 + d)

    layers = []
    for layer in range(L):
        k, v = (
            torch.tensor(
                [
                    [[element(layer, kv, h, p, d) for d in range(D)] for p in range(S)]
                    for h in range(H)
                ]
            ).unsqueeze(0)
            for kv in range(2)
        )
        layers.append((k, v))
    cache = hf_cache.cache_from_layers(config, layers)

    blocks = blocks_from_cache(cache, layout, 1, 3)  # blocks 1 and 2
    # [block][layer][K|V][kv_head][token][head_dim]
    values = blocks.view(torch.float32).view(2, L, 2, H, T, D)
    for b in range(2):
        for layer in range(L):
            for kv in range(2):
                for head in range(H):
                    for t in range(T):
                        pos = (1 + b) * T + t
                        expected = [element(layer, kv, head, pos, d) for d in range(D)]
                        assert values[b, layer, kv, head, t].tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cache_to_blocks_to_cache_is_bit_exact(dtype) -> None:
    model = random_llama("tiny", dtype=dtype)
    layout = KVLayout.from_model(model, block_tokens=T)
    _, cache = prefill(model, torch.arange(5 * T + 3) % 500)
    blocks = blocks_from_cache(cache, layout, 0, 5).numpy()
    loaded = cache_from_blocks(blocks, layout, model.config)
    assert hf_cache.cache_length(loaded) == 5 * T
    for layer in range(layout.num_layers):
        for original, back in zip(
            hf_cache.layer_kv(cache, layer), hf_cache.layer_kv(loaded, layer), strict=True
        ):
            assert back.dtype == dtype and back.is_contiguous()
            assert torch.equal(original[:, :, : 5 * T], back)


def test_loaded_prefix_gives_bit_identical_logits_to_an_in_memory_prefix() -> None:
    model = random_llama("tiny")
    layout = KVLayout.from_model(model, block_tokens=T)
    ids = (torch.arange(7 * T + 2) * 37) % 500
    prefix = 6 * T
    # reference: the prefix prefilled in memory, then the suffix on top of it
    _, ref_cache = prefill(model, ids[:prefix])
    ref_logits, _ = prefill(model, ids[prefix:], ref_cache, start=prefix)
    # the same prefix through bytes
    _, cache = prefill(model, ids[:prefix])
    loaded = cache_from_blocks(blocks_from_cache(cache, layout, 0, 6).numpy(), layout, model.config)
    logits, _ = prefill(model, ids[prefix:], loaded, start=prefix)
    assert torch.equal(logits, ref_logits)
    # a single full prefill differs only in the last bits (other matmul shapes)
    full, _ = prefill(model, ids)
    assert (full[:, prefix:] - logits).abs().max().item() < 1e-4


def test_models_whose_cache_is_not_full_attention_are_refused() -> None:
    sliding = MistralConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=32,
    )
    with pytest.raises(UnsupportedModelError, match="(?i)sliding"):
        hf_cache.check_supported(sliding)
    hf_cache.check_supported(random_llama("tiny").config)  # plain Llama: fine


def test_config_fingerprint_is_stable_and_tells_configs_apart() -> None:
    a = random_llama("tiny").config
    b = random_llama("tiny", seed=1).config  # other weights, same config: the model id's job
    c = random_llama("tiny", intermediate_size=256).config  # same KV layout, other model
    assert config_fingerprint(a) == config_fingerprint(b)
    assert config_fingerprint(a) != config_fingerprint(c)
    # (the same in every process: test_hf_adapter's worker finds the parent's blocks)


def test_kvclient_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "import kvclient\n"
        "from kvclient import KVClient\n"
        "try:\n"
        "    import kvclient.hf\n"
        "except ImportError:\n"
        "    print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
