"""The prefix index: walking chains, tree links, removal order."""

from __future__ import annotations

import pytest

from kvstore.index import READY, Index, NamespaceEntry, Node
from kvstore.keys import BlockKey, NamespaceSpec

ENTRY = NamespaceEntry(NamespaceSpec("m", block_tokens=2, block_bytes=64))


def key(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(32, b"."))


def add(index: Index, name: str, parent: Node | None = None) -> Node:
    node = Node(key(name), ENTRY, parent, state=READY)
    node.on_disk = True  # in some tier, as the store requires before removal checks
    index.add(node)
    return node


def test_walk_returns_longest_indexed_prefix() -> None:
    index = Index()
    a = add(index, "a")
    b = add(index, "b", a)
    add(index, "c", b)
    assert index.walk([key("a"), key("b"), key("x"), key("c")]) == [a, b]
    assert index.walk([key("b")]) == []  # b is not a root: a chain must start at one


def test_walk_checks_parent_links() -> None:
    # a key that exists but under another parent does not extend this chain
    index = Index()
    a = add(index, "a")
    other = add(index, "other")
    add(index, "b", other)
    assert index.walk([key("a"), key("b")]) == [a]


def test_children_and_subtree_postorder() -> None:
    index = Index()
    root = add(index, "r")
    left = add(index, "l", root)
    right = add(index, "q", root)
    leaf = add(index, "ll", left)
    assert set(root.children()) == {left, right}
    order = index.subtree_postorder(root)
    assert order[-1] is root
    assert order.index(leaf) < order.index(left)  # every node after its descendants
    assert len(order) == 4


def test_remove_unlinks_and_counts() -> None:
    index = Index()
    entry = NamespaceEntry(NamespaceSpec("n", block_tokens=2, block_bytes=64))
    root = Node(key("r"), entry, None, state=READY)
    child = Node(key("c"), entry, root, state=READY)
    for node in (root, child):
        index.add(node)
    assert (entry.blocks, entry.bytes, entry.roots) == (2, 128, {key("r")})
    with pytest.raises(AssertionError, match="still has children"):
        index.remove(root)
    index.remove(child)  # neither in host nor on disk: removable
    assert root.first_child is None and entry.blocks == 1
    index.remove(root)
    assert len(index) == 0 and entry.roots == set() and entry.bytes == 0


def _links(index: Index) -> dict[bytes, tuple[object, ...]]:
    """Every node's tree links and its namespace's counts, by key, to compare indexes."""

    def name(node: Node | None) -> bytes | None:
        return None if node is None else node.key

    return {
        k: (name(n.parent), name(n.first_child), name(n.next_sibling), name(n.prev_sibling))
        for k, n in index.nodes.items()
    }


def test_add_chain_links_like_one_add_per_node() -> None:
    # a chain under a parent that already has a child, added in one pass and node by
    # node: the same tree, the same namespace counts
    results = []
    for one_pass in (True, False):
        entry = NamespaceEntry(ENTRY.spec)
        index = Index()
        root = Node(key("root"), entry, None, state=READY)
        index.add(root)
        index.add(Node(key("sibling"), entry, root, state=READY))
        chain: list[Node] = []
        parent = root
        for name in ("x", "y", "z"):
            parent = Node(key(name), entry, parent, state=READY)
            chain.append(parent)
        if one_pass:
            index.add_chain(chain)
        else:
            for node in chain:
                index.add(node)
        results.append((_links(index), entry.blocks, entry.bytes, entry.roots))
    assert results[0] == results[1]
    assert results[0][1] == 5 and results[0][2] == 5 * 64


def test_add_chain_of_a_new_root() -> None:
    entry = NamespaceEntry(ENTRY.spec)
    index = Index()
    a = Node(key("a"), entry, None, state=READY)
    b = Node(key("b"), entry, a, state=READY)
    index.add_chain([a, b])
    assert entry.roots == {key("a")}
    assert index.walk([key("a"), key("b")]) == [a, b]
    assert list(a.children()) == [b] and list(b.children()) == []
