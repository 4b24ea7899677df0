"""KV events for prefix-aware routers, in vLLM's wire format (:class:`Publisher`).

Routers that place requests by prefix (llm-d's precise prefix-cache scorer, NVIDIA
Dynamo's KV router) subscribe to each engine's KV events. This publisher sends what
kvstored holds in the same format, so a router sees a node's host, disk and shared
tiers beside its engines' GPU blocks.

Protocol (vLLM's ``ZmqEventPublisher``):

- A ZMQ PUB socket (``kv_events_listen``) sends frames ``[topic, seq, payload]``:
  ``seq`` an 8-byte big-endian counter per topic from 0, ``payload`` a msgpack
  ``EventBatch`` ``[ts, events, data_parallel_rank]`` whose events are ``BlockStored``,
  ``BlockRemoved`` and ``AllBlocksCleared``, tagged by class name. ``map`` encoding
  (vLLM's current: each event a map with a ``type`` key) or ``array`` (the older one).
- A ZMQ ROUTER socket (``kv_events_replay_listen``) answers ``[start_seq]`` (8 bytes
  big-endian) with every kept batch whose seq is at least that, as
  ``[topic, seq, payload]`` messages, then ``["", -1, ""]``. Since each topic counts on
  its own, a request may name one: ``[topic, start_seq]``.
- Topics: a namespace publishes on its model's name; a tenant's namespaces only on the
  topic its ``[tenants.<name>]`` table names (``events_topic``), else not at all. ZMQ
  topics are prefixes: subscribing to ``""`` receives every topic.

Events: ``BlockStored`` (``block_hashes``: a run of one chain, parents first;
``parent_block_hash``; ``token_ids`` of the run; ``block_size`` in tokens; ``medium``
``CPU`` for the host tier, ``STORAGE`` for the disk and shared tiers with ``locality``
``LOCAL`` or ``REMOTE``; ``ownership`` "kvstore"), ``BlockRemoved`` when a block leaves
a tier (the shared tier's own expiry is not seen), ``AllBlocksCleared`` at every start
(on ``""``, on each tenant topic, and on the topic of every namespace found on disk,
before its blocks are told again) and after a Clear of everything. Hashes are
kvstore's chain keys: bytes, or their low 64 bits as an integer (``kv_events_hashes``).

The publisher's thread takes the store's tier changes (:mod:`kvstore.tier_events`)
every FLUSH_S, encodes and sends them; nothing of this runs under the store's lock.

Memory (``kv_events_buffer_bytes``, B): the feed holds at most B of changes, token ids
included; the thread takes at most TAKE_BYTES of them at a time (it makes Python int
lists of their tokens, 9x their packed bytes); a batch's payload is at most
BATCH_BYTES (runs are cut to fit); at most B of batches are kept for replay, and the
PUB socket queues at most B // BATCH_BYTES messages (B) for a subscriber that does
not read (its ``SNDHWM``: past it ZMQ drops that subscriber's new messages).
"""

from __future__ import annotations

import array
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from kvstore.keys import NamespaceSpec
from kvstore.tenants import tenant_of
from kvstore.tier_events import CLEARED, DISK, HOST, SHARED, STORED, TierChange, TierFeed
from kvstored.log_limits import LIMITED

log = logging.getLogger("kvstored")

FLUSH_S = 0.02  # how often the thread takes changes and answers replay requests
TAKE = 8192  # changes taken per wake-up
TAKE_BYTES = 1 << 20  # ... and their bytes (kvstore.tier_events.change_bytes) at most
BATCH_EVENTS = 1024  # events per EventBatch at most
BATCH_BYTES = 64 << 10  # ... and its payload's bytes at most (an upper estimate)
# an event's encoded bytes at most: its fields and names, each hash, each token id
EVENT_BYTES, HASH_BYTES, TOKEN_BYTES = 256, 34, 5
END_SEQ = (-1).to_bytes(8, "big", signed=True)
OWNERSHIP = "kvstore"
ENCODINGS = ("map", "array")
HASH_FORMS = ("bytes", "int")
# tier -> (medium, locality)
_WHERE = {HOST: ("CPU", "LOCAL"), DISK: ("STORAGE", "LOCAL"), SHARED: ("STORAGE", "REMOTE")}
DROP_LOG_EVERY_S = 60.0
# what one peer can make the publisher hold or do (anyone who reaches its sockets)
MAX_SUBSCRIPTION_BYTES = 64 << 10  # a message to the PUB socket (a subscription)
MAX_REQUEST_BYTES = 4 << 10  # a replay request
REPLAY_SNDHWM = 64  # replay messages queued for one peer that does not read (then dropped)
REPLAYS_PER_S = 2  # replay requests answered per peer and second (the rest ignored)
REPLAYS_PER_S_ALL = 20  # ... and of all peers together
REQUESTS_PER_WAKE = 16  # replay requests read per wake-up (the stop is checked between)


@dataclass(frozen=True, slots=True)
class EventSettings:
    """The daemon's ``kv_events_*`` keys and its tenants' topics."""

    listen: str
    replay_listen: str = ""
    encoding: str = "map"
    hashes: str = "bytes"
    buffer_batches: int = 10_000  # batches kept for replay
    buffer_bytes: int = 64 << 20  # ... and their bytes at most
    feed_changes: int = 262_144  # tier changes kept while the thread catches up
    feed_bytes: int = 64 << 20  # ... and their bytes at most
    tenant_topics: Mapping[str, str] | None = None  # tenant -> its topic


class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _event_types(array_like: bool) -> tuple[type, type, type]:
    """vLLM's three event structs (same names, fields and order), map or array encoded."""

    class KVCacheEvent(  # type: ignore[call-arg]
        msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True
    ):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


def token_list(packed: bytes) -> list[int]:
    """Token ids packed as little-endian uint32 (kvstore.keys) -> ints."""
    ids = array.array("I", packed)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        ids.byteswap()
    return ids.tolist()


def event_bytes(event: Any) -> int:
    """An upper estimate of an event's encoded bytes (EVENT_BYTES and the rest)."""
    hashes, tokens = getattr(event, "block_hashes", ()), getattr(event, "token_ids", ())
    return EVENT_BYTES + HASH_BYTES * len(hashes) + TOKEN_BYTES * len(tokens)


class Publisher:
    """Binds the sockets at construction (a bad address fails the start), then
    publishes on its own thread from :meth:`start` to :meth:`close`."""

    def __init__(self, settings: EventSettings) -> None:
        self.settings = settings
        self.feed = TierFeed(settings.feed_changes, on=True, capacity_bytes=settings.feed_bytes)
        self._stored, self._removed, self._cleared = _event_types(settings.encoding == "array")
        self._encode = msgspec.msgpack.Encoder().encode
        self._tenant_topics = dict(settings.tenant_topics or {})
        self._topics: dict[str, str | None] = {}  # ns_id -> topic (None: not published)
        self._used: set[str] = set()  # topics published on since the start
        self._told: set[str] = set()  # ... of which with blocks
        self._seq: dict[str, int] = {}
        self._kept: deque[tuple[bytes, int, bytes]] = deque(maxlen=settings.buffer_batches)
        self._kept_bytes = 0
        self.batches = 0  # batches sent
        self._replays: dict[bytes, list[float]] = {}  # peer -> its answered requests' times
        self._replayed: list[float] = []  # ... of all peers
        self._dropped_logged = 0
        self._dropped_at = -DROP_LOG_EVERY_S
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(max(REPLAY_SNDHWM, settings.buffer_bytes // BATCH_BYTES))
            self._pub.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
            self._pub.bind(settings.listen)
            if settings.replay_listen:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
                self._replay.setsockopt(zmq.SNDHWM, REPLAY_SNDHWM)
                self._replay.bind(settings.replay_listen)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstored-kv-events", daemon=True)

    @property
    def endpoint(self) -> str:
        """The PUB socket's bound address (the port chosen when asked for port 0)."""
        return str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def replay_endpoint(self) -> str:
        if self._replay is None:
            return ""
        return str(self._replay.getsockopt_string(zmq.LAST_ENDPOINT))

    def start(self) -> None:
        """Start publishing: first AllBlocksCleared on ``""`` and on each tenant's topic
        (a router's index of this node from before the start is void)."""
        self._send_clears(["", *sorted(set(self._tenant_topics.values()))])
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Send what the feed still holds (the store is closed: nothing comes after),
        then close the sockets: the thread does, as it ends (sockets are its own; one
        closed under it fails its next call). A thread that does not end within
        ``timeout`` is left to the process's exit, its sockets with it: the stop never
        waits longer, whatever peers sent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif not self._thread.ident:  # never started
            self._close_sockets()

    # --- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            stopping = self._stop.is_set()
            try:
                if self._replay is not None:
                    if dict(poller.poll(int(FLUSH_S * 1000))):
                        self._answer_replay()
                else:
                    self._stop.wait(FLUSH_S)
                while changes := self.feed.take(TAKE, TAKE_BYTES):
                    self._publish(changes)
                self._note_dropped()
            except Exception:  # noqa: BLE001 - a publisher fault must not end the daemon
                LIMITED.error(log, "kv_events_failed", "publishing KV events failed; going on",
                              exc_info=True)
                time.sleep(FLUSH_S)
            if stopping:
                self._close_sockets()
                return

    def _note_dropped(self) -> None:
        dropped = self.feed.dropped
        now = time.monotonic()
        if dropped > self._dropped_logged and now - self._dropped_at >= DROP_LOG_EVERY_S:
            log.warning(
                "KV events: %d tier changes dropped so far (the publisher fell behind by "
                "%d); routers' indexes of this node miss them until its next start",
                dropped, self.feed.capacity,
                extra={"event": "kv_events_dropped", "dropped": dropped},
            )  # fmt: skip
            self._dropped_logged, self._dropped_at = dropped, now

    def topic_of(self, spec: NamespaceSpec) -> str | None:
        topic = self._topics.get(spec.ns_id, "")
        if topic == "":
            tenant = tenant_of(spec.tenant_salt)
            topic = self._tenant_topics.get(tenant) if tenant else spec.model
            self._topics[spec.ns_id] = topic
        return topic

    def _publish(self, changes: list[TierChange]) -> None:
        """Send ``changes`` as batches per topic, in order; a run of one chain entering
        one tier (each block the child of the one before) becomes one BlockStored."""
        out: dict[str, list[Any]] = {}
        run: Any = None  # the BlockStored that the next change may extend ...
        run_topic, run_tier, run_last = "", "", b""  # ... its topic, tier and last key
        for change in changes:
            if change.op == CLEARED:
                run = None
                if change.ns is None:  # a Clear of everything
                    clears = ["", *self._used, *self._tenant_topics.values()]
                else:  # a namespace found on disk at the start, before its blocks: void
                    topic = self.topic_of(change.ns)  # a router's view from before, unless
                    # blocks went out on its topic since (a put while the index loads)
                    clears = [] if topic is None or topic in self._told else [topic]
                self._flush(out)  # (what came before the clear goes first)
                self._send_clears(clears)
                continue
            spec = change.ns
            assert spec is not None
            topic = self.topic_of(spec)
            if topic is None:
                continue
            events = out.setdefault(topic, [])
            self._told.add(topic)
            key = self._hash(change.key)
            medium, locality = _WHERE[change.tier]
            if change.op != STORED:
                run = None
                events.append(self._removed([key], medium, locality=locality, ownership=OWNERSHIP))
                continue
            tokens = change.tokens
            token_ids = [] if tokens is None else token_list(tokens)
            if (
                run is not None
                and tokens is not None
                and events
                and events[-1] is run
                and (run_topic, run_tier, run_last) == (topic, change.tier, change.parent)
                and len(run.block_hashes) < BATCH_EVENTS
                and event_bytes(run) + HASH_BYTES + TOKEN_BYTES * len(token_ids) <= BATCH_BYTES
            ):
                run.block_hashes.append(key)
                run.token_ids.extend(token_ids)
                run_last = change.key
                continue
            parent = None if change.parent is None else self._hash(change.parent)
            event = self._stored(
                [key], parent, token_ids, spec.block_tokens, None, medium, None,
                locality=locality, ownership=OWNERSHIP,
            )  # fmt: skip
            events.append(event)
            run = event if tokens is not None else None
            run_topic, run_tier, run_last = topic, change.tier, change.key
        self._flush(out)

    def _flush(self, out: dict[str, list[Any]]) -> None:
        """Send each topic's events in batches of at most BATCH_EVENTS and BATCH_BYTES."""
        for topic, events in out.items():
            batch: list[Any] = []
            size = 0
            for event in events:
                more = event_bytes(event)
                if batch and (len(batch) == BATCH_EVENTS or size + more > BATCH_BYTES):
                    self._send(topic, batch)
                    batch, size = [], 0
                batch.append(event)
                size += more
            self._send(topic, batch)
        out.clear()

    def _send_clears(self, topics: list[str]) -> None:
        for topic in dict.fromkeys(topics):  # each once, in order
            self._send(topic, [self._cleared()])

    def _send(self, topic: str, events: list[Any]) -> None:
        if not events:
            return
        name = topic.encode()
        seq = self._seq.get(topic, 0)
        self._seq[topic] = seq + 1
        payload = self._encode(_EventBatch(time.time(), events))
        frame = seq.to_bytes(8, "big")
        self._pub.send_multipart((name, frame, payload), copy=False)
        self._keep(name, seq, payload)
        self._used.add(topic)
        self.batches += 1

    def _keep(self, name: bytes, seq: int, payload: bytes) -> None:
        """Keep a batch for replay: the newest ``buffer_batches``, at most
        ``buffer_bytes`` of them."""
        kept = self._kept
        if len(kept) == kept.maxlen:
            self._kept_bytes -= len(kept[0][2])
        kept.append((name, seq, payload))
        self._kept_bytes += len(payload)
        while self._kept_bytes > self.settings.buffer_bytes and len(kept) > 1:
            self._kept_bytes -= len(kept.popleft()[2])

    def _answer_replay(self) -> None:
        """Answer waiting replay requests, at most ``REQUESTS_PER_WAKE`` (the stop is
        checked between wake-ups), each peer at most ``REPLAYS_PER_S`` a second and all
        of them ``REPLAYS_PER_S_ALL``; the rest are ignored (logged within the
        rate-limited logger's bounds)."""
        assert self._replay is not None
        for _ in range(REQUESTS_PER_WAKE):
            if not self._replay.poll(0):
                return
            frames = self._replay.recv_multipart()
            if len(frames) == 3 and len(frames[2]) == 8:
                client, topic, start = frames[0], None, frames[2]
            elif len(frames) == 4 and len(frames[3]) == 8:
                client, topic, start = frames[0], frames[2], frames[3]
            else:
                LIMITED.warning(
                    log, "kv_events_bad_replay", "KV events: a replay request of %d frames "
                    "ignored", len(frames),
                )  # fmt: skip
                continue
            if not self._may_replay(client):
                LIMITED.warning(
                    log, "kv_events_replay_rate", "KV events: a replay request past %d a "
                    "second from one peer (%d from all) ignored", REPLAYS_PER_S,
                    REPLAYS_PER_S_ALL,
                )  # fmt: skip
                continue
            first = int.from_bytes(start, "big")
            for name, seq, payload in list(self._kept):
                if seq >= first and (topic is None or name == topic):
                    frame = seq.to_bytes(8, "big")
                    self._replay.send_multipart((client, b"", name, frame, payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _may_replay(self, client: bytes) -> bool:
        """Whether a request from ``client`` is within the replay rates (and count it)."""
        now = time.monotonic()
        every = self._replayed = [t for t in self._replayed if now - t < 1.0]
        mine = [t for t in self._replays.get(client, ()) if now - t < 1.0]
        if len(mine) >= REPLAYS_PER_S or len(every) >= REPLAYS_PER_S_ALL:
            return False
        if len(self._replays) > 4 * REPLAYS_PER_S_ALL:  # forget peers quiet for a second
            self._replays = {c: ts for c, ts in self._replays.items() if now - ts[-1] < 1.0}
        self._replays[client] = [*mine, now]
        every.append(now)
        return True

    def _hash(self, key: bytes) -> bytes | int:
        if self.settings.hashes == "int":
            return int.from_bytes(key, "big") & 0xFFFFFFFFFFFFFFFF
        return key

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
