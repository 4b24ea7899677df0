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

# version 3: + the codec and its version that encoded the payload (kvstore.codecs; 0, 0:
# exact) and the block's tokens (a u16 count, then that many little-endian u32)
META = struct.Struct("<B32sB32sQQBdQBBH")
META_V2 = struct.Struct("<B32sB32sQQBdQ")  # + the payload's offset in data.mdb
META_V1 = struct.Struct("<B32sB32sQQBd")  # records of versions 1 and 2 are still read
META_VERSION = 3
MAX_RECORD_TOKENS = 0xFFFF
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
    tokens: bytes = b""  # the block's token ids, packed little-endian uint32 (b"": unknown)
    codec: int = 0  # kvstore.codecs.CODE_IDS of the codec that encoded the payload
    codec_version: int = 0  # ... and its kvstore.codecs.VERSION (0 with exact)


def pack_record(rec: DiskRecord) -> bytes:
    head = META.pack(
        META_VERSION,
        rec.ns_digest,
        len(rec.parent),
        rec.parent,
        rec.size,
        rec.checksum,
        rec.priority,
        rec.last_access,
        rec.offset,
        rec.codec,
        rec.codec_version,
        len(rec.tokens) // 4,
    )
    return head + rec.tokens


# a meta value's fields: ns_digest, parent, size, checksum, priority, last_access, offset,
# tokens, codec, codec version
RecordFields = tuple[bytes, bytes, int, int, int, float, int, bytes, int, int]


def unpack_fields(raw: bytes | memoryview) -> RecordFields:
    """Decode a ``meta`` value into its fields (what :func:`unpack_record` holds, for a
    caller that reads millions and needs no object per record). Raises ValueError (or
    struct.error) if it is malformed."""
    tokens = b""
    codec = codec_version = 0
    if len(raw) >= META.size and raw[0] == META_VERSION:
        fields = META.unpack_from(raw)
        _, digest, parent_len, parent, size, checksum, priority, last, offset = fields[:9]
        codec, codec_version, count = fields[9:]
        if len(raw) != META.size + 4 * count:
            raise ValueError(f"bad meta record ({count} tokens in {len(raw)} bytes)")
        tokens = bytes(raw[META.size :])
    elif len(raw) == META_V2.size and raw[0] == 2:
        _, digest, parent_len, parent, size, checksum, priority, last, offset = META_V2.unpack(raw)
    elif len(raw) == META_V1.size and raw[0] == 1:
        _, digest, parent_len, parent, size, checksum, priority, last = META_V1.unpack(raw)
        offset = 0
    else:
        version = raw[0] if len(raw) else None
        raise ValueError(f"bad meta record (version {version}, {len(raw)} bytes)")
    if parent_len not in _PARENT_LENGTHS:
        raise ValueError(f"bad meta record (parent length {parent_len})")
    return (
        digest, parent[:parent_len], size, checksum, priority, last, offset, tokens, codec,
        codec_version,
    )  # fmt: skip


def unpack_record(key: bytes, raw: bytes | memoryview) -> DiskRecord:
    """Decode a ``meta`` value. Raises ValueError (or struct.error) if it is malformed."""
    return DiskRecord(bytes(key), *unpack_fields(raw))


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
    if len(rec.tokens) % 4 or len(rec.tokens) > 4 * MAX_RECORD_TOKENS:
        raise ValueError(f"tokens must be packed uint32, at most {MAX_RECORD_TOKENS}")
