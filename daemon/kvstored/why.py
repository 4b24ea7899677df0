""""Why did this prompt miss?": a Lookup with ``explain`` (and ``kvctl why``).

The store names the first block of the chain that is not served and what it knows of
it (:func:`kvstore.misses.explain`: pending, lost by a rule, or never stored). A block
the store never held in this namespace may be held in another one the caller sees:
the same tokens under another model, layout, dtype or salt (a client that opened its
namespace with other settings than the engine that stored the blocks). This looks in
each of the caller's other namespaces for a chain that covers more of the prompt, and
names the fields the two namespaces differ in, never their values.

Explains run on a thread of their own, one at a time (``Calls.run_explain``), and that
thread is paced (:class:`Pacer`): its work is cut into bounded steps (the caller's
own chain, then each other namespace), and after each step it sleeps as long as the
step ran, twice over. So however many explains are asked, they hold the store's lock and
the GIL at most a third of the time and at most one step at a time, and another tenant's calls wait
for them at most one step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from kvproto.v1 import kvstore_pb2 as pb
from kvstore.errors import StoreError
from kvstore.keys import BlockKey, NamespaceSpec, chain_keys, tokens_array
from kvstore.misses import NEVER_STORED, OTHER_NAMESPACE, MissReason
from kvstore.store import Store
from kvstored.auth import Caller

REST = 2.0  # the explain thread sleeps this many times as long as each step ran
MAX_PAUSE_S = 0.25  # the longest sleep after one step (a step that ran longer is rare)


class Pacer:
    """Paces the explain thread: :meth:`pace` after each bounded step sleeps ``REST``
    times as long as the step ran (since the last pace), so the thread runs at most a
    third of the time and
    others get the store's lock and the GIL between its steps (a thread that takes a
    lock again at once, as a loop of lookups does, would otherwise starve the event
    loop waiting for it)."""

    def __init__(self) -> None:
        self._since = time.monotonic()

    def pace(self) -> None:
        ran = time.monotonic() - self._since
        time.sleep(min(REST * ran, MAX_PAUSE_S))
        self._since = time.monotonic()


def explain(
    store: Store,
    spec: NamespaceSpec,
    keys: Sequence[BlockKey],
    tokens: np.ndarray,
    extra: Sequence[bytes],
    caller: Caller,
    pacer: Pacer,
) -> pb.MissReason:
    """Why ``keys`` (of ``tokens``) are not served whole, on the explain thread: the
    work before the call (hashing the chain, its lookup) is the first paced step."""
    pacer.pace()
    found = store.why(spec.ns_id, keys)
    if found.reason == NEVER_STORED:
        pacer.pace()
        found = _in_another(store, spec, found, tokens, extra, caller, pacer) or found
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


WALK_BLOCKS = 4096  # at most this many blocks are hashed over the other namespaces


def _in_another(
    store: Store,
    spec: NamespaceSpec,
    found: MissReason,
    tokens: np.ndarray,
    extra: Sequence[bytes],
    caller: Caller,
    pacer: Pacer,
) -> MissReason | None:
    """The caller's namespace whose chain of ``tokens`` is ready past the missing
    block (in tokens), the one that covers most; None if none does.

    Its cost is bounded and the caller's own: only the caller's namespaces are
    looked at (a tenant's; every one for the admin), each is walked only as far as
    it holds the prompt (:func:`_ready_tokens`), and all of them together hash at
    most ``WALK_BLOCKS`` blocks."""
    covered = found.block * spec.block_tokens
    budget = WALK_BLOCKS
    best: tuple[int, str] | None = None
    for other in store.namespaces(None if caller.admin else caller.tenant):
        if other.ns_id == spec.ns_id:
            continue
        ready, hashed = _ready_tokens(store, other, tokens, extra, budget, pacer)
        budget -= hashed
        if ready > covered and (best is None or ready > best[0]):
            best = (ready, other.ns_id)
        if budget <= 0:
            break
    if best is None:
        return None
    return MissReason(found.block, OTHER_NAMESPACE, detail=best[1])


def _ready_tokens(
    store: Store,
    spec: NamespaceSpec,
    tokens: np.ndarray,
    extra: Sequence[bytes],
    budget: int,
    pacer: Pacer,
) -> tuple[int, int]:
    """The tokens of ``spec``'s ready prefix of ``tokens``, and the blocks hashed to
    find it: 1, 2, 4, ... blocks, until the ready prefix stops short of what was
    hashed (a namespace that holds none of the prompt costs one block), the prompt
    ends or ``budget`` blocks are spent; each lookup is a paced step."""
    try:  # (only the tokens of the blocks the budget may hash are looked at)
        arr = tokens_array(tokens[: budget * spec.block_tokens], spec.vocab_size)
    except StoreError:  # its tokens are out of this namespace's vocabulary
        return 0, 0
    total = arr.size // spec.block_tokens
    hashed, want = 0, 1
    while True:
        n = min(want, total, budget - hashed)
        if n <= 0:
            return 0, hashed
        try:
            keys = chain_keys(spec, arr, extra, max_blocks=n)
            ready = store.lookup(spec.ns_id, keys).ready_blocks
        except StoreError:  # too many blocks for one request
            return 0, hashed
        pacer.pace()
        hashed += n
        if ready < n or n == total or hashed >= budget:
            return ready * spec.block_tokens, hashed
        want = 2 * n


def differing(a: NamespaceSpec, b: NamespaceSpec) -> list[str]:
    """The declared fields in which two namespaces differ (names only; labels such as
    the served model are not a difference: they do not make the namespace)."""
    mine, theirs = a.identity(), b.identity()
    return [name for name in mine if mine[name] != theirs[name]]
