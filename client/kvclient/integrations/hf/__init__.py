"""Prefix reuse for Hugging Face transformers: :mod:`.adapter` (``HFPrefixCache``),
:mod:`.layout` (a model's KV as kvstore blocks), :mod:`.cache` (transformers' cache
objects, the one place that knows them) and :mod:`.models` (small random models)."""
