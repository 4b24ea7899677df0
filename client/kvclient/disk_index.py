"""Disk hits with no call: the daemon's disk index, read-only in this process.

A disk-direct get (:mod:`kvclient.disk_reads`) asks the daemon where a disk block's
bytes lie; the answer costs a round trip, 0.3-0.45 ms on our 2-core VMs, as long as
reading the 4 MiB itself. Yet the disk tier is one LMDB environment on this host, and
LMDB lets any process read it under a read transaction of its own: the pages that
transaction sees are not reused until it ends, whatever the daemon commits meanwhile.
So a same-host client can find the blocks itself (:meth:`DiskIndex.read`):

1. the chain keys, computed as the daemon computes them
   (:func:`kvstore.keys.chain_keys`, with the namespace's spec from the environment's
   ``namespaces`` database);
2. in one read transaction: each wanted block's ``meta`` record (offset, size and
   xxh3-64 of its bytes in ``data.mdb``), then a ``preadv2(RWF_NOWAIT)`` of each into
   the caller's buffer, and the checksum.

The client takes this path only where it serves the same bytes the daemon would, no
slower, and asks the daemon in every other case (the caller's rules, in
:class:`DiskFirstReads` and the get):

- every wanted block has a record: a prefix cut short on disk may go on in the host
  tier, which only the daemon knows (tiers are prefix-closed from the top, so a chain
  whose blocks are all on disk is the whole cached prefix);
- every read comes from the page cache (``RWF_NOWAIT``): a read that needs disk I/O
  is the daemon's, which may promote the blocks;
- every checksum matches: damage is the daemon's to find and drop;
- it is this client's first read of that prefix: a second one goes to the daemon,
  which promotes (a block earns its host slot by being read twice, as with
  ``disk_direct``).

Such reads are reported afterwards (``ReportReads`` with ``from_disk``): the daemon
counts them as disk hits read directly, and touches the blocks. ``clear`` and
``delete`` return only once their deletions are committed to the environment, so a get
after them cannot find the blocks here. A block the daemon evicts may still be read
from a snapshot taken before the eviction committed: its bytes are still that
block's bytes (keys are content hashes), so that is a hit, not an error.

One environment per process (LMDB must not be opened twice in one: closing one handle
drops the other's file locks): :meth:`DiskIndex.open` shares one handle among the
clients of a process, counted, and refuses a directory that a DiskTier of this process
has open (a daemon in-process). A forked child never uses its parent's handle, and
py-lmdb refuses a second one for a path the process has open, so its gets ask the
daemon. Transactions take a
reader slot of the environment only while they run (no spare transactions are kept),
and the daemon's map resizes are followed (``MDB_MAP_RESIZED``: adopt the new size,
begin again). Any LMDB error turns the path off for that read: the daemon answers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import lmdb
import numpy as np

from kvclient.fork_safety import renew_in_child
from kvstore.disk_format import DB_NAMES, META_DB, NAMESPACES_DB, DiskExtent, committed_extent
from kvstore.disk_format import open_in_this_process as _tier_open_here
from kvstore.errors import StoreError
from kvstore.keys import BlockKey, NamespaceSpec

log = logging.getLogger(__name__)

SPEC_RESCAN_S = 1.0  # a namespace not found in the environment is looked for again after
FIRST_READS_ENTRIES = 16384  # prefixes a client remembers having read from disk

_registry_lock = threading.Lock()
_registry: dict[str, tuple[int, DiskIndex]] = {}  # realpath -> (pid, the shared index)


def _new_registry_lock_in_child() -> None:
    """After a fork (see :mod:`kvclient.fork_safety`); the parent's handles stay in
    the registry, under the parent's pid, so the child never uses them."""
    global _registry_lock
    _registry_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_registry_lock_in_child)


class DiskIndex:
    """The daemon's LMDB environment, open read-only; shared by this process's clients
    (:meth:`open`, :meth:`close`)."""

    def __init__(self, directory: str, env: Any) -> None:
        self.directory = directory
        self._env = env
        self._meta = env.open_db(META_DB, create=False)
        self._namespaces = env.open_db(NAMESPACES_DB, create=False)
        # transactions of this handle running now: set_mapsize and close need none
        self._cond = threading.Condition()
        self._active = 0
        self._users = 0
        self._specs: dict[str, NamespaceSpec] = {}
        self._scanned_at = -SPEC_RESCAN_S

    @classmethod
    def open(cls, data_path: str) -> DiskIndex | None:
        """The index of the environment holding ``data_path`` (the daemon's
        ``ServerInfo.disk_path``), opened or shared; None when it cannot be read here."""
        directory = os.path.realpath(os.path.dirname(data_path)) if data_path else ""
        if not directory or _tier_open_here(directory):
            return None
        with _registry_lock:
            shared = _registry.get(directory)
            if shared is not None and shared[0] == os.getpid():
                index = shared[1]
            else:  # not open, or inherited over a fork (then py-lmdb refuses: None)
                try:
                    env = lmdb.open(
                        directory,
                        readonly=True,
                        lock=True,  # readers register in lock.mdb, as the daemon's do
                        subdir=True,
                        create=False,
                        max_dbs=len(DB_NAMES),
                        max_spare_txns=0,  # a reader slot only while a read runs
                        readahead=False,
                    )
                    index = cls(directory, env)
                except lmdb.Error as exc:
                    log.info("disk hits go through the daemon: cannot read %s (%s)", directory, exc)
                    return None
                _registry[directory] = (os.getpid(), index)
            index._users += 1
            return index

    def close(self) -> None:
        """One user less; the environment closes with the last one (in its process)."""
        with _registry_lock:
            self._users -= 1
            shared = _registry.get(self.directory)
            if self._users > 0 or shared is None or shared[1] is not self:
                return
            if shared[0] == os.getpid():
                del _registry[self.directory]
                with self._cond:
                    while self._active:
                        self._cond.wait()
                    self._env.close()

    def spec(self, ns_id: str) -> NamespaceSpec | None:
        """The spec of namespace ``ns_id`` as the daemon saved it; None when it is not
        in the environment (yet: looked for again after SPEC_RESCAN_S)."""
        found = self._specs.get(ns_id)
        if found is not None or time.monotonic() - self._scanned_at < SPEC_RESCAN_S:
            return found
        self._scanned_at = time.monotonic()
        specs: dict[str, NamespaceSpec] = {}
        txn = self._begin()
        if txn is None:
            return None
        try:
            for digest, raw in txn.cursor(db=self._namespaces):
                try:
                    spec = NamespaceSpec.from_dict(json.loads(bytes(raw)))
                except (ValueError, TypeError, StoreError):
                    continue  # not a spec this client reads: its gets ask the daemon
                if spec.digest == bytes(digest):
                    specs[spec.ns_id] = spec
        finally:
            self._end(txn)
        self._specs.update(specs)
        return self._specs.get(ns_id)

    def read(self, keys: Sequence[BlockKey], blocks: np.ndarray, reader: Any) -> bool:
        """Read the blocks of ``keys`` into ``blocks[i]`` (uint8 ``[n, block_bytes]``)
        inside one read transaction with ``reader.read_cached(blocks, extents)``; False,
        with ``blocks`` not to be used, unless every key has a committed record of the
        right size and every block came from the page cache and passed its check."""
        size = blocks.shape[1]
        txn = self._begin()
        if txn is None:
            return False
        try:
            extents: list[DiskExtent] = []
            for key in keys:
                raw = txn.get(key, db=self._meta)
                extent = None if raw is None else committed_extent(raw)
                if extent is None or extent.size != size:
                    return False
                extents.append(extent)
            ok: bool = reader.read_cached(blocks, extents)
            return ok
        except lmdb.Error as exc:
            log.info("disk hits go through the daemon for now: %s", exc)
            return False
        finally:
            self._end(txn)

    def _begin(self) -> Any:
        """A read transaction, counted until :meth:`_end`, following a resize of the
        daemon's map (which waits until none of this handle's runs); None when LMDB
        refuses one (every reader slot taken, the handle closed ...)."""
        with self._cond:
            for _ in range(2):
                try:
                    txn = self._env.begin(buffers=True)
                except lmdb.MapResizedError:
                    while self._active:
                        self._cond.wait()
                    self._env.set_mapsize(0)  # adopt the size the daemon grew the map to
                    continue
                except lmdb.Error as exc:
                    log.info("disk hits go through the daemon for now: %s", exc)
                    return None
                self._active += 1
                return txn
        return None

    def _end(self, txn: Any) -> None:
        txn.abort()
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()


class DiskFirstReads:
    """The prefixes a client has read from the disk file (bounded, oldest out): a
    prefix is read there once, and then asked of the daemon (which promotes)."""

    def __init__(self, entries: int = FIRST_READS_ENTRIES) -> None:
        self._entries = entries
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._lock = threading.Lock()
        renew_in_child(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    def first(self, key: Hashable) -> bool:
        """True the first time ``key`` is seen (it is remembered from then on)."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen[key] = None
            if len(self._seen) > self._entries:
                self._seen.popitem(last=False)
            return True
