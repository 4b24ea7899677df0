"""Llama models with random weights, built from a preset: the examples, tests and
benchmarks run real transformers (and vLLM) models with nothing downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# -- random-weight models (examples, tests, benchmarks: nothing is downloaded) ---------

LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    # tests: a few layers, GQA, fp32 in milliseconds
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=4096,
    ),
    # examples: still fast on two CPU cores
    "small": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=16384,
    ),
    # CPU TTFT benchmark: ~250M parameters, 16 layers, GQA 16/4; prefill dominates and
    # 512..8192-token prompts take minutes, not hours, on two cores
    "cpu-250m": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=16384,
    ),
    # vLLM tests and benchmark (save_random_llama): 2 KiB of KV a token in bfloat16
    "vllm-tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=32000,
        max_position_embeddings=32768,
    ),
    # Llama-3-8B's shape (random weights): the GPU benchmark
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    ),
}


def random_llama(
    preset: str = "tiny",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> LlamaForCausalLM:
    """A Llama with seeded random weights from ``LLAMA_PRESETS[preset]`` (+ overrides),
    in eval mode. The same arguments give the same weights in every CPU process."""
    config = LlamaConfig(**{**LLAMA_PRESETS[preset], **overrides})
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the target dtype: no fp32 copy of 8B
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval()


def save_random_llama(directory: str | Path, preset: str = "vllm-tiny", *, seed: int = 0) -> Path:
    """Save a seeded random Llama (bfloat16) and a word-level tokenizer (token ``i`` is
    the word ``t<i>``) to ``directory``, as a model directory that vLLM and
    transformers load offline; idempotent."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(directory)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    model = random_llama(preset, seed=seed, dtype=torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    vocab["<unk>"] = 0
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="t1", eos_token="t2"
    ).save_pretrained(path)
    return path
