""""Why did this prompt miss?": a Lookup with ``explain`` (and ``kvctl why``).

The store names the first block of the chain that is not served and what it knows of
it (:func:`kvstore.misses.explain`: pending, lost by a rule, or never stored). A block
the store never held in this namespace may be held in another one the caller sees:
the same tokens under another model, layout, dtype or salt (a client that opened its
namespace with other settings than the engine that stored the blocks). This looks in
each of the caller's other namespaces for a chain that covers more of the prompt, and
names the fields the two namespaces differ in, never their values.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvproto.v1 import kvstore_pb2 as pb
from kvstore.errors import StoreError
from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.misses import NEVER_STORED, OTHER_NAMESPACE, MissReason
from kvstore.store import Store
from kvstored.auth import Caller


def explain(
    store: Store,
    spec: NamespaceSpec,
    keys: Sequence[BlockKey],
    tokens: np.ndarray,
    extra: Sequence[bytes],
    caller: Caller,
) -> pb.MissReason:
    found = store.why(spec.ns_id, keys)
    if found.reason == NEVER_STORED:
        found = _in_another(store, spec, found, tokens, extra, caller) or found
    loss = found.loss
    return pb.MissReason(
        block=found.block,
        reason=found.reason,
        tier=loss.tier if loss else "",
        rule=loss.rule if loss else "",
        when=loss.when if loss else 0.0,
        other_ns=found.detail,
        differs=differing(spec, store.namespace(found.detail)) if found.detail else (),
    )


def _in_another(
    store: Store,
    spec: NamespaceSpec,
    found: MissReason,
    tokens: np.ndarray,
    extra: Sequence[bytes],
    caller: Caller,
) -> MissReason | None:
    """The caller's namespace whose chain of ``tokens`` is ready past the missing
    block (in tokens), the one that covers most; None if none does."""
    covered = found.block * spec.block_tokens
    best: tuple[int, str] | None = None
    for other in store.namespaces():
        if other.ns_id == spec.ns_id or not caller.owns(other):
            continue
        try:
            chain = store.keys_for(other.ns_id, tokens, extra)
            ready = store.lookup(other.ns_id, chain).ready_blocks * other.block_tokens
        except StoreError:  # its tokens are out of its vocabulary, or too many
            continue
        if ready > covered and (best is None or ready > best[0]):
            best = (ready, other.ns_id)
    if best is None:
        return None
    return MissReason(found.block, OTHER_NAMESPACE, detail=best[1])


def differing(a: NamespaceSpec, b: NamespaceSpec) -> list[str]:
    """The declared fields in which two namespaces differ (names only)."""
    mine, theirs = a.to_dict(), b.to_dict()
    return [name for name in mine if mine[name] != theirs[name]]
