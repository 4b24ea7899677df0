"""kvstore's vLLM v1 KV connector: :mod:`.connector` (the protocol, both sides),
:mod:`.settings` (what both sides share), :mod:`.scheduler`, :mod:`.plan`,
:mod:`.worker` and :mod:`.blocks` (vLLM's paged tensors as kvstore blocks)."""
