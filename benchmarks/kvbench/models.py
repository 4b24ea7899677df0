"""Llama models with random weights, built from a preset: the examples, tests and
benchmarks run real transformers (and vLLM) models with nothing downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def _llama(
    hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, vocab: int, context: int,
    **extra: Any,
) -> dict[str, Any]:
    """A LlamaConfig's shape fields."""
    return dict(
        hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
        max_position_embeddings=context, **extra,
    )  # fmt: skip


LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    # tests: a few layers, GQA, fp32 in milliseconds
    "tiny": _llama(64, 128, 3, 4, 2, 512, 4096),
    # examples: still fast on two CPU cores
    "small": _llama(256, 688, 4, 8, 4, 4096, 16384),
    # CPU TTFT benchmark: ~250M parameters, 16 layers, GQA 16/4; prefill dominates and
    # 512..8192-token prompts take minutes, not hours, on two cores
    "cpu-250m": _llama(1024, 2816, 16, 16, 4, 32000, 16384),
    # vLLM tests and benchmark (save_random_llama): 2 KiB of KV a token in bfloat16
    "vllm-tiny": _llama(256, 512, 4, 4, 2, 32000, 32768, head_dim=64),
    # Llama-3-8B's shape (random weights): the GPU benchmark
    "llama3-8b": _llama(4096, 14336, 32, 32, 8, 128256, 131072, rope_theta=5e5),
}

# vllm-tiny with sliding-window layers between its full-attention ones (256 tokens, two
# of the connector tests' blocks): vLLM's hybrid KV cache manager, two groups
LLAMA_PRESETS["vllm-tiny-swa"] = {
    **LLAMA_PRESETS["vllm-tiny"],
    "sliding_window": 256,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
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


def save_random_lora(
    directory: str | Path, base: str | Path, *, rank: int = 8, seed: int = 0
) -> Path:
    """Save a seeded random LoRA adapter (PEFT's files: ``adapter_config.json`` and
    ``adapter_model.safetensors``) on the q and v projections of the Llama in ``base``
    to ``directory``; idempotent. Its deltas are large enough to change the model's
    answers, so KV computed with it differs from the base model's."""
    import json

    from safetensors.torch import save_file

    path = Path(directory)
    if (path / "adapter_config.json").exists():
        return path
    config = json.loads((Path(base) / "config.json").read_text())
    hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    head_dim = int(config.get("head_dim") or hidden // int(config["num_attention_heads"]))
    outputs = {
        "q_proj": int(config["num_attention_heads"]) * head_dim,
        "v_proj": int(config["num_key_value_heads"]) * head_dim,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module, out in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator)
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=generator)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
              str(path / "adapter_model.safetensors"))  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
        "lora_dropout": 0.0, "bias": "none", "target_modules": sorted(outputs),
        "base_model_name_or_path": str(base),
    }))  # fmt: skip
    return path
