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

Writes happen behind the put, on this tier's own thread. The store queues each block
stored on this node at or above ``min_priority`` (:class:`kvstore.tier_stack.WriteBehind`,
bounded by ``queue_bytes``); the writer takes the queue's blocks out of their host
slots and sends them, batched and pipelined per cluster node (blocks pulled from the
cluster are known to be there and skipped). Prefix-closed from the writer's side: a
block goes out only in the same batch as its parent or after it, and a parent this
process has not sent (e.g. one loaded from disk after a restart) is sent first when
the node still holds it. Past ``queue_bytes``, ``overflow = drop`` (the default: the
shared tier is a best-effort second copy) leaves new blocks unsent, and ``wait`` slows
puts down instead: a queued block is not evicted from the host tier before it is sent,
and puts wait for the writer as they wait for the disk's. Blocks that left the host
tier first, whose parent is gone, or that were queued while the cluster was
unreachable, are counted as dropped.

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvproto.v1.results import SharedStats
from kvstore.codecs import Codec, codec_of
from kvstore.errors import InvalidArgument
from kvstore.far_tier import BlockSource, Lent, Outgoing
from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.policy import OVERFLOW_POLICIES
from kvstore.shared.cluster import CHECK_S, ClusterLink
from kvstore.shared.format import (
    UnauthenticatedValue,
    block_name,
    pack_into,
    packed_size,
    unpack_value,
)

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
    password: str = field(default="", repr=False)  # from shared_password_file, never the URL
    # values carry a MAC with this key (format.mac_key of shared_key_file): b"": none
    mac_key: bytes = field(default=b"", repr=False)
    # the write-behind queue: at most this many block bytes stored and not sent yet;
    # past it, drop (not sent, counted) or wait (puts slow down: kvstore.tier_stack)
    queue_bytes: int = 256 << 20
    overflow: str = "drop"

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
        if self.queue_bytes < 1:
            raise InvalidArgument(f"shared_queue_bytes must be >= 1, got {self.queue_bytes}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise InvalidArgument(
                f"shared_overflow must be one of {list(OVERFLOW_POLICIES)}, "
                f"got {self.overflow!r}"
            )

    @property
    def shown_url(self) -> str:
        """The URL without a password, for logs and status."""
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        netloc = (f"{parts.username}@" if parts.username else "") + host
        netloc += f":{parts.port}" if parts.port else ""
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _codec(spec: NamespaceSpec) -> Codec | None:
    return codec_of(spec.codec, spec.dtype, spec.head_dim, spec.block_bytes)


class SharedTier:
    """See the module docstring."""

    def __init__(self, config: SharedConfig, source: BlockSource, coded: bool = False) -> None:
        """``coded``: blocks of namespaces with a codec are written encoded
        (kvstore.codecs); values are decoded as their header says either way."""
        config.validate()
        self.config = config
        self._coded = coded
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
                "unauthenticated",
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
        received = 0  # value bytes that came over the network (encoded ones: fewer)
        complete = True
        for begin in range(0, len(keys), wave):
            part = keys[begin : begin + wave]
            values = self._link.get([block_name(spec, key) for key in part], deadline)
            for key, value in zip(part, values, strict=True):
                try:
                    payload = unpack_value(spec, key, value, _codec(spec), self.config.mac_key)
                except UnauthenticatedValue:  # planted, or from a node with another secret
                    self._n["unauthenticated"] += 1
                    complete = False
                    break
                if payload is None or value is None:
                    self._n["corrupt"] += value is not None
                    complete = False
                    break
                found.append(payload)
                received += len(value)
            if not complete or time.monotonic() >= deadline:
                break
        self._n["lookups"] += 1
        self._n["hits"] += bool(found)
        self._n["blocks_read"] += len(found)
        self._n["bytes_read"] += received
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

    def stats(self, queue_bytes: int = 0, queue_dropped: int = 0) -> SharedStats:
        """The tier's figures; the store adds its write-behind queue's (bytes held,
        blocks it refused while full)."""
        fields: dict[str, Any] = {**dataclasses.asdict(self._link.stats()), **self._n}
        fields["writes_dropped"] += queue_dropped
        return SharedStats(
            url=self.config.shown_url,
            queue_bytes=queue_bytes,
            queue_limit_bytes=self.config.queue_bytes,
            keyed=bool(self.config.mac_key),
            **fields,
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._link.close()

    # --- writes (this tier's thread) --------------------------------------------------
    def _run(self) -> None:
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
            usable = self._link.usable()
            try:
                lent = self._source.lend_queued(
                    WRITE_BATCH_BLOCKS, self.is_known, timeout=0.2, drop=not usable
                )
            except Exception:  # noqa: BLE001 - the store closed under us
                return
            self._n["writes_dropped"] += lent.lost
            self._write(lent)

    def _write(self, lent: Lent) -> None:
        """Send the lent blocks (unsent ancestors first), packed into the writer's
        scratch buffer (allocated once: fresh pages cost more than the copy) in runs
        of at most SCRATCH_BYTES; the blocks stay pinned until the last run is sent."""
        blocks = lent.blocks
        sent: set[BlockKey] = set()
        try:
            begin = 0
            while begin < len(blocks):
                end, used = begin, 0
                while end < len(blocks) and (
                    end == begin or used + packed_size(blocks[end].payload.nbytes) <= SCRATCH_BYTES
                ):
                    used += packed_size(blocks[end].payload.nbytes)
                    end += 1
                sent |= self._send(blocks[begin:end], used)
                begin = end
        finally:
            lent.release(sent)

    def _send(self, blocks: list[Outgoing], nbytes: int) -> set[BlockKey]:
        """Store ``blocks`` on the cluster; the keys it took, each with its parent."""
        if len(self._scratch) < nbytes:
            self._scratch = memoryview(bytearray(max(nbytes, SCRATCH_BYTES)))
        items, at = [], 0
        for b in blocks:
            codec = _codec(b.spec) if self._coded else None
            size = pack_into(
                self._scratch[at:], b.spec, b.key, b.payload, codec, b.encoded,
                self.config.mac_key,
            )  # fmt: skip
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
        return sent

    def _forget_known(self) -> None:
        with self._known_lock:
            self._known.clear()
