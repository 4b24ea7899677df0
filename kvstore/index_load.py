"""Loading the disk tier's records into the index after a start (:class:`IndexLoad`).

A restart must not keep the engines of a node waiting for an index of millions of
records to be rebuilt: the store answers at once, serves hits for what is loaded and
misses for the rest, and this part loads the records behind it.

- First the deep check (every B-tree walked in a child process:
  :mod:`kvstore.disk.files`), then the open (:meth:`DiskTier.open_checked`): nothing
  in this process reads the file before a check passed, since a damaged page may
  crash it. Until then the disk writer commits nothing (writes queue up; puts that
  need the writer wait as under back-pressure); when the check finds damage the
  environment goes aside and the queued writes go to an empty one. Then the
  namespaces are registered (a handful of records; clients that open theirs before
  that register them themselves).
- Records are read in key order (hash order: random with respect to chains), CHUNK at
  a time, decoded outside the store's lock and indexed under it, one hold per chunk.
  A block becomes visible only with its ancestors: a record whose parent is not
  indexed yet waits for it (in memory); records still waiting at the end lost their
  parent and are deleted, as are records of unknown namespaces or of the wrong size.
- Writes during the load win over the scan, and nothing they leave is lost:
  - a key the store wrote or deleted since the start is never taken from the scan
    (:meth:`DiskTier.adopt`); records waiting for such a key are indexed under it once
    the store holds it on disk;
  - a record of a block the store holds in host only (put again during the load)
    becomes that block's disk copy (the same key is the same bytes), and records under
    a block held in host only wait for it as for a parent not read yet: a parent the
    load has not reached, or the store has not written yet, is not missing. At the end
    the waiting records whose parent is on disk by then are indexed; the rest are
    orphans;
  - a Delete of blocks not indexed yet removes them on disk
    (:meth:`DiskTier.delete_unloaded`; their descendants there are orphans), and a
    Clear voids its namespaces for the scan and removes their records not indexed
    (:func:`clear_unloaded`: a scan of its own, in the caller's thread).
  No block is indexed twice, none acknowledged is lost, none deleted comes back.
- Routers (KV events: :mod:`kvstore.tier_events`) hear AllBlocksCleared for the
  namespaces on disk, then every indexed block, parents first; a chunk waits for the
  feed to have room for it (FEED_WAIT_S at most), so a large tier is told whole.
- Eviction order: at the end the loaded blocks enter the disk tier's eviction order by
  last use, older than the blocks written since the start, in slices, each under the
  lock. Until then they are not evicted (a full disk tier evicts what was written since
  the start first, for the time the load takes).
- A tier whose file is at most ``sync_index_bytes`` is loaded before the store answers
  (small tiers behave as if loading were instant); a larger one on a thread, logging
  progress.
  ``kvctl status`` and the metrics show records loaded of the total.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Sequence
from operator import attrgetter

from kvstore import codecs
from kvstore.codecs import Codec
from kvstore.disk.format import unpack_fields
from kvstore.index import READY, NamespaceEntry, Node
from kvstore.keys import BlockKey, NamespaceSpec, tokens_name_block
from kvstore.store_parts import StoreParts
from kvstore.tier_events import DISK, tokens_change_bytes

log = logging.getLogger(__name__)

CHUNK = 8192  # records indexed per hold of the store's lock
ORDER_SLICE = 65536  # blocks put in eviction order per hold of the lock, at the end
PROGRESS_EVERY_S = 2.0

FEED_WAIT_S = 30.0  # a chunk waits this long at most for the KV event feed to take it

# (key, namespace digest, parent key or b"", payload size, priority, last access, tokens,
# codec id, codec version)
Loaded = tuple[bytes, bytes, bytes, int, int, float, bytes, int, int]


def decode(key: bytes, raw: bytes) -> Loaded | None:
    """A meta record's fields the index needs; None when it is malformed."""
    try:
        digest, parent, size, _, priority, last, _, tokens, codec, version = unpack_fields(raw)
    except (ValueError, struct.error):
        return None
    return key, digest, parent, size, priority, last, tokens, codec, version


def stored_whole(kept: Codec | None, entry: NamespaceEntry, size: int) -> bool:
    """Whether a record of the right codec (:func:`codec_matches`) holds one block of
    ``entry``: its size, as it is or encoded."""
    return size == (entry.spec.block_bytes if kept is None else kept.encoded_bytes)


def codec_matches(kept: Codec | None, codec: int, version: int) -> bool:
    """Whether a record of ``codec`` at ``version`` (0, 0: raw) is how its namespace
    keeps its disk blocks (``kept``, the disk placement's codec for it; None: as they
    are). A raw record where they are kept encoded, or the reverse, or another codec or
    version, is not the namespace's block: dropped, counted, a miss."""
    if kept is None:
        return not codec
    return codec == kept.code_id and version == codecs.VERSION


def record_digest(raw: bytes) -> bytes | None:
    """The namespace digest of a meta record; None when it is malformed."""
    try:
        return unpack_fields(raw)[0]
    except (ValueError, struct.error):
        return None


def clear_unloaded(parts: StoreParts, digests: set[bytes] | None) -> int:
    """The rest of a Clear made while the index loads: remove every record of the
    cleared namespaces (``digests``; None: all) that the store has not indexed, read in
    chunks as the load reads them (the clear dropped what is indexed and voided the
    namespaces, :meth:`DiskTier.void_unloaded`, in one hold of the lock before this).
    Not under the lock: it takes it per chunk. How many records it removed."""
    disk = parts.disk
    assert disk is not None
    removed = 0
    for chunk in disk.scan_chunks(CHUNK):
        keys = [k for k, raw in chunk if digests is None or record_digest(raw) in digests]
        with parts.lock:
            nodes = parts.index.nodes
            removed += disk.delete_unloaded([k for k in keys if BlockKey(k) not in nodes])
    return removed


class IndexLoad:
    """The load of one store's disk tier (see the module docstring): :meth:`start` it
    once the store's parts exist, :meth:`stop` it before the store closes."""

    def __init__(self, parts: StoreParts) -> None:
        assert parts.disk is not None
        self._parts = parts
        self._disk = parts.disk
        self.total = 0  # records in the environment, once it is open
        self.loaded = 0  # records read so far (indexed, waiting for a parent, or dropped)
        self.foreign_codec = 0  # records not of their namespace's disk codec (dropped)
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        size = self._disk.file_bytes()
        if size <= self._parts.config.sync_index_bytes:
            try:
                self._load()  # its errors are the store's open's
            finally:
                self.done.set()
            return
        log.info(
            "loading the disk tier's index in the background (%.1f GiB of records); hits "
            "for what is loaded, misses for the rest until then", size / 2**30,
            extra={"event": "index_loading"},
        )  # fmt: skip
        self._thread = threading.Thread(target=self._run, name="kvstore-index-load", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the load early (at close): what is loaded stays, the rest is not indexed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _register_namespaces(self) -> None:
        """Register the namespaces on disk; routers hear that these namespaces'
        blocks are void (their blocks follow as they are indexed: the warm start)."""
        specs = []
        saved = self._disk.namespaces()
        with self._parts.lock:
            namespaces = self._parts.namespaces
            for digest, spec_dict in saved.items():
                spec = NamespaceSpec.from_dict(spec_dict)
                if spec.digest == digest:
                    if namespaces.get(spec.ns_id) is None:  # (a client may have opened it)
                        namespaces.register(spec)
                    specs.append(spec)
            self._parts.tiers.feed.cleared(specs)

    def _run(self) -> None:
        try:
            self._load()
        except Exception as exc:
            if not self._disk.opened:
                log.exception("the disk tier could not be opened; it takes no writes")
                self._disk.give_up_open(f"{type(exc).__name__}: {exc}")
            else:
                log.exception("loading the disk tier's index failed; the rest stays unindexed")
        finally:
            self.done.set()

    def _load(self) -> None:
        started = time.monotonic()
        self._disk.open_checked()
        if not self._disk.opened:  # a fresh tier waiting for room: nothing to load
            self._disk.end_load()
            return
        self._register_namespaces()
        self.total = self._disk.record_count()
        waiting: dict[bytes, list[Loaded]] = {}
        loaded: list[Node] = []
        dropped = 0
        shown = started
        feed = self._parts.tiers.feed
        for chunk in self._disk.scan_chunks(CHUNK):
            if self._stop.is_set():
                return
            records = [decode(key, raw) for key, raw in chunk]
            told = sum(tokens_change_bytes(rec[6]) for rec in records if rec is not None)
            feed.wait_room(len(chunk), FEED_WAIT_S, told)  # (routers hear of every block)
            with self._parts.lock:
                if self._parts.closed:
                    return
                pairs = zip(chunk, records, strict=True)
                bad = [(k, 0, b"") for (k, _), rec in pairs if rec is None]
                good = [rec for rec in records if rec is not None]
                taken = self._disk.adopt([(rec[0], rec[3], rec[1]) for rec in good] + bad)
                fresh = [rec for rec, take in zip(good, taken, strict=False) if take]
                # (a key the store wrote since the start: children may wait for it)
                known = [rec[0] for rec, take in zip(good, taken, strict=False) if not take]
                dropped += self._index(fresh, waiting, loaded, self._released(known, waiting))
                for (key, _, _), take in zip(bad, taken[len(good) :], strict=True):
                    if take:  # (not a key the store wrote since: that one is live)
                        self._disk.delete(key)
                        dropped += 1
            self.loaded += len(chunk)
            if time.monotonic() - shown >= PROGRESS_EVERY_S:
                shown = time.monotonic()
                self._log_progress(shown - started)
        with self._parts.lock:
            dropped += self._settle(waiting, loaded)
        self._order(loaded)
        self._disk.end_load()
        with self._parts.lock:
            self._parts.tiers.apply_shrunk_disk()
        if self.foreign_codec:
            self._disk.count_codec_mismatches(self.foreign_codec)
            log.warning(
                "%d disk records were not of the codec their namespace keeps on disk "
                "(raw where it keeps them encoded, or the reverse, or a codec version "
                "this daemon does not decode: it knows version %d): dropped as misses",
                self.foreign_codec, codecs.VERSION,
            )  # fmt: skip
        if dropped:
            log.warning(
                "dropped %d disk records: malformed, of an unknown namespace, or whose "
                "parent was missing", dropped,
            )  # fmt: skip
        log.info(
            "loaded the disk tier's index: %d blocks in %d namespaces in %.1f s",
            len(loaded), len(self._parts.namespaces), time.monotonic() - started,
            extra={"event": "index_loaded", "blocks": len(loaded)},
        )  # fmt: skip

    def _index(
        self,
        records: list[Loaded],
        waiting: dict[bytes, list[Loaded]],
        loaded: list[Node],
        released: Sequence[Loaded] = (),
    ) -> int:
        """Index a chunk's records (and the waiting children each one completes), then
        list them in the disk tier's eviction order; how many were stale and deleted.
        ``released``: waiting records whose parent the store holds on disk now.

        A record whose parent the store holds but not on disk (put again during the
        load, in host only so far) waits for it as for a parent not read yet; a record
        of a block the store holds in host only becomes that block's disk copy once its
        parent is on disk (the same key is the same bytes). Under the lock."""
        index = self._parts.index
        tiers = self._parts.tiers
        disk = tiers.disk
        assert disk is not None
        by_digest = self._parts.namespaces.by_digest
        added: list[Node] = []
        added_tokens: list[bytes | None] = []
        stale: list[bytes] = []
        todo = [*records[::-1], *released[::-1]]
        while todo:
            rec = todo.pop()
            key, digest, parent_key, size, priority, last, tokens, codec, version = rec
            entry = by_digest.get(digest)
            kept = disk.codec(entry) if entry is not None else None
            if entry is not None and not codec_matches(kept, codec, version):
                self.foreign_codec += 1
                stale.append(key)
                continue
            if entry is None or not stored_whole(kept, entry, size):
                stale.append(key)
                continue
            held = index.nodes.get(BlockKey(key))  # put again during the load
            if held is not None and held.on_disk:
                continue  # written since the start: that copy is the live one
            if held is not None and held.ns is not entry:
                stale.append(key)
                continue
            parent = None
            if parent_key:
                parent = index.nodes.get(BlockKey(parent_key))
                if parent is None or not parent.on_disk:  # not read, or in host only
                    waiting.setdefault(parent_key, []).append(rec)
                    continue
            if held is not None and not held.ready:  # its put is not committed yet
                waiting.setdefault(key, []).append(rec)  # (tried again at the end)
                continue
            node = held or Node(BlockKey(key), entry, parent, READY, priority, last)
            if held is None:
                index.add(node)
            disk.adopt(node, coded=codec != 0)
            added.append(node)
            # tokens are told to routers only when they are what the key was hashed from
            told = tokens and tokens_name_block(entry.spec, parent_key or None, key, tokens)
            added_tokens.append(tokens if told else None)
            todo.extend(self._released([key], waiting))
        for key in stale:
            self._disk.delete(key)
        tiers.feed.stored(added, DISK, added_tokens)  # parents first (the warm start)
        loaded.extend(added)
        return len(stale)

    def _released(self, keys: list[bytes], waiting: dict[bytes, list[Loaded]]) -> list[Loaded]:
        """The waiting children of ``keys`` whose parent the store now holds on disk,
        but those removed since they were read (kvstore.disk.DiskTier.delete_unloaded).
        Under the lock."""
        nodes = self._parts.index.nodes
        out: list[Loaded] = []
        for key in keys:
            parent = nodes.get(BlockKey(key))
            if parent is not None and parent.on_disk and key in waiting:
                out.extend(waiting.pop(key))
        if not out:
            return out
        live = self._disk.contains_all([rec[0] for rec in out])
        return [rec for rec, alive in zip(out, live, strict=True) if alive]

    def _settle(self, waiting: dict[bytes, list[Loaded]], loaded: list[Node]) -> int:
        """At the end of the scan: index the waiting records whose parent is on disk by
        now (written, or given its disk copy, since), for as long as that settles more;
        delete the rest (their parent never came: orphans). How many were deleted.
        Under the lock."""
        dropped = 0
        while waiting:
            late = [rec for recs in waiting.values() for rec in recs]
            waiting.clear()
            live = self._disk.contains_all([rec[0] for rec in late])
            alive = [rec for rec, ok in zip(late, live, strict=True) if ok]
            dropped += self._index(alive, waiting, loaded)
            if sum(len(recs) for recs in waiting.values()) >= len(late):
                break
        for late_recs in waiting.values():
            for rec in late_recs:
                self._disk.delete(rec[0])
                dropped += 1
        waiting.clear()
        return dropped

    def _order(self, nodes: list[Node]) -> None:
        """List the loaded blocks in the disk tier's eviction order, by last use, older
        than the blocks written since the start; newest first, a slice per hold of the
        lock, each slice in front of the last. Until then they are not evicted."""
        # oldest first; of equal times children first (the load adds parents first),
        # so that every parent is newer than its children, as a touch leaves it
        nodes.reverse()
        nodes.sort(key=attrgetter("last_access"))
        assert self._parts.tiers.disk is not None
        policy = self._parts.tiers.disk.policy
        for end in range(len(nodes), 0, -ORDER_SLICE):
            with self._parts.lock:
                if self._parts.closed:
                    return
                part = nodes[max(0, end - ORDER_SLICE) : end]
                policy.insert_oldest([n for n in part if n.on_disk and n.disk_list is None])

    def _log_progress(self, elapsed: float) -> None:
        total = max(self.total, self.loaded, 1)
        done = self.loaded / total
        bar = "#" * int(done * 20)
        left = elapsed / done - elapsed if done else 0.0
        log.info(
            "loading the disk tier's index [%-20s] %3.0f%%  %d of %d records, about %.0f s left",
            bar, 100 * done, self.loaded, total, left,
            extra={"event": "index_loading", "loaded": self.loaded, "records": total},
        )  # fmt: skip
