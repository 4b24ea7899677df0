"""Eviction order: priority levels, LRU within a level, recency kept on priority change."""

from __future__ import annotations

from kvstore.index import READY, NamespaceEntry, Node
from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.policy import PlainLRU, PriorityLRU, make_policy

ENTRY = NamespaceEntry(NamespaceSpec("m", block_tokens=2, block_bytes=64))


def node(name: str, priority: int = 35, last_access: float = 0.0) -> Node:
    key = BlockKey(name.encode().ljust(32, b"."))
    return Node(key, ENTRY, None, state=READY, priority=priority, last_access=last_access)


def names(policy: PriorityLRU | PlainLRU) -> list[str]:
    return [n.key.rstrip(b".").decode() for n in policy.candidates()]


def test_lowest_priority_first_then_least_recent() -> None:
    policy = PriorityLRU("host")
    for n in (node("a", 50), node("b", 10), node("c", 50), node("d", 10)):
        policy.insert(n)
    assert names(policy) == ["b", "d", "a", "c"]


def test_touch_moves_to_the_newest_end_of_its_level() -> None:
    policy = PriorityLRU("host")
    a, b, c = node("a"), node("b"), node("c")
    for n in (a, b, c):
        policy.insert(n)
    policy.touch(a)
    assert names(policy) == ["b", "c", "a"]
    policy.remove(c)
    assert names(policy) == ["b", "a"] and c not in policy


def test_priority_change_keeps_recency() -> None:
    # a falls back from 80 to 35: it lands among the 35s by its last use, not as newest
    policy = PriorityLRU("host")
    a = node("a", 80, last_access=1.0)
    b, c = node("b", last_access=2.0), node("c", last_access=3.0)
    for n in (a, b, c):
        policy.insert(n)
    assert names(policy) == ["b", "c", "a"]
    a.priority = 35
    policy.reprioritize(a)
    assert names(policy) == ["a", "b", "c"]


def test_candidates_survive_removal_while_iterating() -> None:
    policy = PriorityLRU("disk")
    nodes = [node(str(i)) for i in range(5)]
    for n in nodes:
        policy.insert(n)
    seen = []
    for n in policy.candidates():
        seen.append(n)
        policy.remove(n)
    assert seen == nodes


def test_plain_lru_ignores_priority() -> None:
    policy = make_policy("plain-lru", "host")
    for n in (node("a", 90), node("b", 0)):
        policy.insert(n)
    assert names(policy) == ["a", "b"]  # type: ignore[arg-type]
    assert not policy.leaf_first and not policy.touch_prefix
