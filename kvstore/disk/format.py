"""The disk tier's format: what a record in LMDB says, and where its payload lies.

The daemon's :class:`kvstore.disk.DiskTier` writes this format and a same-host client
reads it (:mod:`kvclient.disk_index`, disk hits with no call), each under read
transactions of its own; so this module holds only the format and the names both
sides open, never the writer. The environment's layout is documented in
:mod:`kvstore.disk`.
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass

META = struct.Struct("<B32sB32sQQBdQ")  # version 2: + the payload's offset in data.mdb
META_V1 = struct.Struct("<B32sB32sQQBd")  # records written before version 2 (still read)
META_VERSION = 2
EXTENT = struct.Struct("<QQ")  # size and checksum fields of META (and of META_V1) ...
EXTENT_AT = 1 + 32 + 1 + 32  # ... at this byte
OFFSET = struct.Struct("<Q")  # the payload offset field of META ...
OFFSET_AT = META.size - 8  # ... at this byte
KEY_SIZES = (16, 32)
_PARENT_LENGTHS = (0, *KEY_SIZES)
DIGEST_SIZE = 32
MAX_PRIORITY = 100

META_DB = b"meta"  # the named databases a reader in another process opens ...
NAMESPACES_DB = b"namespaces"
DB_NAMES = (META_DB, b"payload", NAMESPACES_DB, b"info")  # ... and all of them
FORMAT_KEY = b"format"  # in the info database, whose value is FORMAT
FORMAT = b"kvstore.disk.v1"

# Directories of the DiskTiers open in this process. LMDB must not be opened twice in
# one process (closing one handle drops the other's file locks), so a reader of the
# same environment (kvclient.disk_index) checks here first.
open_here: set[str] = set()
open_here_lock = threading.Lock()


def open_in_this_process(directory: str) -> bool:
    """Whether a DiskTier of this process has the environment at ``directory`` open."""
    with open_here_lock:
        return os.path.realpath(directory) in open_here


@dataclass(frozen=True, slots=True)
class DiskRecord:
    """Metadata of one block on disk."""

    key: bytes  # BlockKey (16 or 32 bytes)
    ns_digest: bytes  # NamespaceSpec.digest (32 bytes) of its namespace
    parent: bytes  # parent BlockKey, b"" for the first block of a chain
    size: int  # payload bytes
    checksum: int  # xxhash.xxh3_64_intdigest(payload)
    priority: int  # 0..100
    last_access: float  # wall-clock seconds (time.time())
    offset: int = 0  # of the payload in data.mdb, once committed (0: not known)


@dataclass(frozen=True, slots=True)
class DiskExtent:
    """Where a committed payload lies in ``data.mdb``: ``size`` bytes from byte
    ``offset``, whose xxh3-64 is ``checksum`` (what a reader checks after reading)."""

    offset: int
    size: int
    checksum: int


def pack_record(rec: DiskRecord) -> bytes:
    return META.pack(
        META_VERSION,
        rec.ns_digest,
        len(rec.parent),
        rec.parent,
        rec.size,
        rec.checksum,
        rec.priority,
        rec.last_access,
        rec.offset,
    )


# a meta value's fields: ns_digest, parent, size, checksum, priority, last_access, offset
RecordFields = tuple[bytes, bytes, int, int, int, float, int]


def unpack_fields(raw: bytes | memoryview) -> RecordFields:
    """Decode a ``meta`` value into its fields (what :func:`unpack_record` holds, for a
    caller that reads millions and needs no object per record). Raises ValueError (or
    struct.error) if it is malformed."""
    if len(raw) == META.size and raw[0] == META_VERSION:
        _, digest, parent_len, parent, size, checksum, priority, last, offset = META.unpack(raw)
    elif len(raw) == META_V1.size and raw[0] == 1:
        _, digest, parent_len, parent, size, checksum, priority, last = META_V1.unpack(raw)
        offset = 0
    else:
        version = raw[0] if len(raw) else None
        raise ValueError(f"bad meta record (version {version}, {len(raw)} bytes)")
    if parent_len not in _PARENT_LENGTHS:
        raise ValueError(f"bad meta record (parent length {parent_len})")
    return digest, parent[:parent_len], size, checksum, priority, last, offset


def unpack_record(key: bytes, raw: bytes | memoryview) -> DiskRecord:
    """Decode a ``meta`` value. Raises ValueError (or struct.error) if it is malformed."""
    return DiskRecord(bytes(key), *unpack_fields(raw))


def committed_extent(raw: bytes | memoryview) -> DiskExtent | None:
    """Where the payload of a ``meta`` record lies in ``data.mdb``, for a reader with its
    own read transaction (the record and its payload are of one snapshot); None for a
    record that does not say (version 1, offset not known) or is malformed."""
    if len(raw) != META.size or raw[0] != META_VERSION:
        return None
    size, checksum = EXTENT.unpack_from(raw, EXTENT_AT)
    (offset,) = OFFSET.unpack_from(raw, OFFSET_AT)
    return DiskExtent(offset, size, checksum) if offset else None


def check_record(rec: DiskRecord) -> None:
    if len(rec.key) not in KEY_SIZES:
        raise ValueError(f"key must be 16 or 32 bytes, got {len(rec.key)}")
    if len(rec.ns_digest) != DIGEST_SIZE:
        raise ValueError(f"ns_digest must be {DIGEST_SIZE} bytes, got {len(rec.ns_digest)}")
    if len(rec.parent) not in (0, *KEY_SIZES):
        raise ValueError(f"parent must be empty or 16/32 bytes, got {len(rec.parent)}")
    if not 0 <= rec.priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be in [0, {MAX_PRIORITY}], got {rec.priority}")
    if not 0 <= rec.checksum < 1 << 64:
        raise ValueError("checksum must be an unsigned 64-bit integer")
