"""How a block is named and framed in the shared tier (a Valkey / Redis Cluster).

Key: ``kv:<ns_id>:<chain key, hex>``. The namespace id is the model name and the first
digits of the namespace digest, which folds in the model, the KV layout and the tenant
salt; the chain key already depends on the whole digest and on every token before it.
Two nodes that compute the same prefix of the same model and layout for the same
tenant name the same key; anything else names another one. The key has no hash tag:
the blocks of one chain spread over every slot, so no cluster node holds a hot prefix
alone.

Value: a 32-byte header, then the block's bytes (encoded, for a namespace with a codec
when the shared tier is one of its coded tiers: kvstore.codecs)::

    magic "KVSB" | version u8 | codec u8 | codec version u8 | 1 byte zero
    | namespace fingerprint 8 bytes | payload length u64 | xxh3-64 of (key + payload) u64

Version 1 values (the codec bytes zero: exact) are still read; a value encoded by a
codec or version the namespace does not decode is a miss.

The fingerprint is the first 8 bytes of the namespace digest, so a value written under
another layout or salt does not pass even where a key collides; the checksum covers the
key too, so a value copied under a wrong key fails as well. A value that fails any check
is a miss (:func:`unpack_value` returns None) and is never served.

With a secret (the daemon's ``shared_key_file``, the same on every node), values are
version 3 and their last u64 is a keyed MAC in place of the checksum: HMAC-SHA256 with
the secret's key, its first 8 bytes, over the namespace digest, the block key, the
header's first 24 bytes and the payload (SHA-256, not BLAKE2b: CPUs with SHA
instructions run it several times faster). A checksum stops accidents only: anyone who
may write the cluster can compute one, and plant a block every node then serves. A node
with a secret serves only version 3 values whose MAC holds, and one without serves none
of them; either refusal raises :class:`UnauthenticatedValue` (a miss the tier counts apart
from damage).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import xxhash

from kvstore import codecs
from kvstore.codecs import Codec, DamagedBlock
from kvstore.keys import BlockKey, NamespaceSpec

MAGIC = b"KVSB"
VERSION = 2
VERSIONS = (1, 2)  # read without a secret
KEYED_VERSION = 3  # written and read with one
HEADER = struct.Struct("<4sBBBx8sQQ")
CHECK_AT = HEADER.size - 8  # the checksum or MAC: the header's last u64
KEY_PREFIX = "kv"
_MAC_PERSON = b"kvstore-shared"


class UnauthenticatedValue(Exception):
    """A value whose keyed MAC does not hold, or that has none where one is required
    (or one where this node holds no secret to check it with)."""


def mac_key(secret: str) -> bytes:
    """The MAC key a secret (the text of ``shared_key_file``) gives: 32 bytes."""
    return hashlib.blake2b(secret.encode(), digest_size=32, person=b"kvstore-mac-key").digest()


def block_name(spec: NamespaceSpec, key: BlockKey) -> bytes:
    """The cluster key of block ``key`` of namespace ``spec``."""
    return f"{KEY_PREFIX}:{spec.ns_id}:{key.hex()}".encode()


def _checksum(key: BlockKey, payload: memoryview | bytes) -> int:
    h = xxhash.xxh3_64(key)
    h.update(payload)
    return h.intdigest()


def _mac(
    secret: bytes, spec: NamespaceSpec, key: BlockKey, head: memoryview, payload: memoryview
) -> int:
    h = hmac.new(secret, _MAC_PERSON, hashlib.sha256)
    for part in (spec.digest, key, head, payload):
        h.update(part)
    return int.from_bytes(h.digest()[:8], "little")


def packed_size(payload_bytes: int) -> int:
    return HEADER.size + payload_bytes


def pack_into(
    out: memoryview,
    spec: NamespaceSpec,
    key: BlockKey,
    payload: memoryview | bytes,
    codec: Codec | None = None,
    encoded: bool = False,
    secret: bytes = b"",
) -> int:
    """Write the stored value of one block (header, then ``payload``, encoded with
    ``codec`` when given, or as it is when it is ``encoded`` with it already) at the
    start of ``out``; its size. With a ``secret`` (:func:`mac_key`): a keyed value."""
    view = memoryview(payload).cast("B")
    if codec is None or encoded:
        stored = out[HEADER.size : HEADER.size + view.nbytes]
        stored[:] = view
        code, version = (0, 0) if codec is None else (codec.code_id, codecs.VERSION)
    else:
        stored = codec.encode(view, out[HEADER.size :])
        code, version = codec.code_id, codecs.VERSION
    if not secret:
        HEADER.pack_into(
            out, 0, MAGIC, VERSION, code, version, spec.digest[:8], stored.nbytes,
            _checksum(key, stored),
        )  # fmt: skip
        return HEADER.size + stored.nbytes
    HEADER.pack_into(out, 0, MAGIC, KEYED_VERSION, code, version, spec.digest[:8], stored.nbytes, 0)
    mac = _mac(secret, spec, key, out[:CHECK_AT], stored)
    struct.pack_into("<Q", out, CHECK_AT, mac)
    return HEADER.size + stored.nbytes


def pack_value(
    spec: NamespaceSpec,
    key: BlockKey,
    payload: memoryview | bytes,
    codec: Codec | None = None,
    encoded: bool = False,
    secret: bytes = b"",
) -> bytearray:
    """The stored value of one block, in a buffer of its own (see :func:`pack_into`)."""
    size = memoryview(payload).nbytes if codec is None else codec.encoded_bytes
    out = bytearray(packed_size(size))
    pack_into(memoryview(out), spec, key, payload, codec, encoded, secret)
    return out


def unpack_value(
    spec: NamespaceSpec,
    key: BlockKey,
    value: bytes | None,
    codec: Codec | None = None,
    secret: bytes = b"",
) -> memoryview | None:
    """The block's bytes in ``value`` (a view into it; decoded into a buffer of its own
    when it was stored encoded by ``codec``, the namespace's), or None when it is
    absent, of another format version, namespace or codec, of the wrong size, or
    damaged. Raises :class:`UnauthenticatedValue` for a value a ``secret`` refuses (or a
    keyed one, without a secret)."""
    if value is None or len(value) < HEADER.size:
        return None
    magic, version, code, code_version, fingerprint, length, check = HEADER.unpack_from(
        value, 0
    )
    keyed = version == KEYED_VERSION
    if magic != MAGIC or not (keyed or version in VERSIONS):
        return None
    if keyed != bool(secret):
        raise UnauthenticatedValue("not keyed" if secret else "keyed, and this node has no secret")
    if fingerprint != spec.digest[:8]:
        return None
    if code and (codec is None or code != codec.code_id or code_version != codecs.VERSION):
        return None
    size = codec.encoded_bytes if code and codec is not None else spec.block_bytes
    view = memoryview(value)
    payload = view[HEADER.size :]
    if length != size or len(payload) != size:
        return None
    if secret:
        if _mac(secret, spec, key, view[:CHECK_AT], payload) != check:
            raise UnauthenticatedValue("its MAC does not hold")
    elif _checksum(key, payload) != check:
        return None
    if not code or codec is None:
        return payload
    block = memoryview(bytearray(spec.block_bytes))
    try:
        codec.decode(payload, block)
    except DamagedBlock:  # its checksum holds, yet no encoder made it: crafted
        return None
    return block
