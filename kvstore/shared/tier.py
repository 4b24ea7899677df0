"""The shared tier: blocks on a Valkey / Redis Cluster that every node's store reads.

It sits behind the node's host and disk tiers and is a cache like them: what it does
not answer in time is a miss.

Reads (:meth:`SharedTier.fetch`, on the caller's thread, never under the store's lock)
ask for the blocks after the node's own ready prefix in waves of up to
``WAVE_BYTES``, batched per cluster node, all before one deadline
(``timeout_ms``). They keep the blocks up to the first one missing, unreachable or
failing its check (:mod:`kvstore.shared.format`): a block is never served without its
ancestors, and a bad value is a miss. The store then puts what came back into its
host tier, where the usual admission takes it to disk.

Writes happen behind the put, on this tier's own thread. It follows the store's event
log: each block stored on this node (not pulled from the cluster) and at or above
``min_priority`` is read out of its host slot and sent, batched and pipelined per
cluster node. Prefix-closed from the writer's side: a block goes out only in the same
batch as its parent or after it, and a parent this process has not sent (e.g. one
rebuilt from disk after a restart) is sent first when the node still holds it. The
writer never slows a put: blocks it cannot keep up with (the event log overran), that
left the host tier first, or whose parent is gone are counted as dropped.

Which blocks the cluster holds is remembered per process for up to ``KNOWN_BLOCKS``
keys (sent, or pulled); a cluster error forgets them, because the cluster may have
restarted empty.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlsplit, urlunsplit

from kvproto.v1.results import Event, SharedStats
from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.shared.cluster import CHECK_S, ClusterLink
from kvstore.shared.format import block_name, pack_into, packed_size, unpack_value

log = logging.getLogger(__name__)

WAVE_BYTES = 64 << 20
WAVE_BLOCKS = 256
WRITE_BATCH_BLOCKS = 64
KNOWN_BLOCKS = 1 << 18
WRITE_DEADLINE_S = 2.0
SCRATCH_BYTES = 32 << 20  # the writer packs values here, at most this much per send


@dataclass(frozen=True, slots=True)
class SharedConfig:
    """The shared tier's settings (the daemon's ``shared_*`` keys)."""

    url: str  # redis:// or rediss:// of any one cluster node; user in the URL
    timeout_ms: int = 100  # one read, all its waves, at most this long
    ttl_s: int = 0  # 0: values never expire (the cluster's maxmemory-policy evicts)
    min_priority: int = 0  # blocks below this priority stay on the node
    password: str = ""  # from the daemon's shared_password_file, never in the URL

    def validate(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in ("redis", "rediss"):
            raise InvalidArgument(
                f"shared_url must start with redis:// or rediss://, got {self.url!r}"
            )
        if not urlsplit(self.url).hostname:
            raise InvalidArgument(f"shared_url names no host: {self.url!r}")
        if not 1 <= self.timeout_ms <= 60_000:
            raise InvalidArgument(f"shared_timeout_ms must be in [1, 60000], got {self.timeout_ms}")
        if self.ttl_s < 0:
            raise InvalidArgument(f"shared_ttl_s must be >= 0, got {self.ttl_s}")

    @property
    def shown_url(self) -> str:
        """The URL without a password, for logs and status."""
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        netloc = (f"{parts.username}@" if parts.username else "") + host
        netloc += f":{parts.port}" if parts.port else ""
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A block the store lends the writer: its bytes stay valid until released."""

    spec: NamespaceSpec
    key: BlockKey
    parent: BlockKey | None  # None: the chain's first block
    payload: memoryview


class Lent(NamedTuple):
    """What the store lends the writer for a batch of stored events."""

    blocks: list[Outgoing]  # unsent ancestors first
    release: Callable[[], None]  # unpins them; call once they are sent
    lost: int  # wanted blocks no longer in the host tier (or an unsent ancestor)


Known = Callable[[BlockKey], bool]  # whether a block is already on the cluster
Wanted = Sequence[tuple[str, BlockKey]]  # (ns_id, key) of stored events


class BlockSource(Protocol):
    """What the shared tier needs of its store."""

    @property
    def last_event_seq(self) -> int: ...

    def events_since(self, seq: int, timeout: float = 0.0, limit: int = 1024) -> list[Event]: ...

    def lend_blocks(self, wanted: Wanted, min_priority: int, known: Known) -> Lent:
        """The blocks to send for ``wanted`` that are not ``known`` to be on the
        cluster, pinned in the host tier until released."""
        ...


class SharedTier:
    """See the module docstring."""

    def __init__(self, config: SharedConfig, source: BlockSource) -> None:
        config.validate()
        self.config = config
        parts = urlsplit(config.url)
        self._link = ClusterLink(
            config.url, config.timeout_ms / 1000, parts.username, config.password or None
        )
        self._source = source
        self._known: OrderedDict[BlockKey, None] = OrderedDict()
        self._known_lock = threading.Lock()
        self._n = dict.fromkeys(
            (
                "lookups",
                "hits",
                "blocks_read",
                "bytes_read",
                "blocks_written",
                "bytes_written",
                "write_errors",
                "writes_dropped",
                "corrupt",
            ),
            0,
        )
        self._scratch = memoryview(bytearray(0))  # the writer's (see _write)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-shared", daemon=True)
        self._thread.start()

    # --- reads (callers' threads) ------------------------------------------------------
    def usable(self) -> bool:
        """Whether a read may find anything now (connected, some node not open)."""
        return self._link.usable()

    def fetch(self, spec: NamespaceSpec, keys: Sequence[BlockKey]) -> list[memoryview]:
        """The bytes of ``keys``' longest prefix found intact on the cluster before the
        deadline (see the module docstring)."""
        if not keys or not self.usable():
            return []
        deadline = time.monotonic() + self.config.timeout_ms / 1000
        wave = max(1, min(WAVE_BLOCKS, WAVE_BYTES // spec.block_bytes))
        found: list[memoryview] = []
        complete = True
        for begin in range(0, len(keys), wave):
            part = keys[begin : begin + wave]
            values = self._link.get([block_name(spec, key) for key in part], deadline)
            for key, value in zip(part, values, strict=True):
                payload = unpack_value(spec, key, value)
                if payload is None:
                    self._n["corrupt"] += value is not None
                    complete = False
                    break
                found.append(payload)
            if not complete or time.monotonic() >= deadline:
                break
        self._n["lookups"] += 1
        self._n["hits"] += bool(found)
        self._n["blocks_read"] += len(found)
        self._n["bytes_read"] += len(found) * spec.block_bytes
        self.note_known(keys[: len(found)])
        return found

    def note_known(self, keys: Sequence[BlockKey]) -> None:
        """``keys`` are on the cluster (sent, or pulled from it): not sent again."""
        with self._known_lock:
            for key in keys:
                self._known[key] = None
                self._known.move_to_end(key)
            while len(self._known) > KNOWN_BLOCKS:
                self._known.popitem(last=False)

    def is_known(self, key: BlockKey) -> bool:
        return key in self._known

    @property
    def blocks_written(self) -> int:
        """Blocks sent so far (a cheap read for a waiter; :meth:`stats` has them all)."""
        return self._n["blocks_written"]

    def stats(self) -> SharedStats:
        fields: dict[str, Any] = {**dataclasses.asdict(self._link.stats()), **self._n}
        return SharedStats(url=self.config.shown_url, **fields)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._link.close()

    # --- writes (this tier's thread) --------------------------------------------------
    def _run(self) -> None:
        seq = self._source.last_event_seq  # blocks stored before the start stay local
        next_check = 0.0
        errors = 0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_check:
                self._link.check()
                next_check = now + CHECK_S
            if self._link.errors != errors:  # any call failed: the cluster may be empty now
                errors = self._link.errors
                self._forget_known()
            try:
                events = self._source.events_since(seq, timeout=0.2, limit=WRITE_BATCH_BLOCKS)
            except Exception:  # noqa: BLE001 - the store closed under us
                return
            if not events:
                continue
            if events[0].seq > seq + 1:  # the event log overran: those blocks stay local
                self._n["writes_dropped"] += events[0].seq - seq - 1
            seq = events[-1].seq
            wanted = [(e.ns_id, BlockKey(e.key)) for e in events if e.kind == "stored"]
            if wanted and self._link.usable():
                self._write(wanted)
            elif wanted:
                self._n["writes_dropped"] += len(wanted)

    def _write(self, wanted: list[tuple[str, BlockKey]]) -> None:
        """Send the blocks of ``wanted`` (and their unsent ancestors), packed into the
        writer's scratch buffer (allocated once: fresh pages cost more than the copy)
        in runs of at most SCRATCH_BYTES; the blocks stay pinned until the last run is
        sent."""
        blocks, release, lost = self._source.lend_blocks(
            wanted, self.config.min_priority, self.is_known
        )
        self._n["writes_dropped"] += lost
        try:
            begin = 0
            while begin < len(blocks):
                end, used = begin, 0
                while end < len(blocks) and (
                    end == begin or used + packed_size(blocks[end].payload.nbytes) <= SCRATCH_BYTES
                ):
                    used += packed_size(blocks[end].payload.nbytes)
                    end += 1
                self._send(blocks[begin:end], used)
                begin = end
        finally:
            release()

    def _send(self, blocks: list[Outgoing], nbytes: int) -> None:
        if len(self._scratch) < nbytes:
            self._scratch = memoryview(bytearray(max(nbytes, SCRATCH_BYTES)))
        items, at = [], 0
        for b in blocks:
            size = pack_into(self._scratch[at:], b.spec, b.key, b.payload)
            items.append((block_name(b.spec, b.key), self._scratch[at : at + size]))
            at += size
        patience = max(WRITE_DEADLINE_S, 4 * self.config.timeout_ms / 1000)
        stored = self._link.set(items, self.config.ttl_s, time.monotonic() + patience)
        sent: set[BlockKey] = set()
        for block, ok, (_, value) in zip(blocks, stored, items, strict=True):
            parent = block.parent
            if ok and (parent is None or parent in sent or self.is_known(parent)):
                sent.add(block.key)
                self._n["blocks_written"] += 1
                self._n["bytes_written"] += len(value)
            elif not ok:
                self._n["write_errors"] += 1
        self.note_known([b.key for b in blocks if b.key in sent])

    def _forget_known(self) -> None:
        with self._known_lock:
            self._known.clear()
