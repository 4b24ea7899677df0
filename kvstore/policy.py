"""Eviction order, one object per tier, swappable.

A policy only orders blocks; the store decides whether a candidate may go (ready,
unpinned, and for leaf-first policies: no children left in that tier). Two policies:

- ``PriorityLRU`` (default): one LRU list per priority level 0..100; candidates come
  lowest priority first, least recently used first within a level. A use touches the
  whole prefix with one timestamp, leaf first, so in every list a parent sits after
  (is newer than) its children: ``lastUse(parent) >= lastUse(child)`` and the oldest
  entries are leaves. ``leaf_first`` is True.
- ``PlainLRU``: the naive baseline kept for comparison (the seed scenario test): one
  list, only the blocks a request names are touched, a block may be evicted while its
  children remain (the store then drops those orphans, since they are unusable).

Lists are intrusive (links live in the nodes) so a block costs no extra objects.

The store keeps a :class:`GroupedPolicy` per tier: one such policy per tenant group
(see kvstore.tenants), so a tenant over its quota finds its own victims without
walking past other tenants' blocks, while tier-wide eviction takes the least valuable
block of all groups (their candidates merged by rank).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterator, Sequence
from typing import Any, Protocol

from kvstore.index import Node

MAX_PRIORITY = 100
# what a put does past its wait for a writer that is behind (kvstore.store_writes): the
# disk's (``overflow``) and the shared tier's (``shared_overflow``) offer the same two
OVERFLOW_POLICIES = ("wait", "drop")


class LruList:
    """Doubly linked list through two node attributes; oldest at the head."""

    __slots__ = ("_prev", "_next", "_owner", "head", "tail", "size")

    def __init__(self, prev_attr: str, next_attr: str, owner_attr: str) -> None:
        self._prev = prev_attr
        self._next = next_attr
        self._owner = owner_attr
        self.head: Node | None = None
        self.tail: Node | None = None
        self.size = 0

    def push_newest(self, node: Node) -> None:
        self.push_run((node,))

    def push_run(self, nodes: Sequence[Node]) -> None:
        """:meth:`push_newest` of each of ``nodes`` in order (the last ends newest),
        linking the run once instead of node by node."""
        prev_attr, next_attr, owner = self._prev, self._next, self._owner
        before = self.tail
        for node in nodes:
            assert getattr(node, owner) is None, "node already in an eviction list"
            setattr(node, prev_attr, before)
            setattr(node, owner, self)
            if before is None:
                self.head = node
            else:
                setattr(before, next_attr, node)
            before = node
        setattr(before, next_attr, None)
        self.tail = before
        self.size += len(nodes)

    def push_oldest_run(self, nodes: Sequence[Node]) -> None:
        """Link ``nodes`` (oldest first) in front of the oldest entry, as one run."""
        if not self.head:
            self.push_run(nodes)
            return
        prev_attr, next_attr, owner = self._prev, self._next, self._owner
        after = self.head
        for node in reversed(nodes):
            assert getattr(node, owner) is None, "node already in an eviction list"
            setattr(node, next_attr, after)
            setattr(after, prev_attr, node)
            setattr(node, owner, self)
            after = node
        setattr(after, prev_attr, None)
        self.head = after
        self.size += len(nodes)

    def insert_by_time(self, node: Node) -> None:
        """Insert at the place its ``last_access`` gives (scanning from the newest end).

        Used when a block changes list without being used (priority change or expiry),
        so it keeps its recency instead of looking freshly used.
        """
        after = self.tail
        while after is not None and after.last_access > node.last_access:
            after = getattr(after, self._prev)
        if after is None or after is self.tail:
            if after is None and self.head is not None:
                self._link_before(node, self.head)
            else:
                self.push_newest(node)
            return
        self._link_before(node, getattr(after, self._next))

    def _link_before(self, node: Node, successor: Node) -> None:
        assert getattr(node, self._owner) is None, "node already in an eviction list"
        prev = getattr(successor, self._prev)
        setattr(node, self._prev, prev)
        setattr(node, self._next, successor)
        setattr(successor, self._prev, node)
        if prev is None:
            self.head = node
        else:
            setattr(prev, self._next, node)
        setattr(node, self._owner, self)
        self.size += 1

    def remove(self, node: Node) -> None:
        assert getattr(node, self._owner) is self, "node not in this list"
        prev = getattr(node, self._prev)
        nxt = getattr(node, self._next)
        if prev is None:
            self.head = nxt
        else:
            setattr(prev, self._next, nxt)
        if nxt is None:
            self.tail = prev
        else:
            setattr(nxt, self._prev, prev)
        setattr(node, self._prev, None)
        setattr(node, self._next, None)
        setattr(node, self._owner, None)
        self.size -= 1

    def move_run_to_newest(self, nodes: Sequence[Node]) -> bool:
        """If ``nodes`` lie next to each other in this list in this order, move them to
        the newest end as one piece (four links change, whatever their number) and
        return True; else change nothing and return False. A prompt's chain, touched
        as a unit the last time, is such a run until blocks are added in between."""
        prev, nxt, owner = self._prev, self._next, self._owner
        first, last = nodes[0], nodes[-1]
        if getattr(first, owner) is not self:
            return False
        node = first
        for want in nodes[1:]:
            node = getattr(node, nxt)
            if node is not want:
                return False
        if last is self.tail:
            return True
        before = getattr(first, prev)
        after = getattr(last, nxt)  # not None: last is not the tail
        if before is None:
            self.head = after
        else:
            setattr(before, nxt, after)
        setattr(after, prev, before)
        setattr(first, prev, self.tail)
        setattr(self.tail, nxt, first)
        setattr(last, nxt, None)
        self.tail = last
        return True

    def oldest_first(self) -> Iterator[Node]:
        """Iterate from the head; the yielded node may be removed before resuming."""
        node = self.head
        while node is not None:
            nxt = getattr(node, self._next)
            yield node
            node = nxt


class TierPolicy(Protocol):
    leaf_first: bool
    touch_prefix: bool

    def insert(self, node: Node) -> None: ...
    def insert_all(self, nodes: Sequence[Node]) -> None: ...
    def insert_oldest(self, nodes: Sequence[Node]) -> None: ...
    def touch(self, node: Node) -> None: ...
    def touch_all(self, nodes: Sequence[Node]) -> None: ...
    def remove(self, node: Node) -> None: ...
    def reprioritize(self, node: Node) -> None: ...
    def candidates(self) -> Iterator[Node]: ...
    def rank(self, node: Node) -> Any: ...
    def __contains__(self, node: Node) -> bool: ...


def _attrs(tier: str) -> tuple[str, str, str]:
    return f"{tier}_prev", f"{tier}_next", f"{tier}_list"


class _ListPolicy:
    """What both policies share: each block in one LruList of the tier, found through
    the node's ``<tier>_list`` link; a subclass says which list a block belongs in."""

    def __init__(self, tier: str) -> None:
        self._owner = _attrs(tier)[2]

    def _list_of(self, node: Node) -> LruList:
        raise NotImplementedError

    def __contains__(self, node: Node) -> bool:
        return getattr(node, self._owner) is not None

    def insert(self, node: Node) -> None:
        self._list_of(node).push_newest(node)

    def insert_all(self, nodes: Sequence[Node]) -> None:
        """:meth:`insert` of each of ``nodes`` in order; one run where they share a
        list (the blocks of one put do)."""
        if not nodes:
            return
        lst = self._list_of(nodes[0])
        if all(self._list_of(node) is lst for node in nodes):
            lst.push_run(nodes)
            return
        for node in nodes:
            self.insert(node)

    def insert_oldest(self, nodes: Sequence[Node]) -> None:
        """List ``nodes`` (oldest first) as older than every block listed now: blocks
        loaded from disk after a start, behind the blocks used since."""
        runs: dict[int, list[Node]] = {}
        lists: dict[int, LruList] = {}
        for node in nodes:
            lst = self._list_of(node)
            runs.setdefault(id(lst), []).append(node)
            lists[id(lst)] = lst
        for key, run in runs.items():
            if run:
                lists[key].push_oldest_run(run)

    def touch(self, node: Node) -> None:
        lst: LruList = getattr(node, self._owner)
        lst.remove(node)
        self._list_of(node).push_newest(node)

    def touch_all(self, nodes: Sequence[Node]) -> None:
        """Touch the listed ``nodes`` in order (each ends newer than the one before).

        A prefix read again is usually one run of its list, in that order (it was
        touched as a unit): it moves to the newest end in one piece."""
        if nodes and self._list_of(nodes[0]).move_run_to_newest(nodes):
            return
        owner = self._owner
        for node in nodes:
            if getattr(node, owner) is not None:
                self.touch(node)

    def remove(self, node: Node) -> None:
        lst: LruList = getattr(node, self._owner)
        lst.remove(node)


class PriorityLRU(_ListPolicy):
    leaf_first = True
    touch_prefix = True

    def __init__(self, tier: str) -> None:
        super().__init__(tier)
        self._lists = [LruList(*_attrs(tier)) for _ in range(MAX_PRIORITY + 1)]

    def _list_of(self, node: Node) -> LruList:
        return self._lists[node.priority]

    def reprioritize(self, node: Node) -> None:
        lst: LruList = getattr(node, self._owner)
        lst.remove(node)
        self._lists[node.priority].insert_by_time(node)

    def candidates(self) -> Iterator[Node]:
        for lst in self._lists:
            if lst.size:
                yield from lst.oldest_first()

    @staticmethod
    def rank(node: Node) -> tuple[int, float]:
        """Where ``node`` comes in :meth:`candidates` (lower first)."""
        return node.priority, node.last_access


class PlainLRU(_ListPolicy):
    leaf_first = False
    touch_prefix = False

    def __init__(self, tier: str) -> None:
        super().__init__(tier)
        self._list = LruList(*_attrs(tier))

    def _list_of(self, node: Node) -> LruList:
        return self._list

    def reprioritize(self, node: Node) -> None:
        """Plain LRU ignores priorities."""

    def candidates(self) -> Iterator[Node]:
        yield from self._list.oldest_first()

    @staticmethod
    def rank(node: Node) -> tuple[int, float]:
        return 0, node.last_access


POLICIES: dict[str, type[PriorityLRU] | type[PlainLRU]] = {
    "priority-lru": PriorityLRU,
    "plain-lru": PlainLRU,
}


class GroupedPolicy:
    """One ``name`` policy per tenant group of a tier; a block is in its namespace's
    group's policy. ``candidates(group)`` yields one group's candidates;
    ``candidates()`` those of every group, merged by rank (a single group's directly).
    The blocks one call names (a chain) are all of one namespace, so of one group."""

    def __init__(self, name: str, tier: str) -> None:
        self._name = name
        self._tier = tier
        self._groups: dict[str, TierPolicy] = {"": make_policy(name, tier)}
        first = self._groups[""]
        self.leaf_first = first.leaf_first
        self.touch_prefix = first.touch_prefix
        self._rank = first.rank

    def _of(self, node: Node) -> TierPolicy:
        group = node.ns.group.name
        policy = self._groups.get(group)
        if policy is None:
            policy = self._groups[group] = make_policy(self._name, self._tier)
        return policy

    def __contains__(self, node: Node) -> bool:
        return node in self._of(node)

    def insert(self, node: Node) -> None:
        self._of(node).insert(node)

    def insert_all(self, nodes: Sequence[Node]) -> None:
        if nodes:
            self._of(nodes[0]).insert_all(nodes)

    def insert_oldest(self, nodes: Sequence[Node]) -> None:
        """:meth:`_ListPolicy.insert_oldest`, per group."""
        groups: dict[str, list[Node]] = {}
        for node in nodes:
            groups.setdefault(node.ns.group.name, []).append(node)
        for run in groups.values():
            self._of(run[0]).insert_oldest(run)

    def touch(self, node: Node) -> None:
        self._of(node).touch(node)

    def touch_all(self, nodes: Sequence[Node]) -> None:
        if nodes:
            self._of(nodes[0]).touch_all(nodes)

    def remove(self, node: Node) -> None:
        self._of(node).remove(node)

    def reprioritize(self, node: Node) -> None:
        self._of(node).reprioritize(node)

    def candidates(self, group: str | None = None, skip: Collection[str] = ()) -> Iterator[Node]:
        """The candidates of ``group``, or of every group not in ``skip``."""
        if group is not None:
            policy = self._groups.get(group)
            return policy.candidates() if policy is not None else iter(())
        policies = [p for name, p in self._groups.items() if name not in skip]
        if len(policies) == 1:
            return policies[0].candidates()
        return heapq.merge(*(p.candidates() for p in policies), key=self._rank)


def make_policy(name: str, tier: str) -> TierPolicy:
    try:
        return POLICIES[name](tier)
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose from {sorted(POLICIES)}"
        ) from None
