"""The LMDB disk tier: block payloads and their metadata in one LMDB environment.

Storage only. The store owns the index and the eviction policy; this module keeps
bytes and the metadata needed to rebuild that index after a restart.

Protocol (who calls what):

- The store calls :meth:`DiskTier.write` when it demotes or writes through a block,
  :meth:`~DiskTier.read` on a disk hit, :meth:`~DiskTier.delete` when it evicts a disk
  leaf, :meth:`~DiskTier.touch` when a disk block is used or re-prioritised, and
  :meth:`~DiskTier.save_namespace` when a namespace is opened. At start-up it rebuilds
  its index from :meth:`~DiskTier.records` and :meth:`~DiskTier.namespaces`.
- ``used_bytes`` is logical accounting: the sum of :meth:`~DiskTier.footprint` over the
  live records, queued writes included, and it changes the moment a call returns. The
  store keeps it at or below ``capacity_bytes`` by deleting leaves.
- ``capacity_bytes`` is the *effective* capacity. It starts at the configured value and
  only goes down: when LMDB runs out of map space (its real footprint, with free-list
  fragmentation and pages pinned by old readers, outgrew our accounting), the writer
  aborts the batch, grows the map once by a bounded step (1/8 of the map, never beyond
  1.5x its initial size), lowers the effective capacity, raises a flag that
  :meth:`~DiskTier.drain_shrunk` returns (once) and retries; the store then evicts
  until ``used_bytes <= capacity_bytes``. At the growth limit the writer commits deletes
  first and then the writes one at a time; a write that still does not fit next to the
  committed data is dropped (its key deleted, ``dropped_writes`` counted), exactly as if
  it had been evicted: ``contains`` turns False and ``read`` misses. Running out of space
  never raises to the caller.

Threading model: any thread may call any method. Writes, deletes and metadata touches
are queued (coalesced per key) and ONE writer thread drains the queue into one write
transaction per batch (up to ``batch_bytes`` of payload), commits, and only then drops
the committed writes from the "readable from queue" map, so a block is readable from the
moment ``write`` returns. LMDB allows one write transaction at a time anyway; a single
writer turns many small commits (each an fdatasync) into a few large ones and is the only
thread that ever resizes the map. The queue is bounded by bytes (``queue_bytes``):
``write`` refuses (returns 0) when it is full instead of waiting, since its caller holds
the store's lock and every call would wait behind the disk. A batch that fails for any
other reason than map space (ENOSPC, EIO: :attr:`~DiskTier.fault`) stops the tier's
writes until a retry commits; its items stay queued and readable meanwhile, and a write
that fails _DROP_AFTER retries is dropped as at the map's limit. The fault lowers the
capacity to a share of what ``data.mdb`` holds (90%, less after each next fault), and
the tier regains only room it has proven (the file, and what the file system gained
since), never the file system's free space as such: a quota or a file size limit is
invisible there.

Who opens the directory: one process at a time (``kvstored.lock``, see
:mod:`kvstore.disk.files`); a damaged ``data.mdb`` is moved aside at open and the tier
starts empty, and a page found damaged at run time makes that read a miss.
Readers run their own read transactions concurrently with the writer (MVCC); a small
shared/exclusive lock keeps every read transaction closed while the writer calls
``set_mapsize``, which LMDB requires.

On-disk format (one environment at ``directory``, files ``data.mdb`` + ``lock.mdb``):

- named db ``payload``: BlockKey (16 or 32 bytes) -> the block's bytes, verbatim.
- named db ``meta``: BlockKey -> ``struct "<B32sB32sQQBdQH"``: record version (3),
  namespace digest, parent length + parent key (zero-padded to 32), payload size,
  xxh3-64 checksum of the payload, priority, last access (``time.time()`` seconds), the
  byte offset of the payload in ``data.mdb`` (0: not known) and the number of the
  block's tokens, then those tokens (little-endian uint32: what a restart tells routers,
  kvstore.tier_events). Records of version 2 (no tokens) and 1 (no offset either) are
  still read.
- named db ``namespaces``: namespace digest (32 bytes) -> ``NamespaceSpec.to_dict()`` as
  UTF-8 JSON with sorted keys. ``meta`` and ``payload`` are always changed together in
  the same transaction, so a restart never sees one without the other.
- named db ``info``: ``b"format"`` -> ``b"kvstore.disk.v1"`` (checked at open).

Durability: ``sync=True, metasync=False`` -- every commit fdatasyncs the data pages
once; the meta page is flushed by the next commit, so a power loss may undo the last
committed batch but cannot corrupt the environment. ``flush()`` forces the meta page
too (``env.sync(True)``). A crash of the process alone loses nothing committed.
``readahead`` is on by default although access is random: values are large (hundreds of
KiB to tens of MiB, stored as contiguous overflow pages) and always read whole, and
without kernel readahead every 4 KiB page of a cold value is its own synchronous I/O
(measured: 0.08 GB/s cold without readahead, 1.0-1.2 GB/s with it; see
``docs/benchmarks/disk.md``). ``writemap`` stays off: writes measured 35-50% slower with it.

Write-back speed (see ``docs/benchmarks/disk.md``): copies of megabytes (``write`` into
the queue, reads into the caller's buffer) release the GIL, so the writer thread is not
stalled waiting for the interpreter between its LMDB calls; the first DiskTier of a
process raises glibc's mmap and trim thresholds (:func:`_tune_malloc`) so that the dirty
pages LMDB mallocs per batch are reused instead of faulted in again; and while a commit
runs, a helper thread starts writeback of the file's dirty pages
(:class:`_EarlyWriteback`) so that the device works while LMDB is still writing the batch
and the commit's fdatasync waits only for the tail. None of this changes what is durable
when: LMDB still fdatasyncs the data pages before it writes the meta page.

Committed payloads are read with ``pread`` at the value's file offset (from its overflow
page header, inside the read transaction that keeps those pages allocated) straight into
the caller's buffer: no faults on a freshly mapped map, GIL released.
"""

from kvstore.disk.format import DiskRecord, open_in_this_process
from kvstore.disk.state import DiskStats
from kvstore.disk.tier import DiskTier

__all__ = ["DiskRecord", "DiskStats", "DiskTier", "open_in_this_process"]
