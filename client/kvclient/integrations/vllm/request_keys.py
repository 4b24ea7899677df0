"""What a vLLM request's blocks are keyed by, beyond their token ids (no I/O but the
LoRA adapter's files).

vLLM's own prefix cache folds into each block's hash the extra keys of
``vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys``: the multimodal items
whose placeholder tokens the block overlaps (each item's hash and its offset in the
block), the LoRA adapter, ``cache_salt`` (first block) and the block's prompt
embeddings. Two requests with the same token ids but another image, adapter or
embeddings have other KV, so kvstore must tell their blocks apart just as well.
:func:`request_keys` asks vLLM's function for each block of the prompt, so the
connector keys whatever vLLM keys, and translates each kind:

- ``mm``: kept (the item's identifier is the hash of its content, or the request's
  own ``multi_modal_uuids``, which vLLM trusts as well; with a LoRA adapter, prefixed
  by its name), with its offset, for its block only;
- ``lora``: vLLM names the adapter by name and path; kvstore by its weights and
  ``adapter_config.json`` (:func:`kvclient.integrations.weights.adapter_id`), as
  models are named, mixed into every block, the reply's too. The same weights under
  two names share; another adapter under the same name does not;
- ``prompt_embeds``: vLLM's SHA-256 of the block's rows of the embedding tensor, kept
  (the tokens of embedded positions are 0s, so the digest is what tells prompts
  apart); where token ids and embeddings mix, the block's mask of which is which too;
- ``cache_salt``: already the namespace's tenant salt, so not repeated.

A kind this module does not know (a later vLLM's), an adapter whose weights cannot be
read, or vLLM's function failing on the request raise :class:`Unkeyable`: the
connector then leaves that request to vLLM, neither loaded nor stored.

Everything here is a pure function of the request's contents: the same request gives
the same keys in every process, on every host, after every restart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.core import kv_cache_utils

from kvclient.integrations.vllm.plan import TEXT, RequestKeys
from kvclient.integrations.weights import WeightsUnreadable, adapter_id
from kvstore.keys import encode_extra

if TYPE_CHECKING:
    from vllm.v1.request import Request

class Unkeyable(Exception):
    """A request whose KV the connector cannot tell apart from another's: ``reason``
    is ``"lora"`` or ``"input"`` (the stats count ``unkeyed_<reason>_requests``), the
    message says what."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def request_keys(request: Request, block_tokens: int) -> RequestKeys:
    """The extra keys of ``request``'s blocks of ``block_tokens`` tokens (see the module
    docstring); :class:`Unkeyable` where it has what cannot be keyed."""
    common: tuple[bytes, ...] = ()
    lora = request.lora_request
    if lora is not None:
        try:
            common = (encode_extra(["lora", adapter_id(lora.lora_path)]),)
        except WeightsUnreadable as exc:
            raise Unkeyable("lora", f"LoRA adapter {lora.lora_name!r}: {exc}") from None
    mask = request.prompt_is_token_ids
    per_block: dict[int, tuple[bytes, ...]] = {}
    mm_index = 0
    # every block holding a prompt token, the last one too (a reply completes it)
    for i in range(-(-request.num_prompt_tokens // block_tokens)):
        start = i * block_tokens
        try:  # vLLM's own function, by module attribute: whatever the installed vLLM keys
            keys, mm_index = kv_cache_utils.generate_block_hash_extra_keys(
                request, start, start + block_tokens, mm_index
            )
        except Exception as exc:  # noqa: BLE001 - an edge: a request vLLM keys oddly is a miss
            raise Unkeyable("input", f"vLLM's block extra keys failed: {exc!r}") from None
        parts = [_translate(key) for key in keys or ()]
        if mask is not None:
            parts.append(encode_extra(["token-mask", bytes(mask[start : start + block_tokens])]))
        own = tuple(part for part in parts if part is not None)
        if own:
            per_block[i] = own
    if not common and not per_block:
        return TEXT
    return RequestKeys(common, per_block)


def _translate(key: Any) -> bytes | None:
    """One of vLLM's tagged extra keys -> kvstore's (None: keyed elsewhere)."""
    tag = key[0] if isinstance(key, tuple) and key else None
    if tag == "mm":
        _, identifier, offset = key
        return encode_extra(["mm", str(identifier), int(offset)])
    if tag == "prompt_embeds":
        return encode_extra(["prompt_embeds", bytes(key[1])])
    if tag in ("lora", "cache_salt"):
        return None  # by the adapter's weights (common); the namespace's salt
    raise Unkeyable(
        "input", f"vLLM keys its blocks by {str(tag or key)[:80]!r}, which kvstore cannot key"
    )
