"""A prefix router over kvstored's KV events: which node holds most of a prompt.

Each kvstored started with ``kv_events_listen`` publishes, in vLLM's KV event format,
every block that enters or leaves its host, disk and shared tiers
(docs/operations/events.md). This router subscribes to several daemons and keeps, per
node, the blocks it holds; asked for a prompt, it answers the node holding its longest prefix.

It bridges through tokens, as llm-d's scorer does: a ``BlockStored`` carries each
block's tokens and its parent's hash, so the router learns "the block after P with
these tokens is H" and walks a prompt block by block without knowing how hashes are
computed. Blocks of the shared tier (``locality`` REMOTE) are every node's to pull and
choose no node. It decodes batches without vLLM's classes, so both encodings (map and
the older array) and both hash forms (bytes, int) work.

    python examples/prefix_router.py --node a=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558 \\
        --node b=tcp://10.0.0.2:5557,tcp://10.0.0.2:5558 --topic MODEL --listen-s 5 < prompt.txt

reads whitespace-separated token ids on stdin, listens for ``--listen-s`` seconds (a
router would listen for good), and prints the chosen node and the tokens it holds.

A router that starts after the blocks were stored learns them from each node's replay
socket (``kv_events_replay_listen``, the second address of ``--node``): it subscribes
first, then asks for every kept batch from seq 0, as docs/operations/events.md says (a DEALER sends
``["", start_seq]``; the answers are ``["", topic, seq, payload]``, then
``["", "", -1, ""]``), and skips the live batches the replay already covered.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import zmq

STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                 "kv_cache_spec_sliding_window", "locality")  # fmt: skip
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message


def fields(event: Any, names: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """(type, fields) of a decoded event: a map (``type`` key) or an array (tag first)."""
    if isinstance(event, dict):
        return event["type"], event
    return event[0], dict(zip(names, event[1:], strict=False))


class PrefixRouter:
    """Subscribes to ``nodes`` (name -> PUB address) on ``topic``; :meth:`poll` applies
    what arrived, :meth:`route` answers a prompt."""

    def __init__(
        self, nodes: Mapping[str, str], topic: str = "", replays: Mapping[str, str] | None = None
    ) -> None:
        """``nodes``: name -> PUB address; ``replays``: name -> replay (ROUTER) address,
        asked for what the node published before this router subscribed."""
        self.ctx = zmq.Context()
        self.sockets: dict[zmq.Socket[bytes], str] = {}
        self.poller = zmq.Poller()
        for name, address in nodes.items():
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt_string(zmq.SUBSCRIBE, topic)
            sub.connect(address)
            self.sockets[sub] = name
            self.poller.register(sub, zmq.POLLIN)
        # (parent, tokens) -> the hashes of such blocks (namespaces that differ in
        # salt or layout name the same tokens differently)
        self.next: dict[tuple[Any, tuple[int, ...]], set[Any]] = {}
        self.held: dict[str, dict[Any, set[str]]] = {n: {} for n in nodes}  # hash -> tiers
        self.block_size = 0
        self.heard: set[str] = set()  # nodes heard from
        self.applied: dict[tuple[str, bytes], int] = {}  # (node, topic) -> last seq applied
        for name, address in (replays or {}).items():
            self.replay(name, address, topic)

    def replay(self, node: str, address: str, topic: str = "", timeout_s: float = 5.0) -> int:
        """Apply every batch ``node`` kept (of ``topic``, '' for all) from its replay
        socket; how many. A node that does not answer in ``timeout_s`` is left to the
        live stream."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(address)
        named = (topic.encode(),) if topic else ()
        applied = 0
        try:
            dealer.send_multipart((b"", *named, (0).to_bytes(8, "big")))
            while dealer.poll(int(timeout_s * 1000)):
                _, name, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return applied
                applied += self.take(node, name, seq, payload)
            print(f"prefix_router: node {node}: no replay from {address}", file=sys.stderr)
            return applied
        finally:
            dealer.close(linger=0)

    def poll(self, timeout_s: float = 0.0) -> int:
        """Apply the batches that arrive within ``timeout_s``; how many."""
        applied = 0
        deadline = time.monotonic() + timeout_s
        while ready := dict(self.poller.poll(max(0, int((deadline - time.monotonic()) * 1000)))):
            for sock in ready:
                name, seq, payload = sock.recv_multipart()
                applied += self.take(self.sockets[sock], name, seq, payload)
        return applied

    def take(self, node: str, topic: bytes, seq: bytes, payload: bytes) -> int:
        """Apply one frame unless a replay already applied its seq (per node and topic:
        each topic counts on its own); 1 if applied. A seq lower than the last applied
        one after a restart of the node (seqs start again at 0) follows its
        ``AllBlocksCleared``: nothing of the old run is kept."""
        number = int.from_bytes(seq, "big")
        last = self.applied.get((node, topic))
        batch = msgspec.msgpack.decode(payload)
        restarted = number == 0 and last is not None and last > 0
        if last is not None and number <= last and not restarted:
            return 0
        self.applied[(node, topic)] = number
        self.apply(node, batch)
        return 1

    def apply(self, node: str, batch: Sequence[Any]) -> None:
        self.heard.add(node)
        held = self.held[node]
        for event in batch[1]:
            kind, f = fields(event, STORED_FIELDS)
            if kind == "AllBlocksCleared":
                held.clear()
            elif kind == "BlockStored":
                where = f"{f['medium']}/{f.get('locality') or 'LOCAL'}"
                size = self.block_size = f["block_size"]
                parent, tokens = f["parent_block_hash"], f["token_ids"]
                for i, block in enumerate(f["block_hashes"]):
                    if len(tokens) >= (i + 1) * size:
                        chunk = (parent, tuple(tokens[i * size : (i + 1) * size]))
                        self.next.setdefault(chunk, set()).add(block)
                    held.setdefault(block, set()).add(where)
                    parent = block
            elif kind == "BlockRemoved":
                _, f = fields(event, REMOVED_FIELDS)
                where = f"{f['medium']}/{f.get('locality') or 'LOCAL'}"
                for block in f["block_hashes"]:
                    tiers = held.get(block)
                    if tiers is not None:
                        tiers.discard(where)
                        if not tiers:
                            del held[block]

    def route(self, tokens: Sequence[int]) -> tuple[str | None, int]:
        """The node holding the longest prefix of ``tokens`` on its own tiers, and how
        many tokens that prefix covers; (None, 0) when no node holds its first block."""
        best: tuple[str | None, int] = (None, 0)
        for node in self.held:
            covered = self.held_prefix(node, tokens)
            if covered > best[1]:
                best = (node, covered)
        return best

    def held_prefix(self, node: str, tokens: Sequence[int]) -> int:
        """Tokens of the longest prefix of ``tokens`` whose blocks ``node`` holds: a
        walk, block by block, through the blocks it holds (of any namespace)."""
        held, size = self.held[node], self.block_size
        frontier: set[Any] = {None}
        blocks = 0
        for i in range(len(tokens) // size if size else 0):
            chunk = tuple(tokens[i * size : (i + 1) * size])
            frontier = {
                block
                for parent in frontier
                for block in self.next.get((parent, chunk), ())
                if any(t.endswith("LOCAL") for t in held.get(block, ()))
            }
            if not frontier:
                break
            blocks += 1
        return blocks * size

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--node",
        action="append",
        required=True,
        metavar="NAME=ADDRESS",
        help="a daemon's kv_events_listen address, and after a comma its "
        "kv_events_replay_listen address (repeatable)",
    )
    parser.add_argument("--topic", default="", help="the model to route ('': every topic)")
    parser.add_argument("--listen-s", type=float, default=5.0, help="seconds to listen")
    args = parser.parse_args(argv)
    addresses = dict(spec.split("=", 1) for spec in args.node)
    nodes = {name: address.split(",")[0] for name, address in addresses.items()}
    replays = {name: address.split(",")[1] for name, address in addresses.items()
               if "," in address}  # fmt: skip
    tokens = [int(word) for word in sys.stdin.read().split()]
    router = PrefixRouter(nodes, args.topic, replays)
    try:
        router.poll(args.listen_s)
        node, covered = router.route(tokens)
    finally:
        router.close()
    print(f"{node or 'none'} {covered}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
