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


def test_touch_all_orders_like_one_touch_per_node() -> None:
    """touch_all moves a run in one piece, or falls back to node by node: either way the
    order is what touching each node in turn gives (random lists, runs and non-runs)."""
    import random

    rng = random.Random(7)
    for cls in (PriorityLRU, PlainLRU):
        for _ in range(300):
            size = rng.randint(1, 12)
            fast, slow = cls("host"), cls("host")
            fast_nodes = [node(f"n{i}", rng.choice((10, 35, 35))) for i in range(size)]
            slow_nodes = [node(f"n{i}", n.priority) for i, n in enumerate(fast_nodes)]
            for a, b in zip(fast_nodes, slow_nodes, strict=True):
                fast.insert(a)
                slow.insert(b)
            for _ in range(4):
                if rng.random() < 0.5:  # a run of the current order, as a chain touch makes
                    order = [n.key for n in fast.candidates()]
                    lo = rng.randrange(size)
                    picked = order[lo : rng.randint(lo + 1, size)]
                else:
                    picked = [n.key for n in rng.sample(fast_nodes, rng.randint(1, size))]
                by_key_fast = {n.key: n for n in fast_nodes}
                by_key_slow = {n.key: n for n in slow_nodes}
                fast.touch_all([by_key_fast[k] for k in picked])
                for k in picked:
                    slow.touch(by_key_slow[k])
                assert names(fast) == names(slow)
                # the links agree with the order both ways
                lists = getattr(fast, "_lists", None) or [fast._list]
                for lst in lists:
                    backward, n = [], lst.tail
                    while n is not None:
                        backward.append(n)
                        n = n.host_prev
                    assert backward[::-1] == list(lst.oldest_first())
                    assert lst.size == len(backward)
                    assert (lst.head is None) == (lst.tail is None)


def test_insert_all_orders_like_one_insert_per_node() -> None:
    # a run of one level links as one piece; a run across levels falls back to inserts
    for run in (
        [node("a"), node("b"), node("c")],
        [node("a", 50), node("b", 10), node("c", 50)],
    ):
        one, many = PriorityLRU("host"), PriorityLRU("host")
        old_one, old_many = node("old"), node("old")
        one.insert(old_one)
        many.insert(old_many)
        one.insert_all(run)
        expected = names(one)
        for n in run:  # the same blocks again, unlinked, node by node
            one.remove(n)
        for n in run:
            many.insert(n)
        assert names(many) == expected
    plain = PlainLRU("host")
    plain.insert_all([node("p"), node("q")])
    plain.insert(node("r"))
    assert names(plain) == ["p", "q", "r"]
    assert plain._list.size == 3
