"""``why``'s look into other namespaces has a bounded cost, and only the caller's:
it hashes a prompt in each of the caller's other namespaces only as far as that
namespace holds it, at most ``WALK_BLOCKS`` blocks in all, and never walks another
tenant's namespaces (#56, items 8 and 9). Counted in blocks hashed (no timing): a
store in this process, the daemon's ``why.explain`` over it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvstore import keys as kvkeys
from kvstore import store as kvstore_store
from kvstore.keys import NamespaceSpec
from kvstore.store import Store, StoreConfig
from kvstore.tenants import tenant_salt
from kvstored import why
from kvstored.auth import Caller

TOKENS = 4
BLOCK = 256
PROMPT_BLOCKS = 4096


@pytest.fixture
def store() -> Iterator[Store]:
    with Store(StoreConfig(host_bytes=4 << 20, shared_arena=False)) as s:
        yield s


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Blocks hashed by chain_keys, wherever the daemon or the store calls it from."""
    counted: list[int] = []
    real = kvkeys.chain_keys

    def counting(spec: NamespaceSpec, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        keys = real(spec, tokens, *args, **kwargs)
        counted.append(len(keys))
        return keys

    monkeypatch.setattr(kvstore_store, "chain_keys", counting)
    monkeypatch.setattr(why, "chain_keys", counting, raising=False)
    return counted


def open_ns(store: Store, model: str, tenant: str) -> NamespaceSpec:
    return store.open_namespace(
        NamespaceSpec(model, TOKENS, BLOCK, tenant_salt=tenant_salt(tenant, ""))
    )


def test_why_walks_only_as_far_as_each_namespace_holds_the_prompt(
    store: Store, hashed: list[int]
) -> None:
    prompt = np.arange(PROMPT_BLOCKS * TOKENS, dtype=np.int64) % 30000
    mine = open_ns(store, "mine", "a")
    holder = open_ns(store, "holder", "a")  # holds the first 8 blocks of the prompt
    store.put(holder.ns_id, store.keys_for(holder.ns_id, prompt[: 8 * TOKENS]), [bytes(BLOCK)] * 8)
    for i in range(300):  # the caller's namespaces that hold none of it
        open_ns(store, f"empty-{i}", "a")
    for i in range(200):  # another tenant's, one holding the whole first block
        open_ns(store, f"theirs-{i}", "b")
    hashed.clear()
    keys = store.keys_for(mine.ns_id, prompt)
    answer = why.explain(store, mine, keys, prompt, [], Caller("a"), why.Pacer())
    assert (answer.reason, answer.other_ns) == ("other_namespace", holder.ns_id)
    spent = sum(hashed) - len(keys)  # (the caller's own chain, hashed once)
    # one block for each empty namespace, 1 + 2 + 4 + 8 + 16 for the holder
    assert spent <= 300 + 31, spent
    assert spent <= why.WALK_BLOCKS


def test_why_costs_a_tenant_the_same_whatever_other_tenants_hold(
    store: Store, hashed: list[int]
) -> None:
    prompt = np.arange(64 * TOKENS, dtype=np.int64)
    mine = open_ns(store, "mine", "a")
    keys = store.keys_for(mine.ns_id, prompt)

    listed: list[int] = []  # namespaces each explain was given to look at
    every = store.namespaces

    def namespaces(tenant: str | None = None) -> list[NamespaceSpec]:
        found = every(tenant)
        listed.append(len(found))
        return found

    store.namespaces = namespaces  # type: ignore[method-assign]

    def spent() -> int:
        hashed.clear()
        why.explain(store, mine, keys, prompt, [], Caller("a"), why.Pacer())
        return sum(hashed)

    alone = spent()
    for i in range(500):  # another tenant's namespaces, each holding the prompt
        theirs = open_ns(store, f"theirs-{i}", "b")
        if i < 3:
            store.put(theirs.ns_id, store.keys_for(theirs.ns_id, prompt), [bytes(BLOCK)] * 64)
    assert spent() == alone
    assert listed == [1, 1]  # its own namespace, not the other tenant's 500
    # the admin sees every namespace: it finds theirs
    answer = why.explain(store, mine, keys, prompt, [], Caller("", admin=True), why.Pacer())
    assert answer.reason == "other_namespace"
