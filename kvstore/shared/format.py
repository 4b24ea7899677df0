"""How a block is named and framed in the shared tier (a Valkey / Redis Cluster).

Key: ``kv:<ns_id>:<chain key, hex>``. The namespace id is the model name and the first
digits of the namespace digest, which folds in the model, the KV layout and the tenant
salt; the chain key already depends on the whole digest and on every token before it.
Two nodes that compute the same prefix of the same model and layout for the same
tenant name the same key; anything else names another one. The key has no hash tag:
the blocks of one chain spread over every slot, so no cluster node holds a hot prefix
alone.

Value: a 32-byte header, then the block's bytes::

    magic "KVSB" | version u8 | 3 bytes zero | namespace fingerprint 8 bytes
    | payload length u64 | xxh3-64 of (key + payload) u64

The fingerprint is the first 8 bytes of the namespace digest, so a value written under
another layout or salt does not pass even where a key collides; the checksum covers the
key too, so a value copied under a wrong key fails as well. A value that fails any check
is a miss (:func:`unpack_value` returns None) and is never served.
"""

from __future__ import annotations

import struct

import xxhash

from kvstore.keys import BlockKey, NamespaceSpec

MAGIC = b"KVSB"
VERSION = 1
HEADER = struct.Struct("<4sB3x8sQQ")
KEY_PREFIX = "kv"


def block_name(spec: NamespaceSpec, key: BlockKey) -> bytes:
    """The cluster key of block ``key`` of namespace ``spec``."""
    return f"{KEY_PREFIX}:{spec.ns_id}:{key.hex()}".encode()


def _checksum(key: BlockKey, payload: memoryview | bytes) -> int:
    h = xxhash.xxh3_64(key)
    h.update(payload)
    return h.intdigest()


def packed_size(payload_bytes: int) -> int:
    return HEADER.size + payload_bytes


def pack_into(
    out: memoryview, spec: NamespaceSpec, key: BlockKey, payload: memoryview | bytes
) -> int:
    """Write the stored value of one block (header, then a copy of ``payload``) at the
    start of ``out``; its size."""
    view = memoryview(payload).cast("B")
    HEADER.pack_into(out, 0, MAGIC, VERSION, spec.digest[:8], view.nbytes, _checksum(key, view))
    end = HEADER.size + view.nbytes
    out[HEADER.size : end] = view
    return end


def pack_value(spec: NamespaceSpec, key: BlockKey, payload: memoryview | bytes) -> bytearray:
    """The stored value of one block, in a buffer of its own."""
    out = bytearray(packed_size(memoryview(payload).nbytes))
    pack_into(memoryview(out), spec, key, payload)
    return out


def unpack_value(spec: NamespaceSpec, key: BlockKey, value: bytes | None) -> memoryview | None:
    """The block's bytes in ``value`` (a view into it), or None when it is absent, of
    another format version or namespace, of the wrong size, or damaged."""
    if value is None or len(value) != HEADER.size + spec.block_bytes:
        return None
    magic, version, fingerprint, length, checksum = HEADER.unpack_from(value, 0)
    if magic != MAGIC or version != VERSION or fingerprint != spec.digest[:8]:
        return None
    payload = memoryview(value)[HEADER.size :]
    if length != spec.block_bytes or _checksum(key, payload) != checksum:
        return None
    return payload
