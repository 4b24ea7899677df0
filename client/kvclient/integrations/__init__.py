"""Engine integrations: kvstore plugged into an inference engine.

They change with the engines' APIs, not with kvstore's protocol, so they live apart
from the client core (``kvclient``) they build on and never the other way round:

- :mod:`kvclient.integrations.vllm`: the vLLM v1 KV connector (``kvclient.vllm`` is
  its public path in vLLM configs).
- :mod:`kvclient.integrations.hf`: prefix reuse for Hugging Face transformers
  (``kvclient.hf`` re-exports it).
- :mod:`kvclient.integrations.gpu`: copies between GPU tensors and the arena.
  Experimental: no line of it has run on a GPU yet.
"""
